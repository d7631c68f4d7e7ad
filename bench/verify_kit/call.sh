#!/bin/bash
# One device call (<= 590 s), from the repository root, kind nvidia-h200, carry [".whl-verify"]:
#   LORASHIP_COMMIT=<git rev-parse HEAD, here> bash bench/verify_kit/call.sh
# The first call starts chain.sh detached (.git does not travel: the commit comes from that variable) and waits up
# to W s (default 560); a later call on the still-warm machine (call again at once: it goes back 30 s after a call
# ends) only waits and collects. With LADDER=1 or LADDER=only (chain.sh says what they run) the call is
#   LADDER=only LORASHIP_COMMIT=<...> bash bench/verify_kit/call.sh
# (the variables reach chain.sh from the first call; a later call needs none of them). Into $OUT:
# verify_served_gpu.json (once all is done), quant_ladder_gpu.json (rewritten after every rung), the runs' JSON as they are,
# state.tgz (every log, config and verify.json; no model or GGUF), and the CUDA build's pieces
# llama-cuda.tgz.part-NN (under 16 MiB each; carry them back in .whl-verify/ and install.sh unpacks them).
S=${VSTATE:-/tmp/vstate}; R=${VS:-/tmp/vs}; mkdir -p $S  # both as chain.sh has them
if [ ! -f $S/started ]; then touch $S/started; LORASHIP_COMMIT=$LORASHIP_COMMIT setsid nohup bash bench/verify_kit/chain.sh > $S/chain.log 2>&1 < /dev/null & fi
end=$(( $(date +%s) + ${W:-560} ))
collect() {
  cp $S/verify_served_gpu.json $S/demo.json $S/qwen2-base.json $S/quant_ladder_gpu.json $OUT/ 2>/dev/null
  tar czf $OUT/state.tgz.tmp -C / --exclude='*.safetensors' --exclude='*.gguf' --exclude='*.bin' --exclude='*.pt' --exclude='*.npz' \
    --exclude=tokenizer.json --exclude='*.png' --exclude=vocab.json --exclude=merges.txt \
    --exclude='llama-cuda.tgz*' --exclude='*.tgz.tmp' ${S#/} ${R#/} 2>/dev/null; mv $OUT/state.tgz.tmp $OUT/state.tgz
}
while [ $(date +%s) -lt $end ] && [ ! -f $S/all.done ]; do sleep 5; [ $(( $(date +%s) % 60 )) -lt 5 ] && collect; done
collect
[ -f $S/llama.built ] && cp $S/llama-cuda.tgz.part-* $OUT/ 2>/dev/null
cat $S/progress $S/machine.log 2>/dev/null; tail -25 $S/install.log
tail -c 1500 $S/chain.log; echo "== build"; tail -c 1500 $S/build.log 2>/dev/null
for f in demo qwen2-base ladder; do echo "== $f"; tail -c 2500 $S/$f.log 2>/dev/null; done
ls -la $S; df -h / | tail -1; nvidia-smi --query-gpu=memory.used --format=csv
