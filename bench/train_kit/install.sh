#!/bin/bash
# Install the train kit carried in .whl-train/ on the bare GPU machine, into /tmp/site (put it first on
# PYTHONPATH), unpack the tiny model whose tokenizer the benches use, and print what is installed.
#   bash .whl-train/install.sh && export PYTHONPATH=/tmp/site:$PWD
# Run from the repository root. Everything is --no-deps: the image's python3 has torch 2.11, transformers
# 5.17, peft, accelerate, triton, numpy, pyyaml, ... (as found on the lent H200); what it lacks is here.
set -e
D=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "${SITE:=/tmp/site}" "$D"/*.whl
mkdir -p .loraship/models && tar xzf "$D/tiny-llama.tgz" -C .loraship/models
PYTHONPATH=$SITE:$PWD python3 - <<'PY'
import importlib.metadata as md
for name in ["torch", "transformers", "peft", "accelerate", "triton", "unsloth", "unsloth_zoo", "torchao", "trl",
             "cut_cross_entropy", "datasets", "diffusers", "bitsandbytes", "liger_kernel", "tyro", "pydantic",
             "pydantic_core", "diskcache", "pytest", "gguf"]:
    try:
        dist = md.distribution(name)
        print(f"{name:18} {dist.version:14} {dist.locate_file('')}")
    except md.PackageNotFoundError:
        print(f"{name:18} MISSING")
PY
