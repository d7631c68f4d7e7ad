"""A quantization's verify figures as the verify manifest and publish's model card quote them: verify writes
them, publish reads them from verify.json, and both take them from here."""

from __future__ import annotations


def figures(section: dict) -> dict:
    """A quantization's verify figures as the manifests and the model card quote them."""
    agreement = section.get("eval_agreement") or {}
    return {"passed": section["passed"], "gguf_bytes": section.get("gguf_bytes"),
            "perplexity_ratio": agreement.get("perplexity_ratio"), "kl_mean": agreement.get("kl_mean"),
            "kl_p99": agreement.get("kl_p99"), "same_top_rate": agreement.get("same_top_rate"),
            "golden_match": section.get("golden_match"), "gpu_memory": section.get("gpu_memory")}
