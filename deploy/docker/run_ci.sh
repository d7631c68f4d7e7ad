#!/usr/bin/env bash
# The container run for CI: every stage of the tiny pipeline in its own image, through a Prefect
# docker work pool, artifacts on the shared `loraship-shared` volume.
#
#   deploy/docker/run_ci.sh   # measured on 2 cores: base 1 min + images 5 min cold (0.1 warm) + run 2.5-3.5 min
#
# Steps: docker.io + a private dockerd (deploy/docker/dockerd.sh) -> base + stage images
# (images/build_all.sh, reusing the host's torch and llama-cpp-python wheels) -> Prefect server
# on 127.0.0.1 -> docker work pool (containers on the host network, so 127.0.0.1 reaches the
# server) + worker -> prefect deploy of train-and-ship/docker and *-docker -> the run, watched
# -> checks: parent COMPLETED, a child run per stage in its stage's image, artifacts on the volume,
# and each image's own entrypoint (`python -m loraship.stages.<stage> CONFIG`) sees the stage as done.
# This machine has no GPU: the deployed copy of prefect.yaml drops the docker GPU requests
# (device_requests) of the GPU stages (train, reference, verify: loraship/stage_table.py), and
# nothing else.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
VENV_BIN="${LORASHIP_VENV_BIN:-$ROOT/.venv/bin}"
export PATH="$VENV_BIN:$PATH"
PORT="${LORASHIP_PREFECT_PORT:-4218}"
LOGS="$ROOT/.loraship/docker-deploy"
VOLUME=loraship-shared
mkdir -p "$LOGS"
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }

step "dockerd"
DOCKER="${DOCKER:-/usr/bin/docker}"
started_dockerd=
if [[ -z "${DOCKER_HOST:-}" ]]; then
  sock="unix://${LORASHIP_DOCKER_ROOT:-/tmp/loraship-docker}/docker.sock"
  if DOCKER_HOST="$sock" "$DOCKER" info >/dev/null 2>&1; then
    DOCKER_HOST="$sock"  # one left running by an earlier call: use it, leave it running
  else
    eval "$(deploy/docker/dockerd.sh start)"
    started_dockerd=1
  fi
fi
export DOCKER DOCKER_HOST

export PREFECT_HOME="$ROOT/.prefect"
export PREFECT_API_URL="http://127.0.0.1:${PORT}/api"
export PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///${PREFECT_HOME}/docker-server.db"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_ENABLED=false
# The worker asks the server for scheduled runs every second, not Prefect's 10: each stage is a flow run of its own
# (8 per pipeline), and each waited on the next poll, up to 10 s (bench/results/ci_time.json).
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-1}"
mkdir -p "$PREFECT_HOME"

source "$ROOT/deploy/lib.sh"
pids=()
cleanup() {
  stop_pids "${pids[@]}"
  if [[ -n "$started_dockerd" && -z "${LORASHIP_KEEP_DOCKER:-}" ]]; then deploy/docker/dockerd.sh stop; fi
}
trap cleanup EXIT

step "tiny base model"
python -m loraship.fixtures.tinymodel --out .loraship/models/tiny-llama >/dev/null

step "images (base + one target of images/Dockerfile per stage image)"
images/build_all.sh >"$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log" >&2; exit 1; }
grep -E '^(built|base image|all images)' "$LOGS/build.log"
"$DOCKER" images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^loraship-'

step "shared volume $VOLUME: base model + demo data, owned by the images' uid 1000"
# Containers of earlier runs (kept for their logs) hold the volume: remove them first.
"$DOCKER" ps -aq --filter label=io.prefect.flow-run-id | xargs -r "$DOCKER" rm -f >/dev/null
"$DOCKER" volume rm -f "$VOLUME" >/dev/null
"$DOCKER" volume create "$VOLUME" >/dev/null
mountpoint="$("$DOCKER" volume inspect -f '{{.Mountpoint}}' "$VOLUME")"
mkdir -p "$mountpoint/models" "$mountpoint/data"
cp -r .loraship/models/tiny-llama "$mountpoint/models/"
cp -r data/demo "$mountpoint/data/"
chown -R 1000:1000 "$mountpoint"

step "Prefect server on 127.0.0.1:$PORT"
start_prefect_server

step "docker work pool (host network) + worker"
prefect work-pool get-default-base-job-template --type docker >"$LOGS/pool-template.json"
python - "$LOGS/pool-template.json" <<'EOF'
import json, sys
path = sys.argv[1]
template = json.load(open(path))
# The server listens on 127.0.0.1 only: containers share the host's network to reach it.
template["variables"]["properties"]["network_mode"]["default"] = "host"
json.dump(template, open(path, "w"), indent=1)
EOF
prefect work-pool create loraship-docker --type docker --base-job-template "$LOGS/pool-template.json" --overwrite >/dev/null
prefect worker start --pool loraship-docker --type docker --name loraship-ci-docker-worker >"$LOGS/worker.log" 2>&1 &
pids+=($!)

step "prefect deploy (train-and-ship/docker + *-docker; GPU requests dropped: no GPU here)"
python - <<'EOF'
import yaml
data = yaml.safe_load(open("deploy/prefect.yaml"))
for d in data["deployments"]:
    kwargs = d["work_pool"].get("job_variables", {}).get("container_create_kwargs")
    if kwargs:
        kwargs.pop("device_requests", None)
yaml.safe_dump(data, open(".loraship/docker-deploy/prefect-cpu.yaml", "w"), sort_keys=False)
EOF
prefect --no-prompt deploy --prefect-file "$LOGS/prefect-cpu.yaml" \
  --name train-and-ship/docker --name '*-docker' >"$LOGS/deploy.log" 2>&1 \
  || { tail -40 "$LOGS/deploy.log" >&2; exit 1; }
prefect deployment ls | grep -E 'docker' || true

step "prefect deployment run train-and-ship/docker --watch"
set +e
prefect deployment run train-and-ship/docker --watch --watch-timeout 2400 2>&1 | tee "$LOGS/run.log"
rc=${PIPESTATUS[0]}
set -e
python deploy/local/check_run.py "$LOGS/run.log" demo || rc=1
"$DOCKER" ps -a --filter label=io.prefect.flow-run-id --format '{{.Image}} {{.Status}}' | sort | uniq -c
ls -la "$mountpoint/artifacts/demo" 2>/dev/null || ls -la "$mountpoint/artifacts" || true
if [[ $rc -ne 0 ]]; then
  echo "--- worker log (tail)"; tail -60 "$LOGS/worker.log"
  exit "$rc"
fi

step "each image's own entrypoint (python -m loraship.stages.<stage> CONFIG) resumes the finished run"
python - "$mountpoint/demo.yaml" <<'EOF2'
import sys, yaml
docker = next(d for d in yaml.safe_load(open("deploy/prefect.yaml"))["deployments"] if d["name"] == "docker")
yaml.safe_dump(docker["parameters"]["config"], open(sys.argv[1], "w"), sort_keys=False)
EOF2
chown 1000:1000 "$mountpoint/demo.yaml"
# stage:image pairs in pipeline order (loraship/stage_table.py).
stage_images="$(python -c 'from loraship.stage_table import STAGE_TABLE
print(" ".join(f"{s.name}:{s.image}" for s in STAGE_TABLE))')"
for pair in $stage_images; do
  stage="${pair%%:*}" image="${pair#*:}"
  if [[ $image != "$stage" ]]; then  # e.g. reference runs in the merge image, quantize in convert's
    out="$("$DOCKER" run --rm --network none -v "$VOLUME:/shared" --entrypoint python \
      "loraship-$image:0.1.0" -m "loraship.stages.$stage" /shared/demo.yaml 2>&1)"
  else
    out="$("$DOCKER" run --rm --network none -v "$VOLUME:/shared" "loraship-$image:0.1.0" /shared/demo.yaml 2>&1)"
  fi
  grep -m1 "skipped (up to date) ->" <<<"$out" || { echo "$out" >&2; exit 1; }
done
step "quantize's importance matrix was made in its image (llama.cpp's tools from images/Dockerfile's llama-tools stage)"
# imatrix is on by default: the flow's quantize ran llama-imatrix and llama-quantize inside the convert image
# (LORASHIP_LLAMA_CPP_TOOLS_DIR), and its manifest records the matrix and the quantizer.
python - "$mountpoint" <<'EOF3'
import json, sys, yaml
from pathlib import Path
mount = Path(sys.argv[1])
config = yaml.safe_load(open(mount / "demo.yaml"))
work = Path(config["workdir"])
manifest = mount / work.relative_to("/shared") / config["run_name"] / "quantize" / "manifest.json"
metrics = json.load(open(manifest))["metrics"]
matrix = metrics.get("imatrix") or {}
assert matrix.get("sha256") and matrix.get("chunks"), f"quantize in the container made no importance matrix: {matrix}"
quantizers = {q: each["quantizer"] for q, each in metrics["quantizations"].items()}
assert all(v.startswith("llama-quantize --imatrix") for v in quantizers.values()), quantizers
print(f"imatrix in the convert image: {matrix['chunks']} chunks, sha256 {matrix['sha256'][:12]}")
EOF3
step "docker deployment OK"
