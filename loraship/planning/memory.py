"""Plan GPU memory for LoRA/QLoRA training, and disk + inference memory for shipping, from config.json.

No weights and no GPU, so `loraship plan` runs on a laptop for a model that is not downloaded: the shapes come from
transformers' own model class built on the meta device (loraship/planning/shape.py, torch imported there only).
The model is additive and physical: every term is bytes of a tensor that exists at the peak, with a
few multipliers (CAL) fitted against bench/memory_matrix.py on a real GPU. bench/memory_matrix.md
shows predicted vs measured, and which rows were used to fit CAL.

Notation: h hidden, q = heads x head_dim, kv = kv_heads x head_dim,
f intermediate, V vocab, L layers, r rank, T = micro_batch x sequence_len tokens.
"""

from __future__ import annotations

import importlib.util
import math
import os

from loraship.config import Config
from loraship.constants import BITS_PER_WEIGHT
from loraship.planning import inference_memory as im
from loraship.errors import LorashipError
from loraship.planning.shape import Shape, UnsupportedModel, shape_from_config  # noqa: F401 (memory.Shape)

GIB = 2**30

# bitsandbytes NF4 with double quant: 4 bits + one uint8 absmax per 64 weights + one fp32 absmax per
# 256 absmax blocks (bitsandbytes functional.quantize_4bit; QLoRA paper section 3).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# PEFT keeps LoRA weights in fp32 (autocast_adapter_dtype): weight 4 + grad 4 + AdamW m and v 8.
LORA_BYTES_PER_PARAM = {"weight": 4, "grad": 4, "optimizer": 8}

# Multipliers fitted on the GPU: `python bench/memory_matrix.py fit bench/results/memory_matrix_raw.json`
# on the 12 even-numbered rows of the H200 matrix only (odd rows and rows 24+ are held out; see
# bench/memory_matrix.md). Starting values were the physical counts (1.0).
CAL = {
    "keep": 1.032,  # per-layer checkpoint (bf16 layer input, 2h bytes per token per layer)
    "layer": 1.0,  # one layer's saved activations (recompute, or each layer without checkpointing)
    # Bytes kept per input feature of each LoRA module when lora_dropout > 0: fp32 dropout output (4) +
    # bool mask (1) by the CUDA kernel's arithmetic; at dropout 0 the fp32-cast input (4) is kept instead.
    "lora_input_dropout": 4.706,
    "layer_backward": 0.292,  # extra peak of one layer's backward, as a multiple of its saved activations
    "hf_loss": 11.907,  # bytes per token per vocab entry at HF cross-entropy's peak (fp32 logits, log-softmax, grads)
    # Liger fused linear CE in the harness: multiple of T x h x 2 bytes (the train stage counts its buffers instead:
    # estimate() fused_loss_transient)
    "fused_loss": 29.65,
    "reserve_loss": 0.22,  # allocator reserve: fraction of the loss transient (HF loss leaves ~1 fp32 logits' worth)
    "reserve_layer": 0.015,  # allocator reserve: fraction of one layer's backward transient
    "reserve_fixed_gib": 0.553,  # allocator reserve: fixed part (cuBLAS workspace, small-block pools)
    # NVML per-process used minus torch reserved, H200, torch 2.11 + CUDA 13: 0.74 GiB in every run.
    "cuda_context_gib": 0.74,
    # The train stage runs with expandable segments (tasks/train.py), where reserved stays close to allocated:
    # reserved minus allocated was 0.28-0.48 GiB (median 0.31) in its six H200 rows of bench/results/train_bench.json
    # as of commit 10ebd3a (2026-12-03), fitted on those (in-sample); 0.16-0.46 (median 0.34) in the eight distinct
    # loraship rows of it as of 6f6364f (2026-12-04), measured after the fit; 0.13-0.67 (median 0.31) in the ten
    # loraship rows of issue #24's run (the file now). The reserve_* terms above are the default allocator's.
    "reserve_expandable_gib": 0.31,
    # ...except after HF cross-entropy: its fp32 logits and log-softmax are a step's largest blocks, and the space
    # they leave stays mapped between steps on a card with room. A fraction of that loss transient, fitted on the
    # train-stage matrix's 4 HF-loss fit rows only (0.20-0.34, median 0.24: `python bench/memory_matrix.py fit-stage`,
    # bench/results/memory_matrix_stage.json). The allocator hands it back under memory pressure (under a 32 GiB cap
    # the same rows reserved 0.3-1.8 GiB over allocated, not 3-5), so it counts in predicted reserved, not in what
    # the card must hold.
    "reserve_hf_loss_expandable": 0.24,
}
# What the card must hold beyond the prediction: the worst under-prediction of peak reserved in
# bench/memory_matrix.md is 7.5% (34 H200 runs), so 8% of the budget (2.56 GiB of 32) is kept free.
SAFETY_MARGIN_FRACTION = 0.08
SAFETY_MARGIN_MIN_GIB = 0.5

# Speed, for one choice only: how many layers to stream when offload must (plan_training's _stream_for_speed; the
# model: step_seconds). Rates of the fastest cards loraship plans for, where copies hide least: executed bf16 FLOP/s
# (recomputes included) of the qwen2-14b-lora default row of bench/results/train_bench.json on the H200 (6,187 tokens/s
# at 61.9 GFLOP per token plus 48 recomputed layers at 0.59 each: ~558 TFLOP/s), and pinned host-to-device copies as
# measured on the H100 of bench/results/train_bench_14b_lora_h100.json (52.9 GB/s, PCIe 5.0 x16). A card that computes
# slower hides the copies better; a PCIe 4.0 host with a card this fast would hide them less than planned.
PLAN_EXECUTED_TFLOPS = 550.0
PLAN_HOST_TO_DEVICE_GBPS = 50.0

# How plans, manifests and model cards name offload_activations (bench/train_bench.py reads it back from them).
ACTIVATIONS_IN_CPU = "checkpointed activations in CPU memory"

QVO = ("q_proj", "v_proj", "o_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 computes q, k, v with one Linear (qkv_proj) and gate, up with another (gate_up_proj): the names of
# ALL_LINEAR that a config may give (the default q, k, v, o) stand for the fused module that holds them
# (Shape.fused_names, read off the model).
FUSED_NAME = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def parse_model_config(mc: dict) -> Shape:
    """The Shape of the decoder-only causal LM a config.json (a dict) describes, read from transformers' own model
    class (loraship/planning/shape.py); a multimodal config's text_config is followed. Raises UnsupportedModel (a
    ValueError) naming the class and the fix for what is no decoder-only causal LM that transformers and the pinned
    llama.cpp converter both support."""
    return shape_from_config(mc)


def lora_modules(s: Shape, requested: list[str] | str) -> tuple[str, ...]:
    """The decoder Linears that `lora_target_modules` adapts in a model of shape `s`, in layer order.

    "all-linear" is every decoder Linear. On Phi-3 a Llama name stands for the fused Linear holding it
    (q_proj -> qkv_proj, gate_proj -> gate_up_proj; lora_target_note says when that adapts more than was
    named). A name that is no decoder Linear of the architecture is refused, not skipped: PEFT would adapt
    the rest silently (q_proj, k_proj, v_proj, o_proj on Phi-3 would train o_proj alone)."""
    names = tuple(s.linears())
    if requested == "all-linear":
        return names
    chosen, unknown = set(), []
    for n in requested:
        m = n if n in names else s.fused_names.get(n)
        if m in names:
            chosen.add(m)
        else:
            unknown.append(n)
    if unknown:
        alias = (" (q_proj, k_proj, v_proj name qkv_proj; gate_proj, up_proj name gate_up_proj)" if s.fused else "")
        raise ValueError(f"lora_target_modules {unknown} name no Linear of a {s.model_type} decoder layer, whose "
                         f"Linears are {', '.join(names)}{alias}; fix: name those, or set lora_target_modules: all-linear")
    return tuple(n for n in names if n in chosen)


def lora_target_note(s: Shape, requested: list[str] | str) -> str | None:
    """Words for the run's record when a fused module adapts projections the config did not name, else None."""
    if not s.fused or requested == "all-linear":
        return None
    wider = []
    for m in lora_modules(s, requested):
        parts = [n for n, f in s.fused_names.items() if f == m]
        named = [n for n in parts if n in requested]
        if named and len(named) < len(parts) and m not in requested:
            wider.append(f"{', '.join(named)} -> {m} (adapts {', '.join(parts)} together)")
    if not wider:
        return None
    return f"{s.model_type} fuses its projections: " + "; ".join(wider)


def target_names(cfg: Config, s: Shape | None = None) -> tuple[str, ...]:
    """The adapted Linears of `s` (lora_modules); without a shape, of a Llama-style layer (bench scripts)."""
    if s is not None:
        return lora_modules(s, cfg.lora_target_modules)
    if cfg.lora_target_modules == "all-linear":
        return ALL_LINEAR
    return tuple(n for n in ALL_LINEAR if n in cfg.lora_target_modules)


def fused_loss_available(cfg: Config, device: str = "cuda") -> bool:
    """Whether training uses Liger's fused linear cross-entropy; plan and train both ask this.

    'auto' means: liger-kernel is importable and the device is CUDA (its kernels are Triton).
    The plan describes GPU training, so it asks for "cuda" unless `device: cpu`. find_spec looks
    the package up without importing it (and torch with it), so `loraship plan` stays light.
    """
    if cfg.fused_loss == "off" or device != "cuda":
        return False
    if cfg.fused_loss == "on":
        return True
    return importlib.util.find_spec("liger_kernel") is not None


def checkpoint_every_layer(cfg: Config) -> bool:
    """Whether every decoder layer is checkpointed: `gradient_checkpointing` where set; else yes under
    `optimize: memory` or `offload_activations: on` (which asks for every checkpointed input in CPU memory, the
    least memory). Otherwise (optimize: speed) the plan checkpoints only as many of the first layers as fit."""
    if cfg.gradient_checkpointing is not None:
        return cfg.gradient_checkpointing
    return cfg.optimize == "memory" or cfg.offload_activations == "on"


def activations_setting(cfg: Config) -> str:
    """offload_activations as the plan applies it: 'auto' under optimize: memory is 'on' (the least GPU memory)."""
    if cfg.offload_activations == "auto" and cfg.optimize == "memory" and checkpoint_every_layer(cfg):
        return "on"
    return cfg.offload_activations


def strategy_from_config(cfg: Config, n_layers: int | None = None) -> dict:
    """The configuration as written. `checkpointed_layers` needs the layer count: without it the key is
    left out and checkpointed_layers() reads `gradient_checkpointing` as all layers or none."""
    out = {"adapter": cfg.adapter, "offload_layers": 0, "micro_batch_size": cfg.micro_batch_size,
           "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
           "fused_loss": fused_loss_available(cfg, "cpu" if cfg.device == "cpu" else "cuda"),
           "gradient_checkpointing": checkpoint_every_layer(cfg),
           "offload_activations": activations_setting(cfg) == "on" and checkpoint_every_layer(cfg)}
    if n_layers is not None:
        out["checkpointed_layers"] = n_layers if checkpoint_every_layer(cfg) else 0
    return out


def checkpointed_layers(strategy: dict, n_layers: int) -> int:
    """How many decoder layers (the first ones) recompute their activations in backward.

    `gradient_checkpointing` stays in the strategy as "any layer checkpointed"; a strategy without
    `checkpointed_layers` (plans written before it existed) means all layers or none.
    """
    k = strategy.get("checkpointed_layers")
    if k is None:
        return n_layers if strategy["gradient_checkpointing"] else 0
    return max(0, min(int(k), n_layers))


def with_checkpointing(strategy: dict, k: int) -> dict:
    """`strategy` with the first k decoder layers checkpointed (both keys kept consistent)."""
    return {**strategy, "gradient_checkpointing": k > 0, "checkpointed_layers": k}


# ---------------------------------------------------------------------------------------------
# The estimate for one strategy
# ---------------------------------------------------------------------------------------------
# Which LoRA modules read the same input tensor (Shape.reads, from where each Linear sits in the layer), and whether a
# decoder layer keeps that tensor anyway: q, k, v read the attention norm's output; o reads the attention output (kept
# by attention itself); gate and up read the MLP norm's output; down reads the activation's output.
KEPT_ANYWAY = {"attn_out"}
# Where the train stage's Liger SwiGLU MLP runs down_proj's LoRA as one node with the activation (Shape.swiglu_down:
# separate gate_proj, up_proj, down_proj around SiLU; loraship/training/fused_lora.py SwiGLUDownLora): h = silu(gate)
# * up is rebuilt in backward from gate and up, which the SwiGLU keeps anyway. Liger's other MLPs (Phi-3's fused
# gate_up_proj, Gemma's GEGLU) keep their own forward. Where a decoder layer ends in `residual + down_proj(h)`
# (Shape.recompute_skips_down), a checkpointed layer's recompute skips down_proj's GEMM (loraship/training/recompute.py).


def lora_saved_per_token(s: Shape, cfg: Config, targets: tuple[str, ...], program: str, liger: bool = False) -> float:
    """Bytes per token one decoder layer's LoRA modules keep for backward.

    The harness (fp32 LoRA weights, PEFT casting the input): each module keeps its own fp32 copy of its
    input (4 B per feature), or with dropout its fp32 dropout output + mask (CAL lora_input_dropout), and
    lora_A's fp32 output (4r). The train stage (tasks/train.py) runs LoRA through fused nodes
    (loraship/training/fused_lora.py) under bf16 autocast: modules reading the same tensor keep it once (bf16,
    2 B), nothing for an input the layer keeps anyway (o_proj's, the attention output; down_proj's under Liger's
    SwiGLU, rebuilt from gate and up: `liger`); with dropout each module adds its 1-byte bool mask (the dropped
    input is rebuilt in backward); x A^T is bf16 (2r).
    """
    lin = s.linears()
    # Eager attention (Gemma 2) keeps the probabilities, not its output: o_proj's LoRA keeps its own input there.
    kept_anyway = set() if s.attn_softcap else set(KEPT_ANYWAY)
    if liger and s.swiglu_down:
        kept_anyway.add("mlp_act")
    if program != "train-stage":
        per_input = CAL["lora_input_dropout"] if cfg.lora_dropout > 0 else 4
        return sum(per_input * lin[n][0] + 4 * cfg.lora_r for n in targets)
    shared = {s.reads(n): lin[n][0] for n in targets if s.reads(n) not in kept_anyway}
    inputs = sum(2 * features for features in shared.values())
    if cfg.lora_dropout > 0:
        inputs += sum(lin[n][0] for n in targets)  # one dropout mask per module
    return inputs + 2 * cfg.lora_r * len(targets)


def layer_saved_per_token(s: Shape, cfg: Config, targets: tuple[str, ...], program: str, liger: bool) -> float:
    """Bytes per token one decoder layer without checkpointing keeps for backward, HF Llama/Qwen2 code with SDPA.

    Two RMSNorms keep their fp32 input (4h each); attention keeps rotated q, k, v and its output (bf16); SwiGLU keeps
    gate, silu(gate) and up (bf16, 3 x 2f); the LoRA modules keep their inputs (lora_saved_per_token). With the fused
    loss the train stage applies every Liger kernel (tasks/train.py): Liger's RMSNorm keeps its bf16 input (2h, not
    4h) and its SwiGLU keeps gate and up only (4f; silu is recomputed in backward). Gemma 2 has four norms per layer
    and GELU-tanh where Llama has SiLU (gate, gelu(gate), up kept the same way; Liger's GEGLU keeps gate and up).
    Counted with autograd's saved-tensor hooks on one CPU decoder layer of each (transformers 5.25, bf16): these
    terms plus < 4% (rotary cos/sin, per-row norm statistics); tests/test_layer_saved_bytes.py recounts the train
    stage's Qwen2 path (fused LoRA nodes, Liger's autograd functions) against this.
    """
    norms, swiglu = (2 * s.norms * s.h, 4 * s.f) if liger else (4 * s.norms * s.h, 6 * s.f)
    if s.mlp == "plain":
        swiglu = 2 * s.f  # an ungated MLP (fc1, activation, fc2): the activation keeps its bf16 input only
    attention = 4 * s.q + 4 * s.kv
    if s.fused:
        # Phi-3's v is a view of qkv_proj's output, so SDPA keeping v keeps all of it (q + 2kv, bf16).
        attention += 2 * s.q + 2 * s.kv
    if s.sliding_layers and not s.attn_softcap and s.sliding_window < cfg.sequence_len:
        # A sliding window shorter than the sequence runs SDPA with a mask (Gemma 3; packing: auto pads such a model):
        # transformers then repeats k and v to every query head (enable_gqa only without a mask), and SDPA keeps the
        # mask converted to bf16, S x S per sequence (2S bytes per token), in each sliding layer. Averaged over the
        # layers; counted with saved-tensor hooks in tests/test_layer_saved_bytes.py.
        attention += s.sliding_layers / s.L * (4 * (s.q - s.kv) + 2 * cfg.sequence_len)
    if s.qk_norm:
        # Qwen3, Gemma 3, OLMo 2 norm q and k before RoPE (per head or over all heads alike): each norm keeps its
        # input as the layer norms do, fp32 in transformers' RMSNorm, bf16 in Liger's.
        attention += (2 if liger else 4) * (s.q + s.kv)
    if s.attn_softcap:
        # Eager attention (transformers' Gemma 2 runs it: SDPA takes no softcap) keeps q, and k and v repeated to
        # every query head (2q each), and per head and key position of the padded row the tanh output (bf16),
        # softmax's fp32 output and its bf16 copy for the product with v: 8 bytes, on sliding layers too (the
        # window only masks). Its backward holds the scores' fp32 gradient into and out of softmax (8 bytes more)
        # while those are still kept (estimate()'s scores_bwd).
        attention = 6 * s.q + 8 * s.heads * cfg.sequence_len
    return norms + attention + swiglu + lora_saved_per_token(s, cfg, targets, program, liger)


def fused_loss_transient(T: int, s: Shape) -> float:
    """Bytes Liger's fused linear cross-entropy holds while it runs (liger_kernel ops/fused_linear_cross_entropy.py):
    the final norm's bf16 output it reads, the bf16 input gradient it fills, and one chunk of bf16 logits of the rows it
    picks, next_power_of_2(T / ceil(V / h)); its cross-entropy kernel writes the chunk's gradient over the logits in
    place (no fp32 copy: 2 bytes per entry, not 2 + 4 as counted before, which over-predicted issue #24's partially
    checkpointed rows, bench/results/planner_rescore.json). Also the final norm's bf16 input, which Liger's RMSNorm
    keeps for backward and no decoder layer's term counts (layer_saved_per_token counts each layer's own input)."""
    rows = min(T, 1 << max(0, math.ceil(T / math.ceil(s.V / s.h)) - 1).bit_length())
    return 3 * 2 * T * s.h + rows * s.V * 2


def estimate(model_config: dict, cfg: Config, strategy: dict, program: str = "train-stage") -> dict:
    """Predicted peak memory of one training step under `strategy`, in GiB, by component.

    `program`: what runs the step. "train-stage" is tasks/train.py: with the fused loss it applies every
    Liger kernel (RMSNorm, SwiGLU, RoPE too) and it allocates with expandable segments. "harness" is
    bench/memory_matrix.py's own loop, on whose rows the CAL constants were fitted: Liger's fused loss
    only, the default caching allocator.

    The peak holds the static terms (weights, LoRA weights, gradients, optimizer state) and the kept
    activations, plus the larger of two transients: the loss (at the start of backward) or one decoder
    layer's recompute + backward (`peak_phase` names which). The allocator reserve and the CUDA context
    come on top: the card must hold reserved + context.
    """
    s = parse_model_config(model_config)
    T = strategy["micro_batch_size"] * cfg.sequence_len
    targets = target_names(cfg, s)
    lin = s.linears()
    qlora = strategy["adapter"] == "qlora"

    # Frozen weights: NF4 quantizes only decoder Linears; embeddings, lm_head, norms, biases stay bf16.
    layer_lin_bytes = s.layer_linear_params * (NF4_BYTES_PER_PARAM if qlora else 2)
    # A multimodal wrapper loads its vision tower too (other_params), frozen and untrained.
    rest_bytes = 2 * (s.n_params - s.L * s.layer_linear_params + s.other_params)
    n_off = min(strategy.get("offload_layers", 0), s.L)
    weights = (s.L - n_off) * layer_lin_bytes + rest_bytes
    # n layers stream back one at a time (loraship/training/offload.py; which ones: streamed_layers, the same memory
    # either way): two copies on the GPU (current + prefetch) while one of them runs or recomputes. At the loss only
    # where every layer streams: the last one is copied again for its recompute as soon as its forward is done;
    # otherwise the last streamed layer is copied when backward reaches the layer after it.
    streamed = min(2, n_off) * layer_lin_bytes
    streamed_at_loss = layer_lin_bytes if n_off == s.L else 0.0

    lora_params = s.L * sum(cfg.lora_r * (lin[n][0] + lin[n][1]) for n in targets)
    lora_w = lora_params * LORA_BYTES_PER_PARAM["weight"]
    lora_g = lora_params * LORA_BYTES_PER_PARAM["grad"]
    opt = lora_params * LORA_BYTES_PER_PARAM["optimizer"]

    liger = strategy["fused_loss"] and program == "train-stage"
    per_tok = layer_saved_per_token(s, cfg, targets, program, liger)
    scores_bwd = T * 8 * s.heads * cfg.sequence_len if s.attn_softcap else 0.0
    layer_saved = CAL["layer"] * T * per_tok
    layer_bwd = CAL["layer_backward"] * layer_saved + scores_bwd
    dequant = max(i * o for i, o in lin.values()) * 2 if qlora else 0  # bnb dequantizes one matrix at a time
    # The first k layers are checkpointed (tasks/train.py): each keeps only its bf16 input; the other L - k
    # keep all their saved activations until their own backward. Backward runs from the last layer down,
    # so the non-checkpointed layers are done (their activations freed) before the first recompute starts.
    # Hence the transient on top of `kept` is one layer's recompute + backward only when every layer is
    # checkpointed (k = L); with k < L the worst layer transient is the plain backward of layer L-1, with
    # all of `kept` still held (a later recompute holds at most k keeps + one layer, which is less: at
    # least one layer's saved activations were freed before it). k = 0 and k = L are exactly the two
    # modes the CAL constants were fitted on (bench/results/memory_matrix.json); 0 < k < L is not measured.
    k = checkpointed_layers(strategy, s.L)
    kept_ckpt = CAL["keep"] * T * 2 * s.h * k
    # Checkpointed inputs in pinned CPU memory (loraship/training/activation_offload.py): on the GPU at most two at a
    # time (the layer computing and the one prefetched or still being copied out).
    offloaded_acts = bool(strategy.get("offload_activations")) and k > 0
    host_acts = 0
    if offloaded_acts:
        host_acts = T * 2 * s.h * k
        kept_ckpt = CAL["keep"] * T * 2 * s.h * min(k, 2)
    kept_full = (s.L - k) * layer_saved
    kept = kept_ckpt + kept_full
    layer_peak = layer_saved + layer_bwd if k == s.L else layer_bwd
    if strategy["fused_loss"] and program == "train-stage":
        # Liger's own buffers only. The harness's fitted CAL["fused_loss"] (13x more at 2 x 4096 on a 7B) stood in
        # for the first recompute + backward after the loss, which the train stage's Liger RMSNorm/SwiGLU make
        # smaller: counted here, it over-predicted the four partially checkpointed rows of issue #24's run
        # (bench/results/train_bench.json, 2026-12-05, commit f4fbbcb5) by 1.84-2.44 GiB, each within 0.4 GiB of it,
        # and the four all-checkpointed 7B/14B rows by 0.08-1.04 GiB, where one layer's recompute + backward is
        # within 0.1 GiB of what they measured.
        loss = fused_loss_transient(T, s)
    elif strategy["fused_loss"]:
        loss = CAL["fused_loss"] * T * 2 * s.h
    else:
        loss = CAL["hf_loss"] * T * s.V
        if s.final_softcap:
            # Gemma 2's cap on the bf16 logits: tanh keeps its output and the capped copy goes to the loss (2 x 2 B).
            # Liger's fused loss caps inside its chunks (tasks/train.py applies it), at no cost here.
            loss += 4 * T * s.V
    # The train stage sets the LoRA gradients to None after each optimizer step (tasks/train.py zero_grad(set_to_none=
    # True)): with k < L the peak, at the loss or the last layer's backward, comes before any is written. Not so with
    # every layer checkpointed (the peak recurs at each recompute, the last one after nearly all gradients were
    # written), nor with accumulation (later micro-batches hold the earlier ones'). The first recompute (k > 0) comes
    # after the gradients of the L - k later layers: counted whole there, with one layer's activations instead of L - k.
    # With k < L the layer peak is the last layer's plain backward, before any streamed layer (all among the first k,
    # recomputed later) is copied back; the first recompute below counts the copies.
    streamed_at_layer = streamed if k == s.L else 0.0
    act_peak = max(loss + streamed_at_loss, layer_peak + dequant + streamed_at_layer)
    grads_before_peak = (program == "train-stage" and k < s.L and strategy["gradient_accumulation_steps"] == 1)
    at_peak, grads_at_peak = kept + act_peak, lora_g
    if not grads_before_peak:
        at_peak += lora_g
    else:
        first_recompute = kept_ckpt + layer_saved + layer_bwd + dequant + streamed + lora_g if k else 0.0
        if first_recompute > at_peak:
            at_peak = first_recompute
        else:
            grads_at_peak = 0.0
    static = weights + lora_w + opt
    allocated = static + at_peak
    # Fragmentation follows the largest one-layer transient that happens at all: a recompute's whenever k > 0.
    layer_transient = (layer_saved + layer_bwd if k else layer_bwd) + dequant
    reclaimable = 0.0
    if program == "train-stage":
        if not strategy["fused_loss"]:
            reclaimable = CAL["reserve_hf_loss_expandable"] * loss
        reserve = CAL["reserve_expandable_gib"] * GIB + reclaimable
    else:
        reserve = CAL["reserve_loss"] * loss + CAL["reserve_layer"] * layer_transient + CAL["reserve_fixed_gib"] * GIB
    reserved = allocated + reserve
    ctx = CAL["cuda_context_gib"] * GIB
    if k == 0:
        acts = {"saved_activations_all_layers": kept_full}
    elif k == s.L:
        acts = {"checkpointed_activations": kept_ckpt}
    else:
        acts = {"checkpointed_activations": kept_ckpt, "saved_activations_other_layers": kept_full}
    comps = {
        "frozen_weights": weights, "lora_weights": lora_w,
        "lora_gradients": grads_at_peak, "optimizer_state": opt,
        **acts,
        **({"streamed_layer_copies": streamed} if n_off else {}),
        "one_layer_recompute_and_backward": layer_peak + dequant,
        "logits_and_cross_entropy": loss,
        "allocator_reserve": reserve, "cuda_context": ctx,
    }
    budget = cfg.gpu_memory_gib
    margin = safety_margin_gib(budget)
    total = reserved - reclaimable + ctx
    return {
        "components_gib": {k: round(v / GIB, 3) for k, v in comps.items()},
        "peak_phase": ("cross-entropy" if loss + streamed_at_loss >= layer_peak + dequant + streamed_at_layer
                       else "one layer's backward"),
        "predicted_allocated_gib": allocated / GIB,
        "predicted_reserved_gib": reserved / GIB,
        "cuda_context_gib": ctx / GIB,
        # What the card must hold: reserved and the CUDA context, less the cache the allocator hands back when short.
        "predicted_total_gib": total / GIB,
        "reclaimable_cache_gib": reclaimable / GIB,
        # What a weights-only calculator (accelerate estimate-memory style) says: all frozen weights, nothing else.
        "weights_only_estimate_gib": (s.L * layer_lin_bytes + rest_bytes) / GIB,
        "fits": total / GIB <= budget - margin,
        "activations_in_cpu_memory_gib": round(host_acts / GIB, 3),
        "lora_params": lora_params,
        "checkpointed_layers": k,
    }


def safety_margin_gib(budget_gib: float) -> float:
    return max(SAFETY_MARGIN_MIN_GIB, SAFETY_MARGIN_FRACTION * budget_gib)


# ---------------------------------------------------------------------------------------------
# Choosing a strategy
# ---------------------------------------------------------------------------------------------
def _divisors_desc(n: int, at_most: int) -> list[int]:
    return [d for d in range(min(n, at_most), 0, -1) if n % d == 0]


def _ladder(model_config: dict, cfg: Config, fallback: list[str] | None = None) -> list[tuple[dict, str]]:
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
    s = parse_model_config(model_config)
    user = strategy_from_config(cfg, s.L)
    eff = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    budget = f"{cfg.gpu_memory_gib:g} GiB"
    every = checkpoint_every_layer(cfg)
    setting = activations_setting(cfg)
    ks = [s.L] if every else list(range(s.L + 1))
    out: list[tuple[dict, str]] = [(user, "as configured")]
    for k in ks:
        if k != user["checkpointed_layers"]:
            out.append((with_checkpointing({**user, "offload_activations": setting == "on" and k > 0}, k),
                        f"checkpointing {k} of {s.L} layers to fit {budget}"))
    # offload_activations: auto, once every layer is checkpointed: their inputs to CPU memory before any change to
    # the batch or the base; from there on every rung keeps them there.
    acts = setting == "on"  # step() applies it to rungs that checkpoint any layer
    if setting == "auto":
        out.append(({**with_checkpointing(user, s.L), "offload_activations": True},
                    f"checkpointed activations kept in CPU memory to fit {budget}"))
        acts = True
        ks = [s.L]
    fused = user["fused_loss"]
    mbs = _divisors_desc(eff, cfg.micro_batch_size)

    def ckpt_words(k):
        if every:
            return ""  # optimize: memory: all layers, as the user asked; nothing to explain
        return f", checkpointing {k} of {s.L} layers to fit {budget}" if k else ", no layer checkpointed"

    def step(adapter, mb, n_off, k, why):
        return (with_checkpointing({"adapter": adapter, "offload_layers": n_off, "micro_batch_size": mb,
                                    "gradient_accumulation_steps": eff // mb, "fused_loss": fused,
                                    "offload_activations": acts and k > 0}, k), why)

    for mb in mbs[1:]:
        for k in ks:
            out.append(step(user["adapter"], mb, 0, k, f"micro-batch {mb} x {eff // mb} accumulation keeps the effective "
                                                       f"batch {eff}{ckpt_words(k)}"))
    if user["adapter"] != "lora":
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
                out.append(step("lora", mb, n, s.L, f"bf16 LoRA, micro-batch {mb} x {eff // mb}, with {n} of {s.L} decoder "
                                               "layers' frozen weights streamed from CPU memory (fallback: offload keeps bf16)"))
        elif kind == "qlora":
            for mb in mbs:
                for k in ks:
                    out.append(step("qlora", mb, 0, k, f"QLoRA (NF4 double-quant base), micro-batch {mb} x {eff // mb}"
                                                       f"{ckpt_words(k)} (fallback: qlora allows this precision change)"))
    return out


def _rung(strategy: dict, user: dict) -> str:
    """Which kind of change a ladder rung makes to the user's strategy."""
    if strategy["offload_layers"]:
        return "offload"
    if strategy["adapter"] != user["adapter"]:
        return "qlora"
    if strategy["micro_batch_size"] != user["micro_batch_size"]:
        return "micro-batch"
    if bool(strategy.get("offload_activations")) != bool(user.get("offload_activations")):
        return "activations"
    return "checkpointing" if strategy.get("checkpointed_layers") != user.get("checkpointed_layers") else "as configured"


def _describe(strategy: dict) -> str:
    k = strategy.get("checkpointed_layers")
    spread = f" (spread over the first {k})" if strategy.get("offload_spread") and k else ""
    off = f" with {strategy['offload_layers']} layers offloaded{spread}" if strategy["offload_layers"] else ""
    ckpt = (f"{k} layers checkpointed" if k is not None
            else f"checkpointing {'on' if strategy['gradient_checkpointing'] else 'off'}")
    acts = f", {ACTIVATIONS_IN_CPU}" if strategy.get("offload_activations") else ""
    return (f"{strategy['adapter']}{off}, micro-batch {strategy['micro_batch_size']} x "
            f"{strategy['gradient_accumulation_steps']}, fused loss {'on' if strategy['fused_loss'] else 'off'}, {ckpt}{acts}")


def _why_not(tried: list[tuple[dict, str, dict]], cfg: Config, n_layers: int) -> str:
    """One clause per kind of rung tried without fitting: the least memory that kind reached."""
    user = strategy_from_config(cfg, n_layers)
    best: dict[str, tuple[dict, dict]] = {}
    for strat, _why, est in tried:
        kind = _rung(strat, user)
        if kind not in best or est["predicted_total_gib"] < best[kind][1]["predicted_total_gib"]:
            best[kind] = (strat, est)
    words = {"as configured": "as configured", "checkpointing": "checkpointing more layers",
             "activations": ACTIVATIONS_IN_CPU, "micro-batch": "the smallest micro-batch",
             "offload": "bf16 LoRA with offload", "qlora": "QLoRA"}
    parts = [f"{words[k]} ({_describe(st)}) needs {est['predicted_total_gib']:.1f} GiB"
             + (f" (peak at {est['peak_phase']})" if k == "as configured" else "")
             for k, (st, est) in best.items()]
    if user["adapter"] == "lora":
        barred = [k for k in ("offload", "qlora") if k not in cfg.fallback]
        if barred:
            parts.append(f"fallback {list(cfg.fallback)} rules out {' and '.join(barred)}")
    return "; ".join(parts)


def _card_needed_gib(total_gib: float) -> float:
    """The smallest gpu_memory_gib whose budget minus the safety margin holds `total_gib`."""
    return max(total_gib + SAFETY_MARGIN_MIN_GIB, total_gib / (1 - SAFETY_MARGIN_FRACTION))


def _refusal(model_config: dict, cfg: Config, tried: list[tuple[dict, str, dict]]) -> str:
    budget, margin = cfg.gpu_memory_gib, safety_margin_gib(cfg.gpu_memory_gib)
    n_layers = parse_model_config(model_config).L
    smallest = min(tried, key=lambda t: t[2]["predicted_total_gib"])
    need = smallest[2]["predicted_total_gib"]
    fixes = []
    if cfg.adapter == "lora":
        for kind in ("offload", "qlora"):
            if kind in cfg.fallback:
                continue
            fit = next((st for st, _w in _ladder(model_config, cfg, fallback=[kind])
                        if _rung(st, strategy_from_config(cfg, n_layers)) == kind and estimate(model_config, cfg, st)["fits"]), None)
            if fit:
                fixes.append(f"set fallback: [{kind}] ({_describe(fit)} fits)")
    if activations_setting(cfg) == "off":
        auto = cfg.model_copy(update={"offload_activations": "auto"})
        fit = next((st for st, _w in _ladder(model_config, auto)
                    if st.get("offload_activations") and estimate(model_config, auto, st)["fits"]), None)
        if fit:
            fixes.append(f"set offload_activations: auto ({_describe(fit)} fits)")
    if cfg.fused_loss == "auto" and not strategy_from_config(cfg)["fused_loss"]:
        fixes.append("install liger-kernel (pip install 'loraship[train]') so fused_loss: auto uses the fused loss")
    fixes.append(f"lower sequence_len (now {cfg.sequence_len}) or lora_r (now {cfg.lora_r})")
    fixes.append(f"train on a card with at least {math.ceil(_card_needed_gib(need))} GiB (gpu_memory_gib)")
    return (f"nothing fits gpu_memory_gib {budget:g} GiB ({budget - margin:.1f} GiB after the {margin:.1f} GiB safety "
            f"margin): {_why_not(tried, cfg, n_layers)}. The smallest plan tried ({_describe(smallest[0])}) needs {need:.1f} GiB, "
            f"{need - (budget - margin):.1f} GiB too much. Fix: " + "; or ".join(fixes) + ".")


def _row(strategy: dict, est: dict) -> dict:
    return {**strategy, "predicted_total_gib": round(est["predicted_total_gib"], 2), "fits": est["fits"]}


def _plan(model_config: dict, cfg: Config, strategy: dict, est: dict, reason: str, alternatives: list[dict]) -> dict:
    s = parse_model_config(model_config)
    return {
        "strategy": strategy, "decoder_layers": s.L,
        # What was planned, as transformers builds it (loraship/planning/shape.py), and what the plan leaves out.
        "model": {"class": s.architecture, "decoder_layer": s.layer_class,
                  **({"wrapper": s.wrapper, "untrained_modules": list(s.untrained_modules)} if s.wrapper else {}),
                  "notes": list(s.notes)},
        "fits": est["fits"], "budget_gib": cfg.gpu_memory_gib,
        "safety_margin_gib": round(safety_margin_gib(cfg.gpu_memory_gib), 2), "fallback": list(cfg.fallback),
        "reason": reason,
        "memory": {
            "components_gib": est["components_gib"], "peak_phase": est["peak_phase"],
            "predicted_allocated_gib": round(est["predicted_allocated_gib"], 2),
            "predicted_reserved_gib": round(est["predicted_reserved_gib"], 2),
            "cuda_context_gib": round(est["cuda_context_gib"], 2),
            "predicted_total_gib": round(est["predicted_total_gib"], 2),
            "weights_only_estimate_gib": round(est["weights_only_estimate_gib"], 2),
            "activations_in_cpu_memory_gib": est["activations_in_cpu_memory_gib"],
        },
        "alternatives": alternatives,
    }


class PlanRefused(LorashipError):
    """Nothing the config allows fits gpu_memory_gib: refused at plan time, before any GPU hour."""


def plan_training(model_config: dict, cfg: Config) -> dict:
    """The first strategy on the ladder that fits gpu_memory_gib minus the safety margin.

    Raises PlanRefused, naming the shortfall and the fix, when none does; with `device: cpu` the
    GPU budget does not bind and the smallest candidate is returned, marked as not fitting.
    """
    tried = []
    n_layers = parse_model_config(model_config).L
    for strat, why in _ladder(model_config, cfg):
        est = estimate(model_config, cfg, strat)
        if est["fits"]:
            if tried:
                why = f"{_why_not(tried, cfg, n_layers)}; so: {why}"
            else:
                why = f"as configured fits: {est['predicted_total_gib']:.1f} GiB of {cfg.gpu_memory_gib:g} GiB"
            strat, est, why = _stream_for_speed(model_config, cfg, strat, est, why)
            strat, why = _spread_if_faster(model_config, cfg, strat, why)
            return _plan(model_config, cfg, strat, est, why, _alternatives(model_config, cfg, strat))
        tried.append((strat, why, est))
    if cfg.device != "cpu":
        raise PlanRefused(_refusal(model_config, cfg, tried))
    strat, _why, est = min(tried, key=lambda t: t[2]["predicted_total_gib"])
    why = f"device: cpu, so the GPU budget does not bind; on a GPU: {_refusal(model_config, cfg, tried)}"
    return _plan(model_config, cfg, strat, est, why, _alternatives(model_config, cfg, strat))


def streamed_layers(strategy: dict, n_layers: int) -> list[int]:
    """Which decoder layers stream their frozen weights from CPU memory (loraship/training/offload.py), ascending.

    The first n; or, where the plan spreads them (`offload_spread`), n spaced evenly over the first k checkpointed
    layers, so each prefetch has the forward of the layers between two streamed ones to hide behind, not one layer's.
    Either way every streamed layer is checkpointed (autograd would otherwise keep its copy until backward).
    """
    n = min(strategy.get("offload_layers", 0), n_layers)
    k = checkpointed_layers(strategy, n_layers)
    if n <= 0:
        return []
    if not strategy.get("offload_spread") or k <= n:
        return list(range(n))
    return [j * k // n for j in range(n)]  # distinct, first 0, last below k - 1: the layer after it is recomputed


def step_seconds(model_config: dict, cfg: Config, strategy: dict) -> dict:
    """Predicted seconds of one micro-batch at PLAN_EXECUTED_TFLOPS and PLAN_HOST_TO_DEVICE_GBPS, simulated layer by
    layer as loraship/training/offload.py schedules the copies: one at a time on a side stream, each starting when the
    streamed layer before it (in that pass's direction) starts, or when the stack starts for the first; a streamed
    layer waits for its copy. Backward walks down: a checkpointed layer's recompute + backward (its offloaded input
    coming back beside it); the last streamed layer's copy starts with the recompute of the layer after it where that
    one is checkpointed, as soon as its own forward is done where it is the model's last, else when it is reached."""
    from loraship.planning import flops

    s = parse_model_config(model_config)
    T = strategy["micro_batch_size"] * cfg.sequence_len
    k = checkpointed_layers(strategy, s.L)
    streamed = streamed_layers(strategy, s.L)
    rate, bw = PLAN_EXECUTED_TFLOPS * 1e12, PLAN_HOST_TO_DEVICE_GBPS * 1e9
    forward = T * flops.forward_flops_per_layer_token(model_config, cfg, cfg.sequence_len) / rate
    recompute = T * flops.recompute_flops_per_layer_token(model_config, cfg, cfg.sequence_len) / rate
    head = T * 4 * s.V * s.h / rate  # lm_head's matmul and its input gradient
    backward = T * flops.train_flops_per_token(model_config, cfg, cfg.sequence_len) / rate - head - s.L * forward
    backward /= s.L
    weights = s.layer_linear_params * 2 / bw  # bf16 (offload is bf16 LoRA only)
    checkpoint = T * 2 * s.h / bw if strategy.get("offload_activations") else 0.0
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


def _layouts(strategy: dict, n_layers: int) -> list[dict]:
    """The ways to place a plan's streamed layers: the first n, and (unless LORASHIP_OFFLOAD_SPREAD=0, what the
    spread is worth in bench/train_bench.py) spread over the checkpointed ones."""
    out = [{k: v for k, v in strategy.items() if k != "offload_spread"}]
    n = min(strategy.get("offload_layers", 0), n_layers)
    if os.environ.get("LORASHIP_OFFLOAD_SPREAD", "1") != "0" and 0 < n < checkpointed_layers(strategy, n_layers):
        out.append({**out[0], "offload_spread": True})
    return out


def _layout_times(model_config: dict, cfg: Config, strat: dict) -> list[tuple[float, dict]]:
    """(predicted seconds of a micro-batch, strategy) for each placement of its streamed layers, the first n first;
    the memory is the same for all."""
    n_layers = parse_model_config(model_config).L
    return [(step_seconds(model_config, cfg, c)["step_s"], c) for c in _layouts(strat, n_layers)]


def _faster_layout(model_config: dict, cfg: Config, strat: dict) -> tuple[float, dict]:
    """The faster placement of a plan's streamed layers (the first n on a tie), with its predicted seconds."""
    return min(_layout_times(model_config, cfg, strat), key=lambda o: o[0])


def _spread_if_faster(model_config: dict, cfg: Config, strat: dict, why: str) -> tuple[dict, str]:
    """Any plan that streams fewer layers than it checkpoints (optimize: memory's least offload among them) spreads
    them where the step model says that is faster: no more memory, the same copies, more compute to hide them."""
    if not strat.get("offload_layers") or strat.get("offload_spread"):
        return strat, why
    options = _layout_times(model_config, cfg, strat)
    t, chosen = min(options, key=lambda o: o[0])
    if not chosen.get("offload_spread"):
        return strat, why
    first = options[0][0]
    k = checkpointed_layers(chosen, parse_model_config(model_config).L)
    return chosen, (f"{why}; its {chosen['offload_layers']} streamed layers spread over the first {k} hide their copies "
                    f"better: predicted {t:.2f} s a micro-batch instead of {first:.2f} s, the same memory")


def _stream_for_speed(model_config: dict, cfg: Config, strat: dict, est: dict, why: str) -> tuple[dict, dict, str]:
    """Where offload had to stream n layers with every layer checkpointed (the ladder's rung), stream more where that
    is faster: each streamed layer frees its weights for the saved activations of a later layer, which then skips its
    recompute (loraship/planning/flops.py recompute_flops_per_layer_token); the copies cost nothing while the matmuls
    take longer, which spreading the streamed layers over the checkpointed ones helps (streamed_layers). The layout
    changes no memory: the same layers' weights stay off the GPU, at most two copies on it. optimize: speed only."""
    s = parse_model_config(model_config)
    n = strat.get("offload_layers", 0)
    if not n or checkpoint_every_layer(cfg) or cfg.gradient_checkpointing is not None:
        return strat, est, why
    first = step_seconds(model_config, cfg, strat)["step_s"]
    options = [(first, strat, est)]
    for more in range(n, s.L + 1):
        for k in range(more, s.L + 1):  # streamed layers are among the checkpointed (offload.py)
            cand = with_checkpointing({**strat, "offload_layers": more}, k)
            cand_est = estimate(model_config, cfg, cand)
            if cand_est["fits"]:
                t, cand = _faster_layout(model_config, cfg, cand)
                options.append((t, cand, cand_est))
                break  # more checkpointed layers would only be slower
    fastest = min(t for t, _, _ in options)
    # The fewest streamed layers within 1% of the fastest: a gain inside the model's error is no reason to copy more.
    t, chosen, chosen_est = next(o for o in options if o[0] <= fastest * 1.01)
    if chosen is strat or t > first * 0.99:
        return strat, est, why
    k = checkpointed_layers(chosen, s.L)
    spread = f", spread over the first {k} (one copy hidden behind more than one layer's forward)" \
        if chosen.get("offload_spread") else ""
    return chosen, chosen_est, (
        f"{why}; streaming {chosen['offload_layers']} layers instead of {n}{spread} leaves room for {s.L - k} layers' "
        f"activations, whose recompute is saved: predicted {t:.2f} s a micro-batch instead of {first:.2f} s "
        f"(at {PLAN_EXECUTED_TFLOPS:g} TFLOP/s and {PLAN_HOST_TO_DEVICE_GBPS:g} GB/s host to device)")


def _alternatives(model_config: dict, cfg: Config, chosen: dict) -> list[dict]:
    L = parse_model_config(model_config).L
    user = strategy_from_config(cfg, L)
    cands = [user, {**user, "fused_loss": not user["fused_loss"]} if cfg.fused_loss == "auto" else None,
             {**user, "adapter": "qlora"}, {**user, "adapter": "lora"}]
    # The fewest checkpointed layers that fit as configured: what optimize: speed would run, the speed
    # optimize: memory leaves unused.
    fewest = next((c for c in (with_checkpointing(user, k) for k in range(L + 1))
                   if estimate(model_config, cfg, c)["fits"]), None)
    cands.append(fewest)
    cands.append({**with_checkpointing(user, L), "offload_activations": True})  # Unsloth's way: inputs in CPU memory
    eff = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    cands.append(with_checkpointing({**user, "micro_batch_size": 1, "gradient_accumulation_steps": eff}, L))
    # The least offload that fits bf16 LoRA at the configured micro-batch (quality of bf16, speed of PCIe).
    for n in range(1, L + 1):
        c = with_checkpointing({**user, "adapter": "lora", "offload_layers": n}, L)
        if estimate(model_config, cfg, c)["fits"]:
            cands.append(c)
            break
    seen, out = [chosen], []
    for c in cands:
        if c is None or c in seen:
            continue
        seen.append(c)
        out.append(_row(c, estimate(model_config, cfg, c)))
    return out


# ---------------------------------------------------------------------------------------------
# After an out-of-memory
# ---------------------------------------------------------------------------------------------
def replan_after_oom(plan: dict, model_config: dict, cfg: Config, measured: dict) -> dict | None:
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
        oom_component = (f"allocator reserve (fragmentation): reserved exceeded allocated by {gap_meas:.1f} GiB, "
                         f"predicted {gap_pred:.1f} GiB")
    elif cur.get("peak_phase") == "cross-entropy":
        oom_component = (f"logits and cross-entropy over the vocabulary (predicted {comps['logits_and_cross_entropy']:.1f} GiB "
                         f"at the peak)")
    else:
        oom_component = (f"activations: one decoder layer's recompute and backward (predicted "
                         f"{comps['one_layer_recompute_and_backward']:.1f} GiB) on top of the kept checkpoints")
    # Budget for the next plan: what the card really offered, judged by this failure.
    under = max(res + cur["cuda_context_gib"] - cur["predicted_total_gib"], 0.0)
    shrink = max(under, 0.1 * cur["predicted_total_gib"])
    limit = cur["predicted_total_gib"]  # plans carry totals rounded to 0.01 GiB; compare like with like
    best = None
    for strat, why in _ladder(model_config, cfg):
        est = estimate(model_config, cfg, strat)
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
    out = _plan(model_config, cfg, strat, est,
                f"re-planned after out-of-memory (under-predicted: {oom_component}); {why}",
                [_row(plan["strategy"], {"predicted_total_gib": cur["predicted_total_gib"], "fits": False})])
    out["oom_component"] = oom_component
    return out


# ---------------------------------------------------------------------------------------------
# Disk and inference
# ---------------------------------------------------------------------------------------------
def plan_disk_and_inference(model_config: dict, cfg: Config) -> dict:
    """Disk for merge/convert/quantize and GPU memory of the shipped GGUF under llama.cpp."""
    s = parse_model_config(model_config)
    P = s.n_params
    merged = 2 * (P + s.other_params)  # bf16 safetensors, a multimodal wrapper's vision tower included
    f16 = 2 * P  # F16 GGUF
    # Every quantization takes disk; the primary (the one Ollama and chat open) is what the GPU figures are for.
    each = {q: BITS_PER_WEIGHT[q] / 8 * P for q in cfg.quantizations}
    quant, quant_disk = each[cfg.primary_quantization], sum(each.values())
    # llama.cpp KV cache in f16: K and V, every layer, every position.
    kv = 2 * s.L * cfg.target_context * s.kv * 2
    # The compute buffer and CUDA context as verify predicts them from the GGUF (loraship/planning/inference_memory.py),
    # here from the model config; the weights are the whole GGUF (the input embedding, which llama.cpp
    # keeps on the CPU, included: a margin at plan time).
    compute = im.compute_buffer_bytes(cfg.target_context, s.heads, s.h, s.f, s.V)
    ctx = im.CUDA_OVERHEAD_GIB * GIB
    runtime = kv + compute + ctx
    total = quant + runtime
    g = lambda b: round(b / GIB, 2)  # noqa: E731
    return {
        "disk_gib": {"merge": g(merged), "convert": g(f16), "quantize": g(quant_disk),
                     "total": g(merged + f16 + quant_disk)},
        "inference": {"gguf_gib": g(quant), "kv_cache_gib": g(kv), "compute_buffer_gib": g(compute),
                      "cuda_context_gib": g(ctx), "total_gib": g(total),
                      "fits_target": total / GIB <= cfg.target_gpu_memory_gib,
                      "target_gpu_memory_gib": cfg.target_gpu_memory_gib,
                      "target_context": cfg.target_context, "quantization": cfg.primary_quantization,
                      "by_quantization": {q: {"gguf_gib": g(b), "total_gib": g(b + runtime),
                                              "fits_target": (b + runtime) / GIB <= cfg.target_gpu_memory_gib}
                                          for q, b in each.items()}},
    }
