"""Quantize: F16 GGUF -> Q4_K_M (or any of config.Quantization; several in one run).

imatrix: true (the default): llama.cpp's llama-imatrix computes an importance matrix over this run's own
training texts (rendered with the chat template, special tokens parsed) on the F16 GGUF, once, and
llama-quantize --imatrix makes every quantization with it; both tools are built from the pinned llama.cpp
(loraship/llamacpp/tools.py). imatrix: false: llama-cpp-python's llama_model_quantize binding,
which cannot take an importance matrix.

Either way the quantizer is the llama.cpp that verify loads, and runs in a child process with a timeout, so
a hang or crash in native code cannot wedge the flow. Adding a quantization to the list re-runs this stage,
but a GGUF (or importance matrix) the last run made from the same F16 GGUF with the same llama.cpp and the
same importance matrix, still intact, is kept rather than made again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from loraship.constants import (
    F16_GGUF,
    GGUF_KEY_FILE_TYPE,
    IMATRIX_FILE,
    IMATRIX_TEXT_FILE,
    MERGED_DIR,
    quantized_gguf_name,
)
from loraship.errors import DataError, IntegrityError
from loraship.llamacpp.gguf_info import read_gguf, read_gguf_of_type
from loraship.llamacpp.quantizing import TIMEOUT_S, check_loads, quantize
from loraship.llamacpp.tools import ensure_tools
from loraship.runtime.manifest import atomic_path, check_outputs, library_versions, read_manifest, sha256_file
from loraship.runtime.proc import write_with_tool
from loraship.runtime.progress import artifact_key
from loraship.planning.resources import cpu_count
from loraship.llamacpp.imatrix_experts import check_expert_coverage, expert_coverage
from loraship.planning.preflight import check_free_disk, imatrix_text_problem
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir

STAGE = "quantize"
UPSTREAM = ("convert",)
FIELDS = ("quantization", "imatrix", "imatrix_min_tokens", "imatrix_max_tokens")
# With imatrix: the training texts are its input, rendered with the merged model's tokenizer and template.
IMATRIX_FIELDS = ("datasets", "eval_datasets", "val_set_size", "seed", "chat_template")
IMATRIX_CHUNK_MAX = 512  # llama-imatrix's own default context
log = logging.getLogger("loraship.quantize")


def calibration_texts(config, merged_dir: Path) -> tuple[list[str], int, dict]:
    """The training split's texts as training saw them (chat rows rendered with the merged model's template,
    special tokens as text), from the same cached encoding the train stage used: all of them where they hold at most
    imatrix_max_tokens, else whole rows drawn in a seeded order until that many tokens. Returns the texts, their
    tokens and what they were drawn from."""
    import random

    from transformers import AutoTokenizer

    from loraship.data import encoded_splits

    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    train, _ = encoded_splits(config, tokenizer)
    sizes = [len(record["input_ids"]) for _, record in train]
    total = sum(sizes)
    chosen = list(range(len(train)))
    if total > config.imatrix_max_tokens:
        # A seeded draw over the whole split, not its first rows: datasets are often sorted by source or topic.
        random.Random(config.seed).shuffle(chosen)
        taken, tokens = [], 0
        for i in chosen:
            if tokens >= config.imatrix_max_tokens:
                break
            taken.append(i)
            tokens += sizes[i]
        chosen = sorted(taken)
    texts = [train[i][1]["text"] for i in chosen]
    return texts, sum(sizes[i] for i in chosen), {"split_texts": len(train), "split_tokens": total}


def imatrix_chunk(config) -> int:
    """llama-imatrix's context: its default 512, less where imatrix_min_tokens allows a shorter text (it needs two
    chunks at least)."""
    return min(IMATRIX_CHUNK_MAX, config.imatrix_min_tokens // 2)


def check_imatrix_tokens(config, tokens: int) -> None:
    problem = imatrix_text_problem(config, tokens)
    if problem:
        raise DataError(problem)


def compute_imatrix(config, src: Path, out: Path, texts: list[str], tokens: int) -> dict:
    """llama-imatrix over the training texts on the F16 GGUF into out (GGUF); what it was made from."""
    from loraship.llamacpp.tools import tool

    check_imatrix_tokens(config, tokens)
    text_file = out.with_name(IMATRIX_TEXT_FILE)
    with atomic_path(text_file) as tmp:
        tmp.write_text("\n".join(texts) + "\n", encoding="utf-8")
    chunk = imatrix_chunk(config)
    # --parse-special: the template's markers (<|im_start|>, ...) are the special tokens training saw, not text;
    # -c = -b: one chunk per batch; --no-ppl: the perplexity of the calibration text is not needed.
    write_with_tool(
        lambda tmp: [
            str(tool("llama-imatrix")),
            "-m",
            str(src),
            "-f",
            str(text_file),
            "-o",
            str(tmp),
            "--output-format",
            "gguf",
            "--parse-special",
            "-c",
            str(chunk),
            "-b",
            str(chunk),
            "--no-ppl",
            "-t",
            str(cpu_count()),
            "--output-frequency",
            "1000000",
        ],
        out,
        f"llama-imatrix over {text_file.name}",
        TIMEOUT_S,
        on_line=lambda line: log.debug("llama-imatrix: %s", line.rstrip()),
    )
    return describe_imatrix(out) | {"text_tokens": tokens, "texts": len(texts), "text_sha256": sha256_file(text_file)}


def describe_imatrix(path: Path) -> dict:
    """An importance matrix read back with gguf-py: how many chunks of how many tokens, how many weight tensors it
    has statistics for; one llama-imatrix wrote with no statistics is refused."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise IntegrityError(
            f"{path}: not a readable importance matrix ({e}); delete it and run quantize again"
        ) from e

    def scalar(key):
        field = reader.get_field(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    weights = sorted({t.name.rsplit(".", 1)[0] for t in reader.tensors if t.name.endswith(".in_sum2")})
    if not weights:
        raise IntegrityError(
            f"{path}: llama-imatrix wrote no statistics for any weight; run quantize again, or set imatrix: false"
        )
    return {
        "file": path.name,
        "sha256": sha256_file(path),
        "chunks": scalar("imatrix.chunk_count"),
        "chunk_tokens": scalar("imatrix.chunk_size"),
        "weights": len(weights),
        "bytes": path.stat().st_size,
    }


def last_manifest(ctx) -> dict | None:
    try:
        return read_manifest(ctx.dir)
    except IntegrityError:
        return None


def same_source(ctx, last: dict | None) -> bool:
    """The last run of this stage read the same F16 GGUF (by sha256) with the same llama-cpp-python."""
    if last is None:
        return False
    f16 = ctx.upstream["convert"]["outputs"].get(F16_GGUF, {}).get("sha256")
    return last.get("inputs", {}).get("convert", {}).get("outputs", {}).get(F16_GGUF, {}).get(
        "sha256"
    ) == f16 and last.get("versions", {}).get("llama-cpp-python") == library_versions().get("llama-cpp-python")


def reusable_imatrix(ctx, last: dict | None, text_sha256: str) -> dict | None:
    """The last run's importance matrix, if it was computed from the same F16 GGUF and the same training texts
    and is still intact."""
    made = ((last or {}).get("metrics") or {}).get("imatrix")
    if not (
        made
        and same_source(ctx, last)
        and made.get("text_sha256") == text_sha256
        and IMATRIX_FILE in last.get("outputs", {})
        and not check_outputs(last, ctx.dir, only=(IMATRIX_FILE,))
    ):
        return None
    return made


def reusable(ctx, quantizations: list[str], imatrix_sha256: str | None = None) -> list[str]:
    """Outputs of the last run of this stage that are exactly what this run would make: the same
    F16 GGUF (by sha256), the same llama-cpp-python, the same importance matrix (or none), and the file still
    matching its manifest."""
    last = last_manifest(ctx)
    if not same_source(ctx, last):
        return []
    made = (last.get("metrics") or {}).get("quantizations") or {}
    names = [
        q
        for q in quantizations
        if quantized_gguf_name(q) in last.get("outputs", {})
        and (made.get(q) or {}).get("imatrix_sha256") == imatrix_sha256
    ]
    return [q for q in names if not check_outputs(last, ctx.dir, only=(quantized_gguf_name(q),))]


def describe(out: Path, quantization: str, f16_bytes: int) -> dict:
    info = read_gguf_of_type(out, quantization)
    size = out.stat().st_size
    return {
        "quantization": quantization,
        "file_type": info["fields"][GGUF_KEY_FILE_TYPE],
        "tensor_count": info["tensor_count"],
        "bytes": size,
        "compression_vs_f16": round(f16_bytes / size, 3),
    }


def merge_tokenizer_files(config) -> tuple[str, ...]:
    """The merged model's files other than its weights: what imatrix's calibration texts are rendered with."""
    from loraship.runtime.stage import stage_dir

    merge = read_manifest(stage_dir(config, "merge"))
    if merge is None:
        raise IntegrityError(
            f"stage 'merge' has no manifest in {stage_dir(config, 'merge')}; run it first "
            "(imatrix: true renders the training texts with the merged model's tokenizer)"
        )
    return tuple(
        rel
        for rel in merge["outputs"]
        if rel.startswith(MERGED_DIR + "/") and not rel.endswith((".safetensors", ".bin", ".pt", ".index.json"))
    )


def timed_imatrix(make) -> dict:
    """make()'s record of the matrix with the seconds it took; a first use's build of llama.cpp's tools (minutes)
    is done before the clock starts and reported apart, as tools_build_seconds (None: nothing was built)."""
    built = ensure_tools()
    if built is not None:
        log.info("quantize: built llama.cpp's tools in %.0f s (once per llama.cpp version, into the cache)", built)
    started = time.time()
    record = make()
    return record | {"seconds": round(time.time() - started, 1), "tools_build_seconds": built}


def depends_on(config) -> dict[str, tuple[str, ...]]:
    """The upstream files this run's result depends on beyond convert's: with imatrix, the merged model's tokenizer
    files (what the calibration texts are rendered with), not its weights. `loraship status` asks the same."""
    return {"merge": merge_tokenizer_files(config)} if config.imatrix_in_use else {}


@exclusive
def run(config) -> dict:
    from loraship.runtime.stage import stage_dir

    f16 = stage_dir(config, "convert") / F16_GGUF
    if f16.is_file():
        read_gguf(f16)  # a truncated input is named before anything else is asked of the run (the merge stage)
    # imatrix: the merged tokenizer (not its weights) and the data fields are inputs too.
    merge = depends_on(config)
    ctx = open_stage(
        config,
        STAGE,
        UPSTREAM + tuple(merge),
        FIELDS + (IMATRIX_FIELDS if merge else ()),
        consumes=merge,
        depends_on=merge,
    )
    if ctx.done:
        return ctx.done
    quantizations = config.quantizations
    src = ctx.upstream_dir("convert") / F16_GGUF
    read_gguf(src)  # refuses a truncated input with the file's name before any work
    imatrix, imatrix_path = None, None
    use_imatrix = config.imatrix_in_use
    if use_imatrix:
        texts, tokens, drawn_from = calibration_texts(config, stage_dir(config, "merge") / MERGED_DIR)
        check_imatrix_tokens(config, tokens)
        text_sha256 = calibration_sha256(texts)
        imatrix = reusable_imatrix(ctx, last_manifest(ctx), text_sha256)
        imatrix_path = ctx.dir / IMATRIX_FILE
    # A matrix still to be computed has no sha256 yet, and no GGUF of the last run was made with it.
    kept = (
        [] if use_imatrix and imatrix is None else reusable(ctx, quantizations, imatrix["sha256"] if imatrix else None)
    )
    keep_imatrix = (IMATRIX_FILE, IMATRIX_TEXT_FILE) if imatrix else ()
    reset_dir(ctx, keep=tuple(quantized_gguf_name(q) for q in kept) + keep_imatrix)
    if use_imatrix and imatrix is None:
        check_free_disk(ctx.dir, src.stat().st_size * 0.1, "quantize (importance matrix)")
        imatrix = timed_imatrix(lambda: compute_imatrix(config, src, imatrix_path, texts, tokens) | drawn_from)
        log.info(
            "quantize: importance matrix from %d training tokens in %d of %d texts (%d chunks of %d) in %.0f s",
            tokens,
            len(texts),
            drawn_from["split_texts"],
            imatrix["chunks"] or 0,
            imatrix["chunk_tokens"] or 0,
            imatrix["seconds"],
        )
    elif imatrix:
        log.info("quantize: keeping the importance matrix the last run computed from the same F16 GGUF and texts")
    if imatrix:
        # A mixture of experts: which (layer, expert) pairs the matrix saw; too few fails here, before quantizing.
        coverage = expert_coverage(imatrix_path, src)
        imatrix = {**imatrix, "expert_coverage": coverage}
        if coverage:
            log.info(
                "quantize: the importance matrix saw %d of %d (layer, expert) pairs (at least %d tokens each)",
                coverage["covered"],
                coverage["pairs"],
                coverage["least_tokens"],
            )
        check_expert_coverage(coverage, tokens, config.imatrix_max_tokens)
    todo = [q for q in quantizations if q not in kept]
    if kept:
        log.info("quantize: keeping %s, made from the same F16 GGUF by the last run", ", ".join(kept))
    if todo:
        check_free_disk(ctx.dir, src.stat().st_size * 0.6 * len(todo), f"quantize ({', '.join(todo)})")
    for quantization in todo:
        quantize(
            src,
            ctx.dir / quantized_gguf_name(quantization),
            quantization,
            progress_key=artifact_key(config.run_name, STAGE, "progress"),
            imatrix=imatrix_path,
        )
        check_loads(ctx.dir / quantized_gguf_name(quantization))
    quantizer = tools_quantizer() if imatrix else "llama-cpp-python llama_model_quantize"
    each = {
        q: {
            **describe(ctx.dir / quantized_gguf_name(q), q, src.stat().st_size),
            "reused": q in kept,
            "quantizer": quantizer,
            "imatrix_sha256": imatrix["sha256"] if imatrix else None,
        }
        for q in quantizations
    }
    # imatrix: true where no quantization asked for can use the matrix: said, not silently dropped.
    unused = (
        f"no importance matrix: {', '.join(quantizations)} cannot use one (llama.cpp's Q8_0 ignores it)"
        if config.imatrix and not use_imatrix
        else None
    )
    # The primary's figures stay at the top level, where one-quantization runs always had them.
    return ctx.finish({**each[quantizations[0]], "quantizations": each, "imatrix": imatrix, "imatrix_unused": unused})


def calibration_sha256(texts: list[str]) -> str:
    """The calibration file's sha256 before it is written: compute_imatrix writes exactly this text."""
    import hashlib

    return hashlib.sha256(("\n".join(texts) + "\n").encode("utf-8")).hexdigest()


def tools_quantizer() -> str:
    from loraship.constants import LLAMA_CPP_PYTHON_VERSION

    return f"llama-quantize --imatrix (llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, built from its sdist)"


if __name__ == "__main__":
    main(run)
