"""Training on several devices with torch's own engines: torchrun, DistributedDataParallel, FSDP2.

The train stage starts itself again under torchrun (torch.distributed.run) inside its own container, one
process per device, and waits (`launch_ranks`, in loraship.training.rank_launch); each rank sets up its
process group (`init_rank`), wraps the model (`wrap`: DDP where the plan's single-GPU strategy fits one card,
FSDP2 `fully_shard` per decoder layer then the root where it does not; under FSDP2 with LoRA rank 0 alone reads
the weights and sends each rank its shards: `load_base`), trains its share of every global batch (`rank_share`:
global batch = micro-batch x accumulation x ranks, the same examples in the same order as one process at that
batch), syncs gradients on the last micro-step only (`accumulating`), and reports global figures (`all_sum`,
`worst_rank_memory`). Rank 0 alone writes the adapter and checkpoints from full state dicts gathered by
torch.distributed.checkpoint.state_dict (`trainable_state`, `optimizer_state`, in loraship.training.sharded_state);
every rank loads them on resume. A rank that fails stops the others (torchrun's agent does) and the stage raises
one LorashipError naming the rank (`RankFailed`), or, for an out-of-memory error in any rank,
`RanksOutOfMemory`, which the stage's re-plan treats as its own out-of-memory error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from loraship.errors import LorashipError

# Re-exported: tasks/train.py, loraship/training and tests/ use them as distributed.NAME.
from loraship.training.rank_launch import (  # noqa: F401
    FAILURES_FILE,
    PROGRESS_FILE,
    REPORTS_ENV,
    RankFailed,
    RanksOutOfMemory,
    failure_of,
    launch_ranks,
)
from loraship.training.sharded_state import (  # noqa: F401
    load_adapter_file,
    load_optimizer_state,
    optimizer_state,
    save_adapter_dir,
    trainable_state,
)
from loraship.training.sharded_state import state_options

ENGINES = ("single", "ddp", "fsdp2")
CPU_RANKS_ENV = "LORASHIP_CPU_RANKS"  # ranks on a CPU, which has no visible GPUs to count (tests, CI)
# A rank's exit code after it wrote its report: a LorashipError (the CLI's code for it) or out of memory.
EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 3


@dataclass(frozen=True)
class Engine:
    """How training spreads over devices: `single` (one process), `ddp` or `fsdp2`, on world_size ranks."""

    name: str
    world_size: int

    def __post_init__(self):
        if self.name not in ENGINES:
            raise LorashipError(
                f"unknown distributed engine {self.name!r}; fix: one of {', '.join(ENGINES)} (re-plan)"
            )
        if self.world_size < 1 or (self.name == "single") != (self.world_size == 1):
            raise LorashipError(
                f"engine {self.name} on {self.world_size} rank(s) is not a valid choice; fix: single on "
                "1, ddp or fsdp2 on 2 or more (re-plan)"
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def engine_of(option: dict | None) -> Engine:
    """The Engine of a plan option ({"gpus": N, "engine": ...}, loraship/planning/multi_gpu.py choose_engine);
    None (a plan from before multi-GPU planning) is one process."""
    if not option:
        return Engine("single", 1)
    try:
        return Engine(str(option["engine"]), int(option["gpus"]))
    except (KeyError, TypeError, ValueError) as e:
        raise LorashipError(f"the plan's distributed option {option!r} lacks engine/gpus; fix: plan again") from e


def cpu_ranks() -> int | None:
    """LORASHIP_CPU_RANKS: how many ranks to run on a CPU (gloo), None when unset."""
    raw = os.environ.get(CPU_RANKS_ENV)
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise LorashipError(f"{CPU_RANKS_ENV}={raw!r} is not a number of ranks; fix: an integer >= 1, or unset it")
    return n


# --- a rank ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rank:
    """This process's place among the ranks. device: "cuda" (this rank's own card, made current) or "cpu"."""

    rank: int
    world_size: int
    local_rank: int
    device: str
    backend: str

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Ranks:
    """The engine a training process runs under and its own rank (None: the one process of `single`)."""

    engine: Engine
    rank: Rank | None = None

    @property
    def main(self) -> bool:
        """The process that writes: rank 0, or the only one."""
        return self.rank is None or self.rank.main

    @property
    def index(self) -> int:
        return self.rank.rank if self.rank else 0

    @property
    def world_size(self) -> int:
        return self.engine.world_size


ONE_PROCESS = Ranks(Engine("single", 1))


def in_ranks() -> bool:
    """True in a process torchrun started (it sets RANK, WORLD_SIZE and LOCAL_RANK)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def init_rank(device: str, timeout_s: float = 1800.0) -> Rank:
    """The process group for this rank: NCCL on CUDA, with this rank's card (LOCAL_RANK) current, gloo on the CPU."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise LorashipError(
                f"rank {rank} wants CUDA device {local} but {torch.cuda.device_count()} are visible; "
                "fix: ask for at most as many gpus as the machine has"
            )
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        backend = "nccl"
    else:
        dist.init_process_group("gloo", timeout=timeout)
        backend = "gloo"
    return Rank(rank, world, local, device, backend)


def close_rank() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        # A barrier first: it runs after any collective still queued (FSDP2 may leave one in flight), so no rank
        # tears gloo down under pending work. Without it a rank of the FSDP2 QLoRA test, its work done, aborted
        # in teardown under load (SIGABRT, "terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()


def report(rank: Rank | None, kind: str, message: str, measured: dict | None = None) -> None:
    """Leave what went wrong in this rank for the launcher (failure_of): kind user_error or out_of_memory."""
    folder = os.environ.get(REPORTS_ENV)
    if not folder:
        return
    number = rank.rank if rank else int(os.environ.get("RANK", "0"))
    Path(folder, f"rank-{number}.json").write_text(
        json.dumps({"rank": number, "kind": kind, "message": message, "measured": measured or {}}), encoding="utf-8"
    )


def serve_rank(
    work: Callable[[Rank], dict],
    device: str,
    result_file: Path,
    *,
    is_out_of_memory: Callable[[BaseException], bool],
    measure: Callable[[], dict],
) -> int:
    """A rank's whole life, for the module torchrun starts: join the process group, run `work`, and leave rank 0's
    result (a JSON-able dict) in result_file for the launcher; the exit code. A LorashipError or an out-of-memory
    error is reported for the launcher (failure_of) and ends this rank; torchrun then stops the others, which wait in
    a collective for it. Anything else propagates to torchrun's own record (exit 1, traceback in the log)."""
    from loraship.runtime.manifest import atomic_write_json

    rank = None
    try:
        rank = init_rank(device)
        quiet_unless_main(rank)
        result = work(rank)
    except LorashipError as e:
        report(rank, "user_error", str(e))
        return EXIT_USER_ERROR
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        # Not destroy_process_group: the peers are blocked in a collective this rank will never join.
        report(rank, "out_of_memory", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}", measure())
        return EXIT_OUT_OF_MEMORY
    if rank.main:
        atomic_write_json(result_file, result)
    close_rank()
    return 0


@dataclass(frozen=True)
class RankJob:
    """What the train stage hands its ranks, as a JSON file: the validated config, where to work, what to run."""

    config: dict
    stage_dir: str
    model_dir: str
    plan: dict  # the whole plan record (Plan.to_json): each rank takes its decisions from it
    engine: str
    world_size: int
    device: str
    result_file: str

    def write(self, path: Path) -> None:
        from dataclasses import asdict

        from loraship.runtime.manifest import atomic_write_json

        atomic_write_json(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> RankJob:
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))


def quiet_unless_main(rank: Rank) -> None:
    """One progress line for the run: ranks other than 0 log warnings and errors only."""
    import logging

    if not rank.main:
        logging.getLogger("loraship").setLevel(logging.WARNING)


def check_same_inputs(rank: Rank, fingerprints: dict[str, str]) -> None:
    """Before training: every rank must train on the same config and data. All ranks gather each other's
    fingerprints; where any differs from rank 0's, every rank raises the same error naming the ranks."""
    import torch.distributed as dist

    gathered: list[dict | None] = [None] * rank.world_size
    dist.all_gather_object(gathered, fingerprints)
    problems = []
    for key, value in gathered[0].items():
        differ = [r for r, theirs in enumerate(gathered) if theirs.get(key) != value]
        if differ:
            problems.append(
                f"{key}: rank(s) {', '.join(map(str, differ))} differ from rank 0 "
                f"({', '.join(str(gathered[r].get(key))[:12] for r in differ)} vs {str(value)[:12]})"
            )
    if problems:
        raise LorashipError(
            f"the {rank.world_size} training ranks disagree before training: "
            + "; ".join(problems)
            + "; fix: every rank must read the same config and data files (one image, one shared "
            "run folder; a file edited during the launch?), then run again"
        )


# --- the model ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wrapped:
    """A model prepared for an engine: `module` runs forward (DDP's wrapper, or the model itself: FSDP2 and single
    shard in place), `model` is the PEFT model itself (save_pretrained, adapters, config)."""

    module: object
    model: object
    engine: Engine
    rank: Rank | None = None  # None: one process

    @property
    def main(self) -> bool:
        """The process that writes files: rank 0, or the only one."""
        return self.rank is None or self.rank.main


def as_wrapped(model) -> Wrapped:
    """A Wrapped as is; a bare PEFT model as one process's (checkpoint helpers take either)."""
    return model if isinstance(model, Wrapped) else Wrapped(model, model, ONE_PROCESS.engine)


def quantization_storage(engine: Engine, dtype) -> dict:
    """BitsAndBytesConfig arguments for QLoRA under this engine: FSDP2 shards the NF4 weights only when they are
    stored as a float dtype like the rest (bnb_4bit_quant_storage, as Axolotl and LLaMA-Factory set it), so that
    one all-gather per layer moves packed NF4 bytes along with the other parameters."""
    return {"bnb_4bit_quant_storage": dtype} if engine.name == "fsdp2" else {}


# FSDP2 exists for a model no card holds, which every rank reading it would hold in host memory as many times as
# there are ranks (32B bf16 on 4 ranks: 4 x 64 GB). As torchtune and accelerate's FSDP2 path do, rank 0 alone reads
# the weights; the others build the same model with its parameters on the meta device, and once every rank sharded
# it (`wrap`, from_rank0) rank 0 sends each rank its shards (set_model_state_dict, broadcast_from_rank0).
QLORA_EVERY_RANK_WHY = (
    "QLoRA's NF4 weights are bitsandbytes Params4bit whose quantization state (absmax, quant_map, the nested "
    "statistics) is a Python object built while from_pretrained quantizes: Linear4bit writes it into a state dict "
    "(_save_to_state_dict) but has no _load_from_state_dict to read it back, so set_model_state_dict over the meta "
    "shards would leave plain tensors that no layer can dequantize. NF4 costs about 0.56 byte per weight of host "
    "memory on each rank"
)


def rank0_loads_weights(engine: Engine, adapter: str) -> bool:
    """True where only rank 0 reads the base weights and the other ranks build the model empty (`empty_model`):
    FSDP2 with LoRA. QLoRA under FSDP2 loads on every rank (QLORA_EVERY_RANK_WHY); DDP needs the whole model on
    every rank anyway. The same answer on every rank: each must call wrap(..., from_rank0=) alike."""
    return engine.name == "fsdp2" and adapter != "qlora"


def loads_weights(engine: Engine, rank: Rank | None, adapter: str) -> bool:
    """Whether this process reads the base weights itself (from_pretrained), or builds the model empty and gets
    its shards from rank 0."""
    return rank is None or rank.main or not rank0_loads_weights(engine, adapter)


def load_base(
    engine: Engine, rank: Rank | None, adapter: str, *, load: Callable[[], object], build: Callable[[], object]
):
    """The base model for this rank: `load()` (from_pretrained) where it reads the weights (loads_weights), else
    `build()` (from_config, the same class, config and dtype) with its parameters on the meta device. Buffers are
    built for real either way, by the model's own __init__: the non-persistent ones (rotary inv_freq) are in no
    state dict, so no broadcast brings them, and they come out as one process computes them."""
    import logging

    if loads_weights(engine, rank, adapter):
        if rank is not None and rank.main and engine.name == "fsdp2":
            if rank0_loads_weights(engine, adapter):
                logging.getLogger("loraship").info(
                    "train: FSDP2: rank 0 alone reads the base weights; the other %d rank(s) build the model on the "
                    "meta device and get their shards from rank 0",
                    rank.world_size - 1,
                )
            else:
                logging.getLogger("loraship").info(
                    "train: FSDP2 with QLoRA: every rank reads the base weights, because %s", QLORA_EVERY_RANK_WHY
                )
        return load()
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build()


def wrap(model, engine: Engine, rank: Rank | None, layers: list, *, from_rank0: bool = False) -> Wrapped:
    """DDP or FSDP2 around a PEFT model whose trainable parameters are its LoRA weights; `layers` are its decoder
    layers, each sharded on its own (FSDP2) so that one layer's full weights live at a time. Wrap before the
    optimizer is made: FSDP2 replaces the parameters with their shards.

    from_rank0 (FSDP2; rank0_loads_weights, the same on every rank): rank 0's model holds the weights, the others'
    are empty (load_base); once sharded, every weight goes from rank 0 to each rank's shard, the LoRA weights
    rank 0 initialised among them, so every rank starts from the same adapter."""
    if not engine.distributed:
        return Wrapped(model, model, engine)
    if rank is None:
        raise LorashipError(f"engine {engine.name} needs the ranks' process group; fix: start it with launch_ranks")
    if engine.name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Every LoRA weight gets a gradient every step: find_unused_parameters off. Not static_graph: with no_sync
        # micro-steps torch 2.13's reducer fails its expect_autograd_hooks_ assertion (tests/test_distributed.py), and
        # non-reentrant checkpointing, the only kind loraship uses, needs no static graph.
        module = DistributedDataParallel(
            model,
            device_ids=[rank.local_rank] if rank.device == "cuda" else None,
            find_unused_parameters=False,
            gradient_as_bucket_view=True,
        )
        return Wrapped(module, model, engine, rank)
    from torch.distributed.fsdp import fully_shard

    if not layers:
        raise LorashipError(
            "FSDP2 shards per decoder layer, and this model has none that transformers marks "
            "(GradientCheckpointingLayer); fix: train it on gpus: 1 or with ddp"
        )
    # Rank 0's whole weights, held (references, no copy) while fully_shard replaces the parameters with shards.
    full = model.state_dict() if from_rank0 and rank.main else {}
    if from_rank0:
        same_ties_as_rank0(model, rank)
    tied = _tied_parameters(model)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)  # the rest: embeddings, final norm, lm_head
    if from_rank0:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, full, options=state_options(full_state_dict=True, broadcast_from_rank0=True))
        del full
        # Over meta shards set_model_state_dict assigns a new parameter per name, which unties tied weights (an
        # lm_head sharing the embedding): FSDP2 then gathers other tensors on those ranks than on rank 0 and the
        # collectives no longer match. Each tied name gets the first one's parameter again, the one FSDP2 manages.
        for places in tied:
            first = getattr(*places[0])
            for module, name in places[1:]:
                setattr(module, name, first)
        empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if empty:
            raise LorashipError(
                f"rank {rank.rank}: {len(empty)} weight(s) got no value from rank 0, e.g. {empty[0]}; "
                "fix: train this model with every rank reading it (gpus: 1, or ddp) and report it"
            )
    return Wrapped(model, model, engine, rank)


def _tied_parameters(model) -> list[list[tuple[object, str]]]:
    """Each parameter held under several names, as its (module, name) places in named_parameters' order."""
    places: dict[int, list[tuple[object, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [p for p in places.values() if len(p) > 1]


def same_ties_as_rank0(model, rank: Rank) -> None:
    """The empty models of ranks other than 0 get rank 0's tied weights (an lm_head sharing the embedding), whatever
    their own construction tied: accelerate's init_empty_weights makes a new meta parameter per name, so from_config
    ties nothing there, and from_pretrained unties where a checkpoint holds both weights with different values.
    FSDP2 must shard the same parameters on every rank for its collectives to match."""
    import torch
    import torch.distributed as dist

    wanted = [
        [[_place_name(model, module, name) for module, name in places] for places in _tied_parameters(model)]
        if rank.main
        else None
    ]
    dist.broadcast_object_list(wanted, src=0)
    if rank.main:
        return
    for places in _tied_parameters(model):  # untie (new meta tensors cost nothing), then tie as rank 0 did
        for module, name in places[1:]:
            param = getattr(module, name)
            setattr(
                module,
                name,
                torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad),
            )
    for names in wanted[0]:
        first = model.get_parameter(names[0])
        for full in names[1:]:
            owner, _, name = full.rpartition(".")
            setattr(model.get_submodule(owner), name, first)


def _place_name(model, module, name: str) -> str:
    owner = next(n for n, m in model.named_modules(remove_duplicate=False) if m is module)
    return f"{owner}.{name}" if owner else name


def rank_share(group: list, rank: int, world_size: int) -> list[tuple[object, bool]]:
    """This rank's micro-batches of one global step (one process's list of them), as (micro-batch, counts): a
    contiguous block of ceil(n / world_size), the same number on every rank. A rank whose block is short fills it
    with a stand-in (counts False: its loss weighs 0), because every rank must run as many forward and backward
    passes as the others: FSDP2 gathers each layer's weights in every forward, and DDP syncs on the last backward."""
    if not group:
        raise ValueError("a step with no micro-batches")
    per = math.ceil(len(group) / world_size)
    mine = [(g, True) for g in group[rank * per : (rank + 1) * per]]
    return mine + [(group[0], False)] * (per - len(mine))


def accumulating(wrapped: Wrapped, final: bool):
    """The context for one micro-step's forward and backward: gradients are synced across ranks only on the final
    micro-step of an optimizer step (DDP no_sync, FSDP2 set_requires_gradient_sync), not on the others."""
    if not wrapped.engine.distributed:
        return contextlib.nullcontext()
    if wrapped.engine.name == "ddp":
        return contextlib.nullcontext() if final else wrapped.module.no_sync()
    wrapped.module.set_requires_gradient_sync(final)
    return contextlib.nullcontext()


def gradient_scale(engine: Engine) -> float:
    """What a rank's loss is multiplied by: DDP and FSDP2 average gradients over the ranks, while each rank's loss
    is already its share of the global step's mean (weighted by the global target count), so the sum is wanted."""
    return float(engine.world_size)


def all_sum(values: list[float], rank: Rank | None) -> list[float]:
    """The sum over the ranks of each value (one collective): the global step loss, tokens."""
    if rank is None:
        return [float(v) for v in values]
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=rank.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def worst_rank_memory(measured: dict, rank: Rank | None) -> dict:
    """The measured peak memory of the run: each figure the largest over the ranks (the card that limits the plan),
    with every rank's own figures beside it. {} stays {} (a CPU run measures nothing)."""
    if rank is None:
        return measured
    import torch.distributed as dist

    gathered: list[dict | None] = [None] * rank.world_size
    dist.all_gather_object(gathered, measured)
    if not any(gathered):
        return {}
    worst = {k: max(g.get(k) or 0 for g in gathered) for k in gathered[0] if isinstance(gathered[0][k], (int, float))}
    worst_rank = max(range(rank.world_size), key=lambda r: gathered[r].get("peak_reserved_gib") or 0)
    return {**worst, "worst_rank": worst_rank, "per_rank": gathered}


def visible_devices(device: str) -> int:
    """How many ranks this machine can train on: its CUDA devices (CUDA_VISIBLE_DEVICES applies), or on the CPU
    LORASHIP_CPU_RANKS (1 when unset)."""
    if device == "cpu":
        return cpu_ranks() or 1
    import torch

    return torch.cuda.device_count()


def barrier(rank: Rank | None) -> None:
    """Wait for every rank (after rank 0 wrote what the others read next)."""
    if rank is not None:
        import torch.distributed as dist

        dist.barrier()
