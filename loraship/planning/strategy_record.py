"""The training strategy as a typed record: what a plan tells the train stage to run.

On disk (plan.json, strategy.json, replanned.json, train_metrics.json) a strategy stays the JSON object it always was;
`Strategy.from_json` reads one, upgrading a plan written before a key existed once, here, and `to_json` writes it
back key for key. `describe` is the one description in words (plan output, refusals, the manifest, the model card).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loraship.config import Config
from loraship.planning.knobs import (
    ACTIVATIONS_IN_CPU,
    activations_setting,
    checkpoint_every_layer,
    fused_loss_available,
)

# Every key a strategy carries, in the order from_config writes them (offload_spread only when set).
KEYS = (
    "adapter",
    "offload_layers",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "fused_loss",
    "gradient_checkpointing",
    "offload_activations",
    "checkpointed_layers",
    "offload_spread",
)
_REQUIRED = ("adapter", "micro_batch_size", "gradient_accumulation_steps", "fused_loss", "gradient_checkpointing")


@dataclass(frozen=True)
class Strategy:
    """One training strategy. `checkpointed_layers` None: a plan from before the key whose layer count was unknown
    when it was read, meaning every layer or none by `gradient_checkpointing` (checkpointed() resolves it)."""

    adapter: str  # "lora" (bf16 base) or "qlora" (NF4 base)
    micro_batch_size: int
    gradient_accumulation_steps: int
    fused_loss: bool  # Liger's fused linear cross-entropy
    gradient_checkpointing: bool  # any layer checkpointed
    offload_layers: int = 0  # decoder layers whose frozen weights stream from CPU memory
    offload_activations: bool = False  # checkpointed layers' inputs kept in pinned CPU memory
    checkpointed_layers: int | None = None  # the first k decoder layers recompute in backward
    offload_spread: bool = False  # streamed layers spread over the checkpointed ones, not the first n
    # The keys as the JSON object had them, in its order: plan files are hashed into later stages' fingerprints,
    # so a strategy written back from its record must be the same bytes.
    keys: tuple[str, ...] = field(default=KEYS[:-1], compare=False, repr=False)

    def __post_init__(self):
        if self.offload_spread and "offload_spread" not in self.keys:  # built in code, spread: written too
            object.__setattr__(self, "keys", (*self.keys, "offload_spread"))

    @classmethod
    def from_json(cls, d: dict, n_layers: int | None = None) -> Strategy:
        """The record of a strategy object from a plan. A plan from before `checkpointed_layers` gets it here, once,
        where the layer count is known: every layer or none, by `gradient_checkpointing`."""
        if isinstance(d, Strategy):
            d = d.to_json()
        missing = [k for k in _REQUIRED if k not in d]
        unknown = [k for k in d if k not in KEYS]
        if missing or unknown:
            raise ValueError(
                f"not a training strategy: {dict(d)!r} lacks {missing} / has unknown keys {unknown}; "
                "fix: re-plan (loraship plan CONFIG) instead of editing the plan by hand"
            )
        keys = tuple(d)
        values = {k: d[k] for k in keys}
        if values.get("checkpointed_layers") is None and n_layers is not None:
            values["checkpointed_layers"] = n_layers if values["gradient_checkpointing"] else 0
            keys += () if "checkpointed_layers" in keys else ("checkpointed_layers",)
        return cls(**values, keys=keys)

    @classmethod
    def from_config(cls, cfg: Config, n_layers: int | None = None) -> Strategy:
        """The configuration as written. `checkpointed_layers` needs the layer count: without it the key is left
        out and checkpointed() reads `gradient_checkpointing` as all layers or none."""
        every = checkpoint_every_layer(cfg)
        out = {
            "adapter": cfg.adapter,
            "offload_layers": 0,
            "micro_batch_size": cfg.micro_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "fused_loss": fused_loss_available(cfg, "cpu" if cfg.device == "cpu" else "cuda"),
            "gradient_checkpointing": every,
            "offload_activations": activations_setting(cfg) == "on" and every,
        }
        if n_layers is not None:
            out["checkpointed_layers"] = n_layers if every else 0
        return cls.from_json(out)

    def to_json(self) -> dict:
        """The JSON object, key for key and in the order it was read or built."""
        return {k: getattr(self, k) for k in self.keys}

    def replace(self, **changes) -> Strategy:
        """A copy with `changes`; a key the object did not carry goes last, as `{**strategy, key: value}` did."""
        keys = self.keys + tuple(k for k in changes if k not in self.keys)
        return dataclasses.replace(self, **changes, keys=keys)

    def with_checkpointing(self, k: int) -> Strategy:
        """This strategy with the first k decoder layers checkpointed (both keys kept consistent)."""
        return self.replace(gradient_checkpointing=k > 0, checkpointed_layers=k)

    def checkpointed(self, n_layers: int) -> int:
        """How many decoder layers (the first ones) recompute their activations in backward."""
        if self.checkpointed_layers is None:
            return n_layers if self.gradient_checkpointing else 0
        return max(0, min(int(self.checkpointed_layers), n_layers))

    def streamed(self, n_layers: int) -> list[int]:
        """Which decoder layers stream their frozen weights from CPU memory (loraship/training/offload.py), ascending.

        The first n; or, where the plan spreads them (`offload_spread`), n spaced evenly over the first k checkpointed
        layers, so each prefetch has the forward of the layers between two streamed ones to hide behind, not one
        layer's. Either way every streamed layer is checkpointed (autograd would otherwise keep its copy until
        backward)."""
        n = min(self.offload_layers, n_layers)
        k = self.checkpointed(n_layers)
        if n <= 0:
            return []
        if not self.offload_spread or k <= n:
            return list(range(n))
        return [j * k // n for j in range(n)]  # distinct, first 0, last below k - 1: the layer after it is recomputed

    def without_spread(self) -> Strategy:
        """The first-n placement of its streamed layers, the offload_spread key dropped (as a plan without it)."""
        return dataclasses.replace(
            self, offload_spread=False, keys=tuple(k for k in self.keys if k != "offload_spread")
        )

    @property
    def base_precision(self) -> str:
        """The precision of the frozen base weights it trains against: NF4 for QLoRA, bf16 for LoRA (streamed
        layers included: they are bf16 copies from CPU memory)."""
        return "NF4" if self.adapter == "qlora" else "bf16"

    def describe(self, n_layers: int | None = None) -> str:
        """What trains, in words: 'bf16 LoRA, micro-batch 2 x 8 accumulation, fused loss, gradient checkpointing 9 of
        28 layers'. A plan from before checkpointed_layers, read without the layer count, says on or off."""
        base = "QLoRA (NF4 base)" if self.adapter == "qlora" else "bf16 LoRA"
        of = f" of {n_layers}" if n_layers else ""
        k = self.checkpointed_layers
        ckpt = f"{k}{of} layers" if k is not None else ("on" if self.gradient_checkpointing else "off")
        spread = f" (spread over the first {k})" if self.offload_spread and k else ""
        off = (
            f", {self.offload_layers}{of} decoder layers' frozen weights streamed from CPU memory{spread}"
            if self.offload_layers
            else ""
        )
        acts = f", {ACTIVATIONS_IN_CPU}" if self.offload_activations else ""
        return (
            f"{base}{off}, micro-batch {self.micro_batch_size} x {self.gradient_accumulation_steps} accumulation, "
            f"{'fused' if self.fused_loss else 'HF'} loss, gradient checkpointing {ckpt}{acts}"
        )
