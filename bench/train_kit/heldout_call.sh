# issue #47: bench/planner_heldout.py measure (held-out families through loraship.stages.plan + train) on the lent GPU.
# One device call (<= 570 s), from the repository root, carry [".whl-train"] (bash bench/train_kit/make.sh):
#   bash bench/train_kit/heldout_call.sh
# The first call installs the kit and starts the measurement detached, waits up to W s and copies what exists into
# $OUT; every later call (the machine still warm) only waits and collects. planner_heldout_raw.json is rewritten
# after every row. Knobs (env, first call only): ONLY (row names, comma-separated), STEPS (3), ROW_TIMEOUT (420 s).
# Then, here: python bench/planner_heldout.py analyze planner_heldout_raw.json
S=/tmp/hstate
if [ -n "$RESTART" ] && [ -f $S/chain.pid ]; then  # RESTART=1: stop a running chain, start over (built models kept)
  kill -- -"$(cat $S/chain.pid)" 2>/dev/null; sleep 2; rm -rf $S /tmp/hm/data
fi
mkdir -p $S
if [ "$1" = chain ]; then
  echo $$ > $S/chain.pid
  set -x
  { df -h / /tmp /dev/shm; nproc; free -g; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } > $S/machine.log 2>&1
  echo "install start $(date +%T)" >> $S/progress
  SITE=${SITE:-/tmp/site} bash .whl-train/install.sh > $S/install.log 2>&1; echo "install rc=$? $(date +%T)" >> $S/progress
  mkdir -p /tmp/family-tokenizers && tar xzf .whl-train/family-tokenizers.tgz -C /tmp/family-tokenizers
  export PYTHONPATH=${SITE:-/tmp/site}:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    LORASHIP_CACHE=/tmp/lcache LORASHIP_LLAMA_CPP_DIR=$PWD/.whl-train/llama.cpp-conv
  DISK=$(df -BG --output=avail /tmp | tail -1 | tr -dc 0-9)
  if [ "$DISK" -ge 36 ]; then M=/tmp/hm/models; else M=/dev/shm/hm-models; fi
  echo "disk ${DISK}G models: $M $(date +%T)" >> $S/progress
  python3 bench/planner_heldout.py measure --out $S/out --root /tmp/hm --models $M --steps ${STEPS:-3} \
    --row-timeout ${ROW_TIMEOUT:-420} ${ONLY:+--only $ONLY} > $S/heldout.log 2>&1
  echo "heldout rc=$? $(date +%T)" >> $S/progress
  touch $S/all.done
  exit 0
fi
if [ ! -f $S/started ]; then touch $S/started; setsid nohup bash "$0" chain > $S/chain.log 2>&1 < /dev/null & fi
end=$(( $(date +%s) + ${W:-560} ))
while [ $(date +%s) -lt $end ] && [ ! -f $S/all.done ]; do sleep 5; done
cp $S/out/*.json $S/*.log $S/progress $OUT/ 2>/dev/null
cat $S/progress $S/machine.log; tail -5 $S/install.log
grep -E '^\{' $S/heldout.log | cut -c1-600
tail -c 1500 $S/chain.log; echo "== heldout.log"; tail -c 2500 $S/heldout.log
ls -t /tmp/hm/*.log 2>/dev/null | head -1 | xargs -r tail -c 2500
df -h / /dev/shm | tail -2; nvidia-smi --query-gpu=memory.used --format=csv
