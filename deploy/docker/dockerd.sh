#!/usr/bin/env bash
# Start (or reuse) a private dockerd for CI and tests; print the DOCKER_HOST to export.
#
#   eval "$(deploy/docker/dockerd.sh start)"   # exports DOCKER_HOST
#   deploy/docker/dockerd.sh stop
#
# Debian's docker.io does not start by itself here; it runs with its own data root and
# socket, and raised ulimits. Stopped by its recorded pid only.
set -euo pipefail

ROOT="${LORASHIP_DOCKER_ROOT:-/tmp/loraship-docker}"
SOCK="$ROOT/docker.sock"
PIDFILE="$ROOT/dockerd.pid"
DOCKER="${DOCKER:-/usr/bin/docker}"

case "${1:-start}" in
  start)
    mkdir -p "$ROOT"
    # Debian's docker.io (20.10) and mmdebstrap (images/build_base.sh): seconds to install.
    if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null; then
      echo "installing docker.io mmdebstrap" >&2
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q docker.io mmdebstrap >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q docker.io mmdebstrap >&2; }
    fi
    if [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
      echo "dockerd already running (pid $(cat "$PIDFILE"))" >&2
    else
      nohup dockerd --data-root "$ROOT/root" --exec-root "$ROOT/exec" --pidfile "$PIDFILE" \
        --host "unix://$SOCK" \
        --default-ulimit nofile=20000:20000 --default-ulimit nproc=32768:32768 \
        >"$ROOT/dockerd.log" 2>&1 &
      for _ in $(seq 60); do
        DOCKER_HOST="unix://$SOCK" "$DOCKER" info >/dev/null 2>&1 && break
        sleep 1
      done
      DOCKER_HOST="unix://$SOCK" "$DOCKER" info >/dev/null || { tail -20 "$ROOT/dockerd.log" >&2; exit 1; }
    fi
    echo "export DOCKER_HOST=unix://$SOCK"
    ;;
  stop)
    if [[ -f "$PIDFILE" ]]; then
      kill "$(cat "$PIDFILE")" 2>/dev/null || true
      rm -f "$PIDFILE"
    fi
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
