"""Pictures of a training run, as PNGs: the loss curves and the memory plan against the measured peak.

matplotlib's object API (Figure, no pyplot): no display, no global state, the Agg renderer
behind savefig, so it draws the same in a headless pod as on a laptop. Written under a
temporary name and renamed, like every stage output (loraship/runtime/manifest.py).
"""

from __future__ import annotations

from pathlib import Path

from loraship.errors import LorashipError
from loraship.runtime.manifest import atomic_path

DPI = 110


def require_matplotlib() -> None:
    """Refuse to start training without matplotlib rather than fail after it (the pictures come last)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise LorashipError(
            "matplotlib is not installed, and the train stage draws its loss curves and memory plan "
            "with it; install the train extra: pip install 'loraship[train]'"
        ) from e


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return out


def loss_curves(
    history: list[dict],
    out: Path,
    *,
    eval_before: float | None = None,
    eval_after: float | None = None,
    steps: int | None = None,
    title: str = "",
) -> Path:
    """Training loss at each logged step (loss_history.jsonl rows: step, loss) and the eval loss of the
    base model (step 0, adapter off) and of the fine-tuned one (last step)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if history:
        ax.plot(
            [h["step"] for h in history],
            [h["loss"] for h in history],
            color="tab:blue",
            linewidth=1.4,
            marker="." if len(history) < 50 else None,
            label="training loss (per optimizer step)",
        )
    last = steps or (history[-1]["step"] if history else 1)
    evals = [(x, y) for x, y in ((0, eval_before), (last, eval_after)) if y is not None]
    if evals:
        ax.plot(
            *zip(*evals),
            color="tab:orange",
            linestyle="--",
            marker="o",
            markersize=7,
            label="eval loss (step 0: base model; last step: fine-tuned)",
        )
        for x, y in evals:
            ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9, color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per target token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    if history or evals:
        ax.legend(fontsize=8)
    return _save(fig, out)


def memory_plan(
    predicted: dict,
    measured: dict,
    out: Path,
    *,
    budget_gib: float | None = None,
    device: str = "cuda",
    title: str = "",
) -> Path:
    """The plan's predicted peak, component by component (loraship/planning/estimate.py's components_gib), next to
    the peak torch measured (reserved and allocated, train_metrics.json's measured_memory).

    torch's reserved figure leaves out the CUDA context, so the context is drawn apart, hatched, after the
    components the measurement is compared with.
    """
    import matplotlib
    from matplotlib.figure import Figure

    components = dict(predicted.get("components_gib") or {})
    context = components.pop("cuda_context", predicted.get("cuda_context_gib"))
    fig = Figure(figsize=(10, 4.2))  # the legend sits right of the bars
    ax = fig.subplots()
    # Blues to greens for the components, reds for what was measured.
    palette = matplotlib.colormaps["viridis"].resampled(max(len(components), 2))
    left = 0.0
    for i, (name, gib) in enumerate(components.items()):
        ax.barh(
            2,
            gib,
            left=left,
            color=palette(i),
            edgecolor="white",
            linewidth=0.5,
            label=f"{name.replace('_', ' ')} {gib:.3g}",
        )
        left += gib
    if context:
        ax.barh(
            2,
            context,
            left=left,
            color="lightgrey",
            hatch="//",
            edgecolor="grey",
            label=f"CUDA context {context:.3g} (not in torch's figures)",
        )
    rows = [(2, f"predicted\n{left:.2f} GiB reserved")]
    reserved, allocated = measured.get("peak_reserved_gib"), measured.get("peak_allocated_gib")
    if reserved is not None:
        ax.barh(1, reserved, color="tab:red", label=f"measured peak reserved {reserved:.2f}")
        rows.append((1, "measured\npeak reserved"))
    if allocated is not None:
        ax.barh(0, allocated, color="salmon", label=f"measured peak allocated {allocated:.2f}")
        rows.append((0, "measured\npeak allocated"))
    if predicted.get("predicted_allocated_gib") is not None:
        ax.axvline(
            predicted["predicted_allocated_gib"],
            color="tab:purple",
            linestyle=":",
            label=f"predicted allocated {predicted['predicted_allocated_gib']:.2f}",
        )
    if budget_gib:
        ax.axvline(budget_gib, color="black", linestyle="--", label=f"GPU budget {budget_gib:g}")
    if reserved is None and allocated is None:
        ax.text(
            0.98,
            0.2,
            f"no GPU measurement: trained on {device}",
            transform=ax.transAxes,
            ha="right",
            fontsize=9,
            color="dimgrey",
        )
    ax.set_yticks([y for y, _ in rows], [label for _, label in rows], fontsize=8)
    ax.set_ylim(-0.6, 2.6)
    ax.set_xlabel("GiB")
    ax.set_title(title or "training memory: plan vs measured")
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(handles)), key=lambda i: labels[i].startswith(("predicted allocated", "GPU budget")))
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        fontsize=7,
        loc="center left",
        bbox_to_anchor=(1.01, 0.5),
    )
    return _save(fig, out)


def quant_ladder(
    rows: list[dict], out: Path, *, shipped: str | None = None, shipped_label: str = "shipped", title: str = ""
) -> Path:
    """Each verified quantization's size against its mean KL divergence from the merged model (verify's ladder rows:
    quant, bytes, kl_mean, passed); passed green, failed red, the shipped (or primary) one ringed, the gate limit per
    rung as a dash (kl_mean_max, where the row has it). KL on a log axis: Q8_0 and IQ3_M differ by two orders."""
    from matplotlib.figure import Figure

    tried = [r for r in rows if r.get("tried", True) and r.get("bytes") and r.get("kl_mean") is not None]
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for r in tried:
        x, y = r["bytes"] / 2**20, max(r["kl_mean"], 1e-6)
        ax.scatter([x], [y], s=45, color="tab:green" if r["passed"] else "tab:red", zorder=3)
        if r.get("kl_mean_max"):
            ax.plot([x], [r["kl_mean_max"]], marker="_", markersize=14, color="grey", zorder=2)
        if r["quant"] == shipped:
            ax.scatter([x], [y], s=180, facecolors="none", edgecolors="black", linewidths=1.4, zorder=4)
        ax.annotate(r["quant"], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.scatter([], [], color="tab:green", label="passed every gate")
    ax.scatter([], [], color="tab:red", label="failed a gate")
    ax.plot([], [], marker="_", markersize=14, linestyle="none", color="grey", label="its kl_mean_max")
    if shipped:
        ax.scatter([], [], s=180, facecolors="none", edgecolors="black", label=f"{shipped_label} ({shipped})")
    if tried:
        ax.set_yscale("log")
    ax.set_xlabel("GGUF size (MiB)")
    ax.set_ylabel("mean KL(merged HF || GGUF), nats/token")
    ax.set_title(title or "quantizations: size against KL divergence")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, out)
