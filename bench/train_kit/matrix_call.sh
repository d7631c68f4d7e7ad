# issue #10 item 5: bench/memory_matrix.py measure-stage (every row through loraship.stages.plan + train) on the lent H200.
# One device call (<= 570 s), from the repository root, kind nvidia-h200, carry [".whl-train"] (bash bench/train_kit/make.sh):
#   bash bench/train_kit/matrix_call.sh
# The first call installs the kit and starts the measurement detached, waits up to W s and copies what exists into $OUT;
# every later call (the machine still warm) only waits and collects. memory_matrix_stage_raw.json is rewritten after
# every row, so a cut-short chain still brings what it measured. Knobs (env, first call only): ONLY (MATRIX rows,
# grouped by shape in this order; each shape's checkpoint is built once and deleted after its rows), STEPS (3),
# ROW_TIMEOUT (420 s a row), ALWAYS_CAP=1 (also run every row under the 32 GiB cap), W (seconds this call waits).
# Then, here: python bench/memory_matrix.py analyze memory_matrix_stage_raw.json (scores, does not refit).
S=/tmp/mstate; mkdir -p $S
if [ "$1" = chain ]; then
  set -x
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  { df -h / /tmp /dev/shm; nproc; free -g; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > $S/machine.log 2>&1
  echo "install start $(date +%T)" >> $S/progress
  SITE=${SITE:-/tmp/site} bash .whl-train/install.sh > $S/install.log 2>&1; echo "install rc=$? $(date +%T)" >> $S/progress
  export PYTHONPATH=${SITE:-/tmp/site}:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    LORASHIP_CACHE=/tmp/lcache LORASHIP_LLAMA_CPP_DIR=$PWD/.whl-train/llama.cpp-conv
  # One shape's checkpoint at a time (the 14B is 27.5 GiB): on the disk where it has room, else in /dev/shm.
  DISK=$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9)
  if [ "$DISK" -ge 36 ]; then M=/tmp/mm/models; else M=/dev/shm/mm-models; fi
  M=${MODELS_DIR:-$M}  # chain.sh's: the bench's checkpoints, reused
  echo "disk ${DISK}G models: $M $(date +%T)" >> $S/progress
  # Default: held-out rows (odd rows of the first call, then later calls' rows), 7B and 8B shapes first, 14B last.
  python3 bench/memory_matrix.py measure-stage --out $S/matrix --root /tmp/mm --models $M --prune-models \
    --steps ${STEPS:-3} --row-timeout ${ROW_TIMEOUT:-420} --only ${ONLY:-1,3,5,7,9,26,11,13,15,27,30,17,21} \
    ${ALWAYS_CAP:+--always-cap} > $S/matrix.log 2>&1
  echo "matrix rc=$? $(date +%T)" >> $S/progress
  touch $S/all.done
  exit 0
fi
if [ ! -f $S/started ]; then touch $S/started; setsid nohup bash "$0" chain > $S/chain.log 2>&1 < /dev/null & fi
end=$(( $(date +%s) + ${W:-560} ))
while [ $(date +%s) -lt $end ] && [ ! -f $S/all.done ]; do sleep 5; done
cp $S/matrix/*.json $S/*.log $S/progress $OUT/ 2>/dev/null
cat $S/progress $S/machine.log; tail -5 $S/install.log
grep -E '^(\[|\{"model")' $S/matrix.log | cut -c1-500
tail -c 1500 $S/chain.log; echo "== matrix.log"; tail -c 2500 $S/matrix.log
ls -t /tmp/mm/stage_*.log 2>/dev/null | head -1 | xargs -r tail -c 1500
ls /tmp/mm /tmp/mm/models /dev/shm/mm-models 2>/dev/null; df -h / /dev/shm | tail -2; nvidia-smi --query-gpu=memory.used --format=csv
