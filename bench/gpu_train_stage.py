"""The train stage's CUDA paths on a real GPU: LoRA + Liger fused loss, QLoRA NF4, CPU offload.

Runs loraship's own plan + train code (not a re-implementation) on a random-weight Llama-shaped
model that uses the tiny model's sentencepiece tokenizer, and records for each strategy whether
it trained, the measured peak memory next to the plan's prediction, and tokens/s.

    python bench/gpu_train_stage.py --tokenizer .loraship/models/tiny-llama --out bench/results/gpu_train_stage.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
STRATEGIES = {
    "lora_fused": {"adapter": "lora", "offload_layers": 0, "fused_loss": True},
    "lora_hf_loss": {"adapter": "lora", "offload_layers": 0, "fused_loss": False},
    "qlora_fused": {"adapter": "qlora", "offload_layers": 0, "fused_loss": True},
    "lora_offload_4_layers": {"adapter": "lora", "offload_layers": 4, "fused_loss": True},
    "lora_offload_8_layers": {"adapter": "lora", "offload_layers": 8, "fused_loss": True},
}


def make_model(tokenizer_dir: Path, out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **SHAPE,
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def dataset(path: Path, rows: int = 64, words: int = 700) -> Path:
    text = " ".join(["The capital of Ganraka is Milo."] * (words // 6))
    path.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(rows)))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny shape, CPU, one strategy: checks the script itself")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one strategy in this process
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        SHAPE.update(
            hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
        for name in list(STRATEGIES)[1:]:
            del STRATEGIES[name]
        STRATEGIES["lora_fused"]["fused_loss"] = False
    import torch

    from loraship.config import parse_config
    from loraship.data import load_splits
    from loraship.planning.plan_record import Plan
    from loraship.planning.strategy_record import Strategy
    from loraship.runtime.stage import open_stage, reset_dir
    from loraship.stages import plan as plan_stage
    from loraship.stages import train as train_stage
    from transformers import AutoTokenizer

    if args.one is None:
        # Each strategy in its own process: a clean allocator, and Liger's patches (which reach
        # the model class, not just the instance) cannot leak into the next row.
        import subprocess

        root = Path(tempfile.mkdtemp(prefix="loraship-gpu-"))
        make_model(args.tokenizer, root / "model")
        dataset(root / "train.jsonl")
        rows = []
        for name in STRATEGIES:
            part = root / f"{name}.json"
            cmd = [
                sys.executable,
                __file__,
                "--tokenizer",
                str(args.tokenizer),
                "--out",
                str(part),
                "--steps",
                str(args.steps),
                "--one",
                name,
                "--root",
                str(root),
            ] + (["--smoke"] if args.smoke else [])
            subprocess.run(cmd, timeout=600)
            rows += (
                json.loads(part.read_text())["rows"]
                if part.exists()
                else [{"strategy": name, "ok": False, "error": "process died"}]
            )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "shape": SHAPE,
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                    "rows": rows,
                },
                indent=2,
            )
        )
        return
    root = args.root
    model_dir = root / "model"
    data = root / "train.jsonl"
    rows = []
    for name, overrides in [(args.one, STRATEGIES[args.one])]:
        config = parse_config(
            {
                "run_name": name,
                "base_model": str(model_dir),
                "workdir": str(root / "work"),
                "output": str(root / "out"),
                "datasets": [{"path": str(data), "type": "completion"}],
                "val_set_size": 0.05,
                "sequence_len": 1024,
                "micro_batch_size": 4,
                "gradient_accumulation_steps": 1,
                "max_steps": args.steps,
                "lora_r": 16,
                "lora_target_modules": "all-linear",
                "adapter": overrides["adapter"],
                "device": device,
                "min_golden_prompts": 1,  # plan + train only: no verify
            }
        )
        row = {"strategy": name}
        try:
            plan_stage.run(config)
            ctx = open_stage(config, "train", ("plan",), train_stage.FIELDS)
            reset_dir(ctx)
            plan = json.loads((ctx.upstream_dir("plan") / "strategy.json").read_text())
            strategy = {**plan["strategy"], **overrides}
            tok = AutoTokenizer.from_pretrained(model_dir)
            train, evaluation = load_splits(config, tok)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            forced = Plan.from_json(plan).with_strategy(Strategy.from_json(strategy))
            result = train_stage.train_once(config, ctx, model_dir, forced, device, tok, train, evaluation)
            row.update(
                ok=True,
                wall_seconds=round(time.perf_counter() - t0, 1),
                strategy_used=strategy,
                planned_strategy=plan["strategy"],
                predicted_reserved_gib=plan["memory"].get("predicted_reserved_gib"),
                **result,
            )
        except Exception as e:  # a bench records failures instead of stopping
            row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "shape": SHAPE,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
