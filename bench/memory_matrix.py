"""Measure LoRA/QLoRA training memory on a real GPU and compare it with loraship.planning.estimate's plan.

Modes:
  python3 bench/memory_matrix.py measure --out DIR      # on the GPU: every config in a fresh process
  python3 bench/memory_matrix.py smoke                   # on CPU: one tiny config, checks the script runs
  python3 bench/memory_matrix.py measure-stage --out DIR --only 1,3,...   # on the GPU, through the train stage
  python3 bench/memory_matrix.py smoke-stage --out DIR   # on CPU: the tiny shape, 2 steps, through the train stage
  python bench/memory_matrix.py analyze RAW.json         # on a laptop: add predictions, fit/eval split,
                                                         # write bench/results/memory_matrix.json + .md

Measurement: random weights in real shapes, built under torch.device("cuda") in bf16; QLoRA
replaces every decoder Linear by bitsandbytes Linear4bit (NF4, double quant, blocksize 64) and
quantizes random bf16 weights one matrix at a time, as from_pretrained does. model.train() is
called (eval mode silently skips checkpointing); use_cache is off; 2 warm-up steps (AdamW state
appears at step 1), then peak stats are reset and one step is measured. Each config runs uncapped
first (its natural peak, so errors can be computed even where a 32 GiB card would fail); configs
whose peak comes near 32 GiB run again under set_per_process_memory_fraction(32 GiB / total).

measure-stage measures what the train stage itself does (issue #10, item 5): per shape, a random bf16 checkpoint on
disk (as LlamaForCausalLM, Qwen2 shapes with attention_bias=True; the tiny Llama's tokenizer), then per config a fresh
process runs loraship.stages.plan.run + loraship.stages.train.run on a config that forces the strategy (generous
gpu_memory_gib, fallback [], packing off, completion rows longer than sequence_len). The row's peak is the max of the
eval before training (model load included) and training, from the train manifest; its prediction is the plan's.
Raw rows carry "through": "train-stage"; `analyze` on such a file scores them (no refit).
GPU: bench/train_kit/matrix_call.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
CAP_GIB = 32.0

# Public config.json shapes (Qwen2-7B/14B and Meta-Llama-3-8B config.json values; examples/models/).
SHAPES = {
    "qwen2-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen2-14b": dict(
        model_type="qwen2",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32768,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        sliding_window=None,
    ),
    "qwen2-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    # CPU smoke test only.
    "tiny": dict(
        model_type="qwen2",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    ),
}


def _c(shape, adapter, r, targets, seq, mb, ckpt=True, fused=False):
    return dict(
        shape=shape,
        adapter=adapter,
        lora_r=r,
        targets=targets,
        sequence_len=seq,
        micro_batch_size=mb,
        gradient_checkpointing=ckpt,
        fused_loss=fused,
    )


# Rows 0, 3, 11, 17, 19 repeat earlier measured configs (rank 64 q/v/o, 2 x 4096) as cross-checks.
MATRIX = [
    _c("qwen2-7b", "lora", 64, "qvo", 4096, 2),
    _c("qwen2-7b", "lora", 64, "qvo", 4096, 2, fused=True),
    _c("qwen2-7b", "lora", 64, "all-linear", 4096, 2),
    _c("qwen2-7b", "qlora", 64, "qvo", 4096, 2),
    _c("qwen2-7b", "qlora", 64, "qvo", 4096, 2, fused=True),
    _c("qwen2-7b", "lora", 8, "qvo", 512, 1, ckpt=False),
    _c("qwen2-7b", "lora", 16, "all-linear", 1024, 2, ckpt=False, fused=True),
    _c("qwen2-7b", "lora", 128, "all-linear", 8192, 1, fused=True),
    _c("qwen2-7b", "qlora", 128, "all-linear", 2048, 4, fused=True),
    _c("qwen2-7b", "lora", 32, "qvo", 2048, 4),
    _c("qwen2-7b", "qlora", 8, "qvo", 1024, 1, ckpt=False),
    _c("llama-3-8b", "lora", 64, "qvo", 4096, 2),
    _c("llama-3-8b", "lora", 64, "qvo", 4096, 2, fused=True),
    _c("llama-3-8b", "qlora", 16, "all-linear", 8192, 1, fused=True),
    _c("llama-3-8b", "lora", 8, "all-linear", 512, 4, ckpt=False, fused=True),
    _c("llama-3-8b", "qlora", 32, "qvo", 2048, 2),
    _c("llama-3-8b", "lora", 128, "qvo", 8192, 1),
    _c("qwen2-14b", "qlora", 64, "qvo", 4096, 2),
    _c("qwen2-14b", "qlora", 64, "qvo", 4096, 2, fused=True),
    _c("qwen2-14b", "lora", 64, "qvo", 4096, 2, fused=True),
    _c("qwen2-14b", "qlora", 16, "all-linear", 8192, 1, fused=True),
    _c("qwen2-14b", "lora", 8, "qvo", 1024, 1),
    _c("qwen2-14b", "qlora", 128, "all-linear", 2048, 1, ckpt=False, fused=True),
    _c("qwen2-7b", "qlora", 16, "all-linear", 4096, 1),
]
# Measured in a second GPU call, after CAL was fitted on rows 0-23: a true out-of-sample check.
FIRST_VALIDATION_INDEX = len(MATRIX)
MATRIX += [
    _c("mistral-7b", "lora", 32, "all-linear", 4096, 2),
    _c("mistral-7b", "qlora", 64, "qvo", 2048, 4, fused=True),
    _c("qwen2-7b", "lora", 16, "qvo", 8192, 1),
    _c("llama-3-8b", "qlora", 64, "all-linear", 4096, 4),
    _c("qwen2-14b", "qlora", 32, "qvo", 4096, 1),
    _c("qwen2-14b", "lora", 16, "all-linear", 2048, 1, fused=True),
    _c("llama-3-8b", "lora", 32, "qvo", 2048, 2, ckpt=False, fused=True),
    _c("qwen2-7b", "qlora", 64, "qvo", 8192, 2, fused=True),
    _c("qwen2-0.5b", "lora", 16, "all-linear", 2048, 4, ckpt=False),
    _c("llama-3-8b", "lora", 16, "qvo", 1024, 4),
]
# Third GPU call, same constants: configurations the planner puts just under the fit threshold
# (predicted total 27.9-29.4 GiB of 32 with the 8% margin), each also run under the 32 GiB cap.
FIRST_THRESHOLD_INDEX = len(MATRIX)
MATRIX += [
    _c("llama-3-8b", "lora", 128, "all-linear", 1024, 4),
    _c("qwen2-14b", "qlora", 32, "all-linear", 1024, 1, ckpt=False, fused=True),
    _c("qwen2-7b", "lora", 64, "all-linear", 1024, 1, ckpt=False),
    _c("mistral-7b", "qlora", 128, "qvo", 8192, 4),
    _c("mistral-7b", "lora", 64, "all-linear", 4096, 4),
    _c("qwen2-14b", "qlora", 128, "all-linear", 1024, 4),
    _c("qwen2-7b", "lora", 64, "all-linear", 4096, 4, fused=True),
    _c("qwen2-14b", "qlora", 32, "all-linear", 4096, 4, fused=True),
    _c("qwen2-7b", "qlora", 8, "all-linear", 8192, 4, fused=True),
    _c("llama-3-8b", "qlora", 128, "all-linear", 2048, 4),
]
if os.environ.get("MEMORY_MATRIX_SMOKE"):  # CPU check of the orchestration: tiny shapes, no GPU
    MATRIX = [_c("tiny", "lora", 8, "qvo", 64, 2), _c("tiny", "qlora", 8, "all-linear", 64, 1, ckpt=False)]

QVO = ["q_proj", "v_proj", "o_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config_name(spec: dict) -> str:
    return (
        f"{spec['shape']} {spec['adapter']} r{spec['lora_r']} {spec['targets']} {spec['micro_batch_size']}x"
        f"{spec['sequence_len']} ckpt={'on' if spec['gradient_checkpointing'] else 'off'} "
        f"loss={'fused' if spec['fused_loss'] else 'hf'}"
    )


# ---------------------------------------------------------------------------------------------
# One configuration, in this process (called in a fresh subprocess by `measure`).
# ---------------------------------------------------------------------------------------------
def _build(spec: dict, device: str):
    import torch
    import transformers

    shape = dict(SHAPES[spec["shape"]])
    mcfg = transformers.AutoConfig.for_model(shape.pop("model_type"), **shape)
    mcfg.use_cache = False  # a training forward with use_cache keeps every layer's K/V
    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    if spec["adapter"] == "lora":
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(mcfg, **kw)
    import bitsandbytes as bnb

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(mcfg, **kw)
    decoder = model.model.layers
    for layer in decoder:
        for name, mod in list(layer.named_modules()):
            if not isinstance(mod, torch.nn.Linear):
                continue
            parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
            q = bnb.nn.Linear4bit(
                mod.in_features,
                mod.out_features,
                bias=mod.bias is not None,
                compute_dtype=torch.bfloat16,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            w = torch.empty(mod.out_features, mod.in_features, dtype=torch.bfloat16, device=device).normal_(0, 0.02)
            q.weight = bnb.nn.Params4bit(
                w, requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64, module=q
            ).to(device)
            del w
            if mod.bias is not None:
                q.bias = torch.nn.Parameter(
                    torch.zeros(mod.out_features, dtype=torch.bfloat16, device=device), requires_grad=False
                )
            setattr(parent, name.rsplit(".", 1)[-1], q)
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            t = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
            t = t.fill_(1.0) if "norm" in name else t.normal_(0, 0.02)
            setattr(owner, name.rsplit(".", 1)[-1], torch.nn.Parameter(t, requires_grad=False))
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    if mcfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, b in list(model.named_parameters()) + list(model.named_buffers()) if b.is_meta]
    if left:
        raise RuntimeError(f"still on meta after materialising: {left[:5]}")
    model.is_loaded_in_4bit = True  # PEFT dispatches its bnb LoRA layer on this flag
    return model


def run_one(spec: dict, cap_gib: float | None, device: str) -> dict:
    import torch
    import peft

    cuda = device == "cuda"
    rec: dict = {"config": config_name(spec), "spec": spec, "cap_gib": cap_gib}
    if cuda and cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / total)
    phase = "load"
    try:
        t0 = time.time()
        model = _build(spec, device)
        if cuda:
            torch.cuda.synchronize()
            rec["weights_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        rec["load_s"] = round(time.time() - t0, 1)
        targets = QVO if spec["targets"] == "qvo" else ALL
        lcfg = peft.LoraConfig(
            r=spec["lora_r"],
            lora_alpha=2 * spec["lora_r"],
            lora_dropout=0.05,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lcfg)
        if spec["gradient_checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        causal = model.base_model.model
        trainable = [p for p in model.parameters() if p.requires_grad]
        rec["lora_params"] = sum(p.numel() for p in trainable)
        rec["lora_dtype"] = str(trainable[0].dtype)
        opt = torch.optim.AdamW(trainable, lr=1e-4)
        flce = None
        if spec["fused_loss"]:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            flce = LigerFusedLinearCrossEntropyLoss()
        V, h = causal.config.vocab_size, causal.config.hidden_size
        ids = torch.randint(0, V, (spec["micro_batch_size"], spec["sequence_len"]), device=device)

        def step():
            if flce is None:
                loss = model(input_ids=ids, labels=ids).loss  # logits die with the output object
            else:
                hs = causal.model(input_ids=ids).last_hidden_state
                loss = flce(causal.lm_head.weight, hs[:, :-1].reshape(-1, h), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        for i in range(2):
            phase = f"warmup step {i + 1}"
            rec[f"loss_{i + 1}"] = step()
        if cuda:
            torch.cuda.synchronize()
            rec["warmup_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            rec["warmup_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        phase = "measured step"
        t1 = time.time()
        rec["loss_3"] = step()
        if cuda:
            torch.cuda.synchronize()
            rec["step_s"] = round(time.time() - t1, 3)
            rec["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            rec["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            rec["reserved_now_gib"] = torch.cuda.memory_reserved() / GIB
            stats = torch.cuda.memory_stats()
            rec["num_alloc_retries"] = stats.get("num_alloc_retries", 0)
            rec["context_gib"] = _context_gib(torch.cuda.memory_reserved())
        rec["oom"] = False
    except torch.OutOfMemoryError as e:
        rec.update(oom=True, oom_phase=phase, error=str(e).splitlines()[0][:300])
    return rec


def _context_gib(reserved: int) -> float | None:
    """CUDA context = this process's NVML usage minus torch's reserved."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory:
                return (p.usedGpuMemory - reserved) / GIB
    except Exception:  # NVML per-process figures are missing in some sandboxes
        return None
    return None


# ---------------------------------------------------------------------------------------------
# Orchestration on the GPU: each run in a fresh subprocess, a few at a time within GPU memory.
# ---------------------------------------------------------------------------------------------
def _rough_gib(spec: dict) -> float:
    """Deliberately generous admission estimate (not the planner): keeps parallel runs inside 141 GiB."""
    s = SHAPES[spec["shape"]]
    h, L, f, V = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"], s["vocab_size"]
    params = L * (4 * h * h + 3 * h * f) + 2 * V * h
    w = params * (2.0 if spec["adapter"] == "lora" else 0.6)
    T = spec["sequence_len"] * spec["micro_batch_size"]
    layer = T * (16 * h + 12 * f)
    act = T * 2 * h * L + layer if spec["gradient_checkpointing"] else L * layer
    loss = 0 if spec["fused_loss"] else 16 * T * V
    return 1.4 * (w + act + loss) / GIB + 3


def measure(
    out: Path, deadline_s: float, parallel: int, gpu_gib: float, only: list[int] | None, always_cap: bool = False
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    raw_path = out / "memory_matrix_raw.json"
    rows: list[dict] = []
    if raw_path.exists():
        rows = json.loads(raw_path.read_text())["rows"]
    done = {(r["index"], r["cap_gib"]) for r in rows}
    todo = [(i, None) for i in (only if only is not None else range(len(MATRIX))) if (i, None) not in done]
    if always_cap:
        todo += [(i, CAP_GIB) for i, _ in todo]
    todo.sort(key=lambda j: -_rough_gib(MATRIX[j[0]]))
    start = time.time()
    running: list[tuple[int, float | None, float, subprocess.Popen]] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def save():
        raw_path.write_text(json.dumps({"gpu": _gpu_name(), "rows": rows}, indent=1))

    while todo or running:
        for job in list(running):
            i, cap, t0, proc = job
            age = time.time() - t0
            # Per-run limit, and a hard stop so the whole call ends inside the device's 10 minutes.
            if proc.poll() is None and age < 240 and time.time() - start < deadline_s + 110:
                continue
            if proc.poll() is None:
                proc.kill()
            running.remove(job)
            log = Path(f"/tmp/memory_matrix_{i}_{cap}.log").read_text(errors="replace")
            line = [ln for ln in log.splitlines() if ln.startswith("{")]
            rec = (
                json.loads(line[-1])
                if line
                else {
                    "config": config_name(MATRIX[i]),
                    "spec": MATRIX[i],
                    "cap_gib": cap,
                    "failed": True,
                    "error": log[-800:],
                }
            )
            rec.update(index=i, wall_s=round(age, 1))
            rows.append(rec)
            save()
            print(
                f"[{time.time() - start:5.0f}s] #{i} cap={cap} oom={rec.get('oom')} "
                f"alloc={rec.get('peak_allocated_gib', 0):.2f} res={rec.get('peak_reserved_gib', 0):.2f} "
                f"ctx={rec.get('context_gib')} {rec['config']} {rec.get('error', '')[:200]}",
                flush=True,
            )
            # Near or over 32 GiB: also run under the cap, unless peak allocated alone exceeds it.
            if cap is None and not always_cap and not rec.get("failed") and not rec.get("oom"):
                if rec.get("peak_reserved_gib", 0) > CAP_GIB - 4 and rec["peak_allocated_gib"] <= CAP_GIB:
                    todo.append((i, CAP_GIB))
        in_use = sum(_rough_gib(MATRIX[i]) if cap is None else CAP_GIB + 2 for i, cap, _, _ in running)
        while todo and len(running) < parallel and time.time() - start < deadline_s:
            i, cap = todo[0]
            need = _rough_gib(MATRIX[i]) if cap is None else CAP_GIB + 2
            if running and in_use + need > gpu_gib:
                break
            todo.pop(0)
            cmd = [sys.executable, __file__, "one", json.dumps(MATRIX[i])] + (["--cap", str(cap)] if cap else [])
            if os.environ.get("MEMORY_MATRIX_SMOKE"):
                cmd += ["--device", "cpu"]
            # A log file, not a pipe: a chatty child must never block on a full pipe.
            logf = open(f"/tmp/memory_matrix_{i}_{cap}.log", "w")
            running.append(
                (i, cap, time.time(), subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env))
            )
            in_use += need
        if todo and not running and time.time() - start >= deadline_s:
            print(f"deadline: {len(todo)} runs not started: {todo}", flush=True)
            break
        time.sleep(1)
    save()


def _gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip()
    except Exception:
        return "unknown"


# ---------------------------------------------------------------------------------------------
# Analysis on CPU: predictions from loraship.planning.estimate, fit/eval split, JSON + markdown table.
# ---------------------------------------------------------------------------------------------
def _cfg_for(spec: dict):
    from loraship.config import Config

    return Config(
        base_model="bench",
        datasets=[{"path": "bench.jsonl", "type": "completion"}],
        adapter=spec["adapter"],
        lora_r=spec["lora_r"],
        lora_alpha=2 * spec["lora_r"],
        lora_target_modules=QVO if spec["targets"] == "qvo" else "all-linear",
        sequence_len=spec["sequence_len"],
        micro_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=1,
        gradient_checkpointing=spec["gradient_checkpointing"],
        fused_loss="on" if spec["fused_loss"] else "off",
        gpu_memory_gib=CAP_GIB,
    )


def predict(spec: dict, program: str = "harness") -> dict:
    from loraship.planning.estimate import estimate
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy_record import Strategy

    mc = dict(SHAPES[spec["shape"]])
    return estimate(shape_from_config(mc), _cfg_for(spec), Strategy.from_config(_cfg_for(spec)), program)


def is_fit_row(index: int) -> bool:
    """Rows used to fit constants: every other matrix row (even index); odd rows are held out."""
    return index < FIRST_VALIDATION_INDEX and index % 2 == 0


def analyze(raw_path: Path, results: Path, md: Path) -> dict:
    raw = json.loads(raw_path.read_text())
    by_index: dict[int, dict] = {}
    for r in raw["rows"]:
        slot = by_index.setdefault(r["index"], {})
        slot["capped" if r["cap_gib"] else "uncapped"] = r
    rows = []
    for i in sorted(by_index):
        un, capped = by_index[i].get("uncapped"), by_index[i].get("capped")
        if not un or un.get("failed") or un.get("oom"):
            continue
        spec = un["spec"]
        p = predict(spec)
        if capped is not None:
            oom_cap, source = bool(capped.get("oom")), "measured under the 32 GiB cap"
        elif un["peak_allocated_gib"] > CAP_GIB:
            oom_cap, source = True, "inferred: uncapped peak allocated exceeds 32 GiB"
        else:
            oom_cap, source = False, "inferred: uncapped peak reserved stays under 32 GiB - 4"
        err = (p["predicted_reserved_gib"] - un["peak_reserved_gib"]) / un["peak_reserved_gib"]
        rows.append(
            {
                "index": i,
                "config": un["config"],
                "spec": spec,
                "used_for_fit": is_fit_row(i),
                "predicted_reserved_gib": round(p["predicted_reserved_gib"], 2),
                "measured_reserved_gib": round(un["peak_reserved_gib"], 2),
                "predicted_allocated_gib": round(p["predicted_allocated_gib"], 2),
                "measured_allocated_gib": round(un["peak_allocated_gib"], 2),
                "reserved_error_pct": round(100 * err, 1),
                "fits_32gib_predicted": p["fits"],
                "oom_under_32gib_cap": oom_cap,
                "oom_source": source,
                "weights_only_estimate_gib": round(p["weights_only_estimate_gib"], 2),
                "predicted_total_gib": round(p["predicted_total_gib"], 2),
                "measured_context_gib": None if un.get("context_gib") is None else round(un["context_gib"], 2),
                "measured_weights_allocated_gib": round(un.get("weights_allocated_gib", 0), 2),
                "measured_step_s": un.get("step_s"),
                "measured_warmup_peak_reserved_gib": round(un.get("warmup_peak_reserved_gib", 0), 2),
            }
        )

    def summary(sel):
        errs = [abs(r["reserved_error_pct"]) for r in sel]
        if not errs:
            return {"rows": 0}
        return {
            "rows": len(sel),
            "median_abs_error_pct": round(statistics.median(errs), 1),
            "worst_abs_error_pct": round(max(errs), 1),
            "predicted_fit_but_oom": [
                r["config"] for r in sel if r["fits_32gib_predicted"] and r["oom_under_32gib_cap"]
            ],
        }

    out = {
        "gpu": raw.get("gpu"),
        "method": __doc__.strip().splitlines()[0],
        "calibration": "constants in loraship/planning/estimate.py were fitted on the rows with used_for_fit=true "
        "only (even rows of the first GPU call); 'held_out' scores the first call's odd rows; 'validation' "
        "scores rows 24+, configurations measured in later GPU calls after the constants were "
        "fitted and committed ('near_threshold', rows 34+, is the part of it the planner puts just "
        "under the 32 GiB fit threshold, each also run under the cap)",
        "all": summary(rows),
        "fit": summary([r for r in rows if r["used_for_fit"]]),
        "held_out": summary([r for r in rows if not r["used_for_fit"] and r["index"] < FIRST_VALIDATION_INDEX]),
        "validation": summary([r for r in rows if r["index"] >= FIRST_VALIDATION_INDEX]),
        "near_threshold": summary([r for r in rows if r["index"] >= FIRST_THRESHOLD_INDEX]),
        "rows": rows,
    }
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(out, indent=1) + "\n")
    md.write_text(_markdown(out))
    return out


FIT_KEYS = (
    "keep",
    "layer",
    "lora_input_dropout",
    "layer_backward",
    "hf_loss",
    "fused_loss",
    "reserve_loss",
    "reserve_layer",
    "reserve_fixed_gib",
)


def fit(raw_path: Path) -> dict:
    """Fit loraship.planning.estimate.CAL on the fit rows only (coordinate descent on squared relative error)."""
    from loraship.planning.estimate import CAL

    raw = json.loads(raw_path.read_text())
    rows = [
        r
        for r in raw["rows"]
        if r["cap_gib"] is None and not r.get("oom") and not r.get("failed") and is_fit_row(r["index"])
    ]
    ctx = [r["context_gib"] for r in raw["rows"] if r.get("context_gib")]
    if ctx:
        CAL["cuda_context_gib"] = round(statistics.median(ctx), 2)

    def loss() -> float:
        tot = 0.0
        for r in rows:
            p = predict(r["spec"])
            er = (p["predicted_reserved_gib"] - r["peak_reserved_gib"]) / r["peak_reserved_gib"]
            ea = (p["predicted_allocated_gib"] - r["peak_allocated_gib"]) / r["peak_allocated_gib"]
            tot += er * er + ea * ea
        return tot

    best = loss()
    step = 0.5
    while step > 0.005:
        improved = False
        for k in FIT_KEYS:
            for f in (1 + step, 1 / (1 + step)):
                old = CAL[k]
                CAL[k] = old * f
                val = loss()
                if val < best - 1e-9:
                    best, improved = val, True
                else:
                    CAL[k] = old
        if not improved:
            step /= 2
    cal = {k: round(v, 3) for k, v in CAL.items()}
    print(f"fitted on {len(rows)} rows, objective {best:.4f}:", json.dumps(cal))
    return cal


NOTES = """## How it was measured, and what to know

- Commands: `python3 bench/memory_matrix.py measure --out $OUT --deadline-s 420 --parallel 3 --gpu-gib 128`
  (rows 0-23, first GPU call, before calibration), then `fit` on the even rows, constants committed to
  `loraship/planning/estimate.py`, then `measure ... --only 24,...,33` (second GPU call: new shapes Mistral-7B and
  Qwen2-0.5B, new ranks/lengths/batches), then `measure ... --always-cap --only 34,35,36,37,40,41` (third
  call: near the threshold, each run both uncapped and under the cap; 41 did not start before the deadline),
  and `python bench/memory_matrix.py analyze bench/results/memory_matrix_raw.json`.
  Logs: `bench/results/memory_matrix_measure.log`.
- Device software: torch 2.11.0+cu130, transformers 5.17.0, peft 0.21.0, bitsandbytes 0.50.2, liger-kernel 0.8.5.
  Up to 3 configurations ran at once on the one GPU, each in its own process (allocator statistics are per
  process); the 32 GiB cap is `torch.cuda.set_per_process_memory_fraction`.
- "Reserved" is torch's peak reserved; the card must also hold the CUDA context, 0.74 GiB in every run
  (NVML per-process usage minus reserved). `fits 32 (pred.)` means reserved + context + the 8% safety
  margin (2.56 GiB) <= 32 GiB.
- The fused loss is `LigerFusedLinearCrossEntropyLoss` alone, on the base model's last hidden state;
  no other Liger kernels (RMSNorm, SwiGLU, RoPE) were applied, so fused rows are not
  "LoRA + all Liger kernels" rows.
- HF loss: the step is `loss = model(input_ids, labels=labels).loss`, so the output object (and its
  bf16 logits) is gone before backward. Earlier HF-loss measurements were about 2.3 GiB higher in allocated
  at 2 x 4096 Qwen2 tokens (Qwen2-7B LoRA 32.55 vs 30.23 here; QLoRA 23.50 vs 21.20), which is one bf16
  copy of the logits (8192 x 152064 x 2 B = 2.32 GiB): a training loop that keeps the outputs alive
  through backward needs that much more than the plan says.
- QLoRA weights are quantized in memory (every decoder Linear replaced by bitsandbytes Linear4bit, NF4,
  double quant, block 64); Qwen2-7B loads at 5.20 GiB here against 5.30 GiB measured via
  from_pretrained. No `prepare_model_for_kbit_training` (it upcasts embeddings/lm_head to fp32).
- LoRA adapters are fp32 (PEFT's default), dropout 0.05, AdamW; `model.train()`; `use_cache=False`;
  non-reentrant checkpointing.
- The weights-only column is what a weights-only calculator reports (frozen weights alone); it misses
  between 11.5% and 97.4% of the measured peak reserved in these rows (median 58%).
- Allocator reserve grows faster than linearly with the HF loss's logits: the worst rows are the two with
  the most tokens under HF loss. Row 27 (Llama-3-8B QLoRA, 4 x 4096) left 9.35 GiB between reserved and
  allocated and is under-predicted by 7.5% (far over 32 GiB either way); row 37 (Mistral-7B QLoRA, 4 x 8192)
  by 7.0%: predicted 28.62, measured 30.77 reserved, which with the 0.74 GiB context still fits 32 GiB by
  0.49 GiB; its allocated was predicted within 0.1 GiB. The 8% margin is what absorbs this.
  `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` was not measured here.
- CPU cross-check of the activation count (saved-tensor hooks on one Qwen2-shaped decoder layer with PEFT
  LoRA q/v/o, dropout 0): 22,408 bytes saved per token against 22,112 by the planner's formula.
"""


def _markdown(out: dict) -> str:
    lines = [
        "# Training memory: planner vs measured",
        "",
        f"GPU: {out['gpu']}. Produced by `bench/memory_matrix.py` (measure on the GPU, then analyze); "
        "figures in GiB, raw data in `bench/results/memory_matrix.json`. Measured = peak over one training "
        "step after 2 warm-up steps, default allocator, random weights, HF transformers + PEFT, SDPA.",
        "",
        f"{out['calibration']}.",
        "",
        "| split | rows | median abs error (reserved) | worst | predicted to fit 32 GiB but OOM under cap |",
        "|---|---|---|---|---|",
    ]
    for k in ("all", "fit", "held_out", "validation", "near_threshold"):
        s = out[k]
        if s["rows"]:
            lines.append(
                f"| {k} | {s['rows']} | {s['median_abs_error_pct']}% | {s['worst_abs_error_pct']}% | "
                f"{len(s['predicted_fit_but_oom'])} |"
            )
    lines += [
        "",
        "| # | config | fit row | pred. reserved | meas. reserved | error | pred. alloc | meas. alloc "
        "| fits 32 (pred.) | OOM at 32 GiB cap | weights-only |",
        "|" + "---|" * 11,
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['index']} | {r['config']} | {'yes' if r['used_for_fit'] else 'no'} | "
            f"{r['predicted_reserved_gib']:.2f} | {r['measured_reserved_gib']:.2f} | {r['reserved_error_pct']:+.1f}% "
            f"| {r['predicted_allocated_gib']:.2f} | {r['measured_allocated_gib']:.2f} | "
            f"{'yes' if r['fits_32gib_predicted'] else 'no'} | "
            f"{'yes' if r['oom_under_32gib_cap'] else 'no'}{'' if r['oom_source'].startswith('measured') else '*'} | "
            f"{r['weights_only_estimate_gib']:.2f} |"
        )
    lines += [
        "",
        "\\* inferred from the uncapped run (peak allocated above 32 GiB, or peak reserved well under it) "
        "rather than a run under the cap.",
        "",
    ]
    measured = {r["index"] for r in out["rows"]}
    missing = [i for i in range(FIRST_THRESHOLD_INDEX, len(MATRIX)) if i not in measured]
    if missing:
        lines += [
            f"Not measured (device time ran out): rows {', '.join(map(str, missing))} of the script, more "
            "configurations the planner puts just under the fit threshold; run them with "
            f"`measure --always-cap --only {','.join(map(str, missing))}`.",
            "",
        ]
    lines.append(NOTES)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Through the train stage (issue #10, item 5): what `loraship.stages.train` itself does.
# ---------------------------------------------------------------------------------------------
STAGE_GPU_MEMORY_GIB = 1024.0  # generous: the planner keeps every configuration as written
STAGE_RAW = "memory_matrix_stage_raw.json"


def _train_bench():
    """bench/train_bench.py's helpers (random checkpoint on disk, long completion rows), by import."""
    sys.path.insert(0, str(ROOT / "bench"))
    import train_bench

    return train_bench


def stage_dims(shape: str) -> dict:
    """SHAPES[shape] as LlamaForCausalLM dims (Qwen2: attention_bias=True, as bench/train_bench.py builds it;
    Mistral-7B without a sliding window is Llama with head_dim), so the tiny Llama's tokenizer passes the plan."""
    d = dict(SHAPES[shape])
    arch = d.pop("model_type")
    d.pop("sliding_window", None)
    return d | {"attention_bias": arch == "qwen2"}


def stage_config(spec: dict, model_dir: Path, data: Path, work: Path, steps: int, device: str) -> dict:
    """A loraship config that forces the spec's strategy: generous gpu_memory_gib, fallback [], packing off."""
    r = spec["lora_r"]
    return {
        "run_name": "matrix",
        "base_model": str(model_dir),
        "workdir": str(work / "work"),
        "output": str(work / "out"),
        "datasets": [{"path": str(data), "type": "completion"}],
        # (steps + 1) x micro rows: `steps` full micro-batches to train, one for the eval before training.
        "val_set_size": 1.0 / (steps + 1),
        "adapter": spec["adapter"],
        "lora_r": r,
        "lora_alpha": 2 * r,
        "lora_dropout": 0.05,
        "lora_target_modules": QVO if spec["targets"] == "qvo" else "all-linear",
        "sequence_len": spec["sequence_len"],
        "micro_batch_size": spec["micro_batch_size"],
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": spec["gradient_checkpointing"],
        "fused_loss": "on" if spec["fused_loss"] else "off",
        "gpu_memory_gib": STAGE_GPU_MEMORY_GIB,
        "fallback": [],
        "packing": "off",
        "offload_activations": "off",
        "max_steps": steps,
        "warmup_steps": 0,
        "save_steps": 10_000,
        "device": device,
        "min_golden_prompts": 1,  # plan + train only: no verify to give golden prompts to
        "target_gpu_memory_gib": 16,  # a 14B's Q4_K_M alone is 8.3 GiB: above the default 8 GiB inference target
    }


def _same_strategy(got: dict, want: dict, device: str) -> bool:
    keys = [
        "adapter",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "checkpointed_layers",
        "offload_layers",
    ] + (["fused_loss"] if device == "cuda" else [])
    return all(got.get(k) == want.get(k) for k in keys)


def run_stage_one(
    spec: dict, cap_gib: float | None, device: str, models: Path, root: Path, tokenizer: Path, steps: int
) -> dict:
    """One configuration through loraship.stages.plan + loraship.stages.train, in this (fresh) process."""
    if device == "cuda":
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # what the train stage sets
    os.environ["HF_HUB_OFFLINE"] = "1"
    import shutil

    import torch

    rec: dict = {
        "config": config_name(spec),
        "spec": spec,
        "cap_gib": cap_gib,
        "through": "train-stage",
        "steps": steps,
        "device": device,
    }
    cuda = device == "cuda"
    if cuda and cap_gib:
        torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    from loraship.planning.strategy_record import Strategy
    from loraship.config import parse_config
    from loraship.errors import LorashipError
    from loraship.stages import plan as plan_stage
    from loraship.stages import train as train_stage

    tb = _train_bench()
    micro = spec["micro_batch_size"]
    n_rows = (steps + 1) * micro
    data = tb.make_data(tokenizer, root / "data" / f"rows{n_rows}", spec["sequence_len"], n_rows, "long")
    work = root / "work" / f"{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    model_dir = models / spec["shape"]
    config = parse_config(stage_config(spec, model_dir, data, work, steps, device))
    forced = Strategy.from_config(config, SHAPES[spec["shape"]]["num_hidden_layers"]).to_json()
    rec["forced_strategy"] = forced
    # Every peak the train stage reads, in order: in a successful attempt the eval before training's
    # (model load included) comes first, training's last. The manifest keeps only the eval's reserved.
    peaks: list[dict] = []
    original = train_stage.peak_memory

    def recording(dev):
        out = original(dev)
        peaks.append(dict(out))
        return out

    train_stage.peak_memory = recording
    phase = "plan"
    try:
        t0 = time.time()
        plan_stage.run(config)
        plan = json.loads((Path(config.workdir) / config.run_name / "plan" / "plan.json").read_text())
        pm = plan["memory"]
        rec.update(
            plan_strategy=plan["strategy"],
            predicted_reserved_gib=pm.get("predicted_reserved_gib"),
            predicted_allocated_gib=pm.get("predicted_allocated_gib"),
            predicted_total_gib=pm.get("predicted_total_gib"),
            plan_fits=plan.get("fits"),
            plan_reason=plan.get("reason"),
        )
        phase = "train"
        metrics = train_stage.run(config)["metrics"]
        rec["wall_stage_s"] = round(time.time() - t0, 1)
        mem = metrics.get("measured_memory") or {}
        rec.update(
            strategy=metrics["strategy"],
            trained_as=metrics["trained_as"],
            strategy_as_forced=_same_strategy(metrics["strategy"], forced, device),
            oom_retries=len(metrics["oom_retries"]),
            oom_retry_details=metrics["oom_retries"],
            stage_predicted_reserved_gib=metrics.get("predicted_reserved_gib"),
            stage_predicted_allocated_gib=metrics.get("predicted_allocated_gib"),
            cuda_allocator=metrics.get("cuda_allocator"),
            step_s=metrics.get("seconds"),
            tokens_per_s=metrics.get("tokens_per_s"),
            loss_first=metrics.get("first_loss"),
            loss_last=metrics.get("last_loss"),
            train_examples=metrics.get("train_examples"),
            eval_examples=metrics.get("eval_examples"),
            truncated_examples=metrics.get("truncated_examples"),
        )
        if mem:
            rec.update(
                train_peak_reserved_gib=mem.get("peak_reserved_gib"),
                train_peak_allocated_gib=mem.get("peak_allocated_gib"),
                eval_peak_reserved_gib=mem.get("eval_peak_reserved_gib"),
                weights_allocated_gib=mem.get("allocated_after_load_gib"),
            )
            if len(peaks) >= 2 and peaks[-2].get("peak_reserved_gib") == mem.get("eval_peak_reserved_gib"):
                rec["eval_peak_allocated_gib"] = peaks[-2].get("peak_allocated_gib")
            pairs = [
                ("train_peak_reserved_gib", "eval_peak_reserved_gib"),
                ("train_peak_allocated_gib", "eval_peak_allocated_gib"),
            ]
            for name, (a, b) in zip(("peak_reserved_gib", "peak_allocated_gib"), pairs):
                vals = [rec[k] for k in (a, b) if rec.get(k) is not None]
                if vals:
                    rec[name] = max(vals)  # the row's peak: the eval before training included
            rec["peak_phase"] = (
                "eval before training"
                if (rec.get("eval_peak_reserved_gib") or 0) > (rec.get("train_peak_reserved_gib") or 0)
                else "training"
            )
        if cuda:
            rec["reserved_now_gib"] = torch.cuda.memory_reserved() / GIB
            rec["num_alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            rec["context_gib"] = _context_gib(torch.cuda.memory_reserved())
        rec["oom"] = bool(rec["oom_retries"])
    except (LorashipError, torch.OutOfMemoryError) as e:
        oom = isinstance(e, torch.OutOfMemoryError) or "out of GPU memory" in str(e)
        if not oom:
            raise
        rec.update(oom=True, oom_phase=phase, error=str(e).splitlines()[0][:300])
    finally:
        train_stage.peak_memory = original
    return rec


def _build_shape(shape: str, models: Path, tokenizer: Path, device: str) -> float:
    """The random bf16 checkpoint (safetensors + the tiny Llama's tokenizer) for `shape`, in a fresh process."""
    if (models / shape / "config.json").is_file():
        return 0.0
    t0 = time.time()
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import memory_matrix as m; from pathlib import "
        f"Path; m._train_bench().make_model(m.stage_dims({shape!r}), Path({str(tokenizer)!r}), "
        f"Path({str(models / shape)!r}), {device!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    return round(time.time() - t0, 1)


def measure_stage(
    out: Path,
    jobs: list[tuple[int, dict]],
    always_cap: bool,
    models: Path,
    root: Path,
    tokenizer: Path,
    steps: int,
    device: str,
    row_timeout: float,
    deadline_s: float,
    prune_models: bool,
) -> Path:
    """Every (index, spec) through plan + train, one fresh process each, shape by shape (each checkpoint built
    once, then deleted with --prune-models when the shape's runs are done); rows saved after each run."""
    out.mkdir(parents=True, exist_ok=True)
    raw_path = out / STAGE_RAW
    rows: list[dict] = json.loads(raw_path.read_text())["rows"] if raw_path.exists() else []
    done = {(r["index"], r["cap_gib"]) for r in rows}
    builds: dict[str, float | str] = {}

    def save():
        tmp = raw_path.with_name(raw_path.name + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "gpu": _gpu_name() if device == "cuda" else "cpu",
                    "through": "train-stage",
                    "steps": steps,
                    "model_build_s": builds,
                    "rows": rows,
                },
                indent=1,
            )
        )
        tmp.replace(raw_path)

    start = time.time()
    shapes = list(dict.fromkeys(spec["shape"] for _, spec in jobs))
    for shape in shapes:
        todo = [(i, s, None) for i, s in jobs if s["shape"] == shape and (i, None) not in done]
        todo += [(i, s, CAP_GIB) for i, s in jobs if s["shape"] == shape and always_cap and (i, CAP_GIB) not in done]
        if not todo:
            continue
        if time.time() - start > deadline_s:
            print(f"deadline: not started {[(i, c) for i, _, c in todo]}", flush=True)
            continue
        try:
            builds[shape] = _build_shape(shape, models, tokenizer, device)
        except Exception as e:  # e.g. the disk full: record it, go on with the other shapes
            builds[shape] = f"{type(e).__name__}: {str(e)[:300]}"
            rows += [
                {
                    "index": i,
                    "config": config_name(s),
                    "spec": s,
                    "cap_gib": c,
                    "through": "train-stage",
                    "failed": True,
                    "error": f"model build failed: {builds[shape]}",
                }
                for i, s, c in todo
            ]
            save()
            continue
        print(json.dumps({"model": shape, "build_s": builds[shape]}), flush=True)
        while todo:
            i, spec, cap = todo.pop(0)
            if time.time() - start > deadline_s:
                print(f"deadline: #{i} cap={cap} not started", flush=True)
                continue
            log_path = root / f"stage_{i}_{cap}.log"
            root.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                __file__,
                "one-stage",
                json.dumps(spec),
                "--device",
                device,
                "--models",
                str(models),
                "--root",
                str(root),
                "--tokenizer",
                str(tokenizer),
                "--steps",
                str(steps),
            ]
            cmd += ["--cap", str(cap)] if cap else []
            t0 = time.time()
            with open(log_path, "w") as logf:  # a file, not a pipe: a chatty child never blocks
                try:
                    subprocess.run(
                        cmd,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        timeout=row_timeout,
                        cwd=ROOT,
                        env=dict(os.environ, PYTHONUNBUFFERED="1"),
                    )
                except subprocess.TimeoutExpired:
                    pass
            log = log_path.read_text(errors="replace")
            line = [ln for ln in log.splitlines() if ln.startswith('{"config"')]
            rec = (
                json.loads(line[-1])
                if line
                else {
                    "config": config_name(spec),
                    "spec": spec,
                    "cap_gib": cap,
                    "through": "train-stage",
                    "failed": True,
                    "error": log[-1500:],
                }
            )
            rec.update(index=i, wall_s=round(time.time() - t0, 1))
            rows.append(rec)
            save()
            print(
                f"[{time.time() - start:5.0f}s] #{i} cap={cap} oom={rec.get('oom')} "
                f"res={rec.get('peak_reserved_gib')} alloc={rec.get('peak_allocated_gib')} "
                f"pred={rec.get('predicted_reserved_gib')} phase={rec.get('peak_phase')} "
                f"forced={rec.get('strategy_as_forced')} {rec['config']} {rec.get('error', '')[:300]}",
                flush=True,
            )
            # Near or over 32 GiB: also run under the cap, unless the uncapped peak allocated alone exceeds it.
            if cap is None and not always_cap and device == "cuda" and not rec.get("failed") and not rec.get("oom"):
                if (rec.get("peak_reserved_gib") or 0) > CAP_GIB - 4 and (
                    rec.get("peak_allocated_gib") or 0
                ) <= CAP_GIB:
                    todo.append((i, spec, CAP_GIB))
        if prune_models:
            import shutil

            shutil.rmtree(models / shape, ignore_errors=True)
    save()
    return raw_path


def analyze_stage(raw_path: Path, results: Path) -> dict:
    """Score the planner against train-stage rows (no refit): |error| of peak reserved, eval before training included.

    The prediction scored is the one the plan stage made for the run (in the row); the error against the
    current constants (predict(spec)) and against the training peak alone are reported beside it."""
    raw = json.loads(raw_path.read_text())
    by_index: dict[int, dict] = {}
    for r in raw["rows"]:
        by_index.setdefault(r["index"], {})["capped" if r.get("cap_gib") else "uncapped"] = r
    rows = []
    for i in sorted(by_index):
        slot = by_index[i]
        un = slot.get("uncapped") if slot.get("uncapped") and not slot["uncapped"].get("oom") else slot.get("capped")
        if (
            not un
            or un.get("failed")
            or un.get("oom")
            or not un.get("peak_reserved_gib")
            or un.get("predicted_reserved_gib") is None
        ):
            continue
        meas, pred = un["peak_reserved_gib"], un["predicted_reserved_gib"]
        current = predict(un["spec"], "train-stage")
        now = current["predicted_reserved_gib"]
        train_only = un.get("train_peak_reserved_gib")
        capped = slot.get("capped")
        rows.append(
            {
                "index": i,
                "config": un["config"],
                "spec": un["spec"],
                "used_for_fit": is_fit_row(i),
                "cap_gib": un.get("cap_gib"),
                "strategy_as_forced": un.get("strategy_as_forced"),
                "predicted_reserved_gib": round(pred, 2),
                "measured_reserved_gib": round(meas, 2),
                "predicted_allocated_gib": un.get("predicted_allocated_gib"),
                "measured_allocated_gib": un.get("peak_allocated_gib"),
                "train_peak_reserved_gib": train_only,
                "eval_peak_reserved_gib": un.get("eval_peak_reserved_gib"),
                "peak_phase": un.get("peak_phase"),
                "reserved_error_pct": round(100 * (pred - meas) / meas, 1),
                "reserved_error_current_constants_pct": round(100 * (now - meas) / meas, 1),
                "reserved_error_training_only_pct": round(100 * (pred - train_only) / train_only, 1)
                if train_only
                else None,
                "oom_under_32gib_cap": None if capped is None else bool(capped.get("oom")),
                "capped_reserved_gib": None
                if capped is None or capped.get("oom")
                else capped.get("peak_reserved_gib"),
                "fits_32gib_predicted_current_constants": current["fits"],
            }
        )

    def summary(sel, key="reserved_error_pct"):
        errs = [abs(r[key]) for r in sel if r.get(key) is not None]
        if not errs:
            return {"rows": 0}
        return {
            "rows": len(errs),
            "median_abs_error_pct": round(statistics.median(errs), 1),
            "worst_abs_error_pct": round(max(errs), 1),
            "worst_config": max(sel, key=lambda r: abs(r.get(key) or 0))["config"],
        }

    held = [r for r in rows if not r["used_for_fit"]]
    out = {
        "gpu": raw.get("gpu"),
        "through": "train-stage",
        "steps": raw.get("steps"),
        "method": "loraship.stages.plan + loraship.stages.train as shipped, one fresh process per row; measured "
        "peak = max(eval before training (model load included), training); 'held_out' scores the "
        "prediction the plan made in the run, "
        "'held_out_current_constants' the one loraship/planning/estimate.py makes now (its HF-loss reserve fitted by "
        "fit-stage on the fit rows alone)",
        "held_out": summary(held),
        "held_out_current_constants": summary(held, "reserved_error_current_constants_pct"),
        "held_out_training_only": summary(held, "reserved_error_training_only_pct"),
        "fit_rows": summary([r for r in rows if r["used_for_fit"]]),
        "fit_rows_current_constants": summary(
            [r for r in rows if r["used_for_fit"]], "reserved_error_current_constants_pct"
        ),
        "all": summary(rows),
        "not_as_forced": [r["config"] for r in rows if r["strategy_as_forced"] is False],
        # The planner's promise: nothing it says fits 32 GiB runs out of memory under a 32 GiB cap.
        "ran_under_32gib_cap": sum(r["oom_under_32gib_cap"] is not None for r in rows),
        "predicted_to_fit_32gib_but_oom_under_cap": [
            r["config"] for r in rows if r["oom_under_32gib_cap"] and r["fits_32gib_predicted_current_constants"]
        ],
        "rows": rows,
    }
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(out, indent=1) + "\n")
    return out


def fit_stage(raw_path: Path) -> dict:
    """CAL["reserve_hf_loss_expandable"] from the train-stage fit rows (even rows < 24) that ran HF cross-entropy:
    the median, over those rows, of what their peak reserved held beyond the predicted allocated and the fixed
    expandable-segments reserve, as a fraction of the predicted loss transient. Held-out rows play no part."""
    raw = json.loads(raw_path.read_text())
    fractions = []
    for r in raw["rows"]:
        if (
            r.get("cap_gib")
            or r.get("failed")
            or r.get("oom")
            or not is_fit_row(r["index"])
            or r["spec"]["fused_loss"]
            or not r.get("peak_reserved_gib")
        ):
            continue
        p = predict(r["spec"], "train-stage")
        loss = p["components_gib"]["logits_and_cross_entropy"]
        # the prediction without the term being fitted: reserved less the cache it adds
        left = r["peak_reserved_gib"] - (p["predicted_reserved_gib"] - p["reclaimable_cache_gib"])
        fractions.append(
            {
                "index": r["index"],
                "config": r["config"],
                "loss_transient_gib": loss,
                "reserved_beyond_prediction_gib": round(left, 3),
                "fraction": round(left / loss, 4),
            }
        )
    if not fractions:
        raise SystemExit("no train-stage fit row with HF cross-entropy in " + str(raw_path))
    value = round(statistics.median(f["fraction"] for f in fractions), 3)
    return {"reserve_hf_loss_expandable": max(0.0, value), "rows": fractions}


def _stage_jobs(only: list[int] | None) -> list[tuple[int, dict]]:
    return [(i, MATRIX[i]) for i in (only if only is not None else range(len(MATRIX)))]


SMOKE_STAGE = _c("tiny", "lora", 8, "qvo", 64, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--deadline-s", type=float, default=450)
    m.add_argument("--parallel", type=int, default=3)
    m.add_argument("--gpu-gib", type=float, default=130)
    m.add_argument("--only", type=lambda s: [int(x) for x in s.split(",")], default=None)
    m.add_argument("--always-cap", action="store_true", help="run every config under the 32 GiB cap as well")
    o = sub.add_parser("one")
    o.add_argument("spec")
    o.add_argument("--cap", type=float, default=None)
    o.add_argument("--device", default="cuda")
    sub.add_parser("smoke")
    tiny_tok = ROOT / ".loraship" / "models" / "tiny-llama"
    for name in ("measure-stage", "smoke-stage"):
        st = sub.add_parser(
            name, help="through loraship.stages.plan + train" + (" (CPU, tiny)" if "smoke" in name else "")
        )
        st.add_argument("--out", type=Path, required=name == "measure-stage", default=Path("/tmp/memory_matrix_smoke"))
        st.add_argument("--root", type=Path, default=None, help="data, work folders and logs (default OUT/stage)")
        st.add_argument("--models", type=Path, default=None, help="random checkpoints (default ROOT/models)")
        st.add_argument(
            "--tokenizer", type=Path, default=tiny_tok, help="the tiny Llama (its sentencepiece tokenizer)"
        )
        st.add_argument("--steps", type=int, default=3 if name == "measure-stage" else 2)
        st.add_argument("--only", type=lambda s: [int(x) for x in s.split(",")], default=None)
        st.add_argument("--always-cap", action="store_true")
        st.add_argument("--row-timeout", type=float, default=900)
        st.add_argument("--deadline-s", type=float, default=1e9, help="start no run after this many seconds")
        st.add_argument("--prune-models", action="store_true", help="delete each shape's checkpoint after its runs")
    os_ = sub.add_parser("one-stage")
    os_.add_argument("spec")
    os_.add_argument("--cap", type=float, default=None)
    os_.add_argument("--device", default="cuda")
    os_.add_argument("--models", type=Path, required=True)
    os_.add_argument("--root", type=Path, required=True)
    os_.add_argument("--tokenizer", type=Path, required=True)
    os_.add_argument("--steps", type=int, default=3)
    a = sub.add_parser("analyze")
    a.add_argument("raw", type=Path)
    a.add_argument(
        "--results",
        type=Path,
        default=None,
        help="train-stage raw files only (default bench/results/memory_matrix_stage.json)",
    )
    f = sub.add_parser("fit")
    f.add_argument("raw", type=Path)
    fs = sub.add_parser("fit-stage", help="the train stage's HF-loss allocator reserve, from its fit rows only")
    fs.add_argument("raw", type=Path)
    args = ap.parse_args()
    if args.cmd == "measure":
        measure(args.out, args.deadline_s, args.parallel, args.gpu_gib, args.only, args.always_cap)
    elif args.cmd == "one":
        print(json.dumps(run_one(json.loads(args.spec), args.cap, args.device)), flush=True)
    elif args.cmd in ("measure-stage", "smoke-stage"):
        sys.path.insert(0, str(ROOT))
        smoke = args.cmd == "smoke-stage"
        root = (args.root or args.out / "stage").resolve()
        models = (args.models or root / "models").resolve()
        jobs = [(0, SMOKE_STAGE)] if smoke else _stage_jobs(args.only)
        raw = measure_stage(
            args.out.resolve(),
            jobs,
            args.always_cap,
            models,
            root,
            args.tokenizer.resolve(),
            args.steps,
            "cpu" if smoke else "cuda",
            args.row_timeout,
            args.deadline_s,
            args.prune_models,
        )
        print(raw)
    elif args.cmd == "one-stage":
        sys.path.insert(0, str(ROOT))
        rec = run_stage_one(
            json.loads(args.spec), args.cap, args.device, args.models, args.root, args.tokenizer, args.steps
        )
        print(json.dumps(rec), flush=True)
    elif args.cmd == "smoke":
        for spec in (_c("tiny", "qlora", 8, "qvo", 64, 2), _c("tiny", "lora", 8, "all-linear", 64, 1, ckpt=False)):
            print(json.dumps(run_one(spec, None, "cpu")))
    elif args.cmd == "fit-stage":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(fit_stage(args.raw), indent=1))
    elif args.cmd == "fit":
        sys.path.insert(0, str(ROOT))
        fit(args.raw)
    elif json.loads(args.raw.read_text()).get("through") == "train-stage":
        sys.path.insert(0, str(ROOT))
        out = analyze_stage(args.raw, args.results or ROOT / "bench/results/memory_matrix_stage.json")
        for k in (
            "held_out",
            "held_out_current_constants",
            "held_out_training_only",
            "fit_rows",
            "fit_rows_current_constants",
            "all",
            "ran_under_32gib_cap",
            "predicted_to_fit_32gib_but_oom_under_cap",
        ):
            print(k, out[k])
        if out["not_as_forced"]:
            print("not trained as forced:", out["not_as_forced"])
    else:
        sys.path.insert(0, str(ROOT))
        out = analyze(args.raw, ROOT / "bench/results/memory_matrix.json", ROOT / "bench/memory_matrix.md")
        for k in ("all", "fit", "held_out", "validation", "near_threshold"):
            print(k, {kk: v for kk, v in out[k].items()})


if __name__ == "__main__":
    main()
