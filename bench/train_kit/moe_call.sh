# issue #46 (and #47's last held-out rows) on one GPU machine, carry [".whl-train"] (bash bench/train_kit/make.sh):
#   LORASHIP_COMMIT=$(git rev-parse HEAD) bash bench/train_kit/moe_call.sh
# The first call installs the kit and starts, detached: bench/train_bench.py on the mixture-of-experts cases
# (loraship's default plan and Unsloth's SFTTrainer first on each case, then loraship's lean plan) into
# /tmp/tstate/train_bench.json, then bench/planner_heldout.py measure on HELDOUT rows into /tmp/hstate. Each call waits
# up to W s and copies what exists into $OUT; later calls (the machine still warm) only wait and collect.
# Qwen3-30B-A3B's random bf16 checkpoint (61 GB) is written one layer a shard across the disk and /dev/shm
# (train_bench.save_spilled). Knobs: STEPS (8), ROW_TIMEOUT (900 s), MOE_CASES, MOE_TRAINERS, HELDOUT (rows).
M=/tmp/moestate
if [ "$1" = chain ]; then
  echo $$ > $M/chain.pid
  CASES="${MOE_CASES:-qwen3-moe-12l-qlora-1x2048 qwen3-30b-a3b-qlora-1x2048 qwen3-30b-a3b-qlora-2x2048}" \
    TRAINERS="${MOE_TRAINERS:-loraship-default unsloth-sft loraship-lean}" STEPS=${STEPS:-8} \
    ROW_TIMEOUT=${ROW_TIMEOUT:-900} BENCH_SPILL_DIRS=/dev/shm/tb-spill:/tmp/tb/spill bash .whl-train/chain.sh
  echo "moe bench done $(date +%T)" >> $M/progress
  rm -rf /tmp/tb/models /tmp/tb/spill /dev/shm/tb-spill /dev/shm/tb-models  # room for the held-out shapes
  ONLY=${HELDOUT-olmo2-13b-qlora-all-2x2048,granite8b-qlora-qvo-4x4096,qwen3moe12l-qlora-all-1x2048}
  [ -n "$ONLY" ] && ONLY=$ONLY STEPS=3 bash bench/train_kit/heldout_call.sh chain
  echo "heldout done $(date +%T)" >> $M/progress
  touch $M/all.done
  exit 0
fi
mkdir -p $M /tmp/tstate
if [ ! -f $M/started ]; then touch $M/started; setsid nohup bash "$0" chain > $M/chain.log 2>&1 < /dev/null & fi
end=$(( $(date +%s) + ${W:-560} ))
collect() {
  cp /tmp/tstate/train_bench.json /tmp/hstate/out/*.json $OUT/ 2>/dev/null
  tar czf $OUT/state.tgz.tmp -C /tmp --exclude='*.safetensors' moestate tstate hstate tb/row-*.json 2>/dev/null
  mv $OUT/state.tgz.tmp $OUT/state.tgz
}
while [ $(date +%s) -lt $end ] && [ ! -f $M/all.done ]; do sleep 5; [ $(( $(date +%s) % 30 )) -lt 5 ] && collect; done
collect
cat /tmp/tstate/progress /tmp/hstate/progress $M/progress /tmp/tstate/machine.log 2>/dev/null; tail -5 /tmp/tstate/install.log
grep -hE '^\{"(case|model)"' /tmp/tstate/bench.log /tmp/tstate/bench_retry.log 2>/dev/null | cut -c1-700
echo "== bench.log"; tail -c 3000 /tmp/tstate/bench.log; echo "== heldout.log"; tail -c 1500 /tmp/hstate/heldout.log 2>/dev/null
ls -t /tmp/tb/*.log 2>/dev/null | head -1 | xargs -r tail -c 2500
df -h / /dev/shm | tail -2; free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv
