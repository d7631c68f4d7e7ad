"""The plan a stage receives, as one typed, frozen record: the Strategy, its MemoryEstimate, the model facts the train
stage reads and every decision it would otherwise ask the planner for (the LoRA modules resolved for this model, the
layers checkpointed and streamed, the fused loss and Liger's kernels, the fallback ladder an out-of-memory re-plan
walks). The train stage reads it once and takes its decisions from it.

On disk it is plan.json (with the shipping estimates beside it) and strategy.json (what training depends on), each
written with sorted keys. A plan written before the decisions were recorded is upgraded once, in `Plan.from_json`,
where the caller passes the model's Shape and the config; without them it is refused with the re-plan command.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from loraship.errors import LorashipError
from loraship.planning.strategy_record import Strategy

# What the plan's record carries beside what the planner wrote before it (strategy.plan_training's keys).
DECISIONS = "decisions"
# The keys of plan.json that describe shipping, not training: strategy.json leaves them out so a change there does
# not train again (tasks/train.py DEPENDS_ON).
SHIPPING_KEYS = ("base_model", "architecture", "gguf_convertible", "quantization_warnings", "disk_gib", "inference")


class PlanError(LorashipError):
    """A plan file this loraship cannot read: it names the file's problem and the re-plan that fixes it."""


def _frozen(d: Mapping | None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted peak GPU memory of one training step (loraship/planning/estimate.py), in GiB: allocated and
    reserved by torch's allocator, the total the card must hold with the CUDA context, and the named terms."""

    predicted_allocated_gib: float
    predicted_reserved_gib: float
    predicted_total_gib: float
    cuda_context_gib: float
    weights_only_estimate_gib: float
    peak_phase: str
    components_gib: Mapping[str, float]
    activations_in_cpu_memory_gib: float | None = None
    # How one layer's activations were counted: traced from its class, or the hand model and why (estimate.py).
    activations_counted: str | None = None
    # Keys a plan file carried that this record does not name, kept so that writing it back loses nothing.
    other: Mapping[str, Any] = field(default_factory=dict, repr=False)

    NAMED = (
        "predicted_allocated_gib",
        "predicted_reserved_gib",
        "predicted_total_gib",
        "cuda_context_gib",
        "weights_only_estimate_gib",
        "peak_phase",
        "components_gib",
        "activations_in_cpu_memory_gib",
        "activations_counted",
    )

    @classmethod
    def from_json(cls, d: Mapping) -> MemoryEstimate:
        missing = [k for k in cls.NAMED[:-2] if k not in d]
        if missing:
            raise PlanError(f"the plan's memory estimate lacks {missing}; fix: re-plan ({_REPLAN})")
        named = {k: d.get(k) for k in cls.NAMED}
        named["components_gib"] = _frozen(named["components_gib"])
        return cls(**named, other=_frozen({k: v for k, v in d.items() if k not in cls.NAMED}))

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.NAMED}
        if self.activations_counted is None:  # a plan from before the key: written back as it was read
            del out["activations_counted"]
        out["components_gib"] = dict(self.components_gib)
        return {**self.other, **out}


@dataclass(frozen=True)
class ModelFacts:
    """What the plan read of the model and the train stage reads too: the class planned (transformers' own), its
    decoder layer and how many, what a multimodal wrapper leaves untrained, and config.json's model_type."""

    architecture: str
    decoder_layer: str
    decoder_layers: int
    model_type: str | None = None
    wrapper: str | None = None
    untrained_modules: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, s) -> ModelFacts:
        """The facts of a planned Shape (loraship/planning/shape.py)."""
        return cls(s.architecture, s.layer_class, s.L, s.model_type, s.wrapper, tuple(s.untrained_modules), s.notes)

    def to_json(self) -> dict:
        """plan.json's "model" object, as the planner has always written it (plus model_type)."""
        out = {"class": self.architecture, "decoder_layer": self.decoder_layer, "model_type": self.model_type}
        if self.wrapper:
            out.update(wrapper=self.wrapper, untrained_modules=list(self.untrained_modules))
        return {**out, "notes": list(self.notes)}

    @classmethod
    def from_json(cls, d: Mapping, decoder_layers: int) -> ModelFacts:
        return cls(
            d.get("class", ""),
            d.get("decoder_layer", ""),
            decoder_layers,
            d.get("model_type"),
            d.get("wrapper"),
            tuple(d.get("untrained_modules", ())),
            tuple(d.get("notes", ())),
        )


@dataclass(frozen=True)
class Plan:
    """One training plan with every decision made. `strategy` is what trains; the decisions below follow from it and
    the model and are recorded, so that train reads them instead of asking the planner."""

    strategy: Strategy
    memory: MemoryEstimate
    model: ModelFacts
    lora_modules: tuple[str, ...]  # lora_target_modules as this architecture names its Linears (Phi-3: qkv_proj)
    lora_modules_note: str | None  # why a fused Linear adapts more projections than the config named, if it does
    checkpointed_layers: tuple[int, ...]  # decoder layers that recompute in backward (the first k)
    streamed_layers: tuple[int, ...]  # decoder layers whose frozen weights stream from CPU memory
    liger_kernels: bool  # Liger's kernels applied, its fused linear cross-entropy among them
    reason: str
    fits: bool
    budget_gib: float
    safety_margin_gib: float
    fallback: tuple[str, ...]  # the ladder an out-of-memory re-plan walks beyond a smaller micro-batch
    alternatives: tuple[Mapping, ...] = ()
    distributed: Mapping | None = None  # engine and GPU count per visible devices (planning/multi_gpu.py)
    oom_component: str | None = None  # a re-plan after out-of-memory: what was under-predicted
    # Every other key of the plan file (model_dir, inputs, the shipping estimates), kept as read: plan files are hashed
    # into later stages' fingerprints, so reading and writing one back must lose nothing.
    other: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def fused_loss(self) -> bool:
        return self.strategy.fused_loss

    @property
    def lora_excluded(self) -> str | None:
        """A regex (PEFT's exclude_modules) for the modules the plan leaves untrained: a multimodal model's vision
        tower and projector (Gemma 3), whose Linears share the language model's names (q_proj, ...)."""
        import re

        untrained = self.model.untrained_modules
        return "(?:" + "|".join(re.escape(m) for m in untrained) + r")(?:\..*)?" if untrained else None

    @classmethod
    def build(cls, planned: Mapping, s, cfg, **other) -> Plan:
        """The record of what strategy.plan_training (or replan_after_oom, or multi_gpu.plan_on_gpus) returned for
        the model of Shape `s` under `cfg`, its decisions made here; `other`: more keys for the plan file."""
        from loraship.planning.targets import lora_modules, lora_target_note

        strategy = Strategy.from_json(planned["strategy"], s.L)
        decisions = {
            "lora_modules": list(lora_modules(s, cfg.lora_target_modules)),
            "lora_modules_note": lora_target_note(s, cfg.lora_target_modules),
            **_layer_decisions(strategy, s.L),
        }
        model = {**planned.get("model", {}), "model_type": s.model_type}
        return cls.from_json({**planned, **other, "model": model, "decoder_layers": s.L, DECISIONS: decisions})

    @classmethod
    def from_json(cls, d: Mapping, s=None, cfg=None) -> Plan:
        """The record of a plan file's object. One written before the decisions were recorded is upgraded here, once,
        with the model's Shape `s` and the config `cfg`; without them it is refused, naming the re-plan."""
        if DECISIONS not in d:
            if s is None or cfg is None:
                raise PlanError(
                    "the plan was written by an older loraship and records no decisions (LoRA modules, layers "
                    f"checkpointed and streamed); fix: re-plan ({_REPLAN})"
                )
            return cls.build(d, s, cfg)
        missing = [k for k in ("strategy", "memory", "decoder_layers", "reason") if k not in d]
        if missing:
            raise PlanError(f"not a training plan: it lacks {missing}; fix: re-plan ({_REPLAN})")
        n = d["decoder_layers"]
        dec = d[DECISIONS]
        named = {"strategy", "memory", "model", "decoder_layers", DECISIONS, *_PLAIN}
        return cls(
            strategy=Strategy.from_json(d["strategy"], n),
            memory=MemoryEstimate.from_json(d["memory"]),
            model=ModelFacts.from_json(d.get("model", {}), n),
            lora_modules=tuple(dec["lora_modules"]),
            lora_modules_note=dec.get("lora_modules_note"),
            checkpointed_layers=tuple(dec["checkpointed_layers"]),
            streamed_layers=tuple(dec["streamed_layers"]),
            liger_kernels=bool(dec["liger_kernels"]),
            reason=d["reason"],
            fits=bool(d.get("fits", False)),
            budget_gib=d.get("budget_gib", 0.0),
            safety_margin_gib=d.get("safety_margin_gib", 0.0),
            fallback=tuple(d.get("fallback", ())),
            alternatives=tuple(_frozen(a) for a in d.get("alternatives", ())),
            distributed=_frozen(d["distributed"]) if d.get("distributed") is not None else None,
            oom_component=d.get("oom_component"),
            other=_frozen({k: v for k, v in d.items() if k not in named}),
        )

    def to_json(self) -> dict:
        """The plan file's object (written with sorted keys: atomic_write_json(..., sort_keys=True))."""
        out = {
            **self.other,
            "strategy": self.strategy.to_json(),
            "memory": self.memory.to_json(),
            "model": self.model.to_json(),
            "decoder_layers": self.model.decoder_layers,
            DECISIONS: {
                "lora_modules": list(self.lora_modules),
                "lora_modules_note": self.lora_modules_note,
                "checkpointed_layers": list(self.checkpointed_layers),
                "streamed_layers": list(self.streamed_layers),
                "liger_kernels": self.liger_kernels,
            },
            "reason": self.reason,
            "fits": self.fits,
            "budget_gib": self.budget_gib,
            "safety_margin_gib": self.safety_margin_gib,
            "fallback": list(self.fallback),
            "alternatives": [dict(a) for a in self.alternatives],
        }
        if self.distributed is not None:
            out["distributed"] = _plain(self.distributed)
        if self.oom_component is not None:
            out["oom_component"] = self.oom_component
        return out

    def training_json(self) -> dict:
        """strategy.json's object: the plan without its shipping estimates, which training does not depend on."""
        return {k: v for k, v in self.to_json().items() if k not in SHIPPING_KEYS}

    def with_strategy(self, strategy: Strategy, reason: str | None = None) -> Plan:
        """This plan training `strategy` instead (the same memory estimate): its layer decisions made again."""
        layers = _layer_decisions(strategy, self.model.decoder_layers)
        return replace(
            self,
            strategy=strategy,
            checkpointed_layers=tuple(layers["checkpointed_layers"]),
            streamed_layers=tuple(layers["streamed_layers"]),
            liger_kernels=layers["liger_kernels"],
            reason=self.reason if reason is None else reason,
        )

    def on_device(self, device: str, fused_loss: bool) -> Plan:
        """The plan as this machine runs it: the fused loss only where `fused_loss` (liger-kernel importable on
        CUDA), and no streamed weights on the CPU (no GPU to stream to)."""
        strategy = self.strategy.replace(fused_loss=fused_loss)
        return self.with_strategy(strategy.replace(offload_layers=0) if device == "cpu" else strategy)


# Plain keys of the plan object that the record names.
_PLAIN = (
    "reason",
    "fits",
    "budget_gib",
    "safety_margin_gib",
    "fallback",
    "alternatives",
    "distributed",
    "oom_component",
)
_REPLAN = "loraship run CONFIG --from plan --force"


def _layer_decisions(strategy: Strategy, n_layers: int) -> dict:
    return {
        "checkpointed_layers": list(range(strategy.checkpointed(n_layers))),
        "streamed_layers": strategy.streamed(n_layers),
        "liger_kernels": strategy.fused_loss,
    }


def _plain(m: Mapping) -> dict:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in m.items()}
