"""Why Q4_K_M loses a real Gemma 3 270M fine-tune that IQ3_M keeps: the quantization ladder, its tensor types and
llama.cpp's own KL divergence, on the CPU.

google/gemma-3-270m with its real weights (loraship.fixtures.families.real_gemma3: dequantized from the packaged
Q4_K_M GGUF, saved in bf16), fine-tuned with LoRA on the demo's chat data, merged, converted, quantized to each rung
with the run's importance matrix and verified, as a user's run does (plan -> verify). Then, beside verify's figures:

- the tensor types of every rung, read back with gguf-py, against loraship/llamacpp/quant_mix.py's prediction, and
  the count that fell back (Gemma 3's rows of 640 are not a multiple of 256);
- llama.cpp's own KL (llama-perplexity --kl-divergence) of each rung against the merged model's F16 GGUF
  (peer_kl_mean), and of the base model's F16 against it (the fine-tune's own size, peer_base_model_kl_mean);
  our scoring's exact KL on llama-perplexity's own tokens and positions (ours_kl_mean), to check our KL;
- delta_kept: how much of the fine-tune's weight change (merged - base, over every layer's linear weights) each
  rung keeps, by type: the projection <Q(merged) - base, merged - base> / |merged - base|^2 (1: kept on
  average, 0: rounded back to the base's weights);
- the base model's own ladder (no fine-tune; llama-quantize with no importance matrix) against its F16 GGUF, and
  the merged model's Q4_K_M made by hand with llama-quantize and the run's importance matrix, compared byte for
  byte with the quantize stage's.

    .venv/bin/python bench/quant_gemma3.py --workdir .loraship/bench-gemma3 \\
        --out bench/results/quant_ladder_gemma3.json
    .venv/bin/python bench/quant_gemma3.py --workdir DIR --steps 40 --rungs Q4_K_M IQ3_M Q5_K_M Q8_0 --verify-only \\
        --out bench/results/quant_ladder_gemma3_imatrix.json      # verify's figures alone, no analysis phase
    .venv/bin/python bench/quant_gemma3.py --workdir DIR --steps 40 --rungs Q4_K_M IQ3_M --imatrix-effect \\
        --out bench/results/quant_imatrix_effect_gemma3.json      # after a run in DIR: with and without its matrix
    .venv/bin/python bench/quant_gemma3.py --grid-only --out bench/results/quant_grid_gemma3.json
    .venv/bin/python bench/quant_gemma3.py --base-only --rungs Q4_K_M IQ3_M --workdir DIR \\
        --out bench/results/quant_base_gemma3.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUNGS = ["IQ3_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]
PEER_CTX = 128
PEER_ARGS = ("-c", str(PEER_CTX), "-b", str(PEER_CTX), "-fa", "off")
STAGES = ("plan", "train", "merge", "reference", "convert", "quantize", "verify")


def config_for(model: Path, root: Path, rungs: list[str], steps: int, imatrix: bool = True):
    import yaml

    from loraship.config import parse_config
    from loraship.fixtures.families import FAMILIES

    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    golden = root / "golden.jsonl"  # the demo's golden prompts without their reply regex, as bench/quant_ladder.py
    rows = [json.loads(line) for line in (REPO / "data/demo/golden.jsonl").read_text().splitlines()]
    golden.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    data.update(
        base_model=str(model),
        workdir=str(root / "work"),
        output=str(root / "artifacts"),
        run_name="gemma3-ladder",
        datasets=[{"path": str(REPO / "data/demo/train.jsonl"), "type": "chat"}],
        eval_datasets=[{"path": str(REPO / "data/demo/eval.jsonl"), "type": "chat"}],
        golden_prompts=str(golden),
        quantization=rungs,
        sequence_len=64,
        max_steps=steps,
        save_steps=steps,
        warmup_steps=1,
        micro_batch_size=4,
        imatrix=imatrix,
        imatrix_max_tokens=1024,
    )
    if FAMILIES["gemma3"].chat_template:
        data["chat_template"] = FAMILIES["gemma3"].chat_template
    return parse_config(data)


def kl_text(root: Path) -> Path:
    """The demo's chats (train, then eval) as plain "role: content" lines: about 3,000 Gemma tokens, 20-odd chunks
    of PEER_CTX. verify's eval texts alone are under the two chunks llama-perplexity needs at least."""
    lines = []
    for name in ("train.jsonl", "eval.jsonl"):
        for line in (REPO / "data" / "demo" / name).read_text().splitlines():
            lines += [f"{m['role']}: {m['content']}" for m in json.loads(line)["messages"]]
    path = root / "kl-text.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(cmd: list[str], what: str, timeout: int = 3600) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def kld_base(perplexity: Path, gguf: Path, text: Path, out: Path) -> Path:
    # Written beside and renamed: a run stopped mid-write must not leave a short file that is reused as whole.
    if not out.is_file():
        part = out.with_name(out.name + ".part")
        run(
            [
                str(perplexity),
                "-m",
                str(gguf),
                "-f",
                str(text),
                "--kl-divergence-base",
                str(part),
                *PEER_ARGS,
                "-t",
                str(os.cpu_count() or 2),
            ],
            f"llama-perplexity --kl-divergence-base on {gguf.name}",
        )
        part.replace(out)
    return out


def peer_kl(perplexity: Path, gguf: Path, base: Path) -> dict:
    text = run(
        [
            str(perplexity),
            "-m",
            str(gguf),
            "--kl-divergence-base",
            str(base),
            "--kl-divergence",
            *PEER_ARGS,
            "-t",
            str(os.cpu_count() or 2),
        ],
        f"llama-perplexity --kl-divergence on {gguf.name}",
    )
    mean = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", text)
    p99 = re.search(r"99\.0%\s+KLD:\s+([0-9.eE+-]+)", text)
    same = re.search(r"Same top p:\s+([0-9.]+)", text)
    ppl = re.search(r"Mean\s+PPL\(Q\)/PPL\(base\)\s*:\s+([0-9.]+)", text)
    return {
        "kl_mean": float(mean.group(1)),
        "kl_p99": float(p99.group(1)) if p99 else None,
        "same_top": float(same.group(1)) / 100 if same else None,
        "ppl_ratio": float(ppl.group(1)) if ppl else None,
    }


def read_kld_tokens(path: Path) -> tuple[int, list[list[int]]]:
    """llama-perplexity's base file header (tools/perplexity/perplexity.cpp): "_logits_", n_ctx, n_vocab, n_chunk,
    then the n_chunk * n_ctx token ids it scored."""
    import numpy as np

    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_"
        n_ctx, _vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32).tolist()
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).reshape(n_chunk, n_ctx)
    return n_ctx, tokens.tolist()


def gguf_bos(gguf: Path) -> int | None:
    """The BOS id llama.cpp puts first, where the GGUF adds one."""
    from loraship.llamacpp.gguf_info import read_gguf

    fields = read_gguf(gguf)["fields"]
    return fields.get("tokenizer.ggml.bos_token_id") if fields.get("tokenizer.ggml.add_bos_token") else None


def own_chunks(gguf: Path, text: Path) -> list[list[int]]:
    """The text as llama-perplexity chunks it: tokenized whole (no special-token parsing), cut into PEER_CTX tokens,
    BOS over each chunk's first token where the GGUF adds one."""
    from llama_cpp import Llama

    bos = gguf_bos(gguf)
    llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        ids = llm.tokenize(text.read_text().encode(), add_bos=False, special=False)
    finally:
        llm.close()
    chunks = [ids[i : i + PEER_CTX] for i in range(0, len(ids) - PEER_CTX + 1, PEER_CTX)]
    return [[bos, *c[1:]] if bos is not None else c for c in chunks]


class Logprobs:
    """Each GGUF's log-softmax at the chunks' scored positions (the second half of each, as llama-perplexity),
    computed once per file."""

    def __init__(self, chunks: list[list[int]]):
        self.chunks, self.cache = chunks, {}
        self.positions = list(range(PEER_CTX // 2, PEER_CTX - 1))

    def __call__(self, path: Path):
        import numpy as np
        from llama_cpp import Llama

        from loraship.verification.llama_ops import logprobs_at

        if path not in self.cache:
            llm = Llama(
                model_path=str(path),
                n_ctx=PEER_CTX,
                n_batch=PEER_CTX,
                logits_all=True,
                verbose=False,
                n_threads=os.cpu_count(),
            )
            try:
                self.cache[path] = np.concatenate([logprobs_at(llm, c, self.positions) for c in self.chunks])
            finally:
                llm.close()
        return self.cache[path]

    def kl(self, base: Path, other: Path) -> dict:
        """Our exact KL(base || other) (loraship/verification/scoring.py exact_kl) and same-top rate."""
        import numpy as np

        from loraship.verification.scoring import exact_kl

        p, q = self(base), self(other)
        kls = np.maximum(exact_kl(p, q), 0)
        return {
            "kl_mean": float(kls.mean()),
            "kl_p99": float(np.percentile(kls, 99)),
            "same_top": float((p.argmax(-1) == q.argmax(-1)).mean()),
            "positions": int(len(kls)),
        }


def tensor_arrays(path: Path) -> dict:
    """Every layer linear weight of a GGUF, dequantized to float32 (gguf-py), by name."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    out = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            out[t.name] = (t.tensor_type.name, np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).ravel())
    return out


def delta_kept(base: dict, merged: dict, quant: dict) -> dict:
    """Per ggml type of the quantized tensors: <Q - base, merged - base> / |merged - base|^2 over those tensors,
    and the relative L2 error |Q - merged| / |merged|."""
    import numpy as np

    acc: dict[str, list[float]] = {}
    for name, (qtype, q) in quant.items():
        b, m = base[name][1].astype(np.float64), merged[name][1].astype(np.float64)
        d = m - b
        a = acc.setdefault(qtype, [0.0, 0.0, 0.0, 0.0, 0])
        a[0] += float(np.dot(q - b, d))
        a[1] += float(np.dot(d, d))
        a[2] += float(np.sum((q - m) ** 2))
        a[3] += float(np.dot(m, m))
        a[4] += 1
    return {
        t: {
            "tensors": a[4],
            "delta_kept": round(a[0] / a[1], 4) if a[1] else None,
            "rel_l2_error": round((a[2] / a[3]) ** 0.5, 5),
            "delta_rel_l2": round((a[1] / a[3]) ** 0.5, 5),
        }
        for t, a in sorted(acc.items())
    }


def types_of(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def check_types(path: Path, rung: str) -> dict:
    """The rung's tensor types read back against quant_mix's prediction; the fallback count."""
    from loraship.llamacpp.quant_mix import gguf_tensors, summarize, tensor_types

    tensors, n_layer, n_gqa = gguf_tensors(path)
    predicted = tensor_types(tensors, rung, n_layer, n_gqa)
    actual = types_of(path)
    wrong = [t.name for t in predicted if t.got is not None and actual[t.name] != t.got]
    mix = summarize(predicted, rung)
    counts: dict[str, int] = {}
    for t in predicted:
        if t.got is not None:
            counts[actual[t.name]] = counts.get(actual[t.name], 0) + 1
    return {
        "types": counts,
        "token_embd": actual.get("token_embd.weight"),
        "quantized": mix.quantized,
        "fell_back": mix.fell_back,
        "fallback_types": list(mix.fallback_types),
        "predicted_types_wrong": wrong,
        "predicted_bytes": mix.weight_bytes,
    }


def tensor_bytes_digest(path: Path) -> str:
    from gguf import GGUFReader

    h = hashlib.sha256()
    for t in GGUFReader(path).tensors:
        h.update(t.name.encode())
        h.update(bytes(t.data))
    return h.hexdigest()


def grid_round_trip(packaged: Path, seed: int = 0) -> list[dict]:
    """The mechanism without a pipeline: layer 0's attn_q and a layer-3 ffn_up of the packaged Q4_K_M GGUF (llama.cpp
    stored them as Q5_0), dequantized and rounded to bf16 as transformers saves them, plus a rank-8 change of 0.3-3%
    of their RMS (a LoRA's), re-quantized with gguf-py's reference quantizers: how much of the change each keeps
    (<Q - W0, D> / |D|^2), its relative L2 error against the changed weights, and the share of weights equal to the
    base's."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize, quantize

    def bf16(x):
        u = x.astype(np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)

    tensors = {t.name: t for t in GGUFReader(packaged).tensors}
    rng = np.random.default_rng(seed)
    rows = []
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_up.weight"):
        t = tensors[name]
        w0 = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        rms = float(np.sqrt((w0.astype(np.float64) ** 2).mean()))
        for size in (0.003, 0.01, 0.03):
            d = rng.standard_normal((w0.shape[0], 8)) @ rng.standard_normal((8, w0.shape[1]))
            d *= size * rms / np.sqrt((d**2).mean())
            merged = bf16(bf16(w0) + d)
            change = merged.astype(np.float64) - w0
            for qtype in ("Q5_0", "Q5_1", "Q8_0"):
                t_ = GGMLQuantizationType[qtype]
                q = dequantize(quantize(merged, t_), t_).astype(np.float64)
                rows.append(
                    {
                        "tensor": name,
                        "source_type": t.tensor_type.name,
                        "change_rms": size,
                        "requantized_as": qtype,
                        "change_kept": round(float(((q - w0) * change).sum() / (change * change).sum()), 4),
                        "rel_l2_vs_merged": round(float(np.linalg.norm(q - merged) / np.linalg.norm(merged)), 5),
                        "equal_to_base": round(float((q == w0).mean()), 4),
                    }
                )
    return rows


def base_only(model: Path, root: Path, rungs: list[str], tools: Path) -> dict:
    """The base model alone (no fine-tune): its F16 GGUF, each rung made from it by llama-quantize (no importance
    matrix), llama-perplexity's KL and ours (on llama-perplexity's tokens) against the F16."""
    from loraship.stages.convert import convert

    f16 = root / "base-F16.gguf"
    if not f16.is_file():
        convert(model, f16)
    text = kl_text(root)
    kld = kld_base(tools / "llama-perplexity", f16, text, root / "base-F16.kld")
    bos = gguf_bos(f16)
    lp = Logprobs([[bos, *c[1:]] if bos is not None else c for c in read_kld_tokens(kld)[1]])
    rows = []
    for rung in rungs:
        out = root / f"base-{rung}.gguf"
        if not out.is_file():
            run([str(tools / "llama-quantize"), str(f16), str(out), rung, str(os.cpu_count() or 2)], rung)
        rows.append(
            {
                "quant": rung,
                "bytes": out.stat().st_size,
                "peer": peer_kl(tools / "llama-perplexity", out, kld),
                "ours": lp.kl(f16, out),
            }
        )
        print(f"base {rung}: {rows[-1]}", flush=True)
    return {"what": base_only.__doc__, "command": " ".join([Path(sys.executable).name, *sys.argv]), "rows": rows}


def imatrix_effect(root: Path, model: Path, rungs: list[str], tools: Path, imatrix: Path, merged_f16: Path) -> dict:
    """What the importance matrix changes, on one run's F16 GGUFs: each rung made by llama-quantize by hand with and
    without the run's matrix, from the base model's F16 (no fine-tune: does the base still come back as the packaged
    values?) and from the merged model's (does the fine-tune survive?). Per ggml type: delta_kept (merged only),
    rel_l2_error against its own F16, and the share of weights equal to the base's values; llama-perplexity's KL
    against its own F16."""
    import numpy as np

    from loraship.stages.convert import convert

    base_f16 = root / "base-F16.gguf"
    if not base_f16.is_file():
        convert(model, base_f16)
    text = kl_text(root)
    perplexity = tools / "llama-perplexity"
    klds = {"base": kld_base(perplexity, base_f16, text, root / "base-F16.kld")}
    klds["merged"] = kld_base(perplexity, merged_f16, text, root / "merged-F16.kld")
    f16 = {"base": base_f16, "merged": merged_f16}
    base_arrays, merged_arrays = tensor_arrays(base_f16), tensor_arrays(merged_f16)
    rows = []
    for rung in rungs:
        for source in ("base", "merged"):
            for with_matrix in (False, True):
                out = root / f"effect-{source}-{rung}-{'imatrix' if with_matrix else 'plain'}.gguf"
                if not out.is_file():  # written beside and renamed, as kld_base
                    part = out.with_name(out.name + ".part")
                    matrix = ["--imatrix", str(imatrix)] if with_matrix else []
                    cmd = [str(tools / "llama-quantize"), *matrix, str(f16[source]), str(part), rung]
                    run([*cmd, str(os.cpu_count() or 2)], f"llama-quantize {out.name}")
                    part.replace(out)
                quant = tensor_arrays(out)
                by_type: dict[str, list[float]] = {}
                for name, (qtype, q) in quant.items():
                    b = base_arrays[name][1].astype(np.float64)
                    ref = (merged_arrays if source == "merged" else base_arrays)[name][1].astype(np.float64)
                    a = by_type.setdefault(qtype, [0.0, 0.0, 0.0, 0])
                    a[0] += float(np.sum((q - ref) ** 2))
                    a[1] += float(np.dot(ref, ref))
                    a[2] += float(np.sum(q == b))
                    a[3] += q.size
                types = {
                    t: {"rel_l2_error": round((a[0] / a[1]) ** 0.5, 5), "equal_to_base": round(a[2] / a[3], 4)}
                    for t, a in sorted(by_type.items())
                }
                if source == "merged":
                    for t, d in delta_kept(base_arrays, merged_arrays, quant).items():
                        types[t]["delta_kept"] = d["delta_kept"]
                row = {
                    "quant": rung,
                    "source": source,
                    "imatrix": with_matrix,
                    "bytes": out.stat().st_size,
                    "types": types,
                    "peer_vs_own_f16": peer_kl(perplexity, out, klds[source]),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"what": imatrix_effect.__doc__, "imatrix": str(imatrix), "rows": rows}


def verify_figures(section: dict) -> dict:
    """One rung's figures from verify.json: its gates' verdict and what they judged."""
    a = section.get("eval_agreement") or {}
    gates = section["gates"]
    return {
        "passed": section["passed"],
        "kl_mean": a.get("kl_mean"),
        "kl_p99": a.get("kl_p99"),
        "same_top": a.get("same_top_rate"),
        "ppl_ratio": a.get("perplexity_ratio"),
        "finetune_kl_ratio": a.get("finetune_kl_ratio"),
        "kl_tokens": a.get("scored_tokens"),
        "golden_match": section.get("golden_match"),
        "finetune_kept_answers": (gates.get("finetune_kept_answers") or {}).get("value"),
        "failed_gates": [k for k, g in gates.items() if not g["passed"]],
    }


def verify_result(config, verify: dict, qdir: Path, rungs: list[str], steps: int, seconds: dict, failure) -> dict:
    """--verify-only's record: each rung's verify figures, the stages' seconds and verify's failure message."""
    rows = [
        {"quant": q, "bytes": (qdir / f"model-{q}.gguf").stat().st_size, **verify_figures(verify["quantizations"][q])}
        for q in rungs
    ]
    matrix = json.loads((qdir / "manifest.json").read_text())["metrics"].get("imatrix") or {}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    return {
        "what": f"verify's figures: real google/gemma-3-270m, {steps} LoRA steps of 4 rows on the demo's chat data, "
        f"each rung quantized {'with' if config.imatrix_in_use else 'without'} the run's importance matrix and "
        "verified on the CPU against the merged model",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.machine(), "cores": os.cpu_count()},
        "imatrix": config.imatrix_in_use,
        "imatrix_tokens": matrix.get("text_tokens"),
        "stage_seconds": seconds,
        "eval_loss": next(iter(verify["quantizations"].values()))["gates"]["eval_loss_improved"]["value"],
        "verify_ladder_kl_order": [r["quant"] for r in sorted(rows, key=lambda r: r["kl_mean"])],
        "verify_failure": failure,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quant_ladder_gemma3.json")
    parser.add_argument("--workdir", type=Path, default=REPO / ".loraship" / "bench-gemma3")
    parser.add_argument("--rungs", nargs="+", default=RUNGS)
    parser.add_argument("--steps", type=int, default=16, help="LoRA steps of 4 rows")
    parser.add_argument("--no-imatrix", action="store_true", help="quantize with llama-cpp-python's binding")
    parser.add_argument(
        "--verify-only", action="store_true", help="stop after verify: its figures per rung, no analysis phase"
    )
    parser.add_argument("--base-only", action="store_true", help="only the base model's ladder against its F16")
    parser.add_argument(
        "--imatrix-effect",
        action="store_true",
        help="only each rung by hand with and without the run's importance matrix, from the base and the merged F16 "
        "(after a pipeline run in --workdir)",
    )
    parser.add_argument(
        "--grid-only", action="store_true", help="only the re-quantization of the packaged weights (seconds)"
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=REPO / ".loraship" / "models" / "real-gemma-3-270m",
        help="where the real Gemma 3 270M HF folder is (made there if missing)",
    )
    args = parser.parse_args()

    from loraship.errors import LorashipError
    from loraship.fixtures.families import real_gemma3
    from loraship.llamacpp.tools import build_info, tools_dir
    from loraship.runtime.stage import stage_dir

    if args.base_only:
        from loraship.fixtures.families import real_gemma3
        from loraship.llamacpp.tools import tools_dir

        result = base_only(real_gemma3(args.model_dir), args.workdir.resolve(), args.rungs, tools_dir(build=False))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    if args.imatrix_effect:
        root = args.workdir.resolve()
        config = config_for(real_gemma3(args.model_dir), root, args.rungs, args.steps)
        merged_f16 = stage_dir(config, "convert") / "model-F16.gguf"
        imatrix = stage_dir(config, "quantize") / "imatrix.gguf"
        result = imatrix_effect(
            root, real_gemma3(args.model_dir), args.rungs, tools_dir(build=False), imatrix, merged_f16
        )
        result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    if args.grid_only:
        from loraship.fixtures.families import gemma3_gguf

        rows = grid_round_trip(gemma3_gguf())
        for r in rows:
            print(
                f"{r['tensor']} ({r['source_type']}) change {r['change_rms']:.1%} RMS -> {r['requantized_as']}: kept "
                f"{r['change_kept']:.3f}, rel L2 vs merged {r['rel_l2_vs_merged']:.4f}, equal to base "
                f"{r['equal_to_base']:.3f}"
            )
        command = " ".join([Path(sys.executable).name, *sys.argv])
        out = {"what": grid_round_trip.__doc__, "command": command, "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        return
    seconds: dict[str, float] = {}
    root = args.workdir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    model = real_gemma3(args.model_dir)
    config = config_for(model, root, args.rungs, args.steps, imatrix=not args.no_imatrix)
    failure = None
    for stage in STAGES:
        started = time.time()
        try:
            importlib.import_module(f"loraship.stages.{stage}").run(config)
        except LorashipError as e:
            if stage != "verify":
                raise
            failure = str(e)
        seconds[stage] = round(time.time() - started, 1)
        print(f"{stage}: {seconds[stage]} s", flush=True)
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    qdir = stage_dir(config, "quantize")
    if args.verify_only:
        result = verify_result(config, verify, qdir, args.rungs, args.steps, seconds, failure)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    merged_f16 = stage_dir(config, "convert") / "model-F16.gguf"

    # The base model's F16 GGUF (no fine-tune), converted by the same pinned converter.
    from loraship.llamacpp.quantizing import quantize as binding_quantize
    from loraship.stages.convert import convert

    base_f16 = root / "base-F16.gguf"
    if not base_f16.is_file():
        convert(model, base_f16)
    try:
        tools = tools_dir(build=False)
    except LorashipError:
        tools = None  # llama-perplexity and llama-quantize not built: our KL only
    text = kl_text(root)
    merged_kld = base_kld = None
    if tools:
        perplexity = tools / "llama-perplexity"
        merged_kld = kld_base(perplexity, merged_f16, text, root / "merged-F16.kld")
        base_kld = kld_base(perplexity, base_f16, text, root / "base-F16.kld")
    # Like for like with llama-perplexity where it ran: its own tokens (BOS over each chunk's first), else ours.
    chunks = own_chunks(merged_f16, text)
    if merged_kld is not None:
        bos = gguf_bos(merged_f16)
        chunks = [[bos, *c[1:]] if bos is not None else c for c in read_kld_tokens(merged_kld)[1]]
    lp = Logprobs(chunks)
    started = time.time()
    base_arrays, merged_arrays = tensor_arrays(base_f16), tensor_arrays(merged_f16)
    fine_tune = lp.kl(merged_f16, base_f16)
    if tools:
        fine_tune["peer"] = peer_kl(perplexity, base_f16, merged_kld)
    print(f"fine-tune's own KL(merged F16 || base F16) {fine_tune['kl_mean']:.4f}", flush=True)

    rows = []
    for rung in args.rungs:
        gguf = qdir / f"model-{rung}.gguf"
        section = verify["quantizations"][rung]
        row = {
            "quant": rung,
            "bytes": gguf.stat().st_size,
            "verify": verify_figures(section),
            **check_types(gguf, rung),
            "ours_vs_merged_f16": lp.kl(merged_f16, gguf),
            "ours_vs_base_f16": lp.kl(base_f16, gguf),
            "delta_kept": delta_kept(base_arrays, merged_arrays, tensor_arrays(gguf)),
        }
        if tools:
            row["peer_vs_merged_f16"] = peer_kl(tools / "llama-perplexity", gguf, merged_kld)
            row["peer_vs_base_f16"] = peer_kl(tools / "llama-perplexity", gguf, base_kld)
        rows.append(row)
        print(
            f"{rung:7s} {row['bytes'] / 1e6:6.0f} MB  verify KL {row['verify']['kl_mean']:.4f} "
            f"ft-ratio {row['verify']['finetune_kl_ratio']}  "
            f"ours KL(merged F16) {row['ours_vs_merged_f16']['kl_mean']:.4f} "
            f"KL(base F16) {row['ours_vs_base_f16']['kl_mean']:.4f}  "
            + (f"peer KL(merged F16) {row['peer_vs_merged_f16']['kl_mean']:.4f}  " if tools else "")
            + f"fell back {row['fell_back']}/{row['quantized']}  types {row['types']}  delta kept "
            + ", ".join(f"{t} {d['delta_kept']}" for t, d in row["delta_kept"].items()),
            flush=True,
        )
    seconds["ours_and_delta"] = round(time.time() - started, 1)

    # The base model's own ladder, no fine-tune and no importance matrix (llama-cpp-python's binding): each rung
    # against its F16 (hypothesis: the packaged weights already being Q4_K_M values makes re-quantizing them lossy).
    started = time.time()
    base_rows = []
    for rung in args.rungs:
        out = root / f"base-{rung}.gguf"
        if not out.is_file():
            binding_quantize(base_f16, out, rung)
        base_rows.append({"quant": rung, "bytes": out.stat().st_size, **lp.kl(base_f16, out)})
        if tools:
            base_rows[-1]["peer"] = peer_kl(tools / "llama-perplexity", out, base_kld)
        print(f"base {rung:7s} ours KL(base F16) {base_rows[-1]['kl_mean']:.5f}", flush=True)
    seconds["base_ladder"] = round(time.time() - started, 1)

    hand = None
    if tools and (qdir / "imatrix.gguf").is_file():  # llama-quantize by hand on the same F16 GGUF and matrix
        by_hand = root / "hand-Q4_K_M.gguf"
        if not by_hand.is_file():
            run(
                [
                    str(tools / "llama-quantize"),
                    "--imatrix",
                    str(qdir / "imatrix.gguf"),
                    str(merged_f16),
                    str(by_hand),
                    "Q4_K_M",
                    str(os.cpu_count() or 2),
                ],
                "llama-quantize Q4_K_M by hand",
            )
        hand = {"same_tensor_bytes": tensor_bytes_digest(by_hand) == tensor_bytes_digest(qdir / "model-Q4_K_M.gguf")}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    result = {
        "what": "bench/quant_gemma3.py: real google/gemma-3-270m (weights dequantized from the packaged Q4_K_M GGUF), "
        f"{args.steps} LoRA steps on the demo's chat data, each rung quantized "
        f"({'with the run importance matrix' if config.imatrix_in_use else 'with no importance matrix'}) and "
        "verified against the merged model; KL against the merged and the base F16 GGUFs",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.machine(), "cores": os.cpu_count()},
        "imatrix": config.imatrix_in_use,
        "kl_note": f"ours_*: loraship/verification/scoring.py exact_kl between two GGUFs in llama-cpp-python over "
        f"the demo's chats (kl_text) cut as llama-perplexity cuts them ({len(chunks)} chunks of {PEER_CTX}, the "
        "second half of each scored, BOS over each chunk's first token); peer_*: llama-perplexity --kl-divergence "
        f"{' '.join(PEER_ARGS)} on the same text" + ("" if tools else " (not run: the tools were not built)"),
        "fine_tune_kl": fine_tune,
        "verify_failure": failure,
        "verify_ladder_kl_order": [r["quant"] for r in sorted(rows, key=lambda r: r["verify"]["kl_mean"])],
        "rows": rows,
        "base_ladder": base_rows,
        "hand_llama_quantize_Q4_K_M": hand,
        "tools_build": build_info() if tools else None,
        "seconds": seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"verify KL order {result['verify_ladder_kl_order']}; wrote {args.out}")


if __name__ == "__main__":
    main()
