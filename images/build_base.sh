#!/usr/bin/env bash
# Build the local test base image (Debian bookworm + Python 3.11) without a registry.
#
#   images/build_base.sh [IMAGE_NAME]        # default: loraship-base:bookworm
#
# No registry is reachable here, so `FROM python:3.11-slim` cannot be pulled; mmdebstrap
# builds the root file system from Debian's packages and `docker import` turns it into an
# image. Production builds pass a CUDA base instead
# (images/base-cuda.Dockerfile). Outgoing TLS goes through a proxy whose CA lives in
# /usr/local/share/ca-certificates: it is copied in and trusted, or pip inside builds fails.
# The image is skipped when it already exists (set LORASHIP_REBUILD_BASE=1 to force).
set -euo pipefail

IMAGE="${1:-loraship-base:bookworm}"
DOCKER="${DOCKER:-/usr/bin/docker}"
SUITE="${LORASHIP_BASE_SUITE:-bookworm}"
CA_DIR="${LORASHIP_CA_DIR:-/usr/local/share/ca-certificates}"

if [[ -z "${LORASHIP_REBUILD_BASE:-}" ]] && "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE exists; skipping (LORASHIP_REBUILD_BASE=1 rebuilds it)"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "mmdebstrap not found: apt-get install -y mmdebstrap" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS

# passwd gives useradd for the non-root user; python3-venv gives the venv every image uses;
# libgomp1 is the OpenMP runtime libllama.so (llama-cpp-python) links against.
hooks=()
if compgen -G "$CA_DIR/*.crt" >/dev/null; then
  mkdir -p "$tmp/ca"
  cp "$CA_DIR"/*.crt "$tmp/ca/"
  hooks+=(--customize-hook="mkdir -p \"\$1/usr/local/share/ca-certificates\"")
  hooks+=(--customize-hook="cp $tmp/ca/*.crt \"\$1/usr/local/share/ca-certificates/\"")
  hooks+=(--customize-hook="chroot \"\$1\" update-ca-certificates")
fi
# Leave no apt lists or caches in the image.
hooks+=(--customize-hook="rm -rf \"\$1\"/var/lib/apt/lists/* \"\$1\"/var/cache/apt/*")

mmdebstrap --variant=minbase \
  --include=ca-certificates,passwd,python3,python3-venv,python3-pip,libgomp1 \
  "${hooks[@]}" "$SUITE" "$tmp/base.tar"

# pip inside a venv uses its own certifi bundle, not the system store that now trusts the proxy.
"$DOCKER" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["/bin/bash"]' \
  "$tmp/base.tar" "$IMAGE"
echo "built $IMAGE in $((SECONDS - start)) s"
