"""The stage table: one row per pipeline stage, in pipeline order, with what runs it where.

Everything else reads this table: loraship.constants.STAGES (the order), stage_module() (the one
way the CLI, status and the flow import a stage's code), flows/ (which stages hold a GPU slot),
images/pin.py (one requirements file per image from the rows' extras), images/build_all.sh (the
image list, one target of images/Dockerfile each) and deploy/render_prefect_yaml.py, which writes
deploy/prefect.yaml from it (tests/test_deploy.py fails when the committed file differs). A new
stage is its module in tasks/, a row here and a test, then `python deploy/render_prefect_yaml.py`.

Plain data and no imports beyond the standard library: the CLI, pin.py and the generator read it
without torch, Prefect or llama.cpp installed; a stage's module is imported only when asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Literal

Gpu = Literal["training", "inference", "none"]
# tasks/<stage>.py, installed as loraship.stages.<stage> (pyproject's package-dir; a plain checkout
# gets the same name from loraship/__init__.py).
STAGES_PACKAGE = "loraship.stages"


@dataclass(frozen=True)
class Resources:
    """A Kubernetes pod's share (requests = limits for memory, so the scheduler never overcommits
    host memory a stage really uses) and its memory-backed /dev/shm; the docker pool's /dev/shm
    (None: Docker's default 64 MB)."""

    cpu: str
    memory: str
    shm: str
    node_pool: str  # the nodes' `loraship.dev/pool` label
    docker_shm: str | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    image: str  # loraship-<image>, built from the target of that name in images/Dockerfile
    gpu: Gpu
    extras: tuple[str, ...]  # pyproject extras the image installs on top of the core dependencies
    resources: Resources
    # Requirements taken by name from other extras, for a stage that needs a few of them only.
    also: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """Its code's module: `python -m <module> CONFIG.yaml` runs it, run(config) in-process."""
        return f"{STAGES_PACKAGE}.{self.name}"


# plan reads the tokenizer (AutoTokenizer, for llama.cpp's BPE pre-tokenizer check) and builds the model's class on
# torch's meta device (loraship/planning/shape.py: no weights, no memory); pyproject has no plan extra, so these come
# from the train extra by name (torch from the images' own torch layer).
TOKENIZER = ("torch", "transformers", "sentencepiece", "protobuf", "safetensors")
# plan reads every dataset row (parquet/CSV and Hub datasets through `datasets`) before any GPU work;
# publish shares plan's image, so its requirement set too.
DATA = ("datasets",)

# Small CPU pods: plan, quantize, publish and the parent flow.
CPU = Resources(cpu="2", memory="8Gi", shm="1Gi", node_pool="cpu")
# Merge holds the bf16 base in host memory; convert is CPU and RAM bound.
HIGHMEM = Resources(cpu="8", memory="64Gi", shm="8Gi", node_pool="cpu-highmem", docker_shm="8g")
# The 32 GB training GPU, tainted so only GPU work lands there. torch DataLoader workers and NCCL
# use /dev/shm (Docker's default is 64 MB). reference runs the merged HF model here too.
TRAINING_GPU = Resources(cpu="8", memory="64Gi", shm="16Gi", node_pool="gpu-train", docker_shm="8g")
# The small inference GPU the GGUF must fit (target_gpu_memory_gib). verify loads only the GGUF
# with llama.cpp, every layer offloaded to the GPU. Host memory holds the memory-mapped GGUF
# pages (clean page cache, reclaimable), the token-embedding table llama.cpp keeps on the CPU and
# the logits buffer (n_ctx x vocab floats: 2.3 GiB at 4096 x 152k): 8Gi covers a 14B Q4_K_M for
# a 12 GiB card. No torch, so a small /dev/shm.
INFERENCE_GPU = Resources(cpu="4", memory="8Gi", shm="1Gi", node_pool="gpu-inference")

STAGE_TABLE: tuple[Stage, ...] = (
    # plan checks GGUF convertibility against the pinned converter, so its image carries
    # llama.cpp's converter script (not the binding). The parent flow runs in this image too.
    Stage("plan", "plan", "none", ("orchestrate",), CPU, also=TOKENIZER + DATA),
    Stage("train", "train", "training", ("train", "orchestrate"), TRAINING_GPU),
    Stage("merge", "merge", "none", ("merge", "orchestrate"), HIGHMEM),
    # The merged HF model's outputs that verify compares against, on the training GPU with
    # merge's stack (torch, transformers, safetensors; no llama.cpp).
    Stage("reference", "merge", "training", ("merge", "orchestrate"), TRAINING_GPU),
    Stage("convert", "convert", "none", ("convert", "orchestrate"), replace(HIGHMEM, docker_shm=None)),
    # quantize uses the same llama.cpp as convert and verify: it runs in convert's image.
    Stage("quantize", "convert", "none", ("convert", "orchestrate"), CPU),
    # The GGUF alone under llama.cpp (no torch, no transformers: pyproject's verify extra).
    Stage("verify", "verify", "inference", ("verify", "orchestrate"), INFERENCE_GPU),
    # publish needs only the core, but sharing plan's layers makes its image free to build.
    Stage("publish", "publish", "none", ("orchestrate",), CPU, also=TOKENIZER + DATA),
)

STAGE_NAMES = tuple(stage.name for stage in STAGE_TABLE)
STAGES_BY_NAME = {stage.name: stage for stage in STAGE_TABLE}
# Image names in build order (the first stage's order; reference/quantize add none).
IMAGES = tuple(dict.fromkeys(stage.image for stage in STAGE_TABLE))
# The parent `train-and-ship` flow only calls run_deployment: plan's image, a small CPU pod.
PARENT_IMAGE = "plan"
PARENT_RESOURCES = CPU
# Kubernetes GPU slots per kind (the cluster's GPUs of that kind): more runs queue in Prefect.
# Prefect counts per deployment, so train and reference together may start more Jobs than there
# are training GPUs; the extra pods wait Pending on nvidia.com/gpu until one frees.
GPU_SLOTS = {"training": 4, "inference": 8}


def gpu_stages(kind: Gpu | None = None) -> frozenset[str]:
    """Stages holding a GPU (of one kind, when given)."""
    return frozenset(s.name for s in STAGE_TABLE if s.gpu != "none" and (kind is None or s.gpu == kind))


def stage_module(name: str) -> ModuleType:
    """The stage's code (run, UPSTREAM, its helpers), imported on first use: the core, the CLI and
    the flow reach stages only through here, so importing the core never pulls in torch or llama.cpp."""
    return importlib.import_module(STAGES_BY_NAME[name].module)
