"""A decoder layer's shapes, read from transformers' own model class for a config.json, not from a list of families.

`shape_from_config` builds the transformers config, refuses what is no decoder-only causal LM (unknown model_type,
encoder-decoder, encoder-only, an architecture the pinned llama.cpp converter lacks) naming the class and the fix,
instantiates the causal-LM class on the meta device (no weights, no memory) and reads the first decoder layer off it:
every nn.Linear, the norms, the attention kind, the MLP, how the layer ends. The memory and FLOP estimates
(estimate.py, flops.py) read only the `Shape` it returns. torch and transformers are imported inside the function, so
`import loraship.planning.estimate` stays light; a config is built once per process (cached on its JSON text).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import lru_cache

from loraship.errors import LorashipError
from loraship.planning.forward_source import layer_ends_in_mlp, mlp_returns_down
from loraship.planning.moe import Experts


class UnsupportedModel(LorashipError, ValueError):
    """A config.json the planner cannot plan: not a decoder-only causal LM that transformers and the pinned llama.cpp
    both support. A ValueError too, so callers that name a config.json the planner cannot read catch it."""


# Where a Linear's input comes from, for sharing one kept copy between LoRA modules (memory.LORA_INPUTS): q, k, v read
# the attention norm's output; o the attention output; gate and up the MLP norm's output; down the activation.
ATTN_IN, ATTN_OUT, MLP_IN, MLP_ACT = "attn_in", "attn_out", "mlp_in", "mlp_act"
# The order plans and LoRA target lists give a Llama-style layer's Linears in (the module order differs: Phi-3 makes
# o_proj before qkv_proj); names outside it follow in the model's own order.
CANONICAL_ORDER = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
)
# The Llama names a fused Linear holds (Phi-3: qkv_proj, gate_up_proj).
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# Linears that write a block's output back to the hidden size (the rest of a block's Linears read its input).
OUTPUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "down_proj", "fc2", "w2", "dense_4h_to_h")
# Class-name endings of heads that are no causal LM, whichever model_type (an encoder's masked LM, a classifier).
NOT_CAUSAL_LM = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForPreTraining",
    "ForNextSentencePrediction",
    "Encoder",
)


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int
    bias: bool
    reads: str  # ATTN_IN, ATTN_OUT, MLP_IN or MLP_ACT


@dataclass(frozen=True)
class Shape:
    model_type: str
    h: int
    L: int
    heads: int
    kv_heads: int
    head_dim: int
    f: int
    V: int
    tied: bool
    qkv_bias: bool
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj (FUSED_PARTS)
    norms: int = 2  # norms over the hidden size per decoder layer; Gemma 2 and 3 add one after attention and MLP (4)
    # A softcap on the attention logits, which torch's SDPA does not take: transformers runs its eager attention
    # (tasks/train.py asks for it), which keeps the T x T scores of every head (memory.estimate()).
    attn_softcap: bool = False
    final_softcap: bool = False  # a tanh cap on the logits (Gemma 2's 30.0): one more T x V tensor in the HF loss
    sliding_window: int | None = None  # on `sliding_layers` of the L layers (config.layer_types)
    sliding_layers: int = 0
    # Read off the model class (shape_from_config); the defaults are a Llama layer's, for Shapes written by hand.
    architecture: str = ""  # the class planned and trained, e.g. Qwen3ForCausalLM
    wrapper: str | None = None  # the config's own class when only its language model is planned (Gemma 3's multimodal)
    layer_class: str = ""
    layer_linears: tuple[Linear, ...] = ()
    qk_norm: bool = False  # RMSNorm on q and k before RoPE (Qwen3, Gemma 3, OLMo 2): keeps q and k once more
    mlp: str = "swiglu"  # "swiglu" (SiLU-gated), "geglu" (GELU-gated), "gated" (another gate), "plain"
    activation: str = "silu"
    # The layer returns `residual + down_proj(...)` (a dropout or a float multiplier at most between): a recompute can
    # skip down_proj's GEMM.
    ends_in_down: bool = True
    multipliers: bool = False  # Granite's residual / embedding / attention / logits multipliers
    rope_scaling: str | None = None  # rope_type of the (full-attention) rotary embedding, None for the default
    max_positions: int | None = None
    counted_params: int = 0  # every parameter of the meta model (tied ones once); 0 for a hand-written Shape
    other_params: int = 0  # what a multimodal wrapper loads beside its language model (vision tower, projector)
    # A wrapper's submodules beside its language model (model.vision_tower, model.multi_modal_projector): loaded,
    # frozen, given no LoRA (the train stage excludes them by these names).
    untrained_modules: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())  # what the plan should say about the model (the vision tower untrained)
    experts: Experts | None = None  # a mixture of experts' routed experts (loraship/planning/moe.py), None if dense
    # The config.json it was read from (sorted-key JSON), for loraship/planning/trace.py; "" for a hand-written Shape.
    config_text: str = field(default="", compare=False, repr=False)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """Decoder Linear layers: name -> (in_features, out_features)."""
        if self.layer_linears:
            return {m.name: (m.in_features, m.out_features) for m in self.layer_linears}
        h, q, kv, f = self.h, self.q, self.kv, self.f
        if self.fused:
            return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * f), "down_proj": (f, h)}
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    def reads(self, name: str) -> str:
        """Which tensor the Linear `name` reads (ATTN_IN, ATTN_OUT, MLP_IN, MLP_ACT)."""
        for m in self.layer_linears:
            if m.name == name:
                return m.reads
        return {
            "q_proj": ATTN_IN,
            "k_proj": ATTN_IN,
            "v_proj": ATTN_IN,
            "qkv_proj": ATTN_IN,
            "o_proj": ATTN_OUT,
            "gate_proj": MLP_IN,
            "up_proj": MLP_IN,
            "gate_up_proj": MLP_IN,
            "down_proj": MLP_ACT,
        }[name]

    @property
    def fused_names(self) -> dict[str, str]:
        """Llama name -> the fused Linear holding it, for the fused Linears this layer has."""
        names = self.linears()
        return {part: fused for fused, parts in FUSED_PARTS.items() if fused in names for part in parts}

    @property
    def swiglu_down(self) -> bool:
        """Separate gate_proj, up_proj and down_proj around SiLU: the train stage's Liger SwiGLU MLP runs down_proj's
        LoRA as one node with the activation (loraship/training/fused_lora.py SwiGLUDownLora)."""
        names = self.linears()
        return self.mlp == "swiglu" and {"gate_proj", "up_proj", "down_proj"} <= set(names)

    @property
    def recompute_skips_down(self) -> bool:
        """The layer ends in `residual + down_proj(h)`: a checkpointed layer's recompute skips down_proj's GEMM
        (loraship/training/recompute.py)."""
        return self.ends_in_down and "down_proj" in self.linears()

    @property
    def layer_linear_params(self) -> int:
        return sum(i * o for i, o in self.linears().values())

    @property
    def embedding_params(self) -> int:
        return self.V * self.h

    @property
    def n_params(self) -> int:
        if self.counted_params:
            return self.counted_params
        bias = (self.q + 2 * self.kv) if self.qkv_bias else 0
        per_layer = self.layer_linear_params + self.norms * self.h + bias
        return self.L * per_layer + self.embedding_params * (1 if self.tied else 2) + self.h


def _refuse(what: str, fix: str) -> UnsupportedModel:
    return UnsupportedModel(f"{what}; fix: {fix}")


def _text_part(mc: dict) -> tuple[dict, str | None]:
    """(the language model's config dict, the wrapper's architecture or None): a multimodal config's text_config."""
    if isinstance(mc.get("text_config"), dict) and "hidden_size" not in mc:
        archs = mc.get("architectures") or []
        wrapper = archs[0] if archs else f"{mc.get('model_type', '?')} (no architectures)"
        return {**mc["text_config"]}, wrapper
    return mc, None


def causal_lm_problem(mc: dict) -> str | None:
    """Why config.json describes an encoder or an encoder-decoder, in the planner's words; else None (a config
    transformers cannot build is the converter check's and the planner's to name). No model is built."""
    if not isinstance(mc, dict):
        return None
    try:
        config = _config(mc, "config.json")
    except UnsupportedModel:
        return None
    if _text_part(mc)[1]:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config.text_config
    try:
        _causal_lm_class(config, list(mc.get("architectures") or []), config.model_type)
    except UnsupportedModel as e:
        return str(e)
    return None


def shape_from_config(mc: dict, check_converter: bool = True) -> Shape:
    """The Shape of the decoder-only causal LM a config.json (a dict) describes, or UnsupportedModel naming the
    class and the fix. A multimodal conditional-generation config plans its text_config's language model."""
    if not isinstance(mc, dict):
        raise _refuse(f"config.json is a {type(mc).__name__}, not an object", "pass the base model's own config.json")
    return _shape_cached(json.dumps(mc, sort_keys=True), check_converter)


@lru_cache(maxsize=64)
def _shape_cached(text: str, check_converter: bool) -> Shape:
    mc = json.loads(text)
    s = dataclasses.replace(_derive(mc), config_text=text)
    if check_converter:
        converter_problem = _converter_problem(mc, s)
        if converter_problem:
            raise converter_problem
    return s


def _converter_problem(mc: dict, s: Shape) -> UnsupportedModel | None:
    """The pinned llama.cpp converter's registry lacks the architecture: refused now. Skipped where the converter is
    not on this machine (`loraship fetch-converter`); the plan stage's check_convertible fetches it and checks then."""
    from loraship.llamacpp.llamacpp import LLAMA_CPP_PYTHON_VERSION, converter_dir, supported_architectures

    try:
        folder = converter_dir(fetch=False)
    except LorashipError:
        return None
    archs = mc.get("architectures") or [s.architecture]  # none named: the class transformers builds for it
    registered = supported_architectures(folder)
    missing = [a for a in archs if a not in registered]
    if not missing:
        return None
    return _refuse(
        f"architecture {missing[0]} is not in the llama.cpp converter's registry (convert_hf_to_gguf.py "
        f"of llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}), so its GGUF could not be made",
        "pick a base model whose architecture the converter registers (Llama, Qwen2/3, Mistral, Gemma 2/3, "
        "Phi-3, OLMo 2, Granite among them), or use a loraship release pinning a newer llama.cpp",
    )


def _config(mc: dict, where: str):
    import transformers
    from transformers import CONFIG_MAPPING

    mt = mc.get("model_type")
    if not mt:
        raise _refuse(f"{where} has no model_type", "pass the base model's own config.json")
    try:
        cls = CONFIG_MAPPING[mt]
    except KeyError as e:
        raise _refuse(
            f"{where} model_type {mt!r} is not known to the installed transformers {transformers.__version__}",
            "upgrade transformers (pip install -U transformers) or use a base model of a supported architecture",
        ) from e
    try:
        return cls.from_dict({k: v for k, v in mc.items() if k != "model_type"})
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise _refuse(f"{where} is not a valid {cls.__name__} ({e})", "pass the base model's own config.json") from e


def _causal_lm_class(config, archs: list[str], mt: str):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(
            f"{archs[0] if archs else mt} is an encoder-decoder model (model_type {mt!r}); loraship trains "
            "decoder-only causal LMs",
            "use a decoder-only base model (Llama, Qwen, Mistral, Gemma, Phi)",
        )
    bad = [a for a in archs if a.endswith(NOT_CAUSAL_LM)]
    if bad or (type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)):
        name = bad[0] if bad else (archs[0] if archs else mt)
        raise _refuse(
            f"{name} is an encoder (model_type {mt!r}: a masked-LM or classifier head, no causal LM); "
            "loraship trains decoder-only causal LMs",
            "use a decoder-only base model (Llama, Qwen, Mistral, Gemma, Phi)",
        )
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as e:
        raise _refuse(
            f"{archs[0] if archs else mt} (model_type {mt!r}) has no causal-LM class in transformers",
            "use a decoder-only base model (Llama, Qwen, Mistral, Gemma, Phi)",
        ) from e


def _decoder_layers(model, L: int):
    import torch

    found = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == L]
    return found[0] if found else None


def _mlp_kind(mlp, act_name: str) -> tuple[str, str]:
    names = {n.rsplit(".", 1)[-1] for n, _ in mlp.named_modules()}
    gated = {"gate_proj", "up_proj"} <= names or "gate_up_proj" in names
    act = str(act_name or "").lower()
    if not gated:
        return "plain", act
    if act in ("silu", "swish"):
        return "swiglu", act
    if act.startswith("gelu"):
        return "geglu", act
    return "gated", act


def _wrapper_parts(mc: dict, archs: list[str], L: int) -> tuple[int, tuple[str, ...]]:
    """(parameters of the whole multimodal model, the names of its submodules beside the language model, e.g.
    model.vision_tower and model.multi_modal_projector), built on the meta device from its class in transformers (by
    config.json's architectures, else the causal-LM class of its config); (0, ()) where it cannot be built."""
    import torch
    import transformers
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    config = _config(mc, "config.json")
    cls = getattr(transformers, archs[0], None) if archs else None
    try:
        cls = cls or MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        with torch.device("meta"):
            model = cls(config)
    except Exception:  # the vision tower only sizes frozen weights and disk: planned without it rather than refused
        return 0, ()
    inner, prefix = (
        (model.model, "model.") if isinstance(getattr(model, "model", None), torch.nn.Module) else (model, "")
    )
    others = tuple(
        f"{prefix}{name}"
        for name, child in inner.named_children()
        if _decoder_layers(child, L) is None and any(True for _ in child.parameters())
    )
    return sum(p.numel() for p in model.parameters()), others


def _rope_type(config) -> str | None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers' scaling
    kind = params.get("rope_type") or params.get("type") if isinstance(params, dict) else None
    return None if kind in (None, "default") else str(kind)


def language_model_config(mc: dict):
    """transformers' config and causal-LM class for config.json (its language model's, for a multimodal wrapper), as
    the planner builds the model from them (here and in trace.py): (config, class, the wrapper's name or None, where
    in config.json it was read). Refuses a config without the keys a model's shape needs."""
    text, wrapper = _text_part(mc)
    where = "config.json" + (" text_config" if wrapper else "")
    config = _config(mc, "config.json")
    if wrapper:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config.text_config
    lm_class = _causal_lm_class(config, list(mc.get("architectures") or []), config.model_type)
    # Keys whose transformers defaults belong to some other model: a config.json without them would be planned as
    # that model, silently.
    aliases = getattr(type(config), "attribute_map", {})
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")
        if text.get(k) is None and text.get(aliases.get(k, k)) is None
    ]
    if missing:
        raise _refuse(f"{where} lacks {', '.join(missing)}", "pass the base model's own config.json")
    pad, vocab = getattr(config, "pad_token_id", None), getattr(config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        config.pad_token_id = None  # a class default past a small vocabulary (Phi-3's 32000): no shape depends on it
    return config, lm_class, wrapper, where


def _meta_model(mc: dict):
    """transformers' causal-LM class for config.json (its language model's, for a multimodal wrapper), built on the
    meta device: (the language model's config, the model, its class, the wrapper's name or None)."""
    import torch

    config, lm_class, wrapper, where = language_model_config(mc)
    config._attn_implementation = "eager"  # nothing runs: the kind of attention is read from the config below
    try:
        with torch.device("meta"):
            model = lm_class(config)
    except Exception as e:  # a class that cannot be built from its own config: name it, whatever broke
        raise _refuse(
            f"transformers' {lm_class.__name__} could not be built from {where} ({type(e).__name__}: {e})",
            "pass the base model's own config.json, or upgrade transformers",
        ) from e
    return config, model, lm_class, wrapper


def _layer_parts(layer, h: int, lm_class) -> tuple[list[Linear], int, bool]:
    """A decoder layer's Linears (in canonical order, each with what it reads), its norms of width h, and whether it
    norms q and k."""
    import torch

    linears: list[Linear] = []
    norms = 0
    qk_norm = False
    for name, module in layer.named_modules():
        short = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear):
            if any(p in name for p in ("attn", "attention")):
                reads = ATTN_OUT if short in OUTPUT_NAMES else ATTN_IN
            else:
                reads = MLP_ACT if short in OUTPUT_NAMES or module.in_features != h else MLP_IN
            linears.append(Linear(short, module.in_features, module.out_features, module.bias is not None, reads))
        elif "norm" in type(module).__name__.lower() and module is not layer:
            weight = getattr(module, "weight", None)
            size = weight.shape[-1] if weight is not None else None
            if short in ("q_norm", "k_norm", "query_norm", "key_norm"):
                qk_norm = True
            elif size == h:
                norms += 1
    if not linears:
        raise _refuse(
            f"{type(layer).__name__} of {lm_class.__name__} has no nn.Linear (a GPT-2 style Conv1D layer?); "
            "LoRA targets and the memory estimate need Linear projections",
            "use a base model of a Llama-style architecture",
        )
    order = {n: i for i, n in enumerate(CANONICAL_ORDER)}
    linears.sort(key=lambda m: order.get(m.name, len(order)))
    return linears, norms, qk_norm


def _derive(mc: dict) -> Shape:
    from loraship.planning.moe import read_experts

    config, model, lm_class, wrapper = _meta_model(mc)
    mt = config.model_type
    archs = list(mc.get("architectures") or [])
    L = int(config.num_hidden_layers)
    layers = _decoder_layers(model, L)
    if layers is None:
        raise _refuse(
            f"{lm_class.__name__} has no list of {L} decoder layers the planner can find",
            "use a base model of a Llama-style architecture",
        )
    layer = layers[0]
    h, heads = int(config.hidden_size), int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)

    linears, norms, qk_norm = _layer_parts(layer, h, lm_class)
    names = {m.name for m in linears}
    fused = bool(names & set(FUSED_PARTS))
    by_name = {m.name: m for m in linears}
    if "gate_up_proj" in by_name:
        f = by_name["gate_up_proj"].out_features // 2
    elif "down_proj" in by_name:
        f = by_name["down_proj"].in_features
    else:
        f = int(getattr(config, "intermediate_size", 0) or 0) or max(
            m.in_features for m in linears if m.reads == MLP_ACT
        )
    first_q = by_name.get("q_proj") or by_name.get("qkv_proj")
    mlp = getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    mlp_kind, activation = _mlp_kind(mlp, act) if mlp is not None else ("plain", str(act))
    ends_in_down = mlp is not None and layer_ends_in_mlp(layer) and mlp_returns_down(mlp)

    types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if window and types:
        sliding = sum(t == "sliding_attention" for t in types)
    else:
        sliding = 0
    in_emb, out_emb = model.get_input_embeddings(), model.get_output_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    V = int(in_emb.weight.shape[0])
    counted = sum(p.numel() for p in model.parameters())
    experts = read_experts(layers, config)
    total, untrained = _wrapper_parts(mc, archs, L) if wrapper else (0, ())
    other = total - counted if wrapper else 0
    notes = []
    if wrapper:
        parts = f" ({', '.join(untrained)}: loaded frozen, no LoRA)" if untrained else ""
        notes.append(
            f"{wrapper}: its language model ({lm_class.__name__}) is planned and trained; the vision tower"
            f"{parts} is not trained"
        )
    return Shape(
        model_type=mt,
        h=h,
        L=L,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        f=f,
        V=V,
        tied=tied,
        qkv_bias=bool(first_q.bias) if first_q else False,
        fused=fused,
        norms=norms,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) is not None,
        final_softcap=getattr(config, "final_logit_softcapping", None) is not None,
        sliding_window=int(window) if window and types else None,
        sliding_layers=sliding,
        architecture=lm_class.__name__,
        wrapper=wrapper,
        layer_class=type(layer).__name__,
        layer_linears=tuple(linears),
        qk_norm=qk_norm,
        mlp=mlp_kind,
        activation=activation,
        ends_in_down=ends_in_down,
        multipliers=any(
            getattr(config, k, None) not in (None, 1, 1.0)
            for k in ("residual_multiplier", "embedding_multiplier", "logits_scaling")
        ),
        rope_scaling=_rope_type(config),
        max_positions=getattr(config, "max_position_embeddings", None),
        counted_params=counted,
        other_params=max(other, 0),
        untrained_modules=untrained,
        notes=tuple(notes),
        experts=experts,
    )
