"""Training on several GPUs of one node: per-GPU memory and expected tokens/s of each engine for 1, 2, 4 and 8 GPUs,
which one to train with (the plan's "distributed" record), and choose_engine for the GPUs the train stage sees.

Engines, all torch's own (the train stage runs them under torchrun, loraship/training/distributed.py):
- single: one GPU, the single-GPU plan (strategy.py).
- ddp: that strategy replicated on N ranks (DistributedDataParallel); each rank holds all of it plus DDP's gradient
  buckets (a second fp32 copy of the LoRA gradients) and NCCL's buffers.
- fsdp2: `fully_shard` per decoder layer: the frozen decoder weights sharded 1/N (QLoRA's NF4 weights stored in
  bf16-typed storage so they shard; their absmax statistics stay whole on every rank), at most two gathered layers in
  flight (the one computing and the one prefetched), LoRA weights, gradients and AdamW states sharded 1/N; the root
  group (embeddings, final norm, lm_head) is gathered for the whole step, so it counts whole; activations as one GPU.

Nothing here was measured on several GPUs: only single-GPU machines were lent while it was written. Each figure is
the single-GPU model (estimate.py memory, step_time.py/flops.py speed) plus the costs above, and every option's `why`
says so. The interconnect is an assumption (INTERCONNECT_GBPS): PCIe-class, the slower of the two common ones.
"""

from __future__ import annotations

import math

from loraship.config import Config
from loraship.errors import LorashipError
from loraship.planning import flops, moe
from loraship.planning.estimate import GIB, NF4_BYTES_PER_PARAM, estimate, safety_margin_gib
from loraship.planning.shape import Shape
from loraship.planning.step_time import PLAN_EXECUTED_TFLOPS, step_seconds
from loraship.planning.strategy import PlanRefused, _alternatives, _plan, ladder, plan_training
from loraship.planning.strategy_record import Strategy

GPU_COUNTS = (1, 2, 4, 8)
ENGINES = ("single", "ddp", "fsdp2")
# NCCL bus bandwidth assumed between the GPUs of one node, GB/s: about what nccl-tests' all_reduce_perf reports on a
# PCIe 4.0 x16 node without NVLink (the slower case; NVLink nodes report several hundred). An assumption, not measured
# here: it sets the expected tokens/s (and so which GPU count `gpus: auto` prefers), never whether a plan fits.
INTERCONNECT_GBPS = 25.0
# Device memory NCCL allocates per rank outside torch's allocator (its channels' buffers): an assumption of the same
# kind, a round figure for one intra-node communicator, counted for ddp and fsdp2.
NCCL_BUFFERS_GIB = 0.5
# FSDP2 unsharded decoder layers on a GPU at once: the one computing and the one prefetched.
FSDP2_LAYERS_IN_FLIGHT = 2
_ASSUMED = (
    f"predicted from the single-GPU model plus each engine's known costs, not measured on several GPUs; "
    f"{INTERCONNECT_GBPS:g} GB/s interconnect assumed"
)


def requested_counts(cfg: Config) -> list[int]:
    """The GPU counts a plan lists: 1, 2, 4, 8 and the requested one."""
    return sorted(set(GPU_COUNTS) | ({cfg.gpus} if isinstance(cfg.gpus, int) else set()))


# -- memory ----------------------------------------------------------------------------------------------------------
def _decoder_bytes_per_param(strategy: Strategy) -> tuple[float, float]:
    """(bytes per decoder Linear parameter that shard, bytes that stay whole on every rank): bf16 shards all 2; NF4
    shards its 4-bit codes (0.5, in bf16-typed storage) and keeps the absmax statistics (quant_state) whole."""
    if strategy.adapter == "qlora":
        return 0.5, NF4_BYTES_PER_PARAM - 0.5
    return 2.0, 0.0


def _layer_params(s: Shape) -> float:
    """One decoder layer's sharded weights: its Linears and, averaged over the layers, a MoE's expert stacks."""
    return s.layer_linear_params + moe.expert_params(s) / s.L


def ddp_per_gpu_gib(est: dict) -> float:
    """One rank of DDP: the single-GPU prediction plus DDP's gradient buckets (one fp32 copy of every LoRA gradient,
    allocated when DDP wraps the model and kept) and NCCL's buffers."""
    return est["predicted_total_gib"] + est["lora_params"] * 4 / GIB + NCCL_BUFFERS_GIB


def fsdp2_per_gpu_gib(s: Shape, strategy: Strategy, est: dict, n: int) -> float:
    """One rank of FSDP2 over n GPUs: the single-GPU prediction less what sharding takes off each rank (decoder
    weights, LoRA weights, gradients and AdamW states to 1/n), plus two gathered layers in flight and NCCL's buffers.
    The strategy streams no layers from CPU memory (FSDP2 is not combined with offload)."""
    sharded, whole = _decoder_bytes_per_param(strategy)
    params = s.L * _layer_params(s)  # a MoE's expert stacks shard with the Linears
    single_weights = params * (sharded + whole)
    fsdp_weights = (
        params * sharded / n + params * whole + min(FSDP2_LAYERS_IN_FLIGHT, s.L) * _layer_params(s) * sharded
    )
    lora_static = est["lora_params"] * (4 + 8)  # fp32 weights + AdamW m and v (estimate.LORA_BYTES_PER_PARAM)
    grads = est["components_gib"]["lora_gradients"] * GIB
    # The bf16 LoRA casts the single-GPU estimate keeps through a step are not kept under FSDP2 (fused_lora.py).
    kept_casts = est["components_gib"].get("lora_compute_copies", 0.0) * GIB
    saved = single_weights - fsdp_weights + (lora_static + grads) * (1 - 1 / n) + kept_casts
    return est["predicted_total_gib"] - saved / GIB + NCCL_BUFFERS_GIB


# -- speed -----------------------------------------------------------------------------------------------------------
def _bus_seconds(nbytes: float, n: int) -> float:
    """Seconds a ring collective moving `nbytes` of payload per rank takes over INTERCONNECT_GBPS: each rank sends and
    receives (n - 1) / n of it (all-gather, reduce-scatter; an all-reduce is both, twice that)."""
    return nbytes * (n - 1) / n / (INTERCONNECT_GBPS * 1e9)


def ddp_seconds(single_s: float, lora_params: int, n: int) -> float:
    """Seconds of one micro-batch on each DDP rank: the single-GPU micro-batch, then the all-reduce of the fp32 LoRA
    gradients, counted after backward (no overlap) and on every micro-batch (DDP's default without no_sync): an upper
    bound."""
    return single_s + 2 * _bus_seconds(lora_params * 4, n)


def fsdp2_seconds(s: Shape, cfg: Config, strategy: Strategy, lora_params: int, n: int) -> float:
    """Seconds of one micro-batch on each FSDP2 rank: layer by layer, the larger of its compute (step_time's rates)
    and the all-gather of its sharded weights (prefetched behind the layer before it), in forward and again in
    backward (weights are resharded after forward), then the reduce-scatter of the LoRA gradients."""
    T = strategy.micro_batch_size * cfg.sequence_len
    rate = PLAN_EXECUTED_TFLOPS * 1e12
    k = strategy.checkpointed(s.L)
    forward = T * flops.forward_flops_per_layer_token(s, cfg, cfg.sequence_len) / rate
    recompute = T * flops.recompute_flops_per_layer_token(s, cfg, cfg.sequence_len) / rate
    head = T * 4 * s.V * s.h / rate
    backward = (T * flops.train_flops_per_token(s, cfg, cfg.sequence_len) / rate - head - s.L * forward) / s.L
    gather = _bus_seconds(_layer_params(s) * _decoder_bytes_per_param(strategy)[0], n)
    t = head + s.L * max(forward, gather)
    t += k * max(backward + recompute, gather) + (s.L - k) * max(backward, gather)
    return t + _bus_seconds(lora_params * 4, n)


# -- options ---------------------------------------------------------------------------------------------------------
def _option(n: int, engine: str, fits: bool, per_gpu: float, tokens: float | None, why: str) -> dict:
    return {
        "gpus": n,
        "engine": engine,
        "fits": bool(fits),
        "per_gpu_gib": round(per_gpu, 2),
        "tokens_per_s": None if tokens is None else round(tokens, 1),
        "why": why,
    }


def options_for(s: Shape, cfg: Config, strategy: Strategy | dict, counts: list[int]) -> list[dict]:
    """single at 1 GPU, ddp and fsdp2 at every other count, each priced for the plan's one strategy (as a plan holds
    it, or its record)."""
    if not isinstance(strategy, Strategy):
        strategy = Strategy.from_json(strategy)
    est = estimate(s, cfg, strategy)
    cap = cfg.gpu_memory_gib - safety_margin_gib(cfg.gpu_memory_gib)
    T = strategy.micro_batch_size * cfg.sequence_len
    single_s = step_seconds(s, cfg, strategy.to_json())["step_s"]
    single_tps = T / single_s
    lora = est["lora_params"]
    room = f"of {cap:.1f} GiB usable per GPU ({cfg.gpu_memory_gib:g} GiB less the safety margin)"
    out = [
        _option(
            1,
            "single",
            est["fits"],
            est["predicted_total_gib"],
            single_tps,
            f"one GPU: {est['predicted_total_gib']:.1f} GiB {room}, {single_tps:,.0f} tokens/s at "
            f"{PLAN_EXECUTED_TFLOPS:g} TFLOP/s ({_ASSUMED})",
        )
    ]
    host = ""
    if strategy.offload_layers:
        host = (
            f"; each rank streams its own copy of the {strategy.offload_layers} offloaded layers from CPU "
            "memory (that much host memory per rank)"
        )
    for n in (c for c in counts if c > 1):
        per = ddp_per_gpu_gib(est)
        t = ddp_seconds(single_s, lora, n)
        tps = n * T / t
        out.append(
            _option(
                n,
                "ddp",
                per <= cap,
                per,
                tps,
                f"DDP on {n} GPUs: the one-GPU {est['predicted_total_gib']:.1f} GiB + "
                f"{lora * 4 / GIB:.2f} GiB gradient buckets + {NCCL_BUFFERS_GIB:g} GiB NCCL = {per:.1f} GiB "
                f"{room}; {tps:,.0f} tokens/s = {n} x {single_tps:,.0f} x {single_s / t:.3f} all-reduce "
                f"efficiency ({lora * 4 / 1e6:,.0f} MB of fp32 LoRA gradients each micro-batch){host} "
                f"({_ASSUMED})",
            )
        )
        if cfg.optimizer == "adamw_8bit":
            out.append(
                _option(
                    n,
                    "fsdp2",
                    False,
                    fsdp2_per_gpu_gib(s, strategy, est, n),
                    None,
                    f"FSDP2 on {n} GPUs: not with optimizer adamw_8bit (bitsandbytes' 8-bit AdamW does not step "
                    "FSDP2's sharded DTensor parameters); set optimizer: adamw to shard",
                )
            )
            continue
        if strategy.offload_layers:
            plain = strategy.replace(offload_layers=0, offload_spread=False)
            per = fsdp2_per_gpu_gib(s, plain, estimate(s, cfg, plain), n)
            out.append(
                _option(
                    n,
                    "fsdp2",
                    False,
                    per,
                    None,
                    f"FSDP2 on {n} GPUs would need {per:.1f} GiB per GPU without the plan's streamed "
                    f"layers, but the plan streams {strategy.offload_layers} layers from CPU memory, "
                    f"which FSDP2 does not combine with; set gpus: {n} to plan sharding before fallback's "
                    "offload",
                )
            )
            continue
        per = fsdp2_per_gpu_gib(s, strategy, est, n)
        t = fsdp2_seconds(s, cfg, strategy, lora, n)
        tps = n * T / t
        sharded, _whole = _decoder_bytes_per_param(strategy)
        gather_s = _bus_seconds(_layer_params(s) * sharded, n)
        out.append(
            _option(
                n,
                "fsdp2",
                per <= cap,
                per,
                tps,
                f"FSDP2 on {n} GPUs: frozen decoder weights, LoRA weights, gradients and AdamW states "
                f"sharded 1/{n}, {FSDP2_LAYERS_IN_FLIGHT} gathered layers in flight, "
                f"+ {NCCL_BUFFERS_GIB:g} GiB NCCL = {per:.1f} GiB {room}; {tps:,.0f} tokens/s "
                f"({'bound by all-gathers' if gather_s > single_s / (3 * s.L) else 'compute-bound'}: "
                f"{gather_s * 1e3:.1f} ms to gather each layer, twice a micro-batch) ({_ASSUMED})",
            )
        )
    return out


def _preferred(options: list[dict], n: int) -> dict | None:
    """The option to train with on exactly n GPUs: single at 1; DDP where it fits (the strategy fits one card), else
    FSDP2 where it fits; None when neither does."""
    at_n = [o for o in options if o["gpus"] == n and o["fits"]]
    order = {"single": 0, "ddp": 1, "fsdp2": 2}
    return min(at_n, key=lambda o: order[o["engine"]]) if at_n else None


def _fewest(options: list[dict]) -> dict | None:
    fitting = [_preferred(options, n) for n in sorted({o["gpus"] for o in options})]
    return next((o for o in fitting if o), None)


# -- the plan --------------------------------------------------------------------------------------------------------
def _sharded_search(s: Shape, cfg: Config, counts: list[int], fallback: list[str] | None = None):
    """(n, strategy, estimate, per-GPU GiB) of the fewest GPUs above one where FSDP2 fits some ladder rung that streams
    no layers (the least change to the configured run first), or None; also the smallest per-GPU GiB seen at the
    largest count, for the refusal."""
    cap = cfg.gpu_memory_gib - safety_margin_gib(cfg.gpu_memory_gib)
    rungs = [st for st, _why in ladder(s, cfg, fallback) if not st.offload_layers]
    least = math.inf
    if cfg.optimizer == "adamw_8bit":
        return None, least  # no FSDP2 with it (options_for says why)
    for n in (c for c in counts if c > 1):
        for st in rungs:
            est = estimate(s, cfg, st)
            per = fsdp2_per_gpu_gib(s, st, est, n)
            if n == counts[-1]:
                least = min(least, per)
            if per <= cap:
                return (n, st, est, per), least
    return None, least


def _sharded_plan(s: Shape, cfg: Config, found: tuple, before: str) -> dict:
    n, st, est, per = found
    cap = cfg.gpu_memory_gib - safety_margin_gib(cfg.gpu_memory_gib)
    return _plan(
        s,
        cfg,
        st,
        est,
        f"{before}; FSDP2 over {n} GPUs holds {st.adapter} at micro-batch "
        f"{st.micro_batch_size} with {st.checkpointed(s.L)} of {s.L} layers checkpointed: "
        f"{per:.1f} GiB per GPU of {cap:.1f} usable",
        _alternatives(s, cfg, st),
    )


def _uses_fallback(strategy: dict, cfg: Config) -> bool:
    """Whether a plan's strategy (as plan.json holds it) takes fallback's offload or QLoRA."""
    st = Strategy.from_json(strategy)
    return bool(st.offload_layers) or st.adapter != cfg.adapter


def plan_on_gpus(s: Shape, cfg: Config) -> dict:
    """strategy.plan_training's record plus "distributed" (the contract in docs/multi_gpu.md).

    One strategy serves every option, so the train stage runs plan["strategy"] with whichever engine it takes. It is
    the single-GPU plan where one card holds it, fallback included (so `gpus: auto` on a one-GPU machine trains as
    before); with `gpus: N` (N > 1), FSDP2 over N is tried before fallback's offload or QLoRA; where no card holds any
    rung, the fewest GPUs FSDP2 fits on. Raises PlanRefused, naming the GPU count that fits, when `gpus: N` is too
    few or nothing fits even on the most GPUs listed.
    """
    counts = requested_counts(cfg)
    cap = cfg.gpu_memory_gib - safety_margin_gib(cfg.gpu_memory_gib)
    try:
        plan, refused = plan_training(s, cfg), None
    except PlanRefused as e:
        plan, refused = None, e
    want = cfg.gpus if isinstance(cfg.gpus, int) else None
    if plan is not None and want and want > 1 and _uses_fallback(plan["strategy"], cfg):
        # The configured adapter sharded over the GPUs asked for, before fallback's change to it.
        found = _sharded_search(s, cfg, [want], fallback=[])[0]
        if found:
            plan = _sharded_plan(
                s,
                cfg,
                found,
                f"gpus: {want} asked for, so sharded instead of fallback's change for one card ({plan['reason']})",
            )
    if plan is None:
        found, least = _sharded_search(s, cfg, counts)
        if not found and cfg.optimizer == "adamw_8bit":
            raise PlanRefused(
                f"{refused} Several GPUs would need FSDP2, which optimizer adamw_8bit does not take; "
                "set optimizer: adamw to plan sharding."
            ) from refused
        if not found:
            raise PlanRefused(
                f"{refused} Several GPUs do not help either: FSDP2 over {counts[-1]} GPUs needs at least "
                f"{least:.1f} GiB per GPU, more than the {cap:.1f} GiB usable of gpu_memory_gib "
                f"{cfg.gpu_memory_gib:g}."
            ) from refused
        plan = _sharded_plan(s, cfg, found, f"no single GPU holds it ({refused})")
    options = options_for(s, cfg, plan["strategy"], counts)
    if want and want > 1 and _preferred(options, want) is None and _uses_fallback(plan["strategy"], cfg):
        # One card holds fallback's plan, but not with DDP's extras (or it streams layers, which FSDP2 does not):
        # the ladder's rungs that stream nothing, fallback's QLoRA included, sharded over the GPUs asked for.
        found = _sharded_search(s, cfg, [want])[0]
        if found:
            plan = _sharded_plan(
                s,
                cfg,
                found,
                f"gpus: {want} asked for; fallback's plan for one card does not run on {want} ({plan['reason']})",
            )
            options = options_for(s, cfg, plan["strategy"], counts)
    fewest = _fewest(options)
    if fewest is None and cfg.device != "cpu":  # a card too small for the sharded rung's own extras
        raise PlanRefused(
            f"nothing fits gpu_memory_gib {cfg.gpu_memory_gib:g} on any of {counts} GPUs: "
            + "; ".join(o["why"] for o in options)
            + ". Fix: lower sequence_len or lora_r, or use larger GPUs."
        )
    min_gpus = fewest["gpus"] if fewest else 1  # device: cpu, where the GPU budget does not bind
    chosen = None
    if want is not None:
        chosen = _preferred(options, want)
        if chosen is None and cfg.device != "cpu":
            if min_gpus < want:  # the strategy fits fewer GPUs but neither engine's extras on `want`
                raise PlanRefused(
                    f"gpus: {want}: "
                    + "; ".join(o["why"] for o in options if o["gpus"] == want)
                    + f"; fix: set gpus: {min_gpus} (or gpus: auto), or allow fallback: [qlora]"
                )
            raise PlanRefused(too_few_words(want, min_gpus, options, "gpus:"))
        chosen = chosen or next(o for o in options if o["gpus"] == want)
    record = {"requested": cfg.gpus, "options": options, "min_gpus": min_gpus, "chosen": chosen}
    return {**plan, "distributed": record}


def too_few_words(given: int, min_gpus: int, options: list[dict], what: str) -> str:
    """The refusal for `given` GPUs where the plan needs min_gpus: what one GPU of `given` would need, the fix."""
    at = [o for o in options if o["gpus"] == given]
    need = min((o["per_gpu_gib"] for o in at), default=None)
    fit = _preferred(options, min_gpus)
    needs = f" (at least {need:.1f} GiB per GPU on {given})" if need is not None else ""
    return (
        f"{what} {given} is too few GPUs for this plan{needs}: it fits on {min_gpus} "
        f"({fit['engine'] if fit else '?'}, {fit['per_gpu_gib'] if fit else '?'} GiB per GPU); fix: set gpus: "
        f"{min_gpus} (or gpus: auto) and train where {min_gpus} GPU{'s are' if min_gpus > 1 else ' is'} visible, "
        "or lower sequence_len or lora_r"
    )


# -- at train time ---------------------------------------------------------------------------------------------------
def choose_engine(distributed: dict | None, visible: int) -> dict:
    """The option to train with where `visible` devices are usable (the contract, docs/multi_gpu.md).

    No record (a plan made before multi-GPU planning): one GPU, the single engine. `gpus: N`: the plan's chosen
    option, refused when fewer than N devices are visible. `gpus: auto`: of the fitting options on at most `visible`
    GPUs, the most expected tokens/s (the fewer GPUs on a tie); refused when the plan needs more than are visible.
    """
    if not isinstance(visible, int) or isinstance(visible, bool) or visible < 1:
        raise LorashipError(
            f"{visible!r} usable training devices; fix: train where a GPU is visible "
            "(CUDA_VISIBLE_DEVICES, the pod's nvidia.com/gpu), or set device: cpu"
        )
    if not distributed:
        return {
            "gpus": 1,
            "engine": "single",
            "fits": True,
            "per_gpu_gib": None,
            "tokens_per_s": None,
            "why": "the plan has no multi-GPU record (made before gpus existed): one GPU, as planned",
        }
    requested, options, min_gpus = distributed["requested"], distributed["options"], distributed["min_gpus"]
    if isinstance(requested, int):
        if requested > visible:
            raise LorashipError(
                f"gpus: {requested} but {visible} device(s) are visible here; fix: set gpus: "
                f"{visible} (or gpus: auto) if the plan fits there (it needs at least {min_gpus}), "
                f"or train where {requested} GPUs are visible (CUDA_VISIBLE_DEVICES, the training "
                "pool's `gpus` job variable)"
            )
        chosen = distributed.get("chosen")
        if not chosen or not chosen["fits"]:
            raise LorashipError(too_few_words(requested, min_gpus, options, "gpus:"))
        return dict(chosen)
    if min_gpus > visible:
        raise LorashipError(too_few_words(visible, min_gpus, options, f"gpus: auto with {visible} visible device(s):"))
    usable = [o for o in options if o["fits"] and o["gpus"] <= visible]
    if not usable:  # device: cpu where nothing fits the GPU budget: the budget does not bind there
        return dict(next(o for o in options if o["gpus"] == 1))
    best = max(usable, key=lambda o: (o["tokens_per_s"] or 0.0, -o["gpus"], -ENGINES.index(o["engine"])))
    return dict(best)
