# issue #24 on one GPU machine: bench/train_bench.py, rows in order of importance (run detached by call.sh); then one
# more pass over the rows that failed (--resume), so a fix sent by a later call (the tree is synced in place) still runs.
# Writes /tmp/tstate/train_bench.json after every row; progress lines in /tmp/tstate/progress.
set -x
S=/tmp/tstate
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ df -h / /tmp /dev/shm; nproc; free -g; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > $S/machine.log 2>&1
echo "install start $(date +%T)" >> $S/progress
SITE=${SITE:-/tmp/site} bash .whl-train/install.sh > $S/install.log 2>&1; echo "install rc=$? $(date +%T)" >> $S/progress
export PYTHONPATH=${SITE:-/tmp/site}:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false LORASHIP_CACHE=/tmp/lcache LORASHIP_LLAMA_CPP_DIR=$PWD/.whl-train/llama.cpp-conv \
  UNSLOTH_DISABLE_STATISTICS=1  # no hub calls from unsloth
# Preflight, seconds: what the stages import and the converter the plan checks with. A failure ends the chain
# at once, so a broken kit costs one short call, not a device budget of failed rows.
if ! python3 -c "import gguf, liger_kernel, loraship.stages.plan, loraship.stages.train
from loraship.llamacpp.llamacpp import converter_dir; print('preflight ok', converter_dir(fetch=False))" >> $S/progress 2>&1; then
  echo "preflight failed $(date +%T)" >> $S/progress; touch $S/all.done; exit 1
fi
gpu_tests() {  # tests/test_gpu_smoke.py: the four strategies through plan + train (about 1-2 min)
  timeout 300 python3 -m pytest -q -s -m gpu tests/test_gpu_smoke.py -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
    > $S/gpu_tests.log 2>&1
  local rc=$?; echo "gpu tests rc=$rc $(date +%T)" >> $S/progress; return $rc
}
# First: the smoke tests gate the bench (a failure there would fail every row the same way).
if [ "$GPU_TESTS" = first ] && ! gpu_tests; then touch $S/all.done; exit 1; fi
[ "$GPU_TESTS" = before ] && gpu_tests  # first, but the bench runs whatever they say
# The random checkpoints: 7B 14.2 GiB + 14B 27.5 GiB. On the disk where it has room, else in /dev/shm.
DISK=$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9); SHM=$(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9)
if [ "$DISK" -ge 52 ] || [ "$SHM" -lt 46 ]; then M=/tmp/tb/models; else M=/dev/shm/tb-models; fi
M=${MODELS_DIR:-$M}  # MODELS_DIR: where the caller wants them (moe_call.sh: /dev/shm, 128 GiB on the H100)
MODELS="--models $M"
echo "disk ${DISK}G shm ${SHM}G models: $M commit: ${LORASHIP_COMMIT:-?}" >> $S/progress
# PROFILE=1 (or all): every case profiled; PROFILE="case ...": those cases only.
case "$PROFILE" in "") PROFILE_ARGS= ;; 1|all) PROFILE_ARGS=--profile ;; *) PROFILE_ARGS="--profile $PROFILE" ;; esac
bench() {
  python3 bench/train_bench.py --tokenizer ${TOKENIZER:-$PWD/.loraship/models/tiny-llama} --root /tmp/tb $MODELS \
    --steps ${STEPS:-10} --warmup 3 --timeout ${ROW_TIMEOUT:-240} --out $S/train_bench.json \
    ${SKIP:+--skip $SKIP} ${TRAINERS:+--trainers $TRAINERS} $PROFILE_ARGS ${DROP_MODELS:+--drop-models} ${RESUME:+--resume} \
    --cases ${CASES:-qwen2-7b-lora qwen2-7b-lora-all-linear qwen2-7b-qlora qwen2-14b-qlora qwen2-14b-lora} "$@"
}
bench > $S/bench.log 2>&1
echo "bench rc=$? $(date +%T)" >> $S/progress
bench --resume > $S/bench_retry.log 2>&1
echo "retry of failed rows rc=$? $(date +%T)" >> $S/progress
# PROFILE_AFTER="case ...": then those cases again, profiled (PROFILE_TRAINERS: only those trainers), into their
# own file; the rows above stay unprofiled.
if [ -n "$PROFILE_AFTER" ]; then
  TRAINERS="${PROFILE_TRAINERS:-$TRAINERS}" PROFILE_ARGS="--profile $PROFILE_AFTER" bench --cases $PROFILE_AFTER --out $S/train_bench_profile.json > $S/bench_profile.log 2>&1
  echo "profiled rows rc=$? $(date +%T)" >> $S/progress
fi
[ "$GPU_TESTS" = last ] && gpu_tests
# MATRIX=1: then the memory matrix through plan + train on the same machine (bench/train_kit/matrix_call.sh).
# Its shapes' checkpoints are the bench's where they exist (same dims: bench/memory_matrix.py stage_dims), so the
# 7B and 14B are not written twice; the matrix deletes each shape once its rows are done.
if [ -n "$MATRIX" ]; then MODELS_DIR=$M bash bench/train_kit/matrix_call.sh chain; echo "matrix done $(date +%T)" >> $S/progress; fi
touch $S/all.done
