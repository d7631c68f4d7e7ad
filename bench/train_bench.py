"""loraship's train stage against Unsloth and HF + PEFT + Liger: memory and steady-state speed.

    python bench/train_bench.py --tokenizer .loraship/models/tiny-llama --out bench/results/train_bench.json
    python bench/train_bench.py --tokenizer .loraship/models/tiny-llama --out /tmp/smoke.json --smoke   # CPU check

On the lent H200: `bash bench/train_kit/make.sh` here builds .whl-train/ (the wheels its python lacks: Unsloth, bitsandbytes,
liger-kernel, ...; 41 MiB), then one device call with carry [".whl-train"] runs `bash .whl-train/call.sh` (detached, rows
in order of importance, JSON after every row; later calls collect): bench/train_kit/README.txt.

Every (case, trainer) pair runs in its own process (a fresh allocator; Liger's and Unsloth's patches
reach model classes and cannot leak into the next row), under a 32 GiB cap on the GPU
(torch.cuda.set_per_process_memory_fraction, as bench/memory_matrix.py does). All trainers train the same examples in
the same order (loraship/packing.py's permutation), LoRA dropout 0 (Unsloth's fast path), AdamW.

Models: random weights in the real Qwen2 shapes (examples/models/*/config.json) built as
LlamaForCausalLM with attention_bias=True, which computes what Qwen2 computes (q/k/v biases, RoPE,
SwiGLU, RMSNorm) and lets the tiny model's sentencepiece tokenizer pass the plan's GGUF
convertibility check. Speed and memory depend on shapes, not on weight values.

Trainers:
- unsloth: FastLanguageModel, use_gradient_checkpointing="unsloth", its own fused loss.
- hf-liger: transformers + PEFT with every Liger kernel for the architecture
  (apply_liger_kernel_to_llama before loading), non-reentrant gradient checkpointing.
- loraship-lean: `loraship.stages.plan` + `loraship.stages.train` as shipped (checkpointing on, fused loss auto,
  offload_activations: on, i.e. every checkpointed layer's input in pinned CPU memory: loraship/activation_offload.py).
- loraship-fast: the same with gradient_checkpointing: false; the planner checkpoints only as many of
  the first decoder layers as the 32 GiB budget needs (strategy checkpointed_layers).
- loraship-packed / loraship-padded (case `packing`): packing: on / off on variable-length chat rows, the same
  examples in every step (the loss curves must agree).

Timing: a global optimizer step hook synchronises and stamps each step; tokens/s is non-pad tokens of
the steps after --warmup divided by their time. loraship's peak memory is the train stage's own
measurement (training only: reset after the eval before training), the peers' is over every step.
Rows: case, trainer, reserved_gib, allocated_gib, tokens_per_s, fits_32gib, strategy (+ details).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30
CAP_GIB = 32.0
QVO = ["q_proj", "v_proj", "o_proj"]


def shape(name: str) -> dict:
    mc = json.loads((ROOT / "examples" / "models" / name / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps")
    return {k: mc[k] for k in keys if k in mc} | {"attention_bias": mc["model_type"] == "qwen2",
                                                   "max_position_embeddings": 32768}


TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, tie_word_embeddings=False, attention_bias=True, max_position_embeddings=4096)

# case -> (model shape, adapter, rank, micro-batch, sequence_len, data kind)
CASES = {
    "qwen2-7b-lora": ("qwen2-7b", "lora", 64, 2, 4096, "long"),
    "qwen2-7b-qlora": ("qwen2-7b", "qlora", 64, 2, 4096, "long"),
    "qwen2-14b-qlora": ("qwen2-14b", "qlora", 64, 2, 4096, "long"),
    "qwen2-14b-lora": ("qwen2-14b", "lora", 64, 2, 4096, "long"),  # bf16 asked, 32 GiB budget
    # chat rows of 64-2048 tokens at micro-batch 8: padded batches pad to the longest of 8. At micro-batch 2 (H200,
    # 2026-12-03) a padded step of about 2,100 tokens took as long as a long-row step of 8,192: per-step costs, not
    # tokens, set the speed there, and packing the same 2 examples has little to win.
    "packing": ("qwen2-7b", "lora", 64, 8, 2048, "chat"),
    "qwen2-14b-lora-8k": ("qwen2-14b", "lora", 64, 1, 8192, "long"),  # target 3: still fits at 1 x 8192
}
TRAINERS = {"packing": ["loraship-packed", "loraship-padded"], "qwen2-14b-lora-8k": ["loraship-lean"]}
SMOKE_SEQ = 128  # --smoke: the tiny shape at short rows, so the CPU check takes seconds
# The order rows run in: the peer and loraship first, so a cut-short GPU call still brings the key ratio.
DEFAULT_TRAINERS = ["unsloth", "loraship-lean", "loraship-fast", "hf-liger"]


# ---------------------------------------------------------------------------------------------
# Inputs, made once in the parent
# ---------------------------------------------------------------------------------------------
def make_model(dims: dict, tokenizer_dir: Path, out: Path, device: str) -> Path:
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **dims)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 14B fp32 build would need 59 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    del model
    tmp.rename(out)
    return out


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
            lines.append({"messages": [{"role": "user", "content": sentence * q},
                                       {"role": "assistant", "content": sentence * max(1, n - q - 1)}]})
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
        return {"step_s": [round(b - a, 4) for a, b in zip(self.times, self.times[1:])], "profile": self.profile,
                "profiled": self.profile_from is not None}

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
        return {"name": e.key[:120], "calls": e.count, "cpu_ms": round(e.cpu_time_total / 1e3, 2),
                "device_ms": round(getattr(e, "device_time_total", 0) / 1e3, 2)}

    ops = sorted((row(e) for e in events if e.device_type != DeviceType.CUDA),
                 key=lambda r: -r["device_ms" if device == "cuda" else "cpu_ms"])
    kernels = sorted((row(e) for e in events if e.device_type == DeviceType.CUDA), key=lambda r: -r["device_ms"])
    return {"ops": ops[:n], "kernels": kernels[:n], "kernel_ms_total": round(sum(k["device_ms"] for k in kernels), 1),
            "kernel_launches": sum(k["calls"] for k in kernels)}


def spec(case: str, smoke: bool) -> tuple:
    shape_name, adapter, r, micro, seq, kind = CASES[case]
    return shape_name, adapter, r, micro, min(seq, SMOKE_SEQ) if smoke else seq, kind


def loraship_config(case: str, trainer: str, model_dir: Path, data: Path, root: Path, steps: int, device: str) -> dict:
    _shape, adapter, r, micro, seq, kind = spec(case, device == "cpu")
    return {
        "run_name": f"{case}-{trainer}", "base_model": str(model_dir), "workdir": str(root / "work"),
        "output": str(root / "out"), "datasets": [{"path": str(data), "type": "completion" if kind == "long" else "chat"}],
        "val_set_size": 0.02, "adapter": adapter, "lora_r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
        "lora_target_modules": QVO, "sequence_len": seq, "micro_batch_size": micro, "gradient_accumulation_steps": 1,
        "max_steps": steps, "warmup_steps": 0, "save_steps": 10_000, "gpu_memory_gib": CAP_GIB, "device": device,
        "target_gpu_memory_gib": 16,  # the 14B's Q4_K_M alone is 8.3 GiB: above the default 8 GiB inference target
        "gradient_checkpointing": trainer != "loraship-fast",
        # lean: the least GPU memory, so checkpointed activations always wait in CPU memory (as Unsloth's do);
        # the others only where that is what makes the plan fit.
        "offload_activations": "on" if trainer == "loraship-lean" else "auto",
        "packing": {"loraship-packed": "on", "loraship-padded": "off"}.get(trainer, "auto"),
    }


def step_tokens(examples: list[dict], micro: int, accum: int, seed: int, steps: int) -> list[int]:
    """Non-pad tokens of each optimizer step (the same examples packed or padded: loraship/packing.py)."""
    from loraship.packing import epoch_steps, steps_per_epoch

    per_epoch = steps_per_epoch(len(examples), micro, accum)
    lengths = [len(e["input_ids"]) for e in examples]
    out = []
    for s in range(steps):
        epoch, within = divmod(s, per_epoch)
        group = epoch_steps(lengths, micro, accum, seed, epoch, None)[within]
        out.append(sum(lengths[i] for rows in group for row in rows for i in row))
    return out


def run_loraship(case, trainer, model_dir, data, root, args, device) -> dict:
    from loraship.config import parse_config
    from loraship.data import load_splits
    from loraship.stages import plan as plan_stage
    from loraship.stages import train as train_stage
    from transformers import AutoTokenizer

    config = parse_config(loraship_config(case, trainer, model_dir, data, root, args.steps, device))
    clock = StepClock(device, args.warmup if args.profile is not None else None)
    plan_stage.run(config)
    metrics = train_stage.run(config)["metrics"]
    train, _ = load_splits(config, AutoTokenizer.from_pretrained(model_dir))
    st = metrics["strategy"]
    tokens = step_tokens(train.examples, st["micro_batch_size"], st["gradient_accumulation_steps"], config.seed,
                         metrics["steps"])
    mem = metrics["measured_memory"]
    history = [json.loads(x) for x in (Path(config.workdir) / config.run_name / "train" / "loss_history.jsonl")
               .read_text().splitlines()]
    return {"reserved_gib": mem.get("peak_reserved_gib"), "allocated_gib": mem.get("peak_allocated_gib"),
            "tokens_per_s": clock.tokens_per_s(tokens, args.warmup),
            "fits_32gib": not metrics["oom_retries"] if device == "cuda" else None,
            "strategy": metrics["trained_as"], "strategy_reason": metrics["strategy_reason"],
            "packing": metrics["packing"], "oom_retries": metrics["oom_retries"],
            "predicted_reserved_gib": metrics["predicted_reserved_gib"], "strategy_detail": st,
            **clock.timing(), "loss_curve": [h["loss"] for h in history]}


def run_peer(case, trainer, model_dir, data, root, args, device) -> dict:
    """Unsloth or HF + PEFT + Liger on the examples loraship's data code makes, in loraship's order."""
    if trainer == "unsloth":
        import unsloth  # noqa: F401  (before transformers, as Unsloth requires)
    import torch
    from transformers import AutoTokenizer

    from loraship.config import parse_config
    from loraship.data import load_splits
    from loraship.packing import collate_padded, epoch_steps, steps_per_epoch

    _shape, adapter, r, micro, seq, _kind = spec(case, device == "cpu")
    config = parse_config(loraship_config(case, "loraship-lean", model_dir, data, root, args.steps, device))
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = load_splits(config, tok)[0].examples
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if trainer == "unsloth":
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=str(model_dir), max_seq_length=seq, dtype=dtype,
                                                     load_in_4bit=adapter == "qlora")
        model = FastLanguageModel.get_peft_model(model, r=r, lora_alpha=2 * r, lora_dropout=0.0, bias="none",
                                                 target_modules=QVO, use_gradient_checkpointing="unsloth",
                                                 random_state=config.seed)
        FastLanguageModel.for_training(model)
        strategy = f"Unsloth {unsloth.__version__}: {'QLoRA (NF4)' if adapter == 'qlora' else 'bf16 LoRA'}, " \
                   "unsloth gradient checkpointing"
    else:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        kernels = "no Liger (CPU)"
        if device == "cuda":
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama()  # every kernel it offers: rope, rms_norm, swiglu, fused linear CE
            kernels = "all Liger kernels"
        kwargs = {"dtype": dtype} | ({"device_map": {"": 0}} if device == "cuda" else {})
        if adapter == "qlora":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                               bnb_4bit_use_double_quant=True,
                                                               bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.config.use_cache = False
        model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=QVO,
                                                 bias="none", task_type="CAUSAL_LM"))
        model.train()
        strategy = f"HF + PEFT, {'QLoRA (NF4)' if adapter == 'qlora' else 'bf16 LoRA'}, {kernels}, checkpointing on"
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate)
    lengths = [len(e["input_ids"]) for e in examples]
    per_epoch = steps_per_epoch(len(examples), micro, 1)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(device, args.warmup if args.profile is not None else None)
    tokens, losses = [], []
    for s in range(args.steps):
        epoch, within = divmod(s, per_epoch)
        (rows,) = epoch_steps(lengths, micro, 1, config.seed, epoch, None)[within]
        batch = [examples[i] for row in rows for i in row]
        ids, labels, mask = (t.to(device) for t in collate_padded(batch, tok.pad_token_id or 0))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens.append(int(mask.sum()))
        losses.append(round(float(loss.detach()), 6))
    out = {"tokens_per_s": clock.tokens_per_s(tokens, args.warmup), "strategy": strategy, "loss_curve": losses,
           "reserved_gib": None, "allocated_gib": None, "fits_32gib": None, **clock.timing()}
    if device == "cuda":
        out.update(reserved_gib=torch.cuda.max_memory_reserved() / GIB, allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                   fits_32gib=True)
    return out


def run_one(case: str, trainer: str, root: Path, args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and trainer.startswith("loraship"):
        # What the train stage sets itself, set here because the cap below starts CUDA first.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ["HF_HUB_OFFLINE"] = "1"  # local folders only: Unsloth otherwise asks the hub
    import torch

    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(CAP_GIB * GIB / torch.cuda.get_device_properties(0).total_memory)
    row = {"case": case, "trainer": trainer, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
           "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")}
    shape_name, _adapter, _r, _micro, seq, kind = spec(case, args.smoke)
    model_dir = args.models / ("tiny" if args.smoke else shape_name)
    data = make_data(args.tokenizer, root / "data", seq, args.rows, kind)
    work = root / f"{case}-{trainer}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        runner = run_loraship if trainer.startswith("loraship") else run_peer
        row.update(ok=True, **runner(case, trainer, model_dir, data, work, args, device))
    except Exception as e:  # a bench records failures instead of stopping
        oom = type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e).lower()
        row.update(ok=False, fits_32gib=False if oom and device == "cuda" else None, reserved_gib=None,
                   allocated_gib=None, tokens_per_s=None, strategy=None,
                   error=f"{type(e).__name__}: {str(e)[:500]}", trace=traceback.format_exc()[-3000:])
    return row


# ---------------------------------------------------------------------------------------------
# Parent: every pair in its own process, then the table
# ---------------------------------------------------------------------------------------------
def max_loss_rel_diff(curve: list[float], base: list[float]) -> float:
    """The largest step-by-step relative difference between two loss curves."""
    return max(abs(a / b - 1) for a, b in zip(curve, base))


def ratios(rows: list[dict]) -> list[dict]:
    """Each loraship row against Unsloth (packing: packed against padded) in the same run."""
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["trainer"]: r for r in rows if r["case"] == case and r.get("ok")}
        base = by.get("loraship-padded" if case == "packing" else "unsloth")
        for name, r in by.items():
            if not name.startswith("loraship") or base is None or r is base:
                continue
            item = {"case": case, "trainer": name, "against": base["trainer"]}
            if r.get("tokens_per_s") and base.get("tokens_per_s"):
                item["tokens_per_s_ratio"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            if r.get("reserved_gib") and base.get("reserved_gib"):
                item["reserved_ratio"] = round(r["reserved_gib"] / base["reserved_gib"], 3)
            if case == "packing" and r.get("loss_curve") and base.get("loss_curve"):
                item["max_loss_rel_diff"] = max_loss_rel_diff(r["loss_curve"], base["loss_curve"])
            out.append(item)
    return out


def targets(rows: list[dict]) -> list[dict]:
    """Issue #10's targets, each met (True), missed (False) or not measured (None: a row is missing or failed)."""
    by = {(r["case"], r["trainer"]): r for r in rows if r.get("ok")}

    def ratio(case, trainer, key, base="unsloth"):
        a, b = by.get((case, trainer), {}).get(key), by.get((case, base), {}).get(key)
        return round(a / b, 3) if a and b else None

    def check(target, figures, *conditions):
        met = None if any(v is None for v in figures.values()) else all(conditions)
        return {"target": target, "met": met, **figures}

    out = []
    for case in ("qwen2-7b-lora", "qwen2-7b-qlora", "qwen2-14b-qlora"):
        mem, speed = ratio(case, "loraship-lean", "reserved_gib"), ratio(case, "loraship-lean", "tokens_per_s")
        out.append(check(f"{case}: lean reserved <= 1.0x Unsloth at tokens/s >= 1.0x",
                         {"case": case, "reserved_ratio": mem, "tokens_per_s_ratio": speed},
                         mem is not None and mem <= 1.0, speed is not None and speed >= 1.0))
    fast = by.get(("qwen2-7b-lora", "loraship-fast"), {})
    speed = ratio("qwen2-7b-lora", "loraship-fast", "tokens_per_s")
    out.append(check("qwen2-7b-lora: fast tokens/s >= 1.15x Unsloth within 32 GiB",
                     {"case": "qwen2-7b-lora", "tokens_per_s_ratio": speed, "fits_32gib": fast.get("fits_32gib")},
                     speed is not None and speed >= 1.15, fast.get("fits_32gib") is True))
    lean = by.get(("qwen2-14b-lora", "loraship-lean"), {})
    speed = ratio("qwen2-14b-lora", "loraship-lean", "tokens_per_s")
    trained = lean.get("strategy")
    out.append(check("qwen2-14b-lora: bf16 (offload if needed) with >= 2 GiB of 32 spare at >= 0.9x Unsloth",
                     {"case": "qwen2-14b-lora", "strategy": trained, "reserved_gib": lean.get("reserved_gib"),
                      "tokens_per_s_ratio": speed},
                     bool(trained) and "QLoRA" not in trained, (lean.get("reserved_gib") or 99) <= CAP_GIB - 2,
                     speed is not None and speed >= 0.9))
    long = by.get(("qwen2-14b-lora-8k", "loraship-lean"), {})
    out.append(check("qwen2-14b-lora: bf16 still fits at 1 x 8192",
                     {"case": "qwen2-14b-lora-8k", "strategy": long.get("strategy"),
                      "fits_32gib": long.get("fits_32gib")},
                     "QLoRA" not in (long.get("strategy") or "QLoRA"), long.get("fits_32gib") is True))
    speed = ratio("packing", "loraship-packed", "tokens_per_s", base="loraship-padded")
    a, b = (by.get(("packing", t), {}).get("loss_curve") for t in ("loraship-packed", "loraship-padded"))
    # bf16 noise: the same tokens in the same steps, summed in another order.
    loss_diff = round(max_loss_rel_diff(a, b), 4) if a and b else None
    out.append(check("packing: non-pad tokens/s >= 1.5x padded, loss curve equal within noise (<= 2%)",
                     {"case": "packing", "tokens_per_s_ratio": speed, "max_loss_rel_diff": loss_diff},
                     speed is not None and speed >= 1.5, loss_diff is not None and loss_diff <= 0.02))
    return out


def bench_config(row: dict):
    """The loraship Config a row's case and trainer ran with (paths are placeholders: planning reads none)."""
    from loraship.config import parse_config

    return parse_config(loraship_config(row["case"], row["trainer"], Path("m"), Path("d.jsonl"), Path("r"), 10, "cuda"))


def trained_strategy(row: dict, cfg) -> dict:
    """The strategy a loraship row trained with: its strategy_detail, or read back from the words of older rows."""
    import re

    from loraship import memory

    if row.get("strategy_detail"):
        return row["strategy_detail"]
    words = row["strategy"]
    k = int(re.search(r"checkpointing (\d+) of", words).group(1))
    off = re.search(r"(\d+) of \d+ decoder layers", words)
    return dict(memory.strategy_from_config(cfg), adapter="qlora" if words.startswith("QLoRA") else "lora",
                checkpointed_layers=k, gradient_checkpointing=k > 0, offload_layers=int(off.group(1)) if off else 0,
                micro_batch_size=int(re.search(r"micro-batch (\d+)", words).group(1)),
                gradient_accumulation_steps=int(re.search(r"micro-batch \d+ x (\d+)", words).group(1)),
                fused_loss=words.find("fused loss") >= 0,
                offload_activations=memory.ACTIVATIONS_IN_CPU in words)


def planner_scores(rows: list[dict]) -> dict:
    """The current planner (loraship/memory.py) against each loraship row's measured peak reserved, at the strategy
    that row trained with: issue #10's item 5 on rows measured through the train stage itself."""
    import statistics

    from loraship import memory

    out = []
    for r in rows:
        if not (r.get("ok") and r["trainer"].startswith("loraship") and r.get("reserved_gib")):
            continue
        shape_name = CASES[r["case"]][0]
        mc = json.loads((ROOT / "examples" / "models" / shape_name / "config.json").read_text())
        cfg = bench_config(r)
        est = memory.estimate(mc, cfg, trained_strategy(r, cfg))
        pred = est["predicted_reserved_gib"]
        out.append({"case": r["case"], "trainer": r["trainer"], "measured_reserved_gib": round(r["reserved_gib"], 2),
                    "predicted_in_run_gib": r.get("predicted_reserved_gib"), "predicted_now_gib": round(pred, 2),
                    "error_now": round(pred / r["reserved_gib"] - 1, 4)})
    errs = [abs(x["error_now"]) for x in out]
    return {"rows": out, "median_abs_error": round(statistics.median(errs), 4) if errs else None,
            "worst_abs_error": round(max(errs), 4) if errs else None, "n": len(out)}


def table(rows: list[dict]) -> str:
    lines = ["| case | trainer | reserved GiB | allocated GiB | tokens/s | fits 32 GiB | strategy |", "|---|---|---|---|---|---|---|"]
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['case']} | {r['trainer']} | {f(r.get('reserved_gib'))} | {f(r.get('allocated_gib'))} | "
                     f"{f(r.get('tokens_per_s'), 0)} | {r.get('fits_32gib')} | {r.get('strategy') or r.get('error', '')[:80]} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="folder with the tiny model's tokenizer files")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--root", type=Path, default=Path("/tmp/loraship-train-bench"), help="models, data, work folders")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--models", type=Path, help="folder for the random checkpoints (default ROOT/models; the 14B "
                   "takes 28 GiB, so /dev/shm where the disk is short)")
    p.add_argument("--trainers", nargs="*", help="default: unsloth loraship-lean loraship-fast hf-liger (in that order)")
    p.add_argument("--skip", nargs="*", default=[],
                   help="trainers left out, everywhere (hf-liger) or in one case (qwen2-7b-qlora:loraship-fast)")
    p.add_argument("--profile", nargs="*", metavar="CASE", help="torch.profiler over two steps after the warm-up: "
                   "each row of the cases named (every case when none is), peers' too, gets its top operators and "
                   "kernels and their total (where its time goes); its tokens/s then carries the profiler's cost")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    p.add_argument("--rows", type=int, default=64, help="training rows per dataset")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per (case, trainer)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape, loraship and HF only: checks the script")
    p.add_argument("--one", nargs=2, metavar=("CASE", "TRAINER"), help=argparse.SUPPRESS)
    p.add_argument("--rescore", action="store_true", help="only rewrite --out's targets and planner scores (the "
                   "planner as it is now, at each row's trained strategy), no training")
    args = p.parse_args()
    if args.rescore:
        result = json.loads(args.out.read_text())
        result.update(ratios=ratios(result["rows"]), targets=targets(result["rows"]), planner=planner_scores(result["rows"]))
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result["planner"][k] for k in ("n", "median_abs_error", "worst_abs_error")}))
        return
    args.tokenizer = args.tokenizer.resolve()
    args.models = args.models or args.root / "models"
    if args.one:
        row = run_one(*args.one, args.root, args)
        args.out.write_text(json.dumps(row))
        return
    if args.smoke:
        args.steps, args.warmup, args.rows = min(args.steps, 4), 1, min(args.rows, 24)
    import torch

    device = "cpu" if args.smoke else "cuda"
    rows, builds = [], {}

    def write() -> dict:
        # After every row, so a run cut short (a GPU call's time limit) still leaves what it measured.
        result = {"device": rows[0].get("device") if rows else None, "date": time.strftime("%Y-%m-%d"),
                  "steps": args.steps, "warmup": args.warmup, "cap_gib": None if args.smoke else CAP_GIB,
                  "model_build_s": builds, "rows": rows, "ratios": ratios(rows), "targets": targets(rows),
                  "planner": planner_scores(rows) if not args.smoke else None}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(args.out)
        return result

    for case in args.cases:
        name = CASES[case][0]
        trainers = args.trainers or TRAINERS.get(case, DEFAULT_TRAINERS)
        if name not in builds:  # each shape when its first case comes, so the first rows start early
            started = time.time()
            try:
                make_model(TINY if args.smoke else shape(name), args.tokenizer,
                           args.models / ("tiny" if args.smoke else name), device)
                builds[name] = round(time.time() - started, 1)
            except Exception as e:  # e.g. the disk full: record it, go on with the other shapes
                builds[name] = f"{type(e).__name__}: {str(e)[:300]}"
            if device == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps({"model": name, "build_s": builds[name]}), flush=True)
        if isinstance(builds[name], str):
            rows += [{"case": case, "trainer": t, "ok": False, "error": f"model build failed: {builds[name]}"}
                     for t in trainers]
            write()
            continue
        for trainer in trainers:
            if args.smoke and trainer == "unsloth" or trainer in args.skip or f"{case}:{trainer}" in args.skip:
                continue
            part = args.root / f"row-{case}-{trainer}.json"
            part.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--tokenizer", str(args.tokenizer), "--out", str(part), "--root",
                   str(args.root), "--models", str(args.models), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--rows", str(args.rows), "--one", case, trainer] + (["--smoke"] if args.smoke else []) \
                + (["--profile"] if args.profile is not None and (not args.profile or case in args.profile) else [])
            started = time.time()
            try:
                subprocess.run(cmd, timeout=args.timeout, cwd=ROOT)
            except subprocess.TimeoutExpired:
                pass
            row = json.loads(part.read_text()) if part.exists() else {
                "case": case, "trainer": trainer, "ok": False, "error": "process died or timed out"}
            row["wall_s"] = round(time.time() - started, 1)
            print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "loss_curve", "profile", "step_s")}), flush=True)
            rows.append(row)
            write()
    result = write()
    print(table(rows))
    print(json.dumps(result["ratios"], indent=2))
    for t in result["targets"]:
        print({True: "MET     ", False: "MISSED  ", None: "NOT RUN "}[t["met"]], json.dumps(t))


if __name__ == "__main__":
    main()
