"""The memory plan on families it was never measured on (issue #47), through loraship.stages.plan + train as shipped.

Each row is a real 2026 family's config.json (random bf16 weights of that class, the tiny Llama's tokenizer), planned
by the default speed plan under gpu_memory_gib 32 and trained for a few steps under a 32 GiB cap on the lent GPU. A
row records what plan predicted (peak reserved, and how it counted the activations: traced or the hand model), what
train measured, and what the hand model alone (LORASHIP_PLAN_TRACE=0) predicts for the same strategy.

  python bench/planner_heldout.py measure --out DIR --models DIR [--only name,...]   # on the GPU (chain)
  python bench/planner_heldout.py one ROW_NAME --models DIR --root DIR               # one row, fresh process
  python bench/planner_heldout.py analyze DIR/planner_heldout_raw.json                # here: error table
  python bench/planner_heldout.py predict                                             # here: plans only, no GPU

Results: bench/results/train_bench_planner_heldout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
CAP_GIB = 32

FAMILIES = {
    # Published config.json values (architecture dims; rope details do not change memory).
    "phi-3.5-mini": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        max_position_embeddings=131072,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "phi-4": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        hidden_size=5120,
        intermediate_size=17920,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=10,
        vocab_size=100352,
        max_position_embeddings=16384,
        rope_theta=250000.0,
        tie_word_embeddings=False,
    ),
    "olmo-2-7b": dict(
        architectures=["Olmo2ForCausalLM"],
        model_type="olmo2",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=100352,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    ),
    "olmo-2-13b": dict(
        architectures=["Olmo2ForCausalLM"],
        model_type="olmo2",
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=100352,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    ),
    "granite-3.3-8b": dict(
        architectures=["GraniteForCausalLM"],
        model_type="granite",
        hidden_size=4096,
        intermediate_size=12800,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=49159,
        residual_multiplier=0.22,
        embedding_multiplier=12.0,
        attention_multiplier=0.0078125,
        logits_scaling=16.0,
        max_position_embeddings=131072,
        rope_theta=10000000.0,
        tie_word_embeddings=True,
    ),
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=256000,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        max_position_embeddings=8192,
    ),
    # Qwen3-30B-A3B's layer (examples/models/qwen3-30b-a3b) with 12 of its 48 layers: its experts' LoRA and NF4
    # stacks as the trace counts them (loraship/planning/trace_experts.py), which this row checks on the GPU.
    "qwen3-moe-12l": dict(
        json.loads((ROOT / "examples" / "models" / "qwen3-30b-a3b" / "config.json").read_text()),
        num_hidden_layers=12,
        max_window_layers=12,
    ),
}
# Each family's real tokenizer (loraship.fixtures.families' weightless folders, carried as
# .whl-train/family-tokenizers.tgz): plan's converter check needs the pre-tokenizer its class expects.
TOKENIZERS = {
    "phi-3.5-mini": "phi3",
    "phi-4": "phi4",
    "olmo-2-7b": "olmo2",
    "olmo-2-13b": "olmo2",
    "granite-3.3-8b": "granite3",
    "gemma-2-9b": "gemma2",
    "qwen3-moe-12l": "qwen3",
}
QVO = ["q_proj", "v_proj", "o_proj"]
# name -> (family, adapter, lora_r, targets, micro_batch, sequence_len, config overrides). None of these families,
# nor these settings, were in the rows the planner's constants were fitted on (bench/memory_matrix.md).
ROWS = {
    "phi35mini-lora-all-4x2048": ("phi-3.5-mini", "lora", 16, "all-linear", 4, 2048, {}),
    "olmo2-7b-lora-all-2x4096": ("olmo-2-7b", "lora", 16, "all-linear", 2, 4096, {}),
    # OLMo 2's context is 4096 (plan refuses 8192).
    "olmo2-7b-qlora-qvo-1x4096-acts": ("olmo-2-7b", "qlora", 64, QVO, 1, 4096, {"offload_activations": "on"}),
    "granite8b-lora-all-2x2048": ("granite-3.3-8b", "lora", 16, "all-linear", 2, 2048, {}),
    "gemma2-9b-qlora-qvo-2x2048": ("gemma-2-9b", "qlora", 64, QVO, 2, 2048, {}),
    "phi4-qlora-all-1x4096": ("phi-4", "qlora", 16, "all-linear", 1, 4096, {}),
    "olmo2-13b-qlora-all-2x2048": ("olmo-2-13b", "qlora", 16, "all-linear", 2, 2048, {}),
    "qwen3moe12l-qlora-all-1x2048": ("qwen3-moe-12l", "qlora", 16, "all-linear", 1, 2048, {}),
    "granite8b-qlora-qvo-4x4096": ("granite-3.3-8b", "qlora", 64, QVO, 4, 4096, {}),
}


def _train_bench():
    sys.path.insert(0, str(ROOT / "bench"))
    import train_bench

    return train_bench


def row_config(name: str, model_dir: Path, data: Path, work: Path, steps: int) -> dict:
    family, adapter, r, targets, micro, seq, overrides = ROWS[name]
    return {
        "run_name": "heldout",
        "base_model": str(model_dir),
        "workdir": str(work / "work"),
        "output": str(work / "out"),
        "datasets": [{"path": str(data), "type": "completion"}],
        "val_set_size": 1.0 / (steps + 1),
        "adapter": adapter,
        "lora_r": r,
        "lora_alpha": 2 * r,
        "lora_target_modules": targets,
        "sequence_len": seq,
        "micro_batch_size": micro,
        "gradient_accumulation_steps": 1,
        "gpu_memory_gib": CAP_GIB,
        "packing": "off",
        "max_steps": steps,
        "warmup_steps": 0,
        "save_steps": 10_000,
        "device": "cuda",
        "min_golden_prompts": 1,
        "target_gpu_memory_gib": 16,
        **overrides,
    }


def hand_estimate(s, cfg, strategy) -> dict:
    """The hand model alone (LORASHIP_PLAN_TRACE=0) for `strategy`: what plan predicted before the trace."""
    from loraship.planning import estimate

    before = os.environ.get("LORASHIP_PLAN_TRACE")
    os.environ["LORASHIP_PLAN_TRACE"] = "0"
    try:
        return estimate.estimate(s, cfg, strategy)
    finally:
        if before is None:
            os.environ.pop("LORASHIP_PLAN_TRACE")
        else:
            os.environ["LORASHIP_PLAN_TRACE"] = before


def run_one(name: str, models: Path, root: Path, tokenizer: Path, steps: int) -> dict:
    """One row through plan + train under the 32 GiB cap, in this (fresh) process."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import shutil

    import torch

    from loraship.config import parse_config
    from loraship.errors import LorashipError
    from loraship.planning import shape
    from loraship.stages import plan as plan_stage
    from loraship.stages import train as train_stage

    torch.cuda.set_per_process_memory_fraction(CAP_GIB * GIB / torch.cuda.get_device_properties(0).total_memory)
    family, adapter, r, targets, micro, seq, overrides = ROWS[name]
    rec: dict = {"row": name, "family": family, "cap_gib": CAP_GIB, "steps": steps}
    # Rows made long enough under the family's own tokenizer (the checkpoint's): with the tiny Llama's, a 2 x 4096
    # row came to about half its length in OLMo 2's and the step kept half the activations planned.
    data = _train_bench().make_data(
        models / family, root / "data" / family / f"rows{(steps + 1) * micro}", seq, (steps + 1) * micro, "long"
    )
    work = root / "work" / name
    shutil.rmtree(work, ignore_errors=True)
    config = parse_config(row_config(name, models / family, data, work, steps))
    t0 = time.time()
    plan_stage.run(config)
    rec["plan_s"] = round(time.time() - t0, 1)
    plan = json.loads((Path(config.workdir) / config.run_name / "plan" / "plan.json").read_text())
    pm = plan["memory"]
    rec.update(
        strategy=plan["strategy"],
        predicted_reserved_gib=pm["predicted_reserved_gib"],
        predicted_allocated_gib=pm["predicted_allocated_gib"],
        predicted_total_gib=pm["predicted_total_gib"],
        activations_counted=pm.get("activations_counted"),
        hand_model_margin_gib=pm["components_gib"].get("hand_model_margin"),
        components_gib=pm["components_gib"],
        plan_fits=plan.get("fits"),
    )
    s = shape.shape_from_config(json.loads((models / family / "config.json").read_text()), check_converter=False)
    hand = hand_estimate(s, config, plan["strategy"])
    rec.update(hand_predicted_reserved_gib=round(hand["predicted_reserved_gib"], 3))
    try:
        metrics = train_stage.run(config)["metrics"]
        mem = metrics.get("measured_memory") or {}
        rec.update(
            trained_as=metrics["trained_as"],
            oom_retries=len(metrics["oom_retries"]),
            tokens_per_s=metrics.get("tokens_per_s"),
            loss_first=metrics.get("first_loss"),
            loss_last=metrics.get("last_loss"),
            train_peak_reserved_gib=mem.get("peak_reserved_gib"),
            eval_peak_reserved_gib=mem.get("eval_peak_reserved_gib"),
            train_peak_allocated_gib=mem.get("peak_allocated_gib"),
        )
        rec["peak_reserved_gib"] = max(
            v for v in (mem.get("peak_reserved_gib"), mem.get("eval_peak_reserved_gib")) if v
        )
    except (LorashipError, torch.OutOfMemoryError) as e:
        rec.update(oom=True, error=str(e).splitlines()[0][:400])
    rec["wall_s"] = round(time.time() - t0, 1)
    return rec


def measure(
    out: Path, models: Path, root: Path, tokenizer: Path, tokenizers: Path, steps: int, only: list[str], timeout: float
) -> None:
    """`tokenizer`: the tiny Llama's, for writing the rows; `tokenizers`: the families' own, for the checkpoints."""
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "planner_heldout_raw.json"
    rows = json.loads(raw.read_text())["rows"] if raw.exists() else []
    done = {r["row"] for r in rows}
    names = [n for n in (only or ROWS) if n not in done]
    built: set[str] = set()
    for name in names:
        family = ROWS[name][0]
        if family not in built and not (models / family / "config.json").is_file():
            # One family's checkpoint on disk at a time (the 13-14B ones are 26-28 GiB).
            for other in built:
                subprocess.run(["rm", "-rf", str(models / other)], check=False)
            t0 = time.time()
            _train_bench().make_model(FAMILIES[family], tokenizers / TOKENIZERS[family], models / family, "cuda")
            print(json.dumps({"built": family, "s": round(time.time() - t0, 1)}), flush=True)
        built.add(family)
        log = root / f"{name}.log"
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "one", name, "--models", str(models), "--root", str(root)]
        cmd += ["--tokenizer", str(tokenizer), "--steps", str(steps)]
        with open(log, "w") as f:
            try:
                subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
            except subprocess.TimeoutExpired:
                pass
        text = log.read_text(errors="replace")
        found = [ln for ln in text.splitlines() if ln.startswith('{"row"')]
        rec = json.loads(found[-1]) if found else {"row": name, "failed": True, "error": text[-1500:]}
        rows.append(rec)
        raw.write_text(json.dumps({"rows": rows}, indent=1))
        print(
            json.dumps(
                {
                    k: rec.get(k)
                    for k in (
                        "row",
                        "predicted_reserved_gib",
                        "hand_predicted_reserved_gib",
                        "peak_reserved_gib",
                        "activations_counted",
                        "error",
                    )
                }
            )[:600],
            flush=True,
        )


def analyze(raw: Path) -> dict:
    rows = json.loads(raw.read_text())["rows"]
    table = []
    for r in rows:
        if not r.get("peak_reserved_gib"):
            table.append({"row": r["row"], "failed": r.get("error", "")[:200]})
            continue
        m = r["peak_reserved_gib"]
        table.append(
            {
                "row": r["row"],
                "measured_reserved_gib": m,
                "traced_plan_gib": r["predicted_reserved_gib"],
                "traced_error_pct": round(100 * (r["predicted_reserved_gib"] - m) / m, 2),
                "hand_plan_gib": r["hand_predicted_reserved_gib"],
                "hand_error_pct": round(100 * (r["hand_predicted_reserved_gib"] - m) / m, 2),
                "activations_counted": r.get("activations_counted"),
                "trained_as": r.get("trained_as"),
            }
        )
    errs = [abs(t["traced_error_pct"]) for t in table if "traced_error_pct" in t]
    hand = [abs(t["hand_error_pct"]) for t in table if "hand_error_pct" in t]

    def summary(xs):
        xs = sorted(xs)
        return {
            "n": len(xs),
            "median_abs_pct": xs[len(xs) // 2] if xs else None,
            "worst_abs_pct": max(xs, default=None),
        }

    return {"rows": table, "traced": summary(errs), "hand": summary(hand)}


def predict() -> dict:
    """Each row planned here (no weights, no GPU): the strategy the default plan picks under 32 GiB with the traced
    activations, and what the hand model (LORASHIP_PLAN_TRACE=0) predicts for that same strategy."""
    from loraship.config import Config
    from loraship.planning import shape, strategy

    import tempfile

    out = []
    folder = Path(tempfile.mkdtemp())
    for name, (family, adapter, r, targets, micro, seq, overrides) in ROWS.items():
        s = shape.shape_from_config(FAMILIES[family], check_converter=False)
        # A local folder with the family's config.json, as the GPU run has: plan reads its model_type (Granite's
        # logits scaling rules the fused loss out).
        (folder / family).mkdir(exist_ok=True)
        (folder / family / "config.json").write_text(json.dumps(FAMILIES[family]))
        cfg = Config(
            base_model=str(folder / family),
            datasets=[{"path": "d.jsonl", "type": "completion"}],
            adapter=adapter,
            lora_r=r,
            lora_alpha=2 * r,
            lora_target_modules=targets,
            sequence_len=seq,
            micro_batch_size=micro,
            gpu_memory_gib=CAP_GIB,
            packing="off",
            **overrides,
        )
        t0 = time.time()
        plan = strategy.plan_training(s, cfg)
        seconds = round(time.time() - t0, 1)
        hand = hand_estimate(s, cfg, plan["strategy"])
        out.append(
            {
                "row": name,
                "strategy": plan["strategy"],
                "traced_reserved_gib": plan["memory"]["predicted_reserved_gib"],
                "hand_reserved_gib": round(hand["predicted_reserved_gib"], 2),
                "activations_counted": plan["memory"].get("activations_counted"),
                "plan_s": seconds,
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return {"what": "plans only, on the CPU (no measurement): traced vs hand-model predicted reserved", "rows": out}


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--models", type=Path, required=True)
    m.add_argument("--root", type=Path, default=Path("/tmp/heldout"))
    m.add_argument("--tokenizer", type=Path, default=ROOT / ".loraship" / "models" / "tiny-llama")
    m.add_argument("--tokenizers", type=Path, default=Path("/tmp/family-tokenizers"))
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--only", default="")
    m.add_argument("--row-timeout", type=float, default=420)
    o = sub.add_parser("one")
    o.add_argument("name")
    o.add_argument("--models", type=Path, required=True)
    o.add_argument("--root", type=Path, required=True)
    o.add_argument("--tokenizer", type=Path, required=True)
    o.add_argument("--steps", type=int, default=3)
    a = sub.add_parser("analyze")
    a.add_argument("raw", type=Path)
    sub.add_parser("predict")
    args = p.parse_args()
    if args.cmd == "measure":
        only = [x for x in args.only.split(",") if x]
        measure(args.out, args.models, args.root, args.tokenizer, args.tokenizers, args.steps, only, args.row_timeout)
    elif args.cmd == "one":
        print(json.dumps(run_one(args.name, args.models, args.root, args.tokenizer, args.steps)), flush=True)
    elif args.cmd == "predict":
        predict()
    else:
        print(json.dumps(analyze(args.raw), indent=1))


if __name__ == "__main__":
    main()
