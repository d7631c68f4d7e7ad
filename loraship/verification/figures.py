"""verify's results as its readers quote them: a quantization's figures (the verify manifest, and publish's model
card reading verify.json, both take them from here), the failing gates in words, and the quantization ladder's
rows and picture."""

from __future__ import annotations

import logging

from loraship.constants import LADDER_PLOT_FILE

log = logging.getLogger("loraship.verify")


def figures(section: dict) -> dict:
    """A quantization's verify figures as the manifests and the model card quote them."""
    agreement = section.get("eval_agreement") or {}
    return {
        "passed": section["passed"],
        "gguf_bytes": section.get("gguf_bytes"),
        "perplexity_ratio": agreement.get("perplexity_ratio"),
        "kl_mean": agreement.get("kl_mean"),
        "kl_p99": agreement.get("kl_p99"),
        "same_top_rate": agreement.get("same_top_rate"),
        "golden_match": section.get("golden_match"),
        "gpu_memory": section.get("gpu_memory"),
    }


def failed_gates(gates: dict) -> str:
    """The failing gates with their values and thresholds (and notes), as verify's errors name them."""
    return "; ".join(
        f"{k} (value {g['value']}, threshold {g['threshold']}{', ' + g['note'] if 'note' in g else ''})"
        for k, g in gates.items()
        if not g["passed"]
    )


def passed_metrics(head: dict, gates: dict, sections: dict[str, dict]) -> dict:
    """The verify manifest's metrics when every gate passed: the shipped (primary) quantization's figures,
    each verified quantization's."""
    return {
        "passed": True,
        "gates": {k: g["passed"] for k, g in gates.items()},
        **{k: v for k, v in figures(head).items() if k not in ("passed", "gguf_bytes", "kl_p99")},
        "prompt_tokens_per_s": head["prompt_tokens_per_s"],
        "gen_tokens_per_s": head["gen_tokens_per_s"],
        "quantizations": {q: figures(section) for q, section in sections.items()},
    }


def ladder_row(quantization: str, section: dict | None) -> dict:
    """One rung of quantization auto's ladder as verify.json and the model card show it."""
    if section is None:
        return {"quant": quantization, "tried": False}
    a = section.get("eval_agreement") or {}
    return {
        "quant": quantization,
        "tried": True,
        "bytes": section["gguf_bytes"],
        "kl_mean": a.get("kl_mean"),
        "kl_p99": a.get("kl_p99"),
        "same_top": a.get("same_top_rate"),
        "ppl_ratio": a.get("perplexity_ratio"),
        "fits": section["gates"]["fits_target_gpu"]["passed"],
        "passed": section["passed"],
        "failed_gates": [k for k, g in section["gates"].items() if not g["passed"]],
    }


def draw_ladder(ctx, config, ladder: list[dict], shipped: str | None, shipped_label: str = "shipped") -> None:
    """LADDER_PLOT_FILE when more than one quantization was asked for (auto or a list): each tried rung's size
    against its KL, passed or failed, beside its kl_mean_max. The picture is a reading aid, so a verify image
    without matplotlib logs that and goes on."""
    if len(config.quantizations) < 2:
        return
    from loraship.publishing.plots import quant_ladder

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning(
            "matplotlib is not installed, so %s is not drawn; install the verify extra: "
            "pip install 'loraship[verify]'",
            LADDER_PLOT_FILE,
        )
        return
    rows = [{**r, "kl_mean_max": config.gate_limits(r["quant"])["kl_mean_max"]} for r in ladder]
    quant_ladder(
        rows,
        ctx.dir / LADDER_PLOT_FILE,
        shipped=shipped,
        shipped_label=shipped_label,
        title=f"{config.run_name}: quantizations verified against the merged model",
    )
