# Quick start: `make demo` runs the pipeline on the embedded default; `make test` runs the tests.
# Both create/refresh the project's own virtualenv; nothing outside the project is relied on.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PREFECT_HOME := $(CURDIR)/.prefect
# No LORASHIP_CACHE here: loraship run from this checkout caches in its .loraship/cache by default
# (loraship/cache.py), so `make demo` and `.venv/bin/loraship run` share one llama.cpp build.
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
TINY_MODEL := .loraship/models/tiny-llama

.PHONY: venv demo test lint tiny-model clean

# llama-cpp-python is compiled here (187 s on 2 cores) for any x86-64 with AVX2, not for this CPU: a native build
# (-march=native) on a CPU with AMX runs ggml's AMX matmul, which crashed every llama.cpp decode on such a machine
# (SIGSEGV in ggml_backend_amx_mul_mat); the images build with GGML_NATIVE off too (images/Dockerfile).
# LLAVA_BUILD off: no multimodal library (libmtmd), which nothing here loads: 187 s instead of 226 s on 2 cores.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF
# torch 2.13.0 first and pinned: it is the CPU build on this machine's disk; a bare `torch`
# requirement would pull a multi-GB CUDA build. The extras' wider ranges then install nothing more.
$(VENV)/.installed: pyproject.toml deploy/requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --quiet -e '.[train,merge,convert,verify,orchestrate,dev]'
	$(PY) -m pip install --quiet -r deploy/requirements-ci.txt
	$(PY) -m loraship.cli fetch-converter
	$(PY) -m loraship.cli build-tools
	touch $@

venv: $(VENV)/.installed

$(TINY_MODEL)/config.json: | $(VENV)/.installed
	$(PY) -m loraship.cli tiny-model $(TINY_MODEL)

tiny-model: $(TINY_MODEL)/config.json

demo: $(VENV)/.installed $(TINY_MODEL)/config.json
	$(VENV)/bin/loraship run configs/demo.yaml

# ruff (pyproject.toml [tool.ruff]): pyflakes, pycodestyle and the formatter's check, first, so a lint error
# fails fast. `ruff format .` fixes what the second command names.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest-xdist workers on 2 cores: one test process alone keeps only part of both busy (bench/results/ci_time.json).
# --dist loadfile: a test file runs on one worker, so no module fixture is built twice; the order tests/conftest.py
# gives (longest files first) is kept.
# One torch thread per worker: the same training loop twice took 76 s on two workers of two OpenMP threads each,
# 39 s on one thread each and 42 s in one process of two (bench/results/omp_threads.json); CI's two-worker run was
# slower than its serial one. PYTEST_WORKERS=0 runs the tests in one process, with torch's own thread count.
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed lint
	$(if $(filter-out 0,$(PYTEST_WORKERS)),OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1}) $(PY) -m pytest \
	  $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

clean:
	rm -rf .loraship/work artifacts .prefect
