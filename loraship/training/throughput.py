"""How fast a run trained: the steady-state token rate (warm-up steps left out), the model FLOPs of one trained
token (loraship/planning/flops.py) and the MFU they make on the card."""

from __future__ import annotations


# Optimizer steps left out of the steady-state rate: the first allocates AdamW's state and runs every kernel's first
# launch (autotuning, cuBLAS heuristics, lazy CUDA module loads); the second still settles the allocator's segments.
WARMUP_STEPS = 2


def steady_rate(stamps: list[tuple[float, int]], warmup: int = WARMUP_STEPS) -> tuple[float | None, str]:
    """Tokens per second after the warm-up steps, from (seconds, tokens so far) stamped after each step of this run,
    and the words that say which steps it covers. None when no step is left after the warm-up."""
    if len(stamps) <= warmup:
        return None, f"no steady-state rate: {len(stamps)} step(s) in this run, the first {warmup} are warm-up"
    (t0, n0), (t1, n1) = stamps[warmup - 1] if warmup else (0.0, 0), stamps[-1]
    if t1 <= t0:
        return None, "no steady-state rate: no time elapsed after the warm-up"
    return round((n1 - n0) / (t1 - t0), 1), (
        f"steady state: steps {warmup + 1}-{len(stamps)} of this run, the first {warmup} (warm-up) left out"
    )


def flops_per_token(model_config: dict | None, config, lengths: list[int]) -> float | None:
    """Model FLOPs of one trained token (loraship/planning/flops.py) of the parsed config.json, None for an
    architecture the planner cannot read."""
    from loraship.planning import flops

    if model_config is None:
        return None
    try:
        return flops.train_flops_per_token(model_config, config, flops.attention_length(lengths))
    except (ValueError, KeyError):
        return None


def utilisation(tokens_per_s: float | None, per_token: float | None, device: str) -> dict:
    """MFU against the card's dense bf16 peak, with the reason where there is none (a CPU, a card not in the table,
    too few steps, an architecture whose FLOPs are not counted)."""
    from loraship.planning import flops

    name = None
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
    if per_token is None:
        return {"mfu": None, "mfu_basis": "no FLOP count for this architecture", "flops_per_token": None}
    value, basis = flops.mfu(tokens_per_s, per_token, name)
    return {"mfu": value, "mfu_basis": basis, "flops_per_token": round(per_token)}
