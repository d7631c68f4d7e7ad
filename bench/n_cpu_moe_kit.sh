#!/bin/bash
# Assemble .loraship/gpukit (ignored; about 19 MiB) for bench/n_cpu_moe_call.sh, from the repository root, after one
# run of tests/test_moe.py (its Qwen3-MoE fixture's tokenizer files) and `loraship fetch-converter`:
#   WHEELS=<a folder holding scikit_build_core, pathspec, gguf and diskcache wheels> bash bench/n_cpu_moe_kit.sh
# Without WHEELS they are fetched with pip download. The llama-cpp-python sdist (the pinned version, in the cache's
# packages/) is cut to what a CUDA build needs: no .git, docs, models, examples, tests or other GPU backends.
set -e
ROOT=$PWD
CACHE=${LORASHIP_CACHE:-.loraship/cache}
K=.loraship/gpukit
rm -rf $K /tmp/nc-kit && mkdir -p $K/tok /tmp/nc-kit
if [ -n "$WHEELS" ]; then
  for w in scikit_build_core pathspec gguf diskcache; do cp "$WHEELS"/$w-*.whl $K/; done
else
  python3 -m pip download -q --no-deps --only-binary=:all: -d $K scikit-build-core pathspec gguf==0.19.0 diskcache
fi
cp -r $CACHE/llama.cpp-0.3.36 $K/conv
cp .loraship/models/family-qwen3-moe/{tokenizer.json,tokenizer_config.json,generation_config.json,config.json} $K/tok/
tar xzf $CACHE/packages/llama_cpp_python-0.3.36.tar.gz -C /tmp/nc-kit
cd /tmp/nc-kit/llama_cpp_python-0.3.36
rm -rf .git examples docker docs vendor/llama.cpp/{.git,.github,docs,models,benches,media,tests,tools/ui,examples,scripts,gguf-py,conversion}
for b in virtgpu cann openvino webgpu et metal hexagon sycl vulkan opencl musa zdnn kompute; do
  rm -rf vendor/llama.cpp/ggml/src/ggml-$b
done
cd /tmp/nc-kit && tar czf "$ROOT/$K/lcp.tgz" llama_cpp_python-0.3.36
cd "$ROOT" && du -sh $K
