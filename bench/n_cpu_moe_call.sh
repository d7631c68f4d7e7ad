#!/bin/bash
# bench/n_cpu_moe_gpu.py on the lent GPU machine (kind nvidia-h100-x1 or nvidia-h200), from the repository root, carry
# [".loraship/gpukit"] (bench/n_cpu_moe_kit.sh makes it): the llama-cpp-python sdist of the pinned version cut to
# CUDA and CPU (lcp.tgz), wheels for scikit-build-core, pathspec, gguf and diskcache, the pinned converter (conv/) and the Qwen3 tokenizer files
# (tok/). The first call starts the chain detached (the CUDA build of llama-cpp-python beside the model's making,
# then quantize, then measure) and waits up to W s; a later call on the still-warm machine only waits and collects
# $OUT/n_cpu_moe_gpu.json and the logs.
K=.loraship/gpukit
S=/tmp/ncstate
if [ "$1" = chain ]; then
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $K/*.whl > $S/install.log 2>&1
  mkdir -p /tmp/lcp && tar xzf $K/lcp.tgz -C /tmp/lcp
  ( CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_TESTS=OFF" CMAKE_BUILD_PARALLEL_LEVEL=14 python3 -m pip install --no-build-isolation --no-deps \
      --no-compile --target /tmp/llama /tmp/lcp/llama_cpp_python-0.3.36 > $S/build.log 2>&1; echo "build rc=$?" >> $S/progress ) &
  python3 bench/n_cpu_moe_gpu.py model --out /tmp/nc --tokenizer $K/tok --converter $K/conv > $S/model.log 2>&1
  echo "model rc=$? $(date +%T)" >> $S/progress
  wait
  export PYTHONPATH=/tmp/llama:/tmp/site:$PWD
  python3 bench/n_cpu_moe_gpu.py quantize --out /tmp/nc > $S/quantize.log 2>&1
  echo "quantize rc=$? $(date +%T)" >> $S/progress
  rm -f /tmp/nc/model-F16.gguf
  python3 bench/n_cpu_moe_gpu.py measure --out /tmp/nc --result $S/n_cpu_moe_gpu.json > $S/measure.log 2>&1
  echo "measure rc=$? $(date +%T)" >> $S/progress
  touch $S/all.done
  exit 0
fi
mkdir -p $S
if [ ! -f $S/started ]; then touch $S/started; setsid nohup bash "$0" chain > $S/chain.log 2>&1 < /dev/null & fi
end=$(( $(date +%s) + ${W:-560} ))
while [ $(date +%s) -lt $end ] && [ ! -f $S/all.done ]; do sleep 5; done
cp $S/n_cpu_moe_gpu.json $OUT/ 2>/dev/null
tar czf $OUT/logs.tgz -C /tmp ncstate 2>/dev/null
cat $S/progress 2>/dev/null; tail -3 $S/install.log $S/build.log $S/model.log $S/quantize.log 2>/dev/null
tail -c 3000 $S/measure.log 2>/dev/null; df -h / | tail -1; nvidia-smi --query-gpu=name,memory.used --format=csv
