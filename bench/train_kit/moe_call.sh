# issue #46 (and #47's last held-out rows) on one GPU machine, carry [".whl-train"] (bash bench/train_kit/make.sh):
#   LORASHIP_COMMIT=$(git rev-parse HEAD) bash bench/train_kit/moe_call.sh
# The first call installs the kit and starts, detached: bench/train_bench.py on the mixture-of-experts cases
# (loraship's default plan and Unsloth's SFTTrainer first on each case, then loraship's lean plan) into
# /tmp/tstate/train_bench.json, then bench/planner_heldout.py measure on HELDOUT rows into /tmp/hstate. Each call waits
# up to W s and copies what exists into $OUT; later calls (the machine still warm) only wait and collect.
# The random checkpoints go to /dev/shm (128 GiB on the lent H100; Qwen3-30B-A3B's bf16 is 61 GB, the disk has
# 64 GiB): loraship refuses a base folder whose shards link outside it, so train_bench.save_spilled is for a
# machine short of both. Knobs: STEPS (8), ROW_TIMEOUT (900 s), MOE_CASES, MOE_TRAINERS, HELDOUT (rows; "" none),
# RESTART=1 (stop the running chain, keep its rows and models, start again: rows that trained are kept).
# Check the harness on the CPU first (a tiny Qwen3-MoE through loraship's plan + train, seconds):
#   python bench/train_bench.py --smoke --tokenizer .loraship/models/family-tokenizers/qwen3 --root /tmp/tbs \
#     --out /tmp/tbs.json --cases qwen3-moe-12l-qlora-1x2048 --trainers loraship-default --steps 3
M=/tmp/moestate
if [ -n "$RESTART" ] && [ -f $M/chain.pid ]; then  # RESTART=1: stop the chain, keep its rows and built models
  kill -- -"$(cat $M/chain.pid)" 2>/dev/null; sleep 3
  mkdir -p /dev/shm/tb-models
  for d in /tmp/tb/models/*/; do [ -d "$d" ] && mv "$d" /dev/shm/tb-models/; done
  for l in /dev/shm/tb-models/*/*.safetensors; do [ -L "$l" ] && mv -f "$(readlink "$l")" "$l"; done
  # Qwen3's own tokenizer (the converter check refuses the tiny Llama's under a Qwen3-MoE class)
  mkdir -p /tmp/family-tokenizers && tar xzf .whl-train/family-tokenizers.tgz -C /tmp/family-tokenizers
  for d in /dev/shm/tb-models/qwen3*/; do rm -f "$d"tokenizer* "$d"chat_template*; cp /tmp/family-tokenizers/qwen3/tokenizer* "$d"; done
  cp /tmp/tstate/train_bench.json $M/train_bench_before_restart.json 2>/dev/null
  rm -f $M/started $M/all.done /tmp/tstate/started
  echo "restarted $(date +%T)" >> $M/progress
fi
if [ "$1" = chain ]; then
  echo $$ > $M/chain.pid
  # Qwen3's own tokenizer for the Qwen3-MoE shapes: the plan's converter check refuses the tiny Llama's there.
  mkdir -p /tmp/family-tokenizers && tar xzf .whl-train/family-tokenizers.tgz -C /tmp/family-tokenizers
  TOKENIZER=/tmp/family-tokenizers/qwen3 CASES="${MOE_CASES:-qwen3-moe-12l-qlora-1x2048 qwen3-30b-a3b-qlora-1x2048 qwen3-30b-a3b-qlora-2x2048}" \
    TRAINERS="${MOE_TRAINERS:-loraship-default unsloth-sft loraship-lean}" STEPS=${STEPS:-8} \
    ROW_TIMEOUT=${ROW_TIMEOUT:-900} MODELS_DIR=/dev/shm/tb-models RESUME=${RESUME-1} bash .whl-train/chain.sh
  echo "moe bench done $(date +%T)" >> $M/progress
  ONLY=${HELDOUT-olmo2-13b-qlora-all-2x2048,granite8b-qlora-qvo-4x4096,qwen3moe12l-qlora-all-1x2048}
  if [ -n "$ONLY" ]; then
    rm -rf /tmp/tb/models /tmp/tb/spill /dev/shm/tb-spill /dev/shm/tb-models  # room for the held-out shapes
    ONLY=$ONLY STEPS=3 bash bench/train_kit/heldout_call.sh chain
  fi
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
