#!/bin/bash
# Build .whl-train/ (ignored, carried to the lent H200): the wheels the train bench and tests/test_gpu_smoke.py
# need there that its python3 (3.12; torch 2.11 CUDA 13, transformers 5.17, peft, accelerate) lacks, slimmed to fit
# the 64 MiB a run may carry, plus the tiny model and this folder's scripts.
#   bash bench/train_kit/make.sh [PYTHON]        # from the repository root; PYTHON: any python with pip
set -e
PY=${1:-python3}
K=.whl-train; FULL=$(mktemp -d)
mkdir -p $K
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
$PY -m pip download -q --no-deps $PLAT -d $K unsloth_zoo==2026.10.9 torchao==0.18.0 tyro docstring-parser typeguard \
  shtab trl==1.15.0 cut-cross-entropy datasets==4.3.0 dill multiprocess hf-transfer msgspec json5 nest-asyncio structlog \
  diffusers liger-kernel==0.8.5 diskcache pydantic==2.14.4 pydantic_core==2.50.5 annotated_types typing_inspection \
  pytest==9.2.0 pluggy iniconfig pygments "gguf==$($PY -c 'import importlib.metadata as m; print(m.version("gguf"))')"
$PY -m pip download -q --no-deps $PLAT -d $FULL unsloth==2026.10.9 bitsandbytes==0.50.2
# Unsloth's studio/ web UI is 26 MB of its 28.6; bitsandbytes keeps only the CUDA 13 libraries torch 2.11 loads.
$PY bench/slim_wheel.py $FULL/unsloth-2026.10.9-py3-none-any.whl $K studio/
$PY bench/slim_wheel.py $FULL/bitsandbytes-0.50.2-*.whl $K \
  bitsandbytes/libbitsandbytes_cuda1{18,21,24,26,28}.so
rm -rf $FULL
$PY -c "from loraship.fixtures.tinymodel import ensure_tiny_model; ensure_tiny_model('.loraship/models/tiny-llama')"
tar czf $K/tiny-llama.tgz -C .loraship/models tiny-llama
# The held-out families' own tokenizers (bench/planner_heldout.py): the weightless folders the family tests build.
T=$(mktemp -d)
for f in olmo2 phi3 phi4 granite3 gemma2 qwen3; do
  $PY -c "import sys; from pathlib import Path; from loraship.fixtures.families import write_folder_without_weights as w; \
w(sys.argv[1], Path(sys.argv[2]))" $f $T/$f
done
tar czf $K/family-tokenizers.tgz -C $T olmo2 phi3 phi4 granite3 gemma2 qwen3 && rm -rf $T
# The llama.cpp converter the plan stage checks convertibility with (the machine has no PyPI to fetch it from):
# chain.sh points LORASHIP_LLAMA_CPP_DIR here.
rm -rf $K/llama.cpp-conv; cp -r "$($PY -c 'from loraship.llamacpp.llamacpp import converter_dir; print(converter_dir())')" $K/llama.cpp-conv
find $K/llama.cpp-conv -name __pycache__ -prune -exec rm -rf {} +
cp bench/train_kit/{install.sh,chain.sh,call.sh,README.txt} $K/
du -sh $K
