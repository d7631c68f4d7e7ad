#!/bin/bash
# verify's served check on one GPU machine (started detached by call.sh; from the repository root):
# install the kit, build llama-cpp-python 0.3.36 with CUDA (sm_90; GGML_NATIVE off as in images/Dockerfile; without the multimodal
# library, which only the LLaVA chat handler imports, as `make venv` builds it) in the background unless a build was carried,
# and meanwhile build the two base models and run their stages up to reference side by side (the demo's tiny Llama
# through `loraship tiny-model`, qwen2-base through loraship.fixtures.families); convert -> quantize -> verify wait
# for the build and run one run at a time (bench/verify_served_gpu.py --wait-for, --lock).
# Writes /tmp/vstate/verify_served_gpu.json at the end, progress lines to /tmp/vstate/progress.
# LADDER=1: also bench/quant_ladder_gpu.py (quantization auto's ladder on a random-weight Qwen2-7B) beside the two runs,
# its convert waiting for the build like theirs, each rung's GPU measurement under their lock; LADDER=only: the ladder
# alone. Into /tmp/vstate/quant_ladder_gpu.json; it starts no rung expected to end later than LADDER_DEADLINE_S
# (default 1100) after this script started (two calls of <= 590 s), LADDER_ARGS go to it as they are.
# A CPU dry run of the chain itself (here, with python3 on PATH being a venv that has loraship's extras and a CPU
# llama-cpp-python): VSTATE=/tmp/x VS=/tmp/y INSTALL=skip LLAMA_BUILD=skip DEVICE=cpu MAX_STEPS=2 \
#   EXTRA_PYTHONPATH=<a sitecustomize folder, if any> bash bench/verify_kit/chain.sh
set -x
T0=$(date +%s)
S=${VSTATE:-/tmp/vstate}; R=${VS:-/tmp/vs}; K=.whl-verify; mkdir -p $S $R; export VSTATE=$S
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nproc; free -g; df -h / /tmp; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvcc --version | tail -2
  python3 --version; } > $S/machine.log 2>&1
echo "install start $(date +%T)" >> $S/progress
[ "$INSTALL" = skip ] || { KIT=$K bash bench/verify_kit/install.sh > $S/install.log 2>&1; echo "install rc=$? $(date +%T)" >> $S/progress; }
export PYTHONPATH=/tmp/site:/tmp/llama:$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  LORASHIP_CACHE=/tmp/lcache LORASHIP_LLAMA_CPP_DIR=$PWD/$K/llama.cpp-conv
BUILT=$S/llama.built
build() {
  local t0=$(date +%s)
  mkdir -p /tmp/src && tar xzf $K/llama_cpp_python-0.3.36-stripped.tgz -C /tmp/src
  if CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=off -DLLAVA_BUILD=OFF -DCMAKE_CUDA_ARCHITECTURES=90" CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-16} \
      python3 -m pip install -v --no-build-isolation --no-deps --no-cache-dir --target /tmp/llama \
      /tmp/src/llama_cpp_python-0.3.36 > $S/build.log 2>&1 \
      && python3 -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 3)" >> $S/build.log 2>&1; then
    echo $(( $(date +%s) - t0 )) > $S/build_seconds
    # A wheel holds libX.so, libX.so.0 and libX.so.0.x.y as three copies: keep one, link the others, so that
    # the build comes back (and is carried again) as one archive in pieces under 16 MiB.
    python3 - /tmp/llama/llama_cpp/lib >> $S/build.log 2>&1 <<'PY'
import hashlib, os, sys
from pathlib import Path
seen = {}
for f in sorted(Path(sys.argv[1]).iterdir(), key=lambda p: -len(p.name)):  # the full version name is kept
    if f.is_file() and not f.is_symlink():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        if digest in seen:
            f.unlink(); f.symlink_to(seen[digest]); print("linked", f.name, "->", seen[digest])
        else:
            seen[digest] = f.name
PY
    du -sh /tmp/llama /tmp/llama/llama_cpp/lib >> $S/build.log
    tar czf $S/llama-cuda.tgz -C /tmp/llama . && (cd $S && split -b 15M -d llama-cuda.tgz llama-cuda.tgz.part-)
    touch $BUILT
  else
    tail -c 3000 $S/build.log > $BUILT.failed
  fi
  echo "llama build ended $(date +%T): $(ls $S | grep llama.built)" >> $S/progress
}
if [ "$LLAMA_BUILD" = skip ]; then
  echo skipped > $S/build_seconds; touch $BUILT
elif python3 -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)" 2>/dev/null; then
  echo carried > $S/build_seconds; touch $BUILT
else
  build &
fi
M=$PWD/.loraship/models
DRIVER="--root $R --wait-for $BUILT --lock $S/phase_b.lock --device ${DEVICE:-cuda} ${MAX_STEPS:+--max-steps $MAX_STEPS}"
demo() {
  local t0=$(date +%s)
  python3 -m loraship.cli tiny-model $M/tiny-llama > $S/tiny-model.log 2>&1 || { echo "tiny-model failed" >> $S/progress; return 1; }
  echo "tiny model built in $(( $(date +%s) - t0 )) s $(date +%T)" >> $S/progress
  echo $(( $(date +%s) - t0 )) > $S/demo_model_seconds
  python3 bench/verify_served_gpu.py --name demo --model $M/tiny-llama --out $S/demo.json $DRIVER > $S/demo.log 2>&1
  echo "demo rc=$? $(date +%T)" >> $S/progress
}
family() {
  local t0=$(date +%s)
  python3 -m loraship.fixtures.families qwen2-base --out $M/family-qwen2-base > $S/family-model.log 2>&1 \
    || { echo "family model failed" >> $S/progress; return 1; }
  echo "qwen2-base model built in $(( $(date +%s) - t0 )) s $(date +%T)" >> $S/progress
  echo $(( $(date +%s) - t0 )) > $S/family_model_seconds
  python3 bench/verify_served_gpu.py --name qwen2-base --family qwen2-base --model $M/family-qwen2-base \
    --out $S/qwen2-base.json $DRIVER > $S/qwen2-base.log 2>&1
  echo "qwen2-base rc=$? $(date +%T)" >> $S/progress
}
ladder() {
  local left=$(( ${LADDER_DEADLINE_S:-1100} - ($(date +%s) - T0) ))
  python3 bench/quant_ladder_gpu.py --root $R/ladder --out $S/quant_ladder_gpu.json --wait-for $BUILT \
    --lock $S/phase_b.lock --device ${DEVICE:-cuda} --deadline-s $left $LADDER_ARGS > $S/ladder.log 2>&1
  echo "ladder rc=$? $(date +%T)" >> $S/progress
}
case "$LADDER" in
  only) ladder ;;
  1) demo & family & ladder & wait ;;
  *) demo & family & wait ;;
esac
# the build's archive is waited for too (a run that failed early must not cut it off)
while [ ! -f $BUILT ] && [ ! -f $BUILT.failed ]; do sleep 2; done
[ "$LADDER" = only ] || python3 - <<'PY'
import datetime, json, os
from pathlib import Path
S = Path(os.environ["VSTATE"])
def read(name):
    p = S / name
    return p.read_text().strip() if p.exists() else None
runs = [json.loads((S / f).read_text()) for f in ("demo.json", "qwen2-base.json") if (S / f).exists()]
out = {
    "what": "verify's served check (llama_cpp.server asked by the openai client, loraship/llamacpp/served.py) on one "
            "NVIDIA H200 under llama-cpp-python 0.3.36 built with CUDA (sm_90) there: loraship's own stages "
            "(python -m loraship.stages.<stage> CONFIG, plan -> verify) on the demo (configs/demo.yaml, the tiny Llama "
            "from `loraship tiny-model`) and on the qwen2-base family model built there "
            "(python -m loraship.fixtures.families qwen2-base, the family test's config overrides), device: cuda",
    "command": "LORASHIP_COMMIT=<commit> bash bench/verify_kit/call.sh (bench/verify_kit; carry [\".whl-verify\"]), "
               "as many calls as it takes; chain.sh runs bench/verify_served_gpu.py per run",
    "commit": os.environ.get("LORASHIP_COMMIT"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": read("machine.log"), "llama_cuda_build_seconds": read("build_seconds"),
    "model_build_seconds": {"demo": read("demo_model_seconds"), "qwen2-base": read("family_model_seconds")},
    "runs": runs,
}
(S / "verify_served_gpu.json").write_text(json.dumps(out, indent=2))
PY
echo "all done $(date +%T)" >> $S/progress
touch $S/all.done
