"""Verify: prove the shipped GGUF under the llama.cpp users will run it with, loading nothing else.

Runs on the small inference GPU (CPU in tests) with the GGUF alone: every layer on the GPU at
`target_context`, compared against what the reference stage stored from the merged HF model. For each
quantization, top to bottom: read the GGUF's metadata and tensor layout, predict its GPU memory
(loraship/verification/device.py), measure it in a fresh llama.cpp process (measure_child.py: KL divergence,
perplexity, tokenizer parity and golden answers, scored as scoring.py says), serve it through llama.cpp's
OpenAI-compatible server with the sampling settings the artifact ships (loraship/llamacpp/served.py,
loraship/sampling.py, recorded as verify.json's "sampling"), and judge each figure with a gate
(loraship/verification/gates.py, which lists them). Every gate carries its evidence count and fails with
"not enough evidence" below the config's minimum, never passing as 0/0.

With several quantizations each GGUF is verified the same way, in its own llama.cpp process;
verify.json keeps the primary's (the first's) report and gates at its top level, where a
one-quantization verify.json has them, the others' gates beside them as '<quantization>/<gate>',
and a section per quantization under "quantizations". With `quantization: auto` the ladder is verified
smallest first and the first rung that passes is shipped, alone.

With adapter_gguf: base GGUF + adapter GGUF (convert's) against the merged GGUF, both under llama.cpp:
mean KL divergence and same-top-token rate on the eval texts (adapter_kl_mean_max, adapter_same_top_min),
gates that exist only when the adapter GGUF does.
"""

from __future__ import annotations

import json
import logging
import time

from loraship.constants import (
    ADAPTER_GGUF,
    REFERENCE_FILE,
    REFERENCE_TOPK_FILE,
    VERIFY_FILE,
    base_gguf_name,
    quantized_gguf_name,
)
from loraship.errors import IntegrityError, StageFailed
from loraship.llamacpp.gguf_info import read_gguf_apart
from loraship.llamacpp.served import served_check
from loraship.planning import inference_memory as im
from loraship.planning.resources import cpu_count
from loraship.runtime.lineage import converted_from
from loraship.runtime.manifest import atomic_write_json
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir
from loraship.sampling import GREEDY
from loraship.verification.device import check_gpu_size, memory_plan, pick_device
from loraship.verification.figures import draw_ladder, failed_gates, ladder_row, passed_metrics
from loraship.verification.gates import (
    Gate,
    adapter_kl_mean_gate,
    adapter_same_top_gate,
    agreement_gates,
    chat_template_gate,
    eval_loss_gate,
    file_type_gate,
    fits_target_gpu_gate,
    golden_gates,
    served_gate,
    special_tokens_gate,
)
from loraship.verification.measure_child import measure_apart
from loraship.verification.way_out import failure_message

STAGE = "verify"
UPSTREAM = ("train", "reference", "quantize")
FIELDS = (
    "golden_match_min",
    "golden_margin",
    "decisive_flips_max",
    "perplexity_ratio_max",
    "kl_mean_max",
    "kl_p99_max",
    "same_top_min",
    "min_golden_prompts",
    "min_decisive_positions",
    "min_scored_tokens",
    "target_gpu_memory_gib",
    "target_context",
    "n_cpu_moe",
    "device",
    "quantization",
    "max_new_tokens",
    "seed",
    "adapter_gguf",
    "kl_topk_mass_min",
    "finetune_kl_fraction_max",
)
ADAPTER_FIELDS = ("adapter_kl_mean_max", "adapter_same_top_min")  # key the stage only with adapter_gguf on
MERGED_TOPK_FILE = ".merged-topk.npz"  # the merged GGUF's top-k for the adapter run; removed once scored
log = logging.getLogger("loraship.verify")


@exclusive
def run(config) -> dict:
    primary = config.primary_quantization
    # adapter_gguf: convert's adapter and base GGUFs are inputs too (only those, not its F16 model).
    adapter = {"convert": (ADAPTER_GGUF, base_gguf_name(primary))} if config.adapter_gguf else {}
    ctx = open_stage(
        config, STAGE, UPSTREAM + tuple(adapter), FIELDS + (ADAPTER_FIELDS if adapter else ()), consumes=adapter
    )
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    reference = json.loads((ctx.upstream_dir("reference") / REFERENCE_FILE).read_text(encoding="utf-8"))
    check_lineage(config, reference)
    device = pick_device(config)
    check_gpu_size(config, device)
    if config.auto_quantization:
        return run_ladder(ctx, config, reference, device)
    # The adapter's base is quantized like the primary, so the pair is compared with the primary GGUF.
    sections = {
        q: verify_quantization(ctx, config, q, reference, device, with_adapter=bool(adapter) and q == primary)
        for q in config.quantizations
    }
    gates = all_gates(sections)
    passed = all(g["passed"] for g in gates.values())
    head = sections[primary]
    draw_ladder(
        ctx,
        config,
        [ladder_row(q, sections[q]) for q in config.quantizations],
        shipped=primary,
        shipped_label="primary",
    )
    verdict = {
        **head,
        "passed": passed,
        "gates": gates,
        "quantizations": sections,
        "verify_seconds": round(time.time() - ctx.started, 2),
    }
    atomic_write_json(ctx.dir / VERIFY_FILE, verdict)
    if not passed:
        raise StageFailed(failure_message(sections, gates, ctx.dir / VERIFY_FILE))
    shown = ("kl_mean", "same_top_rate", "scored_tokens")
    return ctx.finish(
        {
            **passed_metrics(head, gates, sections),
            **({"adapter_gguf": {k: head["adapter_gguf"].get(k) for k in shown}} if adapter else {}),
        }
    )


def check_lineage(config, reference: dict) -> None:
    """The reference must come from the merged model this GGUF was converted from; a convert manifest
    that does not say which merged model that was is refused (loraship/runtime/lineage.py converted_from)."""
    if converted_from(config) != reference.get("merged_digest"):
        raise IntegrityError(
            "the reference stage's results were computed for another merged model than the one this GGUF was "
            "converted from; run the reference stage again for this run (loraship run CONFIG re-runs it)"
        )


def verify_quantization(ctx, config, quantization: str, reference: dict, device: str, with_adapter: bool) -> dict:
    """One quantized GGUF against the reference: its gates and what was measured (a section of verify.json)."""
    gguf_path = ctx.upstream_dir("quantize") / quantized_gguf_name(quantization)
    fields, layout = read_gguf(gguf_path)
    report: dict = {"quantization": quantization, "gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size}
    memory = report["memory"] = memory_plan(layout, config)
    load = load_settings(config, reference, memory, device)
    log.info(
        "loading %s on %s in a fresh process: n_ctx %d, %s GPU layers%s",
        gguf_path.name,
        device,
        load["n_ctx"],
        "all" if load["n_gpu_layers"] == -1 else load["n_gpu_layers"],
        f", the experts of the first {load['n_cpu_moe']} in CPU memory (n_cpu_moe)" if load.get("n_cpu_moe") else "",
    )
    measured = measure_apart(
        ctx,
        {
            "gguf": str(gguf_path),
            **load,
            "seed": config.seed,
            "reference": str(ctx.upstream_dir("reference") / REFERENCE_FILE),
            "topk": str(ctx.upstream_dir("reference") / REFERENCE_TOPK_FILE),
            "max_new_tokens": config.max_new_tokens,
            "golden_margin": config.golden_margin,
            "min_scored_tokens": config.min_scored_tokens,
            "merged_topk_out": str(ctx.dir / MERGED_TOPK_FILE) if with_adapter else None,
        },
    )
    agreement, golden = measured["eval_agreement"], measured["golden"]
    # This quantization's limits: the config's where it sets them, else its calibrated defaults.
    report.update(
        load,
        load_seconds=measured["load_seconds"],
        tokenizer_parity=measured["tokenizer_parity"],
        **({"tensor_buft_overrides": measured["tensor_buft_overrides"]} if load.get("n_cpu_moe") else {}),
        eval_agreement=agreement,
        gate_limits=config.gate_limits(quantization),
    )
    limits = config.model_copy(update=report["gate_limits"])
    gates = [
        file_type_gate(fields, quantization),
        chat_template_gate(fields, reference),
        special_tokens_gate(measured["llama_cpp_tokens"], fields, reference),
        *agreement_gates(report["tokenizer_parity"], agreement, config, limits, reference["top_k"]),
        *golden_gates(golden, reference, config, limits),
    ]
    report.update(golden_report(golden, measured["builtin_template_engine"]))
    gates += serve(ctx, config, quantization, reference, golden, report)
    gates.append(eval_loss_gate(ctx.upstream["train"]["metrics"]))
    report["gpu_memory"] = gpu_memory(memory, layout, load["n_ctx"], measured["gpu_used_gib"], config)
    gates.append(fits_target_gpu_gate(memory, report["gpu_memory"], layout, config))
    if with_adapter:
        report["adapter_gguf"], adapter = adapter_gates(
            ctx,
            config,
            quantization,
            {**load, "seed": config.seed, "reference": str(ctx.upstream_dir("reference") / REFERENCE_FILE)},
        )
        gates += adapter
    n = len(reference["golden"])
    report.update(
        prompt_tokens_per_s=agreement.get("prompt_tokens_per_s"),
        gen_tokens_per_s=golden["gen_tokens_per_s"],
        golden_match=golden["matches"] / n if n else 0.0,  # token for token; the gate also counts near-ties
        golden_parted_at_near_tie=golden["parted_at_near_tie"],
    )
    return {"passed": all(g.passed for g in gates), "gates": {g.name: g.to_json() for g in gates}, **report}


def read_gguf(gguf_path) -> tuple[dict, im.GGUFLayout]:
    """The GGUF's metadata fields and tensor layout, read in a child: llama.cpp loads this file next
    (loraship/llamacpp/gguf_info.py says why)."""
    info = read_gguf_apart(gguf_path)
    if info["layout"] is None:
        raise IntegrityError(
            f"{gguf_path}: its metadata gives no tensor layout ({info['layout_error']}); "
            "run the convert and quantize stages again"
        )
    return info["fields"], im.GGUFLayout(**info["layout"])


def load_settings(config, reference: dict, memory: dict, device: str) -> dict:
    """How llama.cpp loads the GGUF: on the GPU at the context the model must serve, every layer where it fits;
    on the CPU (tests) just the context the texts need."""
    needed = max(
        [len(r["input_ids"]) for r in reference["eval"]]
        + [len(r["prompt_ids"]) + config.max_new_tokens + 1 for r in reference["golden"]]
    )
    n_ctx = max(config.target_context, needed) if device == "cuda" else max(256, needed)
    n_gpu_layers = (-1 if memory["fits"] else memory["gpu_layers_at_target_context"]) if device == "cuda" else 0
    # A mixture of experts' n_cpu_moe goes to llama.cpp on the CPU too: the same loads, the experts' buffers named.
    moe = {"n_cpu_moe": memory["n_cpu_moe"]} if "n_cpu_moe" in memory else {}
    return {"device": device, "n_ctx": n_ctx, "n_gpu_layers": n_gpu_layers, **moe}


def golden_report(golden: dict, builtin_engine: dict) -> dict:
    """What verify.json keeps of the golden answers, and the sampling settings the served check and the artifact
    use (the Modelfile, the card's commands): greedy, as verify's own argmax decoding."""
    report: dict = {"golden_answers": golden["answers"]}
    with_reference = [a for a in golden["answers"] if "reference" in a]
    if with_reference:
        right = sum(a["gguf"] == a["reference"] for a in with_reference)
        report["golden_accuracy_vs_reference"] = right / len(with_reference)
    return {**report, "builtin_template_engine": builtin_engine, "sampling": GREEDY.record()}


def serve(ctx, config, quantization: str, reference: dict, golden: dict, report: dict) -> list[Gate]:
    """The GGUF behind llama.cpp's OpenAI-compatible server on every golden chat prompt, each with the same GGUF's
    own greedy answer (measure's, outside the server): report["served"] and its gate; none without chats."""
    chats = [
        {**r, "gguf_answer_text": a["gguf"], "gguf_match": a["match"], "gguf_own": a["gguf_own"]}
        for r, a in zip(reference["golden"], golden["answers"])
        if r["kind"] == "chat"
    ]
    if not chats:
        return []
    gguf_path = ctx.upstream_dir("quantize") / quantized_gguf_name(quantization)
    log.info(
        "serving %s through llama.cpp's OpenAI-compatible server: %d golden chats, whole and streamed",
        gguf_path.name,
        len(chats),
    )
    report["served"] = served_check(
        gguf_path,
        chats,
        config.max_new_tokens,
        report["n_ctx"],
        report["n_gpu_layers"],
        cpu_count(),
        reference["tokenizer"].get("markers", []),
        ctx.dir / f"server-{quantization}.log",
        GREEDY,
        reference["tokenizer"].get("template_kwargs"),
        n_cpu_moe=report.get("n_cpu_moe", 0),
    )
    return [served_gate(report["served"], config)]


def gpu_memory(memory: dict, layout, n_ctx: int, measured_gib: float | None, config) -> dict:
    """Predicted GiB of the load verify made (all layers, or those that fit) beside what NVML measured."""
    predicted = (
        memory["predicted"]["total_gib"]
        if memory["fits"]
        else im.predict_gpu(layout, n_ctx, memory["gpu_layers_at_target_context"], memory.get("n_cpu_moe", 0))[
            "total_gib"
        ]
    )
    return {"predicted_gib": predicted, "measured_gib": measured_gib, "target_gpu_gib": config.target_gpu_memory_gib}


def adapter_gates(ctx, config, quantization: str, job: dict) -> tuple[dict, list[Gate]]:
    """Base GGUF + adapter GGUF against the merged GGUF's top-k: its report and its gates."""
    convert_dir = ctx.upstream_dir("convert")
    base, lora = convert_dir / base_gguf_name(quantization), convert_dir / ADAPTER_GGUF
    merged_topk = ctx.dir / MERGED_TOPK_FILE
    log.info("loading %s with the adapter %s in a fresh process", base.name, lora.name)
    try:
        measured = measure_apart(
            ctx,
            {**job, "gguf": str(base), "lora": str(lora), "merged_topk": str(merged_topk)},
            entry="measure_adapter",
        )
    finally:
        merged_topk.unlink(missing_ok=True)
    agreement = measured["eval_agreement"]
    note = f"{base.name} + {lora.name} against the merged GGUF, both in llama.cpp, on the eval texts"
    names = {"hf_perplexity": "merged_gguf_perplexity", "gguf_perplexity": "base_plus_adapter_perplexity"}
    report = {
        "base_gguf": str(base),
        "adapter_gguf": str(lora),
        "load_seconds": measured["load_seconds"],
        **{names.get(k, k): v for k, v in agreement.items()},
    }
    return report, [adapter_kl_mean_gate(agreement, config, note), adapter_same_top_gate(agreement, config, note)]


def all_gates(sections: dict[str, dict]) -> dict[str, dict]:
    """Every quantization's gates in one mapping: the primary's (first) under their own names, where
    readers of a one-quantization verify.json find them, the others' as '<quantization>/<gate>'."""
    primary, *others = sections
    return {
        **sections[primary]["gates"],
        **{f"{q}/{name}": g for q in others for name, g in sections[q]["gates"].items()},
    }


def run_ladder(ctx, config, reference: dict, device: str) -> dict:
    """quantization: auto. Verify the ladder smallest first and stop at the first rung that passes every
    gate under its own limits, the target-GPU fit included: that one is shipped, alone. Larger rungs
    are not verified (a smaller one already keeps the fine-tune)."""
    sections: dict[str, dict] = {}
    chosen = None
    for q in config.quantizations:
        sections[q] = verify_quantization(ctx, config, q, reference, device, with_adapter=False)
        log.info(
            "quantization auto: %s %s",
            q,
            "passed"
            if sections[q]["passed"]
            else "failed: " + ", ".join(k for k, g in sections[q]["gates"].items() if not g["passed"]),
        )
        if sections[q]["passed"]:
            chosen = q
            break
    ladder = [ladder_row(q, sections.get(q)) for q in config.quantizations]
    draw_ladder(ctx, config, ladder, shipped=chosen)
    head = sections[chosen] if chosen else sections[config.quantizations[-1]]
    verdict = {
        **head,
        "passed": chosen is not None,
        "quantization_auto": True,
        "shipped_quantization": chosen,
        "ladder": ladder,
        "quantizations": sections,
        "verify_seconds": round(time.time() - ctx.started, 2),
    }
    atomic_write_json(ctx.dir / VERIFY_FILE, verdict)
    if chosen is None:
        raise no_rung_passed(ctx, config, ladder, sections)
    return ctx.finish(
        {**passed_metrics(head, head["gates"], {chosen: head}), "shipped_quantization": chosen, "ladder": ladder}
    )


def no_rung_passed(ctx, config, ladder: list[dict], sections: dict[str, dict]) -> StageFailed:
    """quantization auto's error when no rung passed: none fits the target, or the largest that fits failed."""
    fitting = [r for r in ladder if r["fits"]]
    if not fitting:
        return StageFailed(
            f"quantization auto: no rung of {', '.join(config.quantizations)} fits target_gpu_memory_gib "
            f"{config.target_gpu_memory_gib:g} at target_context {config.target_context}; raise either, or ship a "
            f"smaller base model; details in {ctx.dir / VERIFY_FILE}"
        )
    largest = fitting[-1]
    return StageFailed(
        f"quantization auto: no rung passed every gate; the largest that fits the target, {largest['quant']}, "
        f"failed {failed_gates(sections[largest['quant']]['gates'])}. Train until the eval loss settles, loosen that "
        f"gate's limit in the config if the figure is acceptable, or raise target_gpu_memory_gib for a larger rung; "
        f"details in {ctx.dir / VERIFY_FILE}"
    )


if __name__ == "__main__":
    main(run)
