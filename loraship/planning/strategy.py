"""Choosing a training strategy: the ladder of candidates (least change to the configured run first), the first that
fits the card (plan_training, or PlanRefused naming the fix), the faster offload layout where offload must, the
alternatives a plan lists, and the next smaller plan after an out-of-memory (replan_after_oom).
"""

from __future__ import annotations

import math

from loraship.config import Config
from loraship.errors import LorashipError
from loraship.planning import step_time
from loraship.planning.estimate import SAFETY_MARGIN_FRACTION, SAFETY_MARGIN_MIN_GIB, estimate, safety_margin_gib
from loraship.planning.knobs import (
    ACTIVATIONS_IN_CPU,
    LIGER_NO_FUSED_LOSS,
    activations_setting,
    checkpoint_every_layer,
)
from loraship.planning.shape import Shape
from loraship.planning.step_time import faster_layout, layout_times, step_seconds
from loraship.planning.strategy_record import Strategy


# The keys of a rung the ladder builds, in the order its plan files have always had them: plan.json is hashed into
# later stages' fingerprints, so the same plan must be the same bytes.
_RUNG_KEYS = (
    "adapter",
    "offload_layers",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "fused_loss",
    "offload_activations",
    "gradient_checkpointing",
    "checkpointed_layers",
)


def _divisors_desc(n: int, at_most: int) -> list[int]:
    return [d for d in range(min(n, at_most), 0, -1) if n % d == 0]


def _user(cfg: Config, n_layers: int) -> Strategy:
    """The configuration as written, as a record."""
    return Strategy.from_config(cfg, n_layers)


def ladder(s: Shape, cfg: Config, fallback: list[str] | None = None) -> list[tuple[Strategy, str]]:
    """Candidate strategies in order of preference (least change to the user's run first).

    After the configuration itself: more checkpointed layers, then smaller micro-batches at the same
    effective batch. For `adapter: lora` then what `fallback` allows, in its order: 'offload' keeps
    bf16 and streams some layers' frozen weights from CPU memory, 'qlora' changes the base's
    precision to NF4. QLoRA is never combined with offload (train.load_model refuses it).

    Checkpointing never changes the result, only speed (one more forward of each checkpointed layer).
    `optimize: memory` (or `gradient_checkpointing: true`) checkpoints all L layers on every rung, their inputs in
    CPU memory unless offload_activations is off; `optimize: speed`, the default, tries k = 0, 1, ..., L
    checkpointed layers on each rung, so the first rung that fits has the fewest checkpointed layers that fit its
    micro-batch and adapter.
    """
    fallback = cfg.fallback if fallback is None else fallback
    user = _user(cfg, s.L)
    eff = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    budget = f"{cfg.gpu_memory_gib:g} GiB"
    every = checkpoint_every_layer(cfg)
    setting = activations_setting(cfg)
    ks = [s.L] if every else list(range(s.L + 1))
    out: list[tuple[Strategy, str]] = [(user, "as configured")]
    for k in ks:
        if k != user.checkpointed_layers:
            out.append(
                (
                    user.replace(offload_activations=setting == "on" and k > 0).with_checkpointing(k),
                    f"checkpointing {k} of {s.L} layers to fit {budget}",
                )
            )
    # offload_activations: auto, once every layer is checkpointed: their inputs to CPU memory before any change to
    # the batch or the base; from there on every rung keeps them there.
    acts = setting == "on"  # step() applies it to rungs that checkpoint any layer
    if setting == "auto":
        out.append(
            (
                user.with_checkpointing(s.L).replace(offload_activations=True),
                f"checkpointed activations kept in CPU memory to fit {budget}",
            )
        )
        acts = True
        ks = [s.L]
    fused = user.fused_loss
    mbs = _divisors_desc(eff, cfg.micro_batch_size)

    def ckpt_words(k):
        if every:
            return ""  # optimize: memory: all layers, as the user asked; nothing to explain
        return f", checkpointing {k} of {s.L} layers to fit {budget}" if k else ", no layer checkpointed"

    def step(adapter, mb, n_off, k, why):
        rung = Strategy(
            adapter=adapter,
            offload_layers=n_off,
            micro_batch_size=mb,
            gradient_accumulation_steps=eff // mb,
            fused_loss=fused,
            offload_activations=acts and k > 0,
            gradient_checkpointing=k > 0,
            checkpointed_layers=k,
            keys=_RUNG_KEYS,
        )
        return rung, why

    for mb in mbs[1:]:
        for k in ks:
            out.append(
                step(
                    user.adapter,
                    mb,
                    0,
                    k,
                    f"micro-batch {mb} x {eff // mb} accumulation keeps the effective batch {eff}{ckpt_words(k)}",
                )
            )
    if user.adapter != "lora":
        return out
    for kind in dict.fromkeys(fallback):
        if kind == "offload":
            # Every micro-batch streams the offloaded weights again (forward and recompute), so the cost per
            # optimizer step is n x eff / mb: the least n / mb first, then the fewest layers.
            pairs = sorted(((n, mb) for mb in mbs for n in range(1, s.L + 1)), key=lambda p: (p[0] / p[1], p[0]))
            # Rungs checkpoint every layer: loraship/training/offload.py streams n layers' weights per matmul,
            # and autograd keeps each streamed copy until backward unless the layer is recomputed. Once one fits,
            # plan_training may stream more layers to checkpoint fewer (_stream_for_speed).
            for n, mb in pairs:
                out.append(
                    step(
                        "lora",
                        mb,
                        n,
                        s.L,
                        f"bf16 LoRA, micro-batch {mb} x {eff // mb}, with {n} of {s.L} decoder "
                        "layers' frozen weights streamed from CPU memory (fallback: offload keeps bf16)",
                    )
                )
        elif kind == "qlora":
            for mb in mbs:
                for k in ks:
                    out.append(
                        step(
                            "qlora",
                            mb,
                            0,
                            k,
                            f"QLoRA (NF4 double-quant base), micro-batch {mb} x {eff // mb}"
                            f"{ckpt_words(k)} (fallback: qlora allows this precision change)",
                        )
                    )
    return out


def _rung(strategy: Strategy, user: Strategy) -> str:
    """Which kind of change a ladder rung makes to the user's strategy."""
    if strategy.offload_layers:
        return "offload"
    if strategy.adapter != user.adapter:
        return "qlora"
    if strategy.micro_batch_size != user.micro_batch_size:
        return "micro-batch"
    if bool(strategy.offload_activations) != bool(user.offload_activations):
        return "activations"
    return "checkpointing" if strategy.checkpointed_layers != user.checkpointed_layers else "as configured"


def _why_not(tried: list[tuple[Strategy, str, dict]], cfg: Config, n_layers: int) -> str:
    """One clause per kind of rung tried without fitting: the least memory that kind reached."""
    user = _user(cfg, n_layers)
    best: dict[str, tuple[Strategy, dict]] = {}
    for strat, _why, est in tried:
        kind = _rung(strat, user)
        if kind not in best or est["predicted_total_gib"] < best[kind][1]["predicted_total_gib"]:
            best[kind] = (strat, est)
    words = {
        "as configured": "as configured",
        "checkpointing": "checkpointing more layers",
        "activations": ACTIVATIONS_IN_CPU,
        "micro-batch": "the smallest micro-batch",
        "offload": "bf16 LoRA with offload",
        "qlora": "QLoRA",
    }
    parts = [
        f"{words[k]} ({st.describe(n_layers)}) needs {est['predicted_total_gib']:.1f} GiB"
        + (f" (peak at {est['peak_phase']})" if k == "as configured" else "")
        for k, (st, est) in best.items()
    ]
    if user.adapter == "lora":
        barred = [k for k in ("offload", "qlora") if k not in cfg.fallback]
        if barred:
            parts.append(f"fallback {list(cfg.fallback)} rules out {' and '.join(barred)}")
    return "; ".join(parts)


def _card_needed_gib(total_gib: float) -> float:
    """The smallest gpu_memory_gib whose budget minus the safety margin holds `total_gib`."""
    return max(total_gib + SAFETY_MARGIN_MIN_GIB, total_gib / (1 - SAFETY_MARGIN_FRACTION))


def _refusal(s: Shape, cfg: Config, tried: list[tuple[Strategy, str, dict]]) -> str:
    budget, margin = cfg.gpu_memory_gib, safety_margin_gib(cfg.gpu_memory_gib)
    n_layers = s.L
    user = _user(cfg, n_layers)
    smallest = min(tried, key=lambda t: t[2]["predicted_total_gib"])
    need = smallest[2]["predicted_total_gib"]
    fixes = []
    if cfg.adapter == "lora":
        for kind in ("offload", "qlora"):
            if kind in cfg.fallback:
                continue
            fit = next(
                (
                    st
                    for st, _w in ladder(s, cfg, fallback=[kind])
                    if _rung(st, user) == kind and estimate(s, cfg, st)["fits"]
                ),
                None,
            )
            if fit:
                fixes.append(f"set fallback: [{kind}] ({fit.describe(n_layers)} fits)")
    if activations_setting(cfg) == "off":
        auto = cfg.model_copy(update={"offload_activations": "auto"})
        fit = next(
            (st for st, _w in ladder(s, auto) if st.offload_activations and estimate(s, auto, st)["fits"]), None
        )
        if fit:
            fixes.append(f"set offload_activations: auto ({fit.describe(n_layers)} fits)")
    if cfg.fused_loss == "auto" and not user.fused_loss and s.model_type not in LIGER_NO_FUSED_LOSS:
        fixes.append("install liger-kernel (pip install 'loraship[train]') so fused_loss: auto uses the fused loss")
    fixes.append(f"lower sequence_len (now {cfg.sequence_len}) or lora_r (now {cfg.lora_r})")
    fixes.append(f"train on a card with at least {math.ceil(_card_needed_gib(need))} GiB (gpu_memory_gib)")
    return (
        f"nothing fits gpu_memory_gib {budget:g} GiB ({budget - margin:.1f} GiB after the {margin:.1f} GiB safety "
        f"margin): {_why_not(tried, cfg, n_layers)}. The smallest plan tried ({smallest[0].describe(n_layers)}) "
        f"needs {need:.1f} GiB, {need - (budget - margin):.1f} GiB too much. Fix: " + "; or ".join(fixes) + "."
    )


def _row(strategy: Strategy, est: dict) -> dict:
    return {**strategy.to_json(), "predicted_total_gib": round(est["predicted_total_gib"], 2), "fits": est["fits"]}


def _plan(s: Shape, cfg: Config, strategy: Strategy, est: dict, reason: str, alternatives: list[dict]) -> dict:
    return {
        "strategy": strategy.to_json(),
        "decoder_layers": s.L,
        # What was planned, as transformers builds it (loraship/planning/shape.py), and what the plan leaves out.
        "model": {
            "class": s.architecture,
            "decoder_layer": s.layer_class,
            **({"wrapper": s.wrapper, "untrained_modules": list(s.untrained_modules)} if s.wrapper else {}),
            "notes": list(s.notes),
        },
        "fits": est["fits"],
        "budget_gib": cfg.gpu_memory_gib,
        "safety_margin_gib": round(safety_margin_gib(cfg.gpu_memory_gib), 2),
        "fallback": list(cfg.fallback),
        "reason": reason,
        "memory": {
            "components_gib": est["components_gib"],
            "peak_phase": est["peak_phase"],
            "predicted_allocated_gib": round(est["predicted_allocated_gib"], 2),
            "predicted_reserved_gib": round(est["predicted_reserved_gib"], 2),
            "cuda_context_gib": round(est["cuda_context_gib"], 2),
            "predicted_total_gib": round(est["predicted_total_gib"], 2),
            "weights_only_estimate_gib": round(est["weights_only_estimate_gib"], 2),
            "activations_in_cpu_memory_gib": est["activations_in_cpu_memory_gib"],
            "activations_counted": est["activations_counted"],
        },
        "alternatives": alternatives,
    }


class PlanRefused(LorashipError):
    """Nothing the config allows fits gpu_memory_gib: refused at plan time, before any GPU hour."""


def plan_training(s: Shape, cfg: Config) -> dict:
    """The first strategy on the ladder that fits gpu_memory_gib minus the safety margin.

    Raises PlanRefused, naming the shortfall and the fix, when none does; with `device: cpu` the
    GPU budget does not bind and the smallest candidate is returned, marked as not fitting.
    """
    tried = []
    n_layers = s.L
    for strat, why in ladder(s, cfg):
        est = estimate(s, cfg, strat)
        if est["fits"]:
            if tried:
                why = f"{_why_not(tried, cfg, n_layers)}; so: {why}"
            else:
                why = f"as configured fits: {est['predicted_total_gib']:.1f} GiB of {cfg.gpu_memory_gib:g} GiB"
            strat, est, why = _stream_for_speed(s, cfg, strat, est, why)
            strat, why = _spread_if_faster(s, cfg, strat, why)
            return _plan(s, cfg, strat, est, why, _alternatives(s, cfg, strat))
        tried.append((strat, why, est))
    if cfg.device != "cpu":
        raise PlanRefused(_refusal(s, cfg, tried))
    strat, _why, est = min(tried, key=lambda t: t[2]["predicted_total_gib"])
    why = f"device: cpu, so the GPU budget does not bind; on a GPU: {_refusal(s, cfg, tried)}"
    return _plan(s, cfg, strat, est, why, _alternatives(s, cfg, strat))


def _spread_if_faster(s: Shape, cfg: Config, strat: Strategy, why: str) -> tuple[Strategy, str]:
    """Any plan that streams fewer layers than it checkpoints (optimize: memory's least offload among them) spreads
    them where the step model says that is faster: no more memory, the same copies, more compute to hide them."""
    if not strat.offload_layers or strat.offload_spread:
        return strat, why
    options = layout_times(s, cfg, strat)
    t, chosen = min(options, key=lambda o: o[0])
    if not chosen.offload_spread:
        return strat, why
    first = options[0][0]
    k = chosen.checkpointed(s.L)
    return chosen, (
        f"{why}; its {chosen.offload_layers} streamed layers spread over the first {k} hide their copies "
        f"better: predicted {t:.2f} s a micro-batch instead of {first:.2f} s, the same memory"
    )


def _stream_for_speed(s: Shape, cfg: Config, strat: Strategy, est: dict, why: str) -> tuple[Strategy, dict, str]:
    """Where offload had to stream n layers with every layer checkpointed (the ladder's rung), stream more where that
    is faster: each streamed layer frees its weights for the saved activations of a later layer, which then skips its
    recompute (loraship/planning/flops.py recompute_flops_per_layer_token); the copies cost nothing while the matmuls
    take longer, which spreading the streamed layers over the checkpointed ones helps (streamed_layers). The layout
    changes no memory: the same layers' weights stay off the GPU, at most two copies on it. optimize: speed only."""
    n = strat.offload_layers
    if not n or checkpoint_every_layer(cfg) or cfg.gradient_checkpointing is not None:
        return strat, est, why
    first = step_seconds(s, cfg, strat)["step_s"]
    options = [(first, strat, est)]
    for more in range(n, s.L + 1):
        for k in range(more, s.L + 1):  # streamed layers are among the checkpointed (offload.py)
            cand = strat.replace(offload_layers=more).with_checkpointing(k)
            cand_est = estimate(s, cfg, cand)
            if cand_est["fits"]:
                t, cand = faster_layout(s, cfg, cand)
                options.append((t, cand, cand_est))
                break  # more checkpointed layers would only be slower
    fastest = min(t for t, _, _ in options)
    # The fewest streamed layers within 1% of the fastest: a gain inside the model's error is no reason to copy more.
    t, chosen, chosen_est = next(o for o in options if o[0] <= fastest * 1.01)
    if chosen is strat or t > first * 0.99:
        return strat, est, why
    k = chosen.checkpointed(s.L)
    spread = (
        f", spread over the first {k} (one copy hidden behind more than one layer's forward)"
        if chosen.offload_spread
        else ""
    )
    return (
        chosen,
        chosen_est,
        (
            f"{why}; streaming {chosen.offload_layers} layers instead of {n}{spread} leaves room for {s.L - k} "
            f"layers' activations, whose recompute is saved: predicted {t:.2f} s a micro-batch instead of {first:.2f} "
            f"s (at {step_time.PLAN_EXECUTED_TFLOPS:g} TFLOP/s and {step_time.PLAN_HOST_TO_DEVICE_GBPS:g} GB/s host "
            "to device)"
        ),
    )


def _alternatives(s: Shape, cfg: Config, chosen: Strategy) -> list[dict]:
    L = s.L
    user = _user(cfg, L)
    cands = [
        user,
        user.replace(fused_loss=not user.fused_loss) if cfg.fused_loss == "auto" else None,
        user.replace(adapter="qlora"),
        user.replace(adapter="lora"),
    ]
    # The fewest checkpointed layers that fit as configured: what optimize: speed would run, the speed
    # optimize: memory leaves unused.
    fewest = next((c for c in (user.with_checkpointing(k) for k in range(L + 1)) if estimate(s, cfg, c)["fits"]), None)
    cands.append(fewest)
    cands.append(user.with_checkpointing(L).replace(offload_activations=True))  # Unsloth's way: inputs in CPU memory
    eff = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    cands.append(user.replace(micro_batch_size=1, gradient_accumulation_steps=eff).with_checkpointing(L))
    # The least offload that fits bf16 LoRA at the configured micro-batch (quality of bf16, speed of PCIe).
    for n in range(1, L + 1):
        c = user.replace(adapter="lora", offload_layers=n).with_checkpointing(L)
        if estimate(s, cfg, c)["fits"]:
            cands.append(c)
            break
    seen, out = [chosen], []
    for c in cands:
        if c is None or c in seen:
            continue
        seen.append(c)
        out.append(_row(c, estimate(s, cfg, c)))
    return out


# ---------------------------------------------------------------------------------------------
# After an out-of-memory
# ---------------------------------------------------------------------------------------------


def replan_after_oom(plan: dict, s: Shape, cfg: Config, measured: dict) -> dict | None:
    """The next, strictly smaller plan after a run of `plan` ran out of memory, or None.

    `measured` holds what the train stage saw before the error: peak_reserved_gib, peak_allocated_gib.
    The shortfall (measured + context against the budget, at least the predicted excess) shrinks the
    budget the next plan must fit.
    """
    cur = plan["memory"]
    comps = cur["components_gib"]
    res = measured.get("peak_reserved_gib") or cur["predicted_reserved_gib"]
    alloc = measured.get("peak_allocated_gib") or cur["predicted_allocated_gib"]
    gap_meas, gap_pred = res - alloc, comps.get("allocator_reserve", 0.0)
    if gap_meas - gap_pred > max(0.5, 0.5 * abs(alloc - cur["predicted_allocated_gib"])):
        oom_component = (
            f"allocator reserve (fragmentation): reserved exceeded allocated by {gap_meas:.1f} GiB, "
            f"predicted {gap_pred:.1f} GiB"
        )
    elif cur.get("peak_phase") == "cross-entropy":
        oom_component = (
            f"logits and cross-entropy over the vocabulary (predicted {comps['logits_and_cross_entropy']:.1f} GiB "
            f"at the peak)"
        )
    else:
        oom_component = (
            f"activations: one decoder layer's recompute and backward (predicted "
            f"{comps['one_layer_recompute_and_backward']:.1f} GiB) on top of the kept checkpoints"
        )
    # Budget for the next plan: what the card really offered, judged by this failure.
    under = max(res + cur["cuda_context_gib"] - cur["predicted_total_gib"], 0.0)
    shrink = max(under, 0.1 * cur["predicted_total_gib"])
    limit = cur["predicted_total_gib"]  # plans carry totals rounded to 0.01 GiB; compare like with like
    best = None
    for strat, why in ladder(s, cfg):
        est = estimate(s, cfg, strat)
        if round(est["predicted_total_gib"], 2) >= limit:
            continue
        room = est["predicted_total_gib"] + shrink <= cfg.gpu_memory_gib - safety_margin_gib(cfg.gpu_memory_gib)
        if room:
            best = (strat, why, est)
            break
        if best is None or est["predicted_total_gib"] < best[2]["predicted_total_gib"]:
            best = (strat, why, est)
    if best is None:
        return None
    strat, why, est = best
    out = _plan(
        s,
        cfg,
        strat,
        est,
        f"re-planned after out-of-memory (under-predicted: {oom_component}); {why}",
        [
            _row(
                Strategy.from_json(plan["strategy"]),
                {"predicted_total_gib": cur["predicted_total_gib"], "fits": False},
            )
        ],
    )
    out["oom_component"] = oom_component
    return out
