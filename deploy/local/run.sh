#!/usr/bin/env bash
# The real local deployment, end to end:
#   Prefect server (SQLite, 127.0.0.1) -> process work pool + worker -> prefect deploy ->
#   prefect deployment run train-and-ship/local --watch  (each stage its own flow run)
# then checks the run completed, its stage artifacts exist in Prefect, and (LORASHIP_GITOPS_CHECK=1,
# the default) that `python -m loraship.runtime.gitops` triggers a changed spec once and only once.
#
#   deploy/local/run.sh   # 2 cores, tiny model on the CPU: ~6 min from scratch, ~1.5-3 min when up to date
#   LORASHIP_KEEP_SERVER=1 deploy/local/run.sh   # leave server + worker up (UI on the port)
#
# Everything stays in the project: PREFECT_HOME=.prefect, the server's own SQLite file
# .prefect/local-server.db (not the embedded runs' database), logs in .loraship/local-deploy/.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
VENV_BIN="${LORASHIP_VENV_BIN:-$ROOT/.venv/bin}"
export PATH="$VENV_BIN:$PATH"
PORT="${LORASHIP_PREFECT_PORT:-4217}"
LOGS="$ROOT/.loraship/local-deploy"
mkdir -p "$LOGS"

export PREFECT_HOME="${PREFECT_HOME:-$ROOT/.prefect}"
export PREFECT_API_URL="http://127.0.0.1:${PORT}/api"
export PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///${PREFECT_HOME}/local-server.db"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_ENABLED="${PREFECT_UI_ENABLED:-false}"
export PREFECT_LOGGING_LEVEL="${PREFECT_LOGGING_LEVEL:-INFO}"
# The worker asks the server for scheduled runs every second, not Prefect's 10: each stage is a flow run of its own
# (8 per pipeline), and each waited on the next poll, up to 10 s (bench/results/ci_time.json).
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-1}"
# Inherited by the worker's flow-run subprocesses (the same settings as `make demo`).
export LORASHIP_CACHE="${LORASHIP_CACHE:-$ROOT/.loraship/cache}"
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
mkdir -p "$PREFECT_HOME"

source "$ROOT/deploy/lib.sh"
pids=()
cleanup() {
  if [[ -z "${LORASHIP_KEEP_SERVER:-}" ]]; then
    stop_pids "${pids[@]}"
  else
    echo "server and worker left running: pids ${pids[*]}, API $PREFECT_API_URL"
  fi
}
trap cleanup EXIT
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }

step "Prefect server on 127.0.0.1:$PORT (SQLite ${PREFECT_HOME}/local-server.db)"
start_prefect_server

step "process work pool + worker"
prefect work-pool create loraship-process --type process --overwrite >/dev/null
prefect worker start --pool loraship-process --type process --name loraship-local-worker \
  >"$LOGS/worker.log" 2>&1 &
pids+=($!)

step "tiny base model"
python -m loraship.fixtures.tinymodel --out .loraship/models/tiny-llama >/dev/null

# Every deployment of every pool goes in (the server checks each one's job variables against its
# pool's template), so a broken docker or kubernetes entry fails here too; only the process pool
# has a worker on this machine.
step "prefect deploy --all (the parent and every stage: local, docker and kubernetes pools)"
prefect work-pool create loraship-docker --type docker --overwrite >/dev/null
# One Kubernetes pool per hardware class (CPU, training GPU node, inference GPU), each with its own template.
python deploy/kubernetes/render.py --pools | while read -r pool template; do
  prefect work-pool create "$pool" --type kubernetes --base-job-template "$template" --overwrite >/dev/null
done
prefect --no-prompt deploy --prefect-file deploy/prefect.yaml --all >"$LOGS/deploy.log" 2>&1 \
  || { tail -40 "$LOGS/deploy.log" >&2; exit 1; }
echo "$(grep -c 'successfully created' "$LOGS/deploy.log") deployments created"
prefect deployment ls | grep -E 'local|Name'

step "prefect deployment run train-and-ship/local --watch"
run_log="$LOGS/run.log"
set +e
prefect deployment run train-and-ship/local --watch --watch-timeout 1800 2>&1 | tee "$run_log"
rc=${PIPESTATUS[0]}
set -e
python deploy/local/check_run.py "$run_log" demo
[[ $rc -eq 0 ]] || { echo "prefect deployment run exited $rc" >&2; exit "$rc"; }
ls -la artifacts/demo 2>/dev/null || true

if [[ "${LORASHIP_GITOPS_CHECK:-1}" == 1 ]]; then
  step "gitops: a spec pushed to a scratch repository runs once, never twice"
  scratch="$(mktemp -d)"
  git -C "$scratch" init -q -b main
  git -C "$scratch" -c user.name=ci -c user.email=ci@localhost commit -q --allow-empty -m start
  mkdir -p "$scratch/deploy/gitops/specs"
  # The demo config itself: every stage is already done, so this run completes by resuming.
  cp configs/demo.yaml "$scratch/deploy/gitops/specs/demo.yaml"
  git -C "$scratch" add deploy && git -C "$scratch" -c user.name=ci -c user.email=ci@localhost commit -q -m "spec: demo"
  # First call: triggered (or already-triggered when this server ran the same config before);
  # second call: the same flow run, not a new one.
  python -m loraship.runtime.gitops --repo "$scratch" --from HEAD~1 --to HEAD --deployment train-and-ship/local | tee "$LOGS/gitops-1.log"
  python -m loraship.runtime.gitops --repo "$scratch" --from HEAD~1 --to HEAD --deployment train-and-ship/local | tee "$LOGS/gitops-2.log"
  python - "$LOGS/gitops-1.log" "$LOGS/gitops-2.log" <<'EOF'
import json, sys
first, second = (json.loads(open(p).readline()) for p in sys.argv[1:3])
assert first["ok"] and first["state"] == "COMPLETED", first
assert second["action"] == "already-triggered" and second["flow_run_id"] == first["flow_run_id"], second
print(f"gitops: {first['spec']} -> {first['action']} {first['flow_run_name']}; again -> {second['action']}")
EOF
  rm -rf "$scratch"
fi
step "local deployment OK"
