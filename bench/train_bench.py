"""loraship's train stage against Unsloth (two ways) and HF + PEFT + Liger: memory, steady-state speed, losses.

    python bench/train_bench.py --tokenizer .loraship/models/tiny-llama --out bench/results/train_bench.json
    python bench/train_bench.py --tokenizer .loraship/models/tiny-llama --out /tmp/smoke.json --smoke   # CPU check

On the lent H200: `bash bench/train_kit/make.sh` here builds .whl-train/ (the wheels its python lacks: Unsloth, trl,
bitsandbytes, liger-kernel, ...), then one device call with carry [".whl-train"] runs `bash .whl-train/call.sh`
(detached, rows in order of importance, JSON after every row; later calls collect): bench/train_kit/README.txt.

Every (case, trainer) pair runs in its own process (a fresh allocator; Liger's and Unsloth's patches reach model
classes and cannot leak into the next row), under a 32 GiB cap on the GPU (torch.cuda.set_per_process_memory_fraction).
The random checkpoints are built in a process of their own too, so the parent never holds a CUDA context and a row's
context is the card's used memory minus its own reserved.

Models: random weights in the real architecture class and shape of examples/models/<name>/config.json
(Qwen2ForCausalLM: q/k/v biases, no o_proj bias), saved with the tiny model's sentencepiece tokenizer (token ids fit
every vocabulary; speed and memory depend on shapes, not on weight values).

Every trainer trains the same examples (loraship's data code, the same split) in the same order
(loraship/training/packing.py's permutation), with LoRA dropout 0 (Unsloth's fast path), torch AdamW at loraship's
learning rate and weight decay, loraship's schedule (cosine, no warm-up, over --steps) and gradient clipping at 1.0, so
the first losses agree:
- unsloth-sft: FastLanguageModel + trl's SFTTrainer with bf16=True, as Unsloth's users run it (its notebooks):
  use_gradient_checkpointing="unsloth", pre-tokenized rows (input_ids, labels), trl's own collator; a sequential
  sampler keeps loraship's order.
- unsloth-loop: the same Unsloth model in a bare loop under torch.autocast(bf16): its kernels at their best.
- hf-liger: transformers + PEFT with every Liger kernel for the architecture (applied before loading) through the HF
  Trainer with bf16=True, non-reentrant gradient checkpointing.
- loraship-default: `loraship.stages.plan` + `loraship.stages.train` as shipped, no mode flag (optimize: speed).
- loraship-lean: the same with `optimize: memory`.
- loraship-unfused: loraship-default with PEFT's own LoRA Linears (LORASHIP_FUSED_LORA=0): what the fused LoRA
  nodes (loraship/training/fused_lora.py) are worth, in the same run.
- loraship-lean-full-recompute: loraship-lean recomputing down_proj's GEMM too (LORASHIP_RECOMPUTE_SKIP=0): what
  leaving it out of the recompute (loraship/training/recompute.py) is worth, in the same run.
- loraship-contiguous: loraship-default streaming the first n layers rather than spreading them over the checkpointed
  ones (LORASHIP_OFFLOAD_SPREAD=0): what the spread layout (Strategy.streamed) is worth where
  a plan streams weights (qwen2-14b-lora); elsewhere it plans as the default. Named with --trainers only.
- loraship-sdpa / loraship-flex: loraship-default under SDPA / under flex attention everywhere
  (LORASHIP_ATTENTION): what the default's flex attention on sliding-window models is worth. Named with --trainers.
- loraship-norms-liger: loraship-default with Liger's own RMSNorm backward (LORASHIP_LIGER_NORMS=liger): what the
  spread backward of frozen norms (loraship/training/rms_norm_backward.py) is worth. Named with --trainers.
- loraship-chunks-liger: loraship-default with Liger's own fused-loss chunks (LORASHIP_LOSS_CHUNKS=liger): what chunks
  of 512 rows (loraship/training/loss_chunks.py) are worth (its plan counts the wider chunk).
- loraship-before: loraship-default with the per-head norms copying to heads-first (LORASHIP_NORM_LAYOUT=copy) and
  Python's collector left as it is (LORASHIP_GC_FREEZE=0): what loraship/training/rms_norm_backward.py's
  heads_first_view and loraship/training/gc_pauses.py are worth together. Named with --trainers.
- loraship-recast: loraship-default casting LoRA A and B to bf16 at every forward and recompute
  (LORASHIP_LORA_CASTS=each), not once per optimizer step: what loraship/training/fused_lora.py casts_kept_until_step
  is worth. Named with --trainers.
- loraship-packed / loraship-padded (case `packing`): packing on / off on variable-length chat rows.

Timing: a global optimizer step hook synchronises and stamps each step; tokens/s is non-pad tokens of the steps after
--warmup divided by their time. MFU: model FLOPs per token (loraship/planning/flops.py; recompute not counted) times
that tokens/s over the card's dense bf16 peak. Peak memory: loraship's is the train stage's own measurement (training
only, after the eval before training), the peers' over their training steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30
CAP_GIB = 32.0
QVO = ["q_proj", "v_proj", "o_proj"]


def model_config(name: str) -> dict:
    """The real config.json of a shape (examples/models/<name>), or the tiny Qwen2 of --smoke. A multimodal config
    (Gemma 3's Gemma3ForConditionalGeneration) benches its language model alone, as a text-only causal LM: the
    vision tower is frozen and never runs on text rows in either trainer, so what it would add is a constant."""
    if name == "tiny":
        return dict(TINY)
    if name == "tiny-moe":
        return dict(TINY_MOE)
    base, _, layers = name.partition("@")  # qwen3-30b-a3b@12: the shape with its first 12 layers
    mc = json.loads((ROOT / "examples" / "models" / base / "config.json").read_text())
    if layers:
        mc.update(num_hidden_layers=int(layers), max_window_layers=int(layers))
    if "text_config" in mc:
        text = dict(mc["text_config"])
        arch = {"gemma3_text": "Gemma3ForCausalLM"}[text["model_type"]]
        mc = {**text, "architectures": [arch]}
    return mc


TINY = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)

# --smoke on a MoE case: Qwen3-30B-A3B's class at a few MiB (its router, top-k and fused experts kept)
TINY_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=151936,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    norm_topk_prob=True,
)

# case -> (model shape, adapter, rank, target modules, micro-batch, sequence_len, data kind)
CASES = {
    "qwen2-7b-lora": ("qwen2-7b", "lora", 64, QVO, 2, 4096, "long"),
    "qwen2-7b-lora-all-linear": (
        "qwen2-7b",
        "lora",
        16,
        "all-linear",
        2,
        4096,
        "long",
    ),  # Unsloth's fused MLP/QKV paths
    "qwen2-7b-qlora": ("qwen2-7b", "qlora", 64, QVO, 2, 4096, "long"),
    "qwen2-14b-qlora": ("qwen2-14b", "qlora", 64, QVO, 2, 4096, "long"),
    "qwen2-14b-lora": ("qwen2-14b", "lora", 64, QVO, 2, 4096, "long"),  # bf16 asked, 32 GiB budget
    # chat rows of 64-2048 tokens at micro-batch 8: padded batches pad to the longest of 8.
    "packing": ("qwen2-7b", "lora", 64, QVO, 8, 2048, "chat"),
    "qwen2-14b-lora-8k": ("qwen2-14b", "lora", 64, QVO, 1, 8192, "long"),  # still fits at 1 x 8192
}
# Held out from every fit (issue #35): other families, and micro-batch x sequence settings the five cases never ran,
# planned by the speed plan that fills the card. Peers run them as they run the five.
HELD_OUT_CASES = {
    "qwen3-8b-lora-all-linear-4x2048": ("qwen3-8b", "lora", 16, "all-linear", 4, 2048, "long"),
    "qwen3-8b-qlora-1x8192": ("qwen3-8b", "qlora", 64, QVO, 1, 8192, "long"),
    "gemma3-12b-qlora-all-linear": ("gemma-3-12b", "qlora", 16, "all-linear", 2, 4096, "long"),
    "gemma3-12b-lora": ("gemma-3-12b", "lora", 64, QVO, 1, 4096, "long"),  # bf16 asked: 23 GiB of weights
    "gemma3-12b-lora-2x2048": ("gemma-3-12b", "lora", 64, QVO, 2, 2048, "long"),  # flex attention held out
    "qwen2-14b-qlora-4x2048": ("qwen2-14b", "qlora", 64, QVO, 4, 2048, "long"),
    "mistral-7b-qlora-4x2048": ("mistral-7b", "qlora", 64, QVO, 4, 2048, "long"),
    "llama-3-8b-lora-1x8192": ("llama-3-8b", "lora", 64, QVO, 1, 8192, "long"),
}
CASES.update(HELD_OUT_CASES)
# Mixtures of experts (issue #46): QLoRA with every routed expert adapted (experts 4-bit in both trainers), at 1 and
# 2 x 2048; the 12-layer cut of the same shape first, which fits the lent machine's disk.
MOE_CASES = {
    "qwen3-moe-12l-qlora-1x2048": ("qwen3-30b-a3b@12", "qlora", 16, "all-linear", 1, 2048, "long"),
    "qwen3-30b-a3b-qlora-1x2048": ("qwen3-30b-a3b", "qlora", 16, "all-linear", 1, 2048, "long"),
    "qwen3-30b-a3b-qlora-2x2048": ("qwen3-30b-a3b", "qlora", 16, "all-linear", 2, 2048, "long"),
}
CASES.update(MOE_CASES)
# Both trainers step bitsandbytes' 8-bit AdamW on these, as Unsloth's MoE notebooks do (optim="adamw_8bit"): the
# expert LoRA is 0.6B parameters, whose fp32 AdamW moments alone would take 4.8 GiB.
OPTIMIZER = {case: "adamw_8bit" for case in MOE_CASES}
# loraship alone with gradient accumulation (the peers' drivers step once per micro-batch): the plan's memory with
# accumulation buffers, and its step time.
ACCUMULATION = {"qwen2-14b-qlora-2x2048-ga4": 4}
CASES["qwen2-14b-qlora-2x2048-ga4"] = ("qwen2-14b", "qlora", 64, QVO, 2, 2048, "long")
ISSUE_CASES = ["qwen2-7b-lora", "qwen2-7b-lora-all-linear", "qwen2-7b-qlora", "qwen2-14b-qlora", "qwen2-14b-lora"]
TRAINERS = {
    "packing": ["loraship-packed", "loraship-padded"],
    "qwen2-14b-lora-8k": ["loraship-default"],
    "qwen2-14b-qlora-2x2048-ga4": ["loraship-default", "loraship-lean"],
}
PEERS = ["unsloth-sft", "unsloth-loop", "hf-liger"]
# The order rows run in, when the budget may not cover them all: each phase over every case before the next phase.
PHASES = [
    ["unsloth-sft", "unsloth-loop", "loraship-default"],
    ["loraship-lean"],
    ["loraship-unfused"],
    ["loraship-lean-full-recompute"],
    ["hf-liger"],
]
# loraship rows also compared with loraship's own variant that leaves one change out (what that change is worth).
OWN_BASELINES = {
    "loraship-default": [
        "loraship-unfused",
        "loraship-contiguous",
        "loraship-sdpa",
        "loraship-norms-liger",
        "loraship-chunks-liger",
        "loraship-before",
        "loraship-recast",
    ],
    "loraship-lean": ["loraship-lean-full-recompute"],
}
SMOKE_SEQ = 128  # --smoke: the tiny shape at short rows, so the CPU check takes seconds
LOSS_STEPS = 10  # the first losses every row keeps (`loss_curve`)


# ---------------------------------------------------------------------------------------------
# Stamps
# ---------------------------------------------------------------------------------------------
STAMPED_SOURCES = ("bench/train_bench.py", "tasks/plan.py", "tasks/train.py", "loraship")


def source_stamp() -> dict:
    """The commit this ran from ($LORASHIP_COMMIT, which the device call passes, else git) and a hash of the sources
    that decide a row. The variable comes first: the device machine's copy of the tree carries a .git that is not
    updated when the tree is sent (it once still named the session's first commit)."""
    commit, dirty = os.environ.get("LORASHIP_COMMIT") or None, None
    try:
        if commit is None:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
            dirty = bool(
                subprocess.run(
                    ["git", "status", "--porcelain", "--", *STAMPED_SOURCES],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
            )
    except (OSError, subprocess.CalledProcessError):
        pass
    digest = hashlib.sha256()
    for name in STAMPED_SOURCES:
        path = ROOT / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return {"commit": commit, "dirty": dirty, "sources_sha256": digest.hexdigest()[:16]}


def machine_stamp() -> dict:
    """The machine, without starting CUDA in this process (nvidia-smi)."""
    import platform

    out = {"hostname": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        smi = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            .stdout.strip()
            .splitlines()
        )
        out["gpus"] = smi
    except (OSError, subprocess.SubprocessError):
        out["gpus"] = []
    if out["gpus"]:
        out["host_to_device_gbps"] = host_to_device_gbps()
    return out


# Pinned host -> GPU copies of 1 GiB, as loraship/training/offload.py streams weights: the rate the planner assumes as
# PLAN_HOST_TO_DEVICE_GBPS (loraship/planning/step_time.py). In a child process, so this one starts no CUDA context.
H2D_PROBE = """
import json, time, torch
src = torch.empty(2**29, dtype=torch.bfloat16).pin_memory()
dst = torch.empty_like(src, device="cuda")
rates = []
for _ in range(6):
    torch.cuda.synchronize(); t = time.perf_counter()
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    rates.append(src.numel() * 2 / (time.perf_counter() - t) / 1e9)
print(json.dumps(sorted(rates[1:])[len(rates[1:]) // 2]))
"""


def host_to_device_gbps() -> float | None:
    """The median pinned host-to-device copy rate of the first GPU, GB/s (the first copy is warm-up), or None."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", H2D_PROBE], capture_output=True, text=True, timeout=120, check=True
        )
        return round(float(json.loads(done.stdout.strip().splitlines()[-1])), 1)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def versions(*names: str) -> dict:
    import importlib.metadata as md

    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# ---------------------------------------------------------------------------------------------
# Inputs, made once
# ---------------------------------------------------------------------------------------------
def make_model(mc: dict, tokenizer_dir: Path, out: Path, device: str) -> Path:
    """Random weights in the architecture class named by the config (Qwen2ForCausalLM), saved with the tokenizer.
    Dimensions without `architectures` (tests/test_gpu_smoke.py's) build a LlamaForCausalLM."""
    mc = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **mc}
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    # The tokenizer's special ids replace the config's own (Qwen3-8B's config.json names its bos and eos).
    fields = {
        k: v
        for k, v in mc.items()
        if k
        not in (
            "architectures",
            "model_type",
            "torch_dtype",
            "transformers_version",
            "bos_token_id",
            "eos_token_id",
            "dtype",
        )
    }
    config = AutoConfig.for_model(
        mc["model_type"], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **fields
    )
    config.architectures = list(mc["architectures"])
    cls = getattr(transformers, mc["architectures"][0])
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 14B fp32 build would need 59 GB
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    spill = [Path(d) for d in os.environ.get("BENCH_SPILL_DIRS", "").split(":") if d]
    if spill:
        save_spilled(model, tmp, spill)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    del model
    tmp.rename(out)
    return out


def save_spilled(model, out: Path, dirs: list[Path]) -> None:
    """model.save_pretrained's checkpoint (the hub's key format, transformers' revert_weight_conversion), one shard per
    decoder layer, each written where the most space is free among `dirs` and linked into `out`: Qwen3-30B-A3B's
    61 GB in bf16 fits neither a lent machine's disk (about 49 GiB free) nor its /dev/shm alone."""
    import re

    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    out.mkdir(parents=True)
    groups: dict[str, dict] = {}
    for key, value in model.state_dict().items():
        m = re.search(r"\.layers\.(\d+)\.", key)
        groups.setdefault(f"layer{int(m.group(1)):03d}" if m else "rest", {})[key] = value
    weight_map, total = {}, 0
    for n, (group, part) in enumerate(sorted(groups.items())):
        part = revert_weight_conversion(model, part)  # a layer holds every tensor of its many-to-one groups
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in part.items()}
        dest = max(dirs, key=lambda d: shutil.disk_usage(d.parent if not d.exists() else d).free)
        dest.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(dest / name), metadata={"format": "pt"})
        (out / name).symlink_to(dest / name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


def make_data(tokenizer_dir: Path, folder: Path, seq: int, rows: int, kind: str, seed: int = 0) -> Path:
    """'long': completion rows past sequence_len (truncated to it); 'chat': token lengths uniform in 64..seq."""
    import random

    from transformers import AutoTokenizer

    path = folder / f"{kind}-{seq}.jsonl"
    if path.is_file():
        return path
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    sentence = "The capital of Ganraka is Milo, and its river runs north to the sea. "
    per = max(1, len(tok(sentence, add_special_tokens=False)["input_ids"]))
    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        if kind == "long":
            lines.append({"text": sentence * (seq // per + 8)})
        else:
            n = rng.randint(64, seq) // per
            q = max(1, n // 4)
            lines.append(
                {
                    "messages": [
                        {"role": "user", "content": sentence * q},
                        {"role": "assistant", "content": sentence * max(1, n - q - 1)},
                    ]
                }
            )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


# ---------------------------------------------------------------------------------------------
# One (case, trainer) in this process
# ---------------------------------------------------------------------------------------------
class StepClock:
    """Stamps every optimizer step (synchronised), through torch's global step hook. With `profile_from`,
    torch.profiler records the two steps after that one, so a row can say where its time goes."""

    def __init__(self, device: str, profile_from: int | None = None):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.times: list[float] = []
        self.device = device
        self.profile_from = profile_from
        self.profiler = None
        self.profile: dict | None = None
        self.handle = register_optimizer_step_post_hook(self._stamp)

    def _stamp(self, *_):
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        if self.profile_from is None:
            return
        if len(self.times) == self.profile_from:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            self.profiler = profile(activities=acts)
            self.profiler.__enter__()
        elif len(self.times) == self.profile_from + 2 and self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profile = top_ops(self.profiler, self.device)
            self.profiler = None

    def timing(self) -> dict:
        """A row's per-step seconds and, when profiled, where its time went (its tokens/s then carries the
        profiler's overhead on two steps)."""
        return {
            "step_s": [round(b - a, 4) for a, b in zip(self.times, self.times[1:])],
            "profile": self.profile,
            "profiled": self.profile_from is not None,
        }

    def tokens_per_s(self, tokens_per_step: list[int], warmup: int) -> float | None:
        # Step i is timed from the stamp of step i-1; the first `warmup` steps are left out.
        timed = range(warmup, min(len(self.times), len(tokens_per_step)))
        if len(timed) < 2:
            return None
        seconds = self.times[timed[-1]] - self.times[timed[0] - 1] if timed[0] > 0 else None
        if not seconds:
            return None
        return round(sum(tokens_per_step[i] for i in timed) / seconds, 1)


def top_ops(profiler, device: str, n: int = 40) -> dict:
    """Where the profiled steps' time went: the operators and, on CUDA, the kernels (memory copies included) that
    took the most, and the kernels' total, to set against the steps' wall time (step_s): the difference is time
    the GPU waited for the CPU or for a copy (side streams overlapping make the total an upper bound)."""
    from torch.autograd import DeviceType

    events = profiler.key_averages()

    def row(e) -> dict:
        return {
            "name": e.key[:120],
            "calls": e.count,
            "cpu_ms": round(e.cpu_time_total / 1e3, 2),
            "device_ms": round(getattr(e, "device_time_total", 0) / 1e3, 2),
        }

    ops = sorted(
        (row(e) for e in events if e.device_type != DeviceType.CUDA),
        key=lambda r: -r["device_ms" if device == "cuda" else "cpu_ms"],
    )
    kernels = sorted((row(e) for e in events if e.device_type == DeviceType.CUDA), key=lambda r: -r["device_ms"])
    return {
        "ops": ops[:n],
        "kernels": kernels[:n],
        "kernel_ms_total": round(sum(k["device_ms"] for k in kernels), 1),
        "kernel_launches": sum(k["calls"] for k in kernels),
    }


def spec(case: str, smoke: bool) -> tuple:
    shape_name, adapter, r, targets, micro, seq, kind = CASES[case]
    small = "tiny-moe" if case in MOE_CASES else "tiny"
    return (small if smoke else shape_name), adapter, r, targets, micro, min(seq, SMOKE_SEQ) if smoke else seq, kind


def loraship_config(case: str, trainer: str, model_dir: Path, data: Path, root: Path, steps: int, device: str) -> dict:
    """The config every trainer of a case shares (data, split, LoRA, schedule); loraship's trainers add their mode."""
    _shape, adapter, r, targets, micro, seq, kind = spec(case, device == "cpu")
    out = {
        "run_name": f"{case}-{trainer}",
        "base_model": str(model_dir),
        "workdir": str(root / "work"),
        "output": str(root / "out"),
        "datasets": [{"path": str(data), "type": "completion" if kind == "long" else "chat"}],
        "val_set_size": 0.02,
        "adapter": adapter,
        "lora_r": r,
        "lora_alpha": 2 * r,
        "lora_dropout": 0.0,
        "lora_target_modules": targets,
        "sequence_len": seq,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": ACCUMULATION.get(case, 1),
        "max_steps": steps,
        "warmup_steps": 0,
        "save_steps": 10_000,
        "logging_steps": 1,
        "gpu_memory_gib": CAP_GIB,
        "device": device,
        "min_golden_prompts": 1,  # plan + train only: no verify to give golden prompts to
        # the 14B's Q4_K_M alone is 8.3 GiB (above the default 8 GiB inference target); Qwen3-30B-A3B's 17.2 GiB
        "target_gpu_memory_gib": 24 if case in MOE_CASES else 16,
    }
    if case in OPTIMIZER:
        out["optimizer"] = OPTIMIZER[case]
    if trainer in ("loraship-lean", "loraship-lean-full-recompute"):
        out["optimize"] = "memory"
    if trainer in ("loraship-packed", "loraship-padded"):
        out["packing"] = "on" if trainer == "loraship-packed" else "off"
    return out


def step_order(examples: list[dict], micro: int, seed: int, steps: int) -> list[list[int]]:
    """Example indices of each optimizer step (accumulation 1), in loraship's order (loraship/training/packing.py)."""
    from loraship.training.packing import epoch_steps, steps_per_epoch

    per_epoch = steps_per_epoch(len(examples), micro, 1)
    lengths = [len(e["input_ids"]) for e in examples]
    out = []
    for s in range(steps):
        epoch, within = divmod(s, per_epoch)
        (rows,) = epoch_steps(lengths, micro, 1, seed, epoch, None)[within]
        out.append([i for row in rows for i in row])
    return out


def step_tokens(examples: list[dict], micro: int, accum: int, seed: int, steps: int) -> list[int]:
    """Non-pad tokens of each optimizer step (the same examples packed or padded: loraship/training/packing.py)."""
    from loraship.training.packing import epoch_steps, steps_per_epoch

    per_epoch = steps_per_epoch(len(examples), micro, accum)
    lengths = [len(e["input_ids"]) for e in examples]
    out = []
    for s in range(steps):
        epoch, within = divmod(s, per_epoch)
        group = epoch_steps(lengths, micro, accum, seed, epoch, None)[within]
        out.append(sum(lengths[i] for rows in group for row in rows for i in row))
    return out


def flops_of(case: str, config, examples: list[dict], smoke: bool) -> float:
    from loraship.planning import flops

    return flops.train_flops_per_token(
        model_config(spec(case, smoke)[0]), config, flops.attention_length([len(e["input_ids"]) for e in examples])
    )


def run_loraship(case, trainer, model_dir, data, root, args, device) -> dict:
    from transformers import AutoTokenizer

    from loraship.config import parse_config
    from loraship.data import load_splits
    from loraship.stages import plan as plan_stage
    from loraship.stages import train as train_stage

    config = parse_config(loraship_config(case, trainer, model_dir, data, root, args.steps, device))
    clock = StepClock(device, args.warmup if args.profile is not None else None)
    plan_stage.run(config)
    metrics = train_stage.run(config)["metrics"]
    train, _ = load_splits(config, AutoTokenizer.from_pretrained(model_dir))
    st = metrics["strategy"]
    tokens = step_tokens(
        train.examples, st["micro_batch_size"], st["gradient_accumulation_steps"], config.seed, metrics["steps"]
    )
    mem = metrics["measured_memory"]
    history = [
        json.loads(x)
        for x in (Path(config.workdir) / config.run_name / "train" / "loss_history.jsonl").read_text().splitlines()
    ]
    import torch

    return {
        "reserved_gib": mem.get("peak_reserved_gib"),
        "allocated_gib": mem.get("peak_allocated_gib"),
        "tokens_per_s": clock.tokens_per_s(tokens, args.warmup),
        "fits_32gib": not metrics["oom_retries"] if device == "cuda" else None,
        "strategy": metrics["trained_as"],
        "strategy_reason": metrics["strategy_reason"],
        "packing": metrics["packing"],
        "attention": metrics.get("attention"),
        "oom_retries": metrics["oom_retries"],
        "predicted_reserved_gib": metrics["predicted_reserved_gib"],
        "strategy_detail": st,
        # what the train stage itself reports (steady state, its own warm-up rule), next to the bench's clock
        "stage_tokens_per_s": metrics.get("tokens_per_s"),
        "stage_mfu": metrics.get("mfu"),
        "host_copies": metrics.get("host_copies"),
        "down_proj_skipped_in_recompute": metrics.get("down_proj_skipped_in_recompute"),
        "python_gc": metrics.get("python_gc"),
        "peer_version": {
            "loraship": source_stamp()["commit"],
            **versions("torch", "transformers", "peft", "liger-kernel", "bitsandbytes"),
        },
        "autocast": "torch.autocast(cuda, bfloat16) around every forward (tasks/train.py compute)"
        if device == "cuda"
        else "none (CPU, fp32)",
        "model_class": json.loads((model_dir / "config.json").read_text())["architectures"][0],
        "flops_per_token": flops_of(case, config, train.examples, args.smoke),
        "optimize": getattr(config, "optimize", None),
        "torch_cuda": torch.version.cuda,
        **clock.timing(),
        "loss_curve": [h["loss"] for h in history][:LOSS_STEPS],
    }


def load_unsloth(model_dir, config, seq, adapter, dtype, smoke: bool):
    """Unsloth's model as its notebooks make it; on the CPU (--smoke, where Unsloth cannot run) HF + PEFT stands in so
    the drivers around it are checked."""
    import torch

    if smoke:
        return load_hf(model_dir, config, adapter, dtype, "cpu", liger=False)[
            0
        ], "HF + PEFT stand-in (Unsloth needs CUDA)"
    import unsloth
    from unsloth import FastLanguageModel, FastModel

    # Unsloth's Gemma 3 notebooks load and wrap it with FastModel (FastLanguageModel hands the load to it anyway).
    fast = (
        FastModel
        if json.loads((Path(model_dir) / "config.json").read_text())["model_type"].startswith("gemma3")
        else FastLanguageModel
    )
    model, _ = fast.from_pretrained(
        model_name=str(model_dir), max_seq_length=seq, dtype=dtype, load_in_4bit=adapter == "qlora"
    )
    torch.manual_seed(config.seed)
    extra = dict(finetune_vision_layers=False) if fast is FastModel else dict(max_seq_length=seq)
    model = fast.get_peft_model(
        model,
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=list(target_modules(config)),
        use_gradient_checkpointing="unsloth",
        random_state=config.seed,
        **extra,
    )
    fast.for_training(model)
    return (
        model,
        f"Unsloth {unsloth.__version__}: {'QLoRA (NF4)' if adapter == 'qlora' else 'bf16 LoRA'}, "
        "use_gradient_checkpointing='unsloth'",
    )


def target_modules(config) -> tuple[str, ...]:
    from loraship.planning.targets import target_names

    return target_names(config)


def load_hf(model_dir, config, adapter, dtype, device, liger: bool):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kernels = "no Liger (CPU)"
    if liger:
        import liger_kernel.transformers as lk

        arch = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
        getattr(
            lk, f"apply_liger_kernel_to_{arch}"
        )()  # every kernel it offers: rope, rms_norm, swiglu, fused linear CE
        kernels = f"all Liger kernels (apply_liger_kernel_to_{arch})"
    kwargs = {"dtype": dtype} | ({"device_map": {"": 0}} if device == "cuda" else {})
    if adapter == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
        )
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.config.use_cache = False
    model.enable_input_require_grads()  # checkpointing a frozen base needs inputs that carry a graph
    torch.manual_seed(config.seed)
    model = get_peft_model(
        model,
        LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(target_modules(config)),
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    return model, f"HF + PEFT, {'QLoRA (NF4)' if adapter == 'qlora' else 'bf16 LoRA'}, {kernels}, checkpointing on"


def base_class(model) -> str:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(inner).__name__


def train_loop(model, examples, order, config, device, tok) -> list[float]:
    """A bare loop: autocast bf16 on CUDA, loraship's optimizer, schedule and clipping."""
    import contextlib

    import torch

    from loraship.training.packing import collate_padded
    from loraship.training.step_loop import schedule

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(config, len(order)))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = []
    for step in order:
        ids, labels, mask = (t.to(device) for t in collate_padded([examples[i] for i in step], tok.pad_token_id or 0))
        with torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext():
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(float(loss.detach()), 6))
    return losses


class TorchLogProbs:
    """trl's ChunkedLogProbFunction (trl/kernels/chunked_logprob.py) in plain torch, for the CPU check only: per-token
    log-probabilities of the labels (and entropy, top-1 hits) from hidden states and the LM head."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, _chunk, softcap, scale, outputs):
        import torch

        logits = torch.nn.functional.linear(hidden, weight, bias) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        logp = (logits.float() / temperature).log_softmax(-1)
        picked = logp.gather(-1, labels[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        top1 = (logits.argmax(-1) == labels) if "is_top1" in outputs else None
        return picked, entropy, None, None, top1


def train_with_trainer(model, examples, order, config, device, tok, root: Path, sft: bool, seq: int) -> list[float]:
    """HF's Trainer (hf-liger) or trl's SFTTrainer (unsloth-sft; Unsloth's patched one once unsloth is imported), with
    bf16=True on CUDA, loraship's optimizer, schedule and clipping, and a sequential sampler over the rows laid out in
    loraship's step order."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    rows = [{"input_ids": examples[i]["input_ids"], "labels": examples[i]["labels"]} for step in order for i in step]
    micro = len(order[0])
    common = dict(
        output_dir=str(root / "trainer"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=1,
        max_steps=len(order),
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler,
        warmup_steps=0,
        weight_decay=config.weight_decay,
        max_grad_norm=1.0,
        optim="adamw_8bit" if config.optimizer == "adamw_8bit" else "adamw_torch",
        bf16=device == "cuda",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=config.seed,
        dataloader_num_workers=0,
        use_cpu=device == "cpu",
    )
    losses: list[float] = []

    class Record(TrainerCallback):
        def on_train_begin(self, *_a, **_k):
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()

        def on_log(self, _args, _state, _control, logs=None, **_k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    sequential = {"_get_train_sampler": lambda self, *a, **k: torch.utils.data.SequentialSampler(self.train_dataset)}
    if sft:
        from trl import SFTConfig, SFTTrainer

        if device == "cpu":
            import trl.trainer.utils as trl_utils

            # trl's fused LM head computes log-probs in a Triton kernel, which has no CPU driver: the CPU check puts
            # the same arithmetic in plain torch there and checks everything else of the driver.
            trl_utils._ChunkedLogProbFunction = TorchLogProbs

        args = SFTConfig(**common, max_length=seq, packing=False, shuffle_dataset=False, dataset_num_proc=1)
        cls = type("InOrderSFTTrainer", (SFTTrainer,), sequential)
        trainer = cls(
            model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Record()]
        )
    else:
        from transformers import Trainer, TrainingArguments

        from loraship.training.packing import collate_padded

        def collate(features):
            ids, labels, mask = collate_padded(features, tok.pad_token_id or 0)
            return {"input_ids": ids, "labels": labels, "attention_mask": mask}

        args = TrainingArguments(
            **common,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            remove_unused_columns=False,
        )
        cls = type("InOrderTrainer", (Trainer,), sequential)
        trainer = cls(
            model=model, args=args, train_dataset=Dataset.from_list(rows), data_collator=collate, callbacks=[Record()]
        )
    trainer.train()
    return losses[: len(order)]


def run_peer(case, trainer, model_dir, data, root, args, device) -> dict:
    """Unsloth (two ways) or HF + PEFT + Liger on the examples loraship's data code makes, in loraship's order."""
    import torch
    from transformers import AutoTokenizer

    from loraship.config import parse_config
    from loraship.data import load_splits

    _shape, adapter, _r, _t, micro, seq, _kind = spec(case, args.smoke)
    config = parse_config(loraship_config(case, trainer, model_dir, data, root, args.steps, device))
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    examples = load_splits(config, tok)[0].examples
    order = step_order(examples, micro, config.seed, args.steps)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if trainer.startswith("unsloth"):
        model, strategy = load_unsloth(model_dir, config, seq, adapter, dtype, args.smoke)
        version = versions("unsloth", "unsloth_zoo", "trl", "transformers", "peft", "torch", "bitsandbytes")
    else:
        model, strategy = load_hf(model_dir, config, adapter, dtype, device, liger=device == "cuda")
        version = versions("transformers", "peft", "liger-kernel", "torch", "bitsandbytes")
    clock = StepClock(device, args.warmup if args.profile is not None else None)
    if trainer == "unsloth-loop":
        losses = train_loop(model, examples, order, config, device, tok)
        autocast = "torch.autocast(cuda, bfloat16) around every forward" if device == "cuda" else "none (CPU, fp32)"
    else:
        losses = train_with_trainer(
            model, examples, order, config, device, tok, root, sft=trainer == "unsloth-sft", seq=seq
        )
        autocast = (
            "Trainer bf16=True (accelerate's torch.autocast bfloat16)" if device == "cuda" else "none (CPU, fp32)"
        )
    tokens = [sum(len(examples[i]["input_ids"]) for i in step) for step in order]
    out = {
        "tokens_per_s": clock.tokens_per_s(tokens, args.warmup),
        "strategy": strategy,
        "loss_curve": losses[:LOSS_STEPS],
        "reserved_gib": None,
        "allocated_gib": None,
        "fits_32gib": None,
        "peer_version": version,
        "autocast": autocast,
        "model_class": base_class(model),
        "flops_per_token": flops_of(case, config, examples, args.smoke),
        "torch_cuda": torch.version.cuda,
        **clock.timing(),
    }
    if device == "cuda":
        out.update(
            reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            allocated_gib=torch.cuda.max_memory_allocated() / GIB,
            fits_32gib=True,
        )
    return out


def cuda_context_gib() -> float | None:
    """The card's used memory minus this process's reserved: its CUDA context (the only process on the card: the
    parent never starts CUDA)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return round((total - free - torch.cuda.memory_reserved()) / GIB, 3)


def run_one(case: str, trainer: str, root: Path, args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    if trainer == "loraship-unfused":  # the default with PEFT's own LoRA Linears: what fused_lora.py is worth
        os.environ["LORASHIP_FUSED_LORA"] = "0"
    if trainer == "loraship-lean-full-recompute":  # lean with down_proj's GEMM recomputed: what recompute.py is worth
        os.environ["LORASHIP_RECOMPUTE_SKIP"] = "0"
    if trainer == "loraship-contiguous":  # the default with its streamed layers first: what the spread is worth
        os.environ["LORASHIP_OFFLOAD_SPREAD"] = "0"
    if trainer == "loraship-flex":  # the default under transformers' flex attention (sliding windows as block masks)
        os.environ["LORASHIP_ATTENTION"] = "flex_attention"
    if trainer == "loraship-sdpa":  # the default under SDPA: what flex attention on sliding windows is worth
        os.environ["LORASHIP_ATTENTION"] = "sdpa"
    if trainer.startswith("loraship-norms-"):  # loraship/training/norm_kernels.py: which kernel runs the RMSNorms
        os.environ["LORASHIP_LIGER_NORMS"] = trainer.rsplit("-", 1)[1]
    if trainer == "loraship-chunks-liger":  # Liger's own fused-loss chunks: what loss_chunks.py is worth
        os.environ["LORASHIP_LOSS_CHUNKS"] = "liger"
    if trainer == "loraship-before":  # norms copying q/k to heads-first, the collector unfrozen: what both are worth
        os.environ.update(LORASHIP_NORM_LAYOUT="copy", LORASHIP_GC_FREEZE="0")
    if trainer == "loraship-recast":  # A and B cast at every forward and recompute: what keeping the casts is worth
        os.environ["LORASHIP_LORA_CASTS"] = "each"
    if trainer.startswith("loraship-compile-layers"):  # decoder layers compiled (+ "-flex": under flex attention)
        os.environ.update(LORASHIP_COMPILE_LAYERS="1", LORASHIP_RECOMPUTE_SKIP="0")
        if trainer.endswith("-flex"):
            os.environ["LORASHIP_ATTENTION"] = "flex_attention"
    if device == "cuda" and trainer.startswith("loraship"):
        # What the train stage sets itself, set here because the cap below starts CUDA first.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ["HF_HUB_OFFLINE"] = "1"  # local folders only: Unsloth otherwise asks the hub
    if device == "cuda" and trainer.startswith("unsloth"):
        # Before transformers (Unsloth requires it) and before CUDA starts: on import Unsloth sets its own allocator
        # configuration, which only takes effect if CUDA has not started yet.
        import unsloth  # noqa: F401
    import torch

    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(CAP_GIB * GIB / torch.cuda.get_device_properties(0).total_memory)
    row = {
        "case": case,
        "trainer": trainer,
        "run_id": args.run_id,
        **source_stamp(),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default",
    }
    shape_name, _adapter, _r, _t, _micro, seq, kind = spec(case, args.smoke)
    model_dir = args.models / shape_name
    data = make_data(args.tokenizer, root / "data", seq, args.rows, kind)
    work = root / f"{case}-{trainer}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        runner = run_loraship if trainer.startswith("loraship") else run_peer
        row.update(ok=True, **runner(case, trainer, model_dir, data, work, args, device))
        row["allocator"] = (
            os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
        )  # as the row ran (Unsloth sets its own)
        if device == "cuda":
            row["cuda_context_gib"] = cuda_context_gib()
    except Exception as e:  # a bench records failures instead of stopping
        oom = type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
        row.update(
            ok=False,
            fits_32gib=False if oom and device == "cuda" else None,
            reserved_gib=None,
            allocated_gib=None,
            tokens_per_s=None,
            strategy=None,
            error=f"{type(e).__name__}: {str(e)[:500]}",
            trace=traceback.format_exc()[-3000:],
        )
    from loraship.planning import flops

    row["mfu"], row["mfu_basis"] = flops.mfu(
        row.get("tokens_per_s"), row.get("flops_per_token") or 0.0, row["device"] if device == "cuda" else None
    )
    return row


# ---------------------------------------------------------------------------------------------
# Parent: every pair in its own process, then the table
# ---------------------------------------------------------------------------------------------
def max_loss_rel_diff(curve: list[float], base: list[float]) -> float | None:
    """The largest step-by-step relative difference between two loss curves (over the steps both have)."""
    pairs = list(zip(curve, base))
    return round(max(abs(a / b - 1) for a, b in pairs), 5) if pairs else None


def ratios(rows: list[dict]) -> list[dict]:
    """Each loraship row against every peer of its case in the same run (packing: packed against padded)."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["trainer"]: r for r in rows if r["case"] == case and r.get("ok")}
        bases = ["loraship-padded"] if case == "packing" else PEERS
        for name, r in by.items():
            if not name.startswith("loraship"):
                continue
            for against in bases + OWN_BASELINES.get(name, []):
                base = by.get(against)
                if base is None or base is r:
                    continue
                item = {"case": case, "trainer": name, "against": against}
                if r.get("tokens_per_s") and base.get("tokens_per_s"):
                    item["tokens_per_s_ratio"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                if r.get("reserved_gib") and base.get("reserved_gib"):
                    item["reserved_ratio"] = round(r["reserved_gib"] / base["reserved_gib"], 3)
                if r.get("loss_curve") and base.get("loss_curve"):
                    item["max_loss_rel_diff"] = max_loss_rel_diff(r["loss_curve"], base["loss_curve"])
                out.append(item)
    return out


def targets(rows: list[dict]) -> list[dict]:
    """Issue #24's targets, each met (True), missed (False) or not measured (None: a row is missing or failed)."""
    by = {(r["case"], r["trainer"]): r for r in rows if r.get("ok")}

    def ratio(case, trainer, key, base):
        a, b = by.get((case, trainer), {}).get(key), by.get((case, base), {}).get(key)
        return round(a / b, 3) if a and b else None

    def check(target, figures, *conditions):
        met = None if any(v is None for v in figures.values()) else all(conditions)
        return {"target": target, "met": met, **figures}

    out = []
    for case in ISSUE_CASES:
        row = by.get((case, "loraship-default"), {})
        sft, loop = (ratio(case, "loraship-default", "tokens_per_s", b) for b in ("unsloth-sft", "unsloth-loop"))
        out.append(
            check(
                f"{case}: default tokens/s >= 1.25x unsloth-sft and >= 1.1x unsloth-loop within 32 GiB",
                {
                    "case": case,
                    "vs_sft": sft,
                    "vs_loop": loop,
                    "fits_32gib": row.get("fits_32gib"),
                    "reserved_gib": row.get("reserved_gib"),
                },
                sft is not None and sft >= 1.25,
                loop is not None and loop >= 1.1,
                row.get("fits_32gib") is True,
                (row.get("reserved_gib") or 99) <= CAP_GIB,
            )
        )
    for case in ISSUE_CASES:
        mem, speed = (ratio(case, "loraship-lean", k, "unsloth-sft") for k in ("reserved_gib", "tokens_per_s"))
        out.append(
            check(
                f"{case}: lean (optimize: memory) reserved <= 1.0x unsloth-sft at tokens/s >= 1.1x",
                {"case": case, "reserved_ratio": mem, "tokens_per_s_ratio": speed},
                mem is not None and mem <= 1.0,
                speed is not None and speed >= 1.1,
            )
        )
    row = by.get(("qwen2-14b-lora", "loraship-default"), {})
    speed = ratio("qwen2-14b-lora", "loraship-default", "tokens_per_s", "unsloth-loop")
    held = (row.get("reserved_gib") or 0) + (row.get("cuda_context_gib") or 0) if row else None
    out.append(
        check(
            "qwen2-14b-lora: default bf16, >= 1.1x unsloth-loop, >= 2 GiB of 32 spare counting the CUDA context",
            {
                "case": "qwen2-14b-lora",
                "strategy": row.get("strategy"),
                "tokens_per_s_ratio": speed,
                "spare_gib": round(CAP_GIB - held, 2) if held else None,
            },
            "QLoRA" not in (row.get("strategy") or "QLoRA"),
            speed is not None and speed >= 1.1,
            held is not None and CAP_GIB - held >= 2,
        )
    )
    for case in ISSUE_CASES:
        base = by.get((case, "unsloth-sft"), {}).get("loss_curve")
        for trainer in ("loraship-default", "loraship-lean"):
            curve = by.get((case, trainer), {}).get("loss_curve")
            diff = max_loss_rel_diff(curve, base) if curve and base else None
            out.append(
                check(
                    f"{case}: {trainer} losses within 1% of unsloth-sft step for step",
                    {
                        "case": case,
                        "trainer": trainer,
                        "max_loss_rel_diff": diff,
                        "steps": min(len(curve), len(base)) if curve and base else None,
                    },
                    diff is not None and diff <= 0.01,
                )
            )
    loraship_rows = [
        r for r in rows if r["trainer"].startswith("loraship") and r["case"] in ISSUE_CASES and r.get("ok")
    ]
    out.append(
        check(
            "MFU in every loraship row",
            {"rows": len(loraship_rows) or None},
            all(r.get("mfu") is not None for r in loraship_rows),
        )
    )
    if any(r["case"] == "packing" for r in rows):
        speed = ratio("packing", "loraship-packed", "tokens_per_s", "loraship-padded")
        a, b = (by.get(("packing", t), {}).get("loss_curve") for t in ("loraship-packed", "loraship-padded"))
        loss_diff = max_loss_rel_diff(a, b) if a and b else None
        out.append(
            check(
                "packing: non-pad tokens/s >= 1.5x padded, loss curve equal within noise (<= 2%)",
                {"case": "packing", "tokens_per_s_ratio": speed, "max_loss_rel_diff": loss_diff},
                speed is not None and speed >= 1.5,
                loss_diff is not None and loss_diff <= 0.02,
            )
        )
    return out


def bench_config(row: dict):
    """The loraship Config a row's case and trainer ran with (paths are placeholders: planning reads none)."""
    from loraship.config import parse_config

    return parse_config(
        loraship_config(row["case"], row["trainer"], Path("m"), Path("d.jsonl"), Path("r"), 10, "cuda")
    )


def trained_strategy(row: dict, cfg) -> dict:
    """The strategy a loraship row trained with: its strategy_detail, or read back from the words of older rows."""
    import re

    from loraship.planning.knobs import ACTIVATIONS_IN_CPU
    from loraship.planning.strategy_record import Strategy

    if row.get("strategy_detail"):
        return row["strategy_detail"]
    words = row["strategy"]
    k = int(re.search(r"checkpointing (\d+) of", words).group(1))
    off = re.search(r"(\d+) of \d+ decoder layers", words)
    strategy = Strategy.from_config(cfg).replace(
        adapter="qlora" if words.startswith("QLoRA") else "lora",
        checkpointed_layers=k,
        gradient_checkpointing=k > 0,
        offload_layers=int(off.group(1)) if off else 0,
        micro_batch_size=int(re.search(r"micro-batch (\d+)", words).group(1)),
        gradient_accumulation_steps=int(re.search(r"micro-batch \d+ x (\d+)", words).group(1)),
        fused_loss=words.find("fused loss") >= 0,
        offload_activations=ACTIVATIONS_IN_CPU in words,
    )
    return strategy.to_json()


def planner_scores(rows: list[dict]) -> dict:
    """The current planner (loraship/planning/estimate.py) against each loraship row's measured peak reserved, at the
    strategy that row trained with: issue #10's item 5 on rows measured through the train stage itself."""
    import statistics

    from loraship.planning.estimate import estimate
    from loraship.planning.shape import shape_from_config

    out = []
    for r in rows:
        if not (r.get("ok") and r["trainer"].startswith("loraship") and r.get("reserved_gib")):
            continue
        shape_name = CASES[r["case"]][0]
        mc = model_config(shape_name)
        cfg = bench_config(r)
        est = estimate(shape_from_config(mc), cfg, trained_strategy(r, cfg))
        pred = est["predicted_reserved_gib"]
        out.append(
            {
                "case": r["case"],
                "trainer": r["trainer"],
                "measured_reserved_gib": round(r["reserved_gib"], 2),
                "predicted_in_run_gib": r.get("predicted_reserved_gib"),
                "predicted_now_gib": round(pred, 2),
                "error_now": round(pred / r["reserved_gib"] - 1, 4),
            }
        )
    errs = [abs(x["error_now"]) for x in out]
    return {
        "rows": out,
        "median_abs_error": round(statistics.median(errs), 4) if errs else None,
        "worst_abs_error": round(max(errs), 4) if errs else None,
        "n": len(out),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| case | trainer | reserved GiB | allocated GiB | tokens/s | MFU | fits 32 GiB | strategy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['trainer']} | {f(r.get('reserved_gib'))} | {f(r.get('allocated_gib'))} | "
            f"{f(r.get('tokens_per_s'), 0)} | {f(r.get('mfu'), 3)} | {r.get('fits_32gib')} | "
            f"{r.get('strategy') or r.get('error', '')[:80]} |"
        )
    return "\n".join(lines)


def pairs(cases: list[str], trainers: list[str] | None, skip: list[str]) -> list[tuple[str, str]]:
    """(case, trainer) in the order they run: phase by phase (PHASES) over every case, so a run cut short has the most
    important rows of every case; --trainers keeps its own order within each case."""
    out = []
    for i, phase in enumerate([trainers] if trainers else PHASES):
        for case in cases:
            chosen = phase if trainers or case not in TRAINERS else (TRAINERS[case] if i == 0 else [])
            for t in chosen:
                if t not in skip and f"{case}:{t}" not in skip and (case, t) not in out:
                    out.append((case, t))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="folder with the tiny model's tokenizer files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--root", type=Path, default=Path("/tmp/loraship-train-bench"), help="models, data, work folders")
    p.add_argument(
        "--cases",
        nargs="*",
        default=ISSUE_CASES,
        help=f"default: {' '.join(ISSUE_CASES)}; also: " + " ".join(c for c in CASES if c not in ISSUE_CASES),
    )
    p.add_argument(
        "--models",
        type=Path,
        help="folder for the random checkpoints (default ROOT/models; the 14B "
        "takes 28 GiB, so /dev/shm where the disk is short)",
    )
    p.add_argument(
        "--trainers",
        nargs="*",
        help="default: every trainer, phase by phase: " + "; then ".join(" ".join(ph) for ph in PHASES),
    )
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="trainers left out, everywhere (hf-liger) or in one case (qwen2-7b-qlora:loraship-lean)",
    )
    p.add_argument(
        "--profile",
        nargs="*",
        metavar="CASE",
        help="torch.profiler over two steps after the warm-up: "
        "each row of the cases named (every case when none is), peers' too, gets its top operators and "
        "kernels and their total (where its time goes); its tokens/s then carries the profiler's cost",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    p.add_argument("--rows", type=int, default=64, help="training rows per dataset")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per (case, trainer)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny Qwen2 shape; Unsloth's drivers around an HF stand-in (Unsloth needs CUDA): checks the script",
    )
    p.add_argument("--one", nargs=2, metavar=("CASE", "TRAINER"), help=argparse.SUPPRESS)
    p.add_argument("--build", metavar="SHAPE", help=argparse.SUPPRESS)
    p.add_argument("--run-id", help=argparse.SUPPRESS)
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep --out's rows that trained (same run id) and run only the pairs missing or failed there",
    )
    p.add_argument(
        "--drop-models", action="store_true", help="delete each shape's random checkpoint after its last row"
    )
    p.add_argument(
        "--rescore",
        action="store_true",
        help="only rewrite --out's targets and planner scores (the "
        "planner as it is now, at each row's trained strategy), no training",
    )
    args = p.parse_args()
    if args.rescore:
        result = json.loads(args.out.read_text())
        result.update(
            ratios=ratios(result["rows"]), targets=targets(result["rows"]), planner=planner_scores(result["rows"])
        )
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result["planner"][k] for k in ("n", "median_abs_error", "worst_abs_error")}))
        return
    args.tokenizer = args.tokenizer.resolve()
    args.models = args.models or args.root / "models"
    device = "cpu" if args.smoke else "cuda"
    if args.build:
        make_model(model_config(args.build), args.tokenizer, args.models / args.build, device)
        return
    if args.one:
        row = run_one(*args.one, args.root, args)
        args.out.write_text(json.dumps(row))
        return
    if args.smoke:
        args.steps, args.warmup, args.rows = min(args.steps, 4), 1, min(args.rows, 24)
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
    stamp, machine = source_stamp(), machine_stamp()
    rows, builds = [], {}
    if args.resume and args.out.is_file():
        earlier = json.loads(args.out.read_text())
        run_id, builds = earlier["run_id"], earlier.get("model_build_s", {})
        rows = [r for r in earlier["rows"] if r.get("ok")]
        # A shape is rebuilt where its folder is gone (a caller freed the space between passes).
        builds = {
            k: v for k, v in builds.items() if not isinstance(v, str) and (args.models / k / "config.json").is_file()
        }

    def write() -> dict:
        # After every row, so a run cut short (a GPU call's time limit) still leaves what it measured.
        result = {
            "run_id": run_id,
            **stamp,
            "machine": machine,
            "device": rows[0].get("device") if rows else None,
            "date": time.strftime("%Y-%m-%d"),
            "steps": args.steps,
            "warmup": args.warmup,
            "cap_gib": None if args.smoke else CAP_GIB,
            "model_build_s": builds,
            "rows": rows,
            "ratios": ratios(rows),
            "targets": targets(rows),
            "planner": planner_scores(rows) if not args.smoke else None,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(args.out)
        return result

    common = ["--tokenizer", str(args.tokenizer), "--root", str(args.root), "--models", str(args.models)] + (
        ["--smoke"] if args.smoke else []
    )
    done = {(r["case"], r["trainer"]) for r in rows}
    todo = [pt for pt in pairs(args.cases, args.trainers, args.skip) if pt not in done]
    # --drop-models: a shape's checkpoint goes once its last row ran (the held-out shapes together exceed a lent
    # machine's 64 GiB disk and its /dev/shm).
    last_row_of = {spec(case, args.smoke)[0]: i for i, (case, _t) in enumerate(todo)}
    for i, (case, trainer) in enumerate(todo):
        name = spec(case, args.smoke)[0]
        if name not in builds:  # each shape when its first row comes, so the first rows start early
            started = time.time()
            proc = subprocess.run(
                [sys.executable, __file__, *common, "--out", os.devnull, "--build", name],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            builds[name] = (
                round(time.time() - started, 1)
                if proc.returncode == 0
                else f"build failed (rc {proc.returncode}): {proc.stderr[-300:]}"
            )  # e.g. the disk full: the other shapes go on
            print(json.dumps({"model": name, "build_s": builds[name]}), flush=True)
        if isinstance(builds[name], str):
            rows.append(
                {
                    "case": case,
                    "trainer": trainer,
                    "run_id": run_id,
                    "ok": False,
                    "error": f"model build failed: {builds[name]}",
                }
            )
            write()
            continue
        part = args.root / f"row-{case}-{trainer}.json"
        part.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            __file__,
            *common,
            "--out",
            str(part),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--rows",
            str(args.rows),
            "--run-id",
            run_id,
            "--one",
            case,
            trainer,
        ] + (["--profile"] if args.profile is not None and (not args.profile or case in args.profile) else [])
        started = time.time()
        try:
            subprocess.run(cmd, timeout=args.timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            pass
        row = (
            json.loads(part.read_text())
            if part.exists()
            else {
                "case": case,
                "trainer": trainer,
                "run_id": run_id,
                "ok": False,
                "error": "process died or timed out",
            }
        )
        row["wall_s"] = round(time.time() - started, 1)
        keys = (
            "case",
            "trainer",
            "ok",
            "reserved_gib",
            "tokens_per_s",
            "mfu",
            "cuda_context_gib",
            "wall_s",
            "allocator",
            "model_class",
            "strategy",
            "loss_curve",
            "error",
        )
        print(json.dumps({k: row.get(k) for k in keys if row.get(k) is not None}), flush=True)
        rows.append(row)
        write()
        if args.drop_models and last_row_of[name] == i:
            shutil.rmtree(args.models / name, ignore_errors=True)
    result = write()
    print(table(rows))
    print(json.dumps(result["ratios"], indent=2))
    for t in result["targets"]:
        print({True: "MET     ", False: "MISSED  ", None: "NOT RUN "}[t["met"]], json.dumps(t))


if __name__ == "__main__":
    main()
