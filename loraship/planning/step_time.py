"""Predicted seconds of one micro-batch under a strategy: the FLOPs at a fixed rate, and the side-stream simulation
of streamed layers' weight copies (loraship/training/offload.py's schedule). Used for one choice only: how many layers
to stream, and where, when offload must (strategy.py).
"""

from __future__ import annotations

import os

from loraship.config import Config
from loraship.planning import flops
from loraship.planning.shape import Shape
from loraship.planning.strategy_record import Strategy

# Speed, for one choice only: how many layers to stream when offload must (plan_training's _stream_for_speed; the
# model: step_seconds). Rates of the fastest cards loraship plans for, where copies hide least: executed bf16 FLOP/s
# (recomputes included) of the qwen2-14b-lora default row of bench/results/train_bench.json on the H200 (6,187 tokens/s
# at 61.9 GFLOP per token plus 48 recomputed layers at 0.59 each: ~558 TFLOP/s), and pinned host-to-device copies as
# measured on the H100 of bench/results/train_bench_14b_lora_h100.json (52.9 GB/s, PCIe 5.0 x16). A card that computes
# slower hides the copies better; a PCIe 4.0 host with a card this fast would hide them less than planned.
PLAN_EXECUTED_TFLOPS = 550.0
PLAN_HOST_TO_DEVICE_GBPS = 50.0


def step_seconds(s: Shape, cfg: Config, strategy: Strategy | dict) -> dict:
    """Predicted seconds of one micro-batch at PLAN_EXECUTED_TFLOPS and PLAN_HOST_TO_DEVICE_GBPS, simulated layer by
    layer as loraship/training/offload.py schedules the copies: one at a time on a side stream, each starting when the
    streamed layer before it (in that pass's direction) starts, or when the stack starts for the first; a streamed
    layer waits for its copy. Backward walks down: a checkpointed layer's recompute + backward (its offloaded input
    coming back beside it); the last streamed layer's copy starts with the recompute of the layer after it where that
    one is checkpointed, as soon as its own forward is done where it is the model's last, else when it is reached."""
    strategy = Strategy.from_json(strategy)  # a plan file's JSON object, or the record itself
    T = strategy.micro_batch_size * cfg.sequence_len
    k = strategy.checkpointed(s.L)
    streamed = strategy.streamed(s.L)
    rate, bw = PLAN_EXECUTED_TFLOPS * 1e12, PLAN_HOST_TO_DEVICE_GBPS * 1e9
    forward = T * flops.forward_flops_per_layer_token(s, cfg, cfg.sequence_len) / rate
    recompute = T * flops.recompute_flops_per_layer_token(s, cfg, cfg.sequence_len) / rate
    head = T * 4 * s.V * s.h / rate  # lm_head's matmul and its input gradient
    backward = T * flops.train_flops_per_token(s, cfg, cfg.sequence_len) / rate - head - s.L * forward
    backward /= s.L
    weights = s.layer_linear_params * 2 / bw  # bf16 (offload is bf16 LoRA only)
    checkpoint = T * 2 * s.h / bw if strategy.offload_activations else 0.0
    is_streamed = set(streamed)
    last = streamed[-1] if streamed else None
    t = side = announced = 0.0  # now; when the side stream is free; when the next streamed layer's copy may start

    def arrive(t, announced, side):  # a streamed layer starts: its copy began at `announced`, after the one before
        side = max(announced, side) + weights
        return max(t, side), side

    for i in range(s.L):
        if i in is_streamed:
            t, side = arrive(t, announced, side)
            announced = t  # the next streamed layer's copy starts as this layer starts
        t += forward
        if i == last == s.L - 1:
            announced = t  # copied again for its recompute, backward's first work
    t += head
    for i in reversed(range(s.L)):
        if last is not None and i == last + 1 and i < k:
            announced = t  # this recompute announces the last streamed layer's
        if i in is_streamed:
            if i == last and k <= last + 1 < s.L:
                announced = t  # nothing announced it (the layer after it is not recomputed): copied when reached
            t, side = arrive(t, announced, side)
            announced = t
        t += max(backward + recompute, checkpoint) if i < k else backward
    compute = head + s.L * (forward + backward) + k * recompute
    return {"compute_s": compute, "step_s": t, "copy_bound_s": t - compute}


def layouts(strategy: Strategy, n_layers: int) -> list[Strategy]:
    """The ways to place a plan's streamed layers: the first n, and (unless LORASHIP_OFFLOAD_SPREAD=0, what the
    spread is worth in bench/train_bench.py) spread over the checkpointed ones."""
    first = strategy.without_spread()
    n = min(strategy.offload_layers, n_layers)
    spread = os.environ.get("LORASHIP_OFFLOAD_SPREAD", "1") != "0" and 0 < n < strategy.checkpointed(n_layers)
    return [first, first.replace(offload_spread=True)] if spread else [first]


def layout_times(s: Shape, cfg: Config, strat: Strategy) -> list[tuple[float, Strategy]]:
    """(predicted seconds of a micro-batch, strategy) for each placement of its streamed layers, the first n first;
    the memory is the same for all."""
    return [(step_seconds(s, cfg, c)["step_s"], c) for c in layouts(strat, s.L)]


def faster_layout(s: Shape, cfg: Config, strat: Strategy) -> tuple[float, Strategy]:
    """The faster placement of a plan's streamed layers (the first n on a tie), with its predicted seconds."""
    return min(layout_times(s, cfg, strat), key=lambda o: o[0])
