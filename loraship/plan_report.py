"""What `loraship plan` prints: the memory table whose sums add up as printed, the alternatives, disk and inference,
per-GPU options, and where publish will put the artifact (also said by `loraship init`)."""

from __future__ import annotations

from loraship.stage_table import stage_module


def artifact_place(config) -> str:
    """Where publish will put the artifact: output/run_name, or a Hub repository itself."""
    return stage_module("publish").destination_of(config)


def artifact_words(config) -> str:
    place = artifact_place(config)
    if place == config.output.rstrip("/"):
        return f"{place} (the Hub repository itself)"
    return (
        f"{place}/ (the folder named by run_name {config.run_name!r} inside output {config.output!r}; "
        "output is the folder runs publish under)"
    )


# The components of the peak (loraship/planning/estimate.py estimate): the static terms and the kept activations happen
# together, plus the larger of two transients: the loss, or one layer's backward with the streamed layer copies.
_LAYER_TRANSIENT = ("one_layer_recompute_and_backward", "streamed_layer_copies")
_LOSS_TRANSIENT = ("logits_and_cross_entropy",)
_SUMMED_BELOW = ("allocator_reserve", "cuda_context", "hand_model_margin")


def memory_rows(plan: dict) -> list[tuple[str, float, bool]]:
    """(label, GiB, added) rows of the plan's memory table, written so that every sum adds up as printed:
    the components at the peak give allocated; + allocator reserve = reserved; - the cache the allocator
    hands back under pressure + the CUDA context = what the card must hold; the budget less that is spare.
    A transient that is not at the peak is listed but not added (added False)."""
    mem = plan["memory"]
    phase = mem.get("peak_phase", "cross-entropy")
    idle = _LAYER_TRANSIENT if phase == "cross-entropy" else _LOSS_TRANSIENT
    rows = []
    for k, v in mem["components_gib"].items():
        if k not in _SUMMED_BELOW:
            label = k.replace("_", " ") + (f" (not at the peak: {phase} is larger)" if k in idle else "")
            rows.append((label, v, k not in idle))
    allocated, reserved = mem["predicted_allocated_gib"], mem["predicted_reserved_gib"]
    context, total = mem["cuda_context_gib"], mem["predicted_total_gib"]
    # plan.json carries no reclaimable_cache_gib, but total = reserved - that cache + context (memory.estimate).
    hand = mem["components_gib"].get("hand_model_margin", 0.0)
    cache = round(reserved + context + hand - total, 2)
    rows += [
        (f"allocated (peak, at {phase})", allocated, True),
        ("+ allocator reserve", round(reserved - allocated, 2), True),
        ("= reserved (peak)", reserved, True),
    ]
    if cache >= 0.01:
        rows.append(("- of reserved, cache the allocator hands back under pressure", cache, True))
    rows.append(("+ CUDA context", context, True))
    if hand:
        rows.append(("+ margin: the hand model counted the activations (see the plan's activations line)", hand, True))
    rows += [
        ("= card must hold", total, True),
        (
            f"spare of the {plan['budget_gib']:g} GiB budget (the plan keeps a safety margin of "
            f"{plan['safety_margin_gib']:.2f})",
            round(plan["budget_gib"] - total, 2),
            True,
        ),
    ]
    return rows


def render_plan(plan: dict, disk: dict):
    """A rich renderable for `loraship plan CONFIG`."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from loraship.planning.strategy_record import Strategy

    mem = plan["memory"]
    verdict = "[green]fits[/]" if plan["fits"] else "[red]does not fit[/]"
    words = Strategy.from_json(plan["strategy"]).describe(plan.get("decoder_layers"))
    head = Text.from_markup(
        f"[bold]Training plan[/]: {words}"
        + f"\n{mem['predicted_total_gib']:.1f} GiB predicted of {plan['budget_gib']:g} GiB "
        f"(safety margin {plan['safety_margin_gib']:.1f} GiB): {verdict}\n{plan['reason']}"
    )
    t = Table(title="Peak training memory (GiB)", show_footer=False)
    t.add_column("component")
    t.add_column("GiB", justify="right")
    for label, value, counted in memory_rows(plan):
        bold = label.startswith(("allocated", "= ", "spare"))
        figure = f"{value:.2f}" if counted else f"({value:.2f})"
        t.add_row(f"[bold]{label}" if bold else label, f"[bold]{figure}" if bold else figure)
    t.add_row("weights-only estimate, for comparison (not added)", f"({mem['weights_only_estimate_gib']:.2f})")
    if mem.get("activations_counted"):
        t.caption = f"activations: {mem['activations_counted']}"
    if mem.get("activations_in_cpu_memory_gib"):
        t.add_row(
            "checkpointed activations in pinned CPU memory (not on the GPU, not added)",
            f"({mem['activations_in_cpu_memory_gib']:.2f})",
        )
    a = Table(title="Alternatives")
    for c in ("adapter", "offload", "micro x GA", "fused", "ckpt layers", "GiB", "fits"):
        a.add_column(c)
    for r in plan["alternatives"]:
        a.add_row(
            r["adapter"],
            str(r["offload_layers"]),
            f"{r['micro_batch_size']} x {r['gradient_accumulation_steps']}",
            str(r["fused_loss"]),
            str(r.get("checkpointed_layers", r["gradient_checkpointing"]))
            + (" (in CPU memory)" if r.get("offload_activations") else ""),
            f"{r['predicted_total_gib']:.1f}",
            "yes" if r["fits"] else "no",
        )
    inf = disk["inference"]
    d = Table(title="Disk and inference (GiB)")
    d.add_column("item")
    d.add_column("GiB", justify="right")
    for k, v in disk["disk_gib"].items():
        d.add_row(f"disk: {k}", f"{v:.2f}")
    where = f"inference ({inf['quantization']}, n_ctx {inf['target_context']})"
    for k in ("gguf_gib", "kv_cache_gib", "compute_buffer_gib", "cuda_context_gib", "total_gib"):
        if k == "total_gib" and (inf.get("experts") or {}).get("n_cpu_moe"):
            kept = inf["by_quantization"][inf["quantization"]]
            d.add_row(
                f"{where}: - experts kept in CPU memory (n_cpu_moe {inf['experts']['n_cpu_moe']}), less one layer's "
                "copy on the GPU",
                f"{kept['gpu_weights_gib'] - inf['gguf_gib']:.2f}",
            )
        d.add_row(f"{where}: {k.removesuffix('_gib')}", f"{inf[k]:.2f}")
    d.add_row(f"fits the {inf['target_gpu_memory_gib']:g} GiB target", "yes" if inf["fits_target"] else "no")
    if inf.get("experts"):
        d.add_row(*expert_row(inf["experts"]))
        d.caption = speed_words(inf["experts"])
    others = {q: f for q, f in (inf.get("by_quantization") or {}).items() if q != inf["quantization"]}
    for q, f in others.items():  # the other quantizations of the list: same context, their own weights
        d.add_row(
            f"inference ({q}): total, fits the target: {'yes' if f['fits_target'] else 'no'}", f"{f['total_gib']:.2f}"
        )
    parts = [head, t, a]
    if plan.get("distributed"):
        parts.append(gpu_table(plan["distributed"]))
    return Group(*parts, d)


def expert_row(experts: dict) -> tuple[str, str]:
    """The plan's n_cpu_moe row: how it was chosen, the GPU without it, the experts it keeps in CPU memory."""
    how = "auto" if experts["n_cpu_moe_setting"] == "auto" else "set in the config"
    return (
        f"n_cpu_moe {experts['n_cpu_moe']} ({how}; every expert on the GPU would need "
        f"{experts['all_on_gpu_total_gib']:.2f}): experts in CPU memory",
        f"{experts['experts_in_cpu_memory_gib']:.2f}",
    )


def speed_words(experts: dict) -> str:
    speed = experts["tokens_per_s"]
    return (
        f"expected generation tokens/s: all on the GPU {speed['all_on_gpu']:g}, with n_cpu_moe "
        f"{experts['n_cpu_moe']} {speed['with_n_cpu_moe']:g} ({speed['note']})"
    )


def gpu_table(distributed: dict):
    """Per-GPU memory and expected tokens/s of each engine and GPU count (loraship/planning/multi_gpu.py)."""
    from rich.table import Table

    chosen = distributed.get("chosen")
    how = (
        f"gpus: {distributed['requested']} -> {chosen['engine']} on {chosen['gpus']}"
        if chosen
        else f"gpus: auto: train takes the fastest fitting option on the GPUs it sees (at least "
        f"{distributed['min_gpus']})"
    )
    g = Table(title=f"GPUs ({how})")
    for c in ("GPUs", "engine", "GiB per GPU", "tokens/s", "fits"):
        g.add_column(c, justify="left" if c == "engine" else "right")
    for o in distributed["options"]:
        mark = " *" if chosen and (o["gpus"], o["engine"]) == (chosen["gpus"], chosen["engine"]) else ""
        g.add_row(
            f"{o['gpus']}{mark}",
            o["engine"],
            f"{o['per_gpu_gib']:.1f}",
            "-" if o["tokens_per_s"] is None else f"{o['tokens_per_s']:,.0f}",
            "yes" if o["fits"] else "no",
        )
    # Why it chose: the chosen option's reasoning, or under auto that of the fewest GPUs that fit.
    shown = chosen or next(
        (o for o in distributed["options"] if o["gpus"] == distributed["min_gpus"] and o["fits"]), None
    )
    if shown:
        g.caption = shown["why"]
    return g
