"""Predicted peak GPU memory of one LoRA/QLoRA training step under one strategy, from the model's Shape.

The model is additive and physical: every term is bytes of a tensor that exists at the peak, with a few multipliers
(CAL) fitted against bench/memory_matrix.py on a real GPU; bench/memory_matrix.md shows predicted vs measured, and
which rows were used to fit CAL. Choosing a strategy is strategy.py's; this module only prices one.

Notation: h hidden, q = heads x head_dim, kv = kv_heads x head_dim,
f intermediate, V vocab, L layers, r rank, T = micro_batch x sequence_len tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraship.config import Config
from loraship.fused_loss import liger_loss_chunk_rows, loss_chunk_mem_const
from loraship.planning import moe
from loraship.planning.shape import Shape
from loraship.planning.strategy_record import Strategy
from loraship.planning.targets import target_names

GIB = 2**30

# bitsandbytes NF4 with double quant: 4 bits + one uint8 absmax per 64 weights + one fp32 absmax per
# 256 absmax blocks (bitsandbytes functional.quantize_4bit; QLoRA paper section 3).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# PEFT keeps LoRA weights in fp32 (autocast_adapter_dtype): weight 4 + grad 4 + AdamW m and v 8.
LORA_BYTES_PER_PARAM = {"weight": 4, "grad": 4, "optimizer": 8}
# bitsandbytes' AdamW8bit: two uint8 moments + one fp32 absmax per 256-value block each (blockwise 8-bit
# optimizers, bitsandbytes functional.optimizer_update_8bit_blockwise). Tensors under 4096 values keep fp32
# moments (its min_8bit_size).
ADAMW_8BIT_BYTES_PER_PARAM = 2 + 2 * 4 / 256


BNB_MIN_8BIT_SIZE = 4096


def optimizer_bytes(cfg: Config, factors: list[int], expert_params: int) -> float:
    """The optimizer's moments for the Linears' LoRA factors (`factors`: each one's values, per layer) and a MoE's
    expert LoRA (stacks far above bitsandbytes' floor for 8-bit moments)."""
    fp32 = LORA_BYTES_PER_PARAM["optimizer"]
    if cfg.optimizer != "adamw_8bit":
        return fp32 * (sum(factors) + expert_params)
    per = sum(n * (ADAMW_8BIT_BYTES_PER_PARAM if n >= BNB_MIN_8BIT_SIZE else fp32) for n in factors)
    return per + ADAMW_8BIT_BYTES_PER_PARAM * expert_params


# The train stage keeps a bf16 cast of every LoRA weight through each optimizer step (fused_lora.py
# casts_kept_until_step), where the harness cast them per layer and let them go with its activations.
LORA_COMPUTE_COPY_BYTES = 2

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
    # reserved minus allocated was 0.28-0.48 GiB (median 0.31) in the six H200 rows it was fitted on (in-sample);
    # 0.16-0.46 (median 0.34) in eight loraship rows measured after the fit and 0.13-0.67 (median 0.31) in the ten
    # loraship rows of bench/results/train_bench.json. The reserve_* terms above are the default allocator's.
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

# Which LoRA modules read the same input tensor (Shape.reads, from where each Linear sits in the layer), and whether a
# decoder layer keeps that tensor anyway: q, k, v read the attention norm's output; o reads the attention output (kept
# by attention itself); gate and up read the MLP norm's output; down reads the activation's output.
KEPT_ANYWAY = {"attn_out"}
# Where the train stage's Liger SwiGLU MLP runs down_proj's LoRA as one node with the activation (Shape.swiglu_down:
# separate gate_proj, up_proj, down_proj around SiLU; loraship/training/fused_lora.py SwiGLUDownLora): h = silu(gate)
# * up is rebuilt in backward from gate and up, which the SwiGLU keeps anyway. Liger's other MLPs (Phi-3's fused
# gate_up_proj, Gemma's GEGLU) keep their own forward. Where a decoder layer ends in `residual + down_proj(h)`
# (Shape.recompute_skips_down), a checkpointed layer's recompute skips down_proj's GEMM
# (loraship/training/recompute.py).


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
    if s.experts is not None:
        # A mixture of experts: its MoE layers keep the router's and the routed experts' tensors (moe.py), the rest
        # (mlp_only_layers, decoder_sparse_step) a dense MLP's; averaged over the layers.
        share = s.experts.layers / s.L
        routed = moe.moe_saved_per_token(s)
        if getattr(cfg, "train_router", False) and s.experts.router:
            routed += 2 * s.h  # the router's LoRA keeps its bf16 input
        swiglu = share * routed + (1 - share) * swiglu
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
    the final norm's bf16 output it reads, the bf16 input gradient it fills, and one chunk of bf16 logits
    (loss_chunk_mem_const's rows); its cross-entropy kernel writes the chunk's gradient over the logits in place (no
    fp32 copy: 2 bytes per entry, not 2 + 4 as counted before, which over-predicted issue #24's partially checkpointed
    rows, bench/results/planner_rescore.json). Also the final norm's bf16 input, which Liger's RMSNorm keeps for
    backward and no decoder layer's term counts (layer_saved_per_token counts each layer's own input)."""
    rows = liger_loss_chunk_rows(T, s.V, s.h, loss_chunk_mem_const(T, s.V, s.h))
    return 3 * 2 * T * s.h + rows * s.V * 2


@dataclass(frozen=True)
class _Weights:
    """Bytes of the frozen weights a step holds: resident, and the streamed layers' copies on the GPU."""

    layer_linear: float  # one decoder layer's Linears, at the base's precision
    rest: float  # embeddings, lm_head, norms, biases, a wrapper's vision tower: bf16
    streamed_layers: int
    resident: float
    streamed: float  # copies of streamed layers on the GPU during a layer's forward or recompute
    streamed_at_loss: float


def _frozen_weights(s: Shape, strategy: Strategy, qlora: bool) -> _Weights:
    # Frozen weights: NF4 quantizes the decoder Linears and a MoE's stacked expert tensors (the train stage does,
    # loraship/training/experts.py), averaged over the layers; embeddings, lm_head, norms, routers, biases stay bf16.
    experts = moe.expert_params(s)
    layer_lin_bytes = (s.layer_linear_params + experts / s.L) * (NF4_BYTES_PER_PARAM if qlora else 2)
    # A multimodal wrapper loads its vision tower too (other_params), frozen and untrained.
    rest_bytes = 2 * (s.n_params - s.L * s.layer_linear_params - experts + s.other_params)
    n_off = min(strategy.offload_layers, s.L)
    weights = (s.L - n_off) * layer_lin_bytes + rest_bytes
    # n layers stream back one at a time (loraship/training/offload.py; which ones: streamed_layers, the same memory
    # either way): two copies on the GPU (current + prefetch) while one of them runs or recomputes. At the loss only
    # where every layer streams: the last one is copied again for its recompute as soon as its forward is done;
    # otherwise the last streamed layer is copied when backward reaches the layer after it.
    streamed = min(2, n_off) * layer_lin_bytes
    streamed_at_loss = layer_lin_bytes if n_off == s.L else 0.0
    return _Weights(layer_lin_bytes, rest_bytes, n_off, weights, streamed, streamed_at_loss)


# Added to the activations the hand model counts, where the layer could not be traced (layer_terms): its per-layer
# formulas missed what families it was not written for keep by up to 14% (OLMo 2's q/k norms under Liger, counted
# against the trace in tests/test_trace.py).
HAND_MODEL_MARGIN = 0.15


def trace_wanted() -> bool:
    """LORASHIP_PLAN_TRACE=0 plans activations with the hand model (bench comparisons of the two)."""
    import os

    return os.environ.get("LORASHIP_PLAN_TRACE", "1") != "0"


@dataclass(frozen=True)
class LayerTerms:
    """One un-checkpointed decoder layer's saved activations and its backward's transient, in bytes, and how they
    were counted."""

    saved: float
    backward: float
    traced: bool
    how: str
    fallback: bool = False  # the trace was wanted and could not run: the plan adds HAND_MODEL_MARGIN
    # How far a traced MoE layer's forward (a recompute's) goes above its saved activations and backward: its NF4
    # expert stacks dequantized next to their LoRA-folded copies (trace_experts.py). 0 where not traced.
    forward_over: float = 0.0


def layer_terms(s: Shape, cfg: Config, strategy: Strategy, targets, program: str, T: int) -> LayerTerms:
    """Traced from the model's own layer class under the train stage's wrappers (loraship/planning/trace.py) for the
    train stage; the hand model (layer_saved_per_token, CAL) for the bench harness, a hand-written Shape,
    LORASHIP_PLAN_TRACE=0, or a layer the trace cannot run (`fallback`), which the returned `how` names."""
    liger = strategy.fused_loss and program == "train-stage"
    # Eager attention's backward on CUDA holds the scores' fp32 gradient into and out of softmax (8 bytes per score),
    # which the CPU trace does not see either: Gemma 2 9B QLoRA 2 x 2048 reserved 29.37 GiB on an H100 where the
    # trace alone predicted 27.92 (bench/results/train_bench_planner_heldout.json).
    scores_bwd = T * 8 * s.heads * cfg.sequence_len if s.attn_softcap else 0.0
    why_not = "the bench harness's own loop" if program != "train-stage" else "a Shape written by hand"
    fallback = False
    if program == "train-stage" and s.config_text and trace_wanted():
        fallback = True
        from loraship.planning import trace

        try:
            # Everything a layer keeps and frees per token is per sequence: traced for one, times the micro-batch; a
            # MoE's expert stacks (and their gradients) once per layer.
            t = trace.trace_layers(
                s.config_text,
                targets,
                cfg.lora_r,
                cfg.lora_dropout,
                1,
                cfg.sequence_len,
                liger,
                experts=expert_wrapping(s, cfg, strategy),
            )
            B = strategy.micro_batch_size
            how = f"traced from {t.layer_class} (FakeTensorMode)"
            saved, backward = B * t.saved + t.fixed_saved, B * t.backward + t.fixed_backward + scores_bwd
            over = max(0.0, B * t.forward + t.fixed_forward - saved - backward) if s.experts is not None else 0.0
            return LayerTerms(saved, backward, True, how, forward_over=over)
        except trace.NotTraceable as e:
            why_not = f"{s.layer_class or 'the layer'} could not be traced: {e}"
    elif program == "train-stage" and not trace_wanted():
        why_not = "LORASHIP_PLAN_TRACE=0"
    per_tok = layer_saved_per_token(s, cfg, targets, program, liger)
    saved = CAL["layer"] * T * per_tok
    backward = CAL["layer_backward"] * saved + scores_bwd
    if s.experts is not None:
        # A MoE layer's expert stacks kept for backward (folded with their LoRA, or dequantized under QLoRA) and the
        # adapted ones' gradient in backward (moe.kept_stack_bytes, stack_gradient_bytes); the trace counts them
        # where it runs.
        share = s.experts.layers / s.L
        saved += moe.kept_stack_bytes(s, cfg, strategy.adapter == "qlora") * share
        backward += moe.stack_gradient_bytes(s, cfg) * share
    return LayerTerms(saved, backward, False, f"hand model ({why_not})", fallback)


def expert_wrapping(s: Shape, cfg: Config, strategy: Strategy):
    """How the train stage wraps a MoE's experts (loraship/training/experts.py), for the trace: the stacked tensors
    lora_target_modules adapts, the router with train_router, NF4 under QLoRA (every stack, adapted or not)."""
    from loraship.planning.trace_experts import NONE, ExpertWrapping

    if s.experts is None:
        return NONE
    return ExpertWrapping(
        tensors=moe.expert_targets(s.experts, cfg.lora_target_modules, set(s.linears())),
        router=bool(getattr(cfg, "train_router", False) and s.experts.router),
        nf4=strategy.adapter == "qlora",
    )


@dataclass(frozen=True)
class _Activations:
    """Bytes of the activations a step keeps and of one layer's transient, with k layers checkpointed."""

    k: int
    layer_saved: float  # one un-checkpointed layer's saved activations
    layer_backward: float
    dequant: float  # bitsandbytes' dequantized matrix during a QLoRA matmul
    kept_checkpointed: float
    kept_full: float
    in_cpu_memory: float  # checkpointed inputs in pinned CPU memory
    terms: LayerTerms  # how one layer's terms were counted

    @property
    def kept(self) -> float:
        return self.kept_checkpointed + self.kept_full

    def layer_peak(self, n_layers: int) -> float:
        """One layer's transient: its recompute + backward when every layer is checkpointed, else the last layer's
        plain backward."""
        return self.layer_saved + self.layer_backward if self.k == n_layers else self.layer_backward


def _activations(
    s: Shape, cfg: Config, strategy: Strategy, targets, program: str, T: int, qlora: bool
) -> _Activations:
    lin = s.linears()
    terms = layer_terms(s, cfg, strategy, targets, program, T)
    layer_saved, layer_bwd = terms.saved, terms.backward
    dequant = max(i * o for i, o in lin.values()) * 2 if qlora else 0  # bnb dequantizes one matrix at a time
    if s.experts is not None and terms.traced:
        # A MoE layer's forward, traced: its peak over the saved activations and backward (under QLoRA the stacks'
        # dequantized copies, alive next to their folds; tests/test_trace_moe.py counts the same on real tensors).
        dequant = max(dequant, terms.forward_over)
    elif s.experts is not None and qlora:
        # Under QLoRA one expert stack is dequantized whole at a time.
        dequant = max(dequant, 2 * max(t.params for t in s.experts.tensors))
    # The first k layers are checkpointed (tasks/train.py): each keeps only its bf16 input; the other L - k
    # keep all their saved activations until their own backward. Backward runs from the last layer down,
    # so the non-checkpointed layers are done (their activations freed) before the first recompute starts.
    # Hence the transient on top of `kept` is one layer's recompute + backward only when every layer is
    # checkpointed (k = L); with k < L the worst layer transient is the plain backward of layer L-1, with
    # all of `kept` still held (a later recompute holds at most k keeps + one layer, which is less: at
    # least one layer's saved activations were freed before it). k = 0 and k = L are exactly the two
    # modes the CAL constants were fitted on (bench/results/memory_matrix.json); 0 < k < L is not measured.
    k = strategy.checkpointed(s.L)
    kept_ckpt = CAL["keep"] * T * 2 * s.h * k
    # Checkpointed inputs in pinned CPU memory (loraship/training/activation_offload.py): on the GPU at most two at a
    # time (the layer computing and the one prefetched or still being copied out).
    offloaded_acts = bool(strategy.offload_activations) and k > 0
    host_acts = 0
    if offloaded_acts:
        host_acts = T * 2 * s.h * k
        kept_ckpt = CAL["keep"] * T * 2 * s.h * min(k, 2)
    kept_full = (s.L - k) * layer_saved
    return _Activations(k, layer_saved, layer_bwd, dequant, kept_ckpt, kept_full, host_acts, terms)


def _loss_transient(s: Shape, strategy: Strategy, program: str, T: int) -> float:
    """Bytes the loss holds at the start of backward."""
    if strategy.fused_loss and program == "train-stage":
        # Liger's own buffers only. The harness's fitted CAL["fused_loss"] (13x more at 2 x 4096 on a 7B) stood in
        # for the first recompute + backward after the loss, which the train stage's Liger RMSNorm/SwiGLU make
        # smaller: counted here, it over-predicted the four partially checkpointed rows of issue #24's run
        # (bench/results/train_bench.json) by 1.84-2.44 GiB, each within 0.4 GiB of it, and the four all-checkpointed
        # 7B/14B rows by 0.08-1.04 GiB, where one layer's recompute + backward is within 0.1 GiB of what they measured.
        return fused_loss_transient(T, s)
    if strategy.fused_loss:
        return CAL["fused_loss"] * T * 2 * s.h
    loss = CAL["hf_loss"] * T * s.V
    if s.final_softcap:
        # Gemma 2's cap on the bf16 logits: tanh keeps its output and the capped copy goes to the loss (2 x 2 B).
        # Liger's fused loss caps inside its chunks (tasks/train.py applies it), at no cost here.
        loss += 4 * T * s.V
    return loss


def estimate(s: Shape, cfg: Config, strategy: Strategy | dict, program: str = "train-stage") -> dict:
    """Predicted peak memory of one training step under `strategy`, in GiB, by component.

    `program`: what runs the step. "train-stage" is tasks/train.py: with the fused loss it applies every
    Liger kernel (RMSNorm, SwiGLU, RoPE too) and it allocates with expandable segments. "harness" is
    bench/memory_matrix.py's own loop, on whose rows the CAL constants were fitted: Liger's fused loss
    only, the default caching allocator.

    The peak holds the static terms (weights, LoRA weights, gradients, optimizer state) and the kept
    activations, plus the larger of two transients: the loss (at the start of backward) or one decoder
    layer's recompute + backward (`peak_phase` names which). The allocator reserve and the CUDA context
    come on top: the card must hold reserved + context. A strategy read from a plan file may come as its JSON
    object: it is read into the record here, once.
    """
    if not isinstance(strategy, Strategy):
        strategy = Strategy.from_json(strategy)
    T = strategy.micro_batch_size * cfg.sequence_len
    targets = target_names(cfg, s)
    lin = s.linears()
    qlora = strategy.adapter == "qlora"
    w = _frozen_weights(s, strategy, qlora)
    # A MoE's expert LoRA: r x experts x (in + out) per adapted stack and layer (moe.expert_lora_params).
    factors = [cfg.lora_r * d for n in targets for d in lin[n][:2]] * s.L  # each LoRA A (r x in) and B (out x r)
    linear_lora = sum(factors)
    lora_params = linear_lora + moe.expert_lora_params(s, cfg)
    lora_w = lora_params * LORA_BYTES_PER_PARAM["weight"]
    lora_g = lora_params * LORA_BYTES_PER_PARAM["grad"]
    opt = optimizer_bytes(cfg, factors, lora_params - linear_lora)
    # Kept for the Linears' fused LoRA nodes only: PEFT casts an expert stack's factors inside each forward.
    lora_casts = linear_lora * LORA_COMPUTE_COPY_BYTES if program == "train-stage" else 0
    a = _activations(s, cfg, strategy, targets, program, T, qlora)
    k = a.k
    loss = _loss_transient(s, strategy, program, T)
    at_peak, grads_at_peak, streamed_at_layer = _activations_at_peak(s, strategy, program, w, a, loss, lora_g)
    allocated = w.resident + lora_w + lora_casts + opt + at_peak
    reserve, reclaimable = _allocator_reserve(strategy, program, loss, a)
    reserved = allocated + reserve
    ctx = CAL["cuda_context_gib"] * GIB
    comps = {
        "frozen_weights": w.resident,
        "lora_weights": lora_w,
        "lora_gradients": grads_at_peak,
        "optimizer_state": opt,
        **({"lora_compute_copies": lora_casts} if lora_casts else {}),
        **_kept_activations(a, s.L),
        **({"streamed_layer_copies": w.streamed} if w.streamed_layers else {}),
        "one_layer_recompute_and_backward": a.layer_peak(s.L) + a.dequant,
        "logits_and_cross_entropy": loss,
        "allocator_reserve": reserve,
        "cuda_context": ctx,
    }
    budget = cfg.gpu_memory_gib
    margin = safety_margin_gib(budget)
    total = reserved - reclaimable + ctx
    hand_margin = _hand_model_margin(a)
    if hand_margin:
        comps["hand_model_margin"] = hand_margin
        total += hand_margin
    return {
        "components_gib": {k: round(v / GIB, 3) for k, v in comps.items()},
        "peak_phase": (
            "cross-entropy"
            if loss + w.streamed_at_loss >= a.layer_peak(s.L) + a.dequant + streamed_at_layer
            else "one layer's backward"
        ),
        "predicted_allocated_gib": allocated / GIB,
        "predicted_reserved_gib": reserved / GIB,
        "cuda_context_gib": ctx / GIB,
        # What the card must hold: reserved and the CUDA context, less the cache the allocator hands back when short.
        "predicted_total_gib": total / GIB,
        "reclaimable_cache_gib": reclaimable / GIB,
        # What a weights-only calculator (accelerate estimate-memory style) says: all frozen weights, nothing else.
        "weights_only_estimate_gib": (s.L * w.layer_linear + w.rest) / GIB,
        "fits": total / GIB <= budget - margin,
        "activations_in_cpu_memory_gib": round(a.in_cpu_memory / GIB, 3),
        "lora_params": lora_params,
        "checkpointed_layers": k,
        "activations_counted": a.terms.how,
    }


def _hand_model_margin(a: _Activations) -> float:
    """Bytes added where a real model's layer could not be traced and the hand model counted it (HAND_MODEL_MARGIN of
    the activations at the peak); none for a traced layer, the bench harness, a hand-written Shape or
    LORASHIP_PLAN_TRACE=0."""
    if not a.terms.fallback:
        return 0.0
    return HAND_MODEL_MARGIN * (a.kept_full + a.layer_saved + a.layer_backward)


def _activations_at_peak(
    s: Shape, strategy: Strategy, program: str, w: _Weights, a: _Activations, loss: float, lora_g: float
) -> tuple[float, float, float]:
    """What the peak holds on top of the static terms (kept activations, the larger transient, the LoRA gradients
    where written by then), the LoRA gradients among it, and the streamed copies at a layer's transient."""
    # The train stage sets the LoRA gradients to None after each optimizer step (tasks/train.py zero_grad(set_to_none=
    # True)): with k < L the peak, at the loss or the last layer's backward, comes before any is written. Not so with
    # every layer checkpointed (the peak recurs at each recompute, the last one after nearly all gradients were
    # written), nor with accumulation (later micro-batches hold the earlier ones'). The first recompute (k > 0) comes
    # after the gradients of the L - k later layers: counted whole there, with one layer's activations instead of
    # L - k.
    # With k < L the layer peak is the last layer's plain backward, before any streamed layer (all among the first k,
    # recomputed later) is copied back; the first recompute below counts the copies.
    k = a.k
    streamed_at_layer = w.streamed if k == s.L else 0.0
    act_peak = max(loss + w.streamed_at_loss, a.layer_peak(s.L) + a.dequant + streamed_at_layer)
    grads_before_peak = program == "train-stage" and k < s.L and strategy.gradient_accumulation_steps == 1
    at_peak, grads_at_peak = a.kept + act_peak, lora_g
    if not grads_before_peak:
        at_peak += lora_g
    else:
        first_recompute = (
            a.kept_checkpointed + a.layer_saved + a.layer_backward + a.dequant + w.streamed + lora_g if k else 0.0
        )
        if first_recompute > at_peak:
            at_peak = first_recompute
        else:
            grads_at_peak = 0.0
    return at_peak, grads_at_peak, streamed_at_layer


def _allocator_reserve(strategy: Strategy, program: str, loss: float, a: _Activations) -> tuple[float, float]:
    """The allocator's reserve on top of allocated, and the part of it it hands back under pressure."""
    # Fragmentation follows the largest one-layer transient that happens at all: a recompute's whenever k > 0.
    layer_transient = (a.layer_saved + a.layer_backward if a.k else a.layer_backward) + a.dequant
    reclaimable = 0.0
    if program == "train-stage":
        if not strategy.fused_loss:
            reclaimable = CAL["reserve_hf_loss_expandable"] * loss
        return CAL["reserve_expandable_gib"] * GIB + reclaimable, reclaimable
    return CAL["reserve_loss"] * loss + CAL["reserve_layer"] * layer_transient + CAL[
        "reserve_fixed_gib"
    ] * GIB, reclaimable


def _kept_activations(a: _Activations, L: int) -> dict:
    if a.k == 0:
        return {"saved_activations_all_layers": a.kept_full}
    if a.k == L:
        return {"checkpointed_activations": a.kept_checkpointed}
    return {"checkpointed_activations": a.kept_checkpointed, "saved_activations_other_layers": a.kept_full}


def safety_margin_gib(budget_gib: float) -> float:
    return max(SAFETY_MARGIN_MIN_GIB, SAFETY_MARGIN_FRACTION * budget_gib)
