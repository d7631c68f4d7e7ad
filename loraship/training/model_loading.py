"""The base model with its LoRA adapter as a strategy trains it (load_model), and what the train stage loads with it:
the tokenizer, the training stack's imports, the counters of what lives in CPU memory."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraship.models import config_json
from loraship.chat import set_template_kwargs, template_kwargs, template_of, use_configured_template
from loraship.errors import LorashipError
from loraship.models import torch_load_kwargs
from loraship.training import distributed, loss_chunks, norm_kernels
from loraship.training.gradient_checkpointing import apply_checkpointing, decoder_layers
from loraship.training.lora_targets import lora_config

if TYPE_CHECKING:
    from loraship.planning.plan_record import Plan
    from loraship.planning.strategy_record import Strategy

log = logging.getLogger("loraship.train")


def read_model_config(model_dir: Path) -> dict | None:
    """The base's config.json as a dict, None where it cannot be read here (transformers then says why)."""
    try:
        return config_json(model_dir)
    except (OSError, ValueError):
        return None


def attention_choice(model_config: dict | None, sequence_len: int, device: str) -> tuple[str | None, str]:
    """transformers' attention implementation for training (None: its default, SDPA) and why, in words."""
    if model_config is None:
        return None, "transformers' default (config.json unreadable here)"
    model_config = model_config.get("text_config") or model_config
    if model_config.get("attn_logit_softcapping") is not None:
        # Gemma 2 caps its attention logits, which SDPA cannot: eager attention, the one implementation in
        # transformers that applies the cap without a kernel package, asked for by name so no default drops it.
        return "eager", "eager: the model soft-caps its attention logits (attn_logit_softcapping), which SDPA cannot"
    # A bench knob (bench/train_bench.py loraship-sdpa, loraship-flex): one of transformers' implementations by name.
    if os.environ.get("LORASHIP_ATTENTION"):
        return os.environ["LORASHIP_ATTENTION"], "set by LORASHIP_ATTENTION"
    from transformers.utils import is_torch_flex_attn_available

    window = model_config.get("sliding_window")
    sliding = "sliding_attention" in (model_config.get("layer_types") or [])
    if device == "cuda" and sliding and window and window < sequence_len and is_torch_flex_attn_available():
        # SDPA runs a sliding-window layer as full causal attention under a dense mask; flex attention's block mask
        # skips the blocks outside the window: Gemma 3 12B's attention kernels 459 -> 220 ms over two steps
        # (bench/results/train_bench_gemma3_profile.json).
        return "flex_attention", (
            f"flex attention: its sliding windows ({window} tokens) are shorter than sequence_len {sequence_len}, "
            "and a block mask skips what lies outside them"
        )
    return None, "transformers' default (SDPA)"


@dataclass(frozen=True)
class LoadedModel:
    """The PEFT model load_model built, and what it applied to it (read by training, the evals and the manifest)."""

    model: Any
    # loraship/training/activation_offload.py's hooks, whose counters the manifest reports (None: inputs on the GPU).
    activation_offload: Any | None
    # loraship/training/offload.py's prefetcher of streamed weights, its passes counted likewise (None: none stream).
    weight_prefetcher: Any | None
    fused_lora: dict  # loraship/training/fused_lora.py: LoRA Linears fused into one autograd node, and why not
    recompute_skips: int  # checkpointed layers whose recompute leaves out down_proj's GEMM
    fused_loss: bool  # Liger's fused loss applied: evaluate() asks it to skip the logits
    attention_why: str  # why transformers runs the attention implementation it runs (attention_choice)
    experts: Any | None = None  # loraship/training/experts.py ExpertPlan: a MoE's adapted expert tensors (None: dense)


def load_model(
    model_dir: Path,
    config,
    strategy: Plan | Strategy | dict,
    device: str,
    engine: distributed.Engine = distributed.ONE_PROCESS.engine,
    rank: distributed.Rank | None = None,
    model_config: dict | None = None,
) -> LoadedModel:
    """The base with its LoRA adapter as `strategy` trains it: precision, streamed weights, checkpointed layers,
    Liger's kernels, fused LoRA nodes; in train mode. Given the train stage's Plan, its decisions (LoRA modules,
    layers streamed) are taken from it; given a bare strategy (tests, bench), the planner is asked for them. Under
    FSDP2 (LoRA) only rank 0 reads the weights; the other ranks' parameters stay on the meta device until
    distributed.wrap sends them their shards. `model_config`: the base's config.json as the stage parsed it (read
    here when not given)."""
    from peft import get_peft_model

    from loraship.planning.plan_record import Plan
    from loraship.planning.strategy_record import Strategy

    plan = strategy if isinstance(strategy, Plan) else None
    strategy = plan.strategy if plan else Strategy.from_json(strategy)
    model_config = read_model_config(model_dir) if model_config is None else model_config
    attention, attention_why = attention_choice(model_config, config.sequence_len, device)
    kwargs, offload = model_kwargs(model_dir, config, strategy, device, engine, attention)
    model = load_base(model_dir, config, strategy, kwargs, engine, rank)
    experts = prepare_experts(model, model_config, config, strategy)
    if strategy.adapter == "qlora" and device != "cuda":
        keep_nf4_trainable_on_cpu(model)
    # The decoder layers, and how many of the first ones recompute: the same modules after PEFT wraps the model
    # (it replaces Linears inside them, not the layers).
    layers = decoder_layers(model)
    k = strategy.checkpointed(len(layers))
    activation_offload = apply_checkpointing(model, strategy, layers, k)
    model.config.use_cache = False
    model = get_peft_model(model, lora_config(model_dir, config, experts.parameters if experts else (), plan=plan))
    if experts:
        experts_after_peft(model, experts, config, strategy)
    streamed = list(plan.streamed_layers) if plan else strategy.streamed(len(layers))
    prefetcher = stream_frozen_weights(model, streamed) if offload else None
    fused_loss = device == "cuda" and (plan.liger_kernels if plan else strategy.fused_loss)
    if fused_loss:
        apply_fused_loss(model, experts_adapted=bool(experts and experts.tensors))
    if device == "cuda":
        lora_matmuls_in_bf16(model)
    fused_lora, skips = fuse_lora(model, strategy, layers, k)
    # from_pretrained returns eval mode, where HF silently skips gradient checkpointing
    # (seen on the H200: 67.6 GiB instead of 23.5). Train mode, always.
    model.train()
    return LoadedModel(
        model=model,
        activation_offload=activation_offload,
        weight_prefetcher=prefetcher,
        fused_lora=fused_lora,
        recompute_skips=skips,
        fused_loss=fused_loss,
        attention_why=attention_why,
        experts=experts,
    )


def load_base(
    model_dir: Path,
    config,
    strategy: Strategy,
    kwargs: dict,
    engine: distributed.Engine,
    rank: distributed.Rank | None,
):
    """The base model with from_pretrained's `kwargs`, read by every rank or (FSDP2) by rank 0 alone, the others'
    built empty on the meta device (distributed.load_base)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def empty():
        # The class, config, dtype and attention from_pretrained gets: from_config's share of kwargs.
        base = AutoConfig.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
        return AutoModelForCausalLM.from_config(
            base, **{k: v for k, v in kwargs.items() if k in ("dtype", "attn_implementation", "trust_remote_code")}
        )

    # With offload the model is assembled on the CPU and moved to the GPU after the frozen
    # weights of the offloaded layers were set aside (loraship/training/offload.py).
    return distributed.load_base(
        engine,
        rank,
        strategy.adapter,
        build=empty,
        load=lambda: AutoModelForCausalLM.from_pretrained(model_dir, **kwargs),
    )


def prepare_experts(model, model_config: dict | None, config, strategy: Strategy):
    """A mixture of experts' expert tensors to adapt (loraship/training/experts.py); None for a dense model.
    Under QLoRA experts_after_peft stores them in NF4."""
    from loraship.training import experts

    plan = experts.plan_experts(model, model_config, config)
    if plan is None:
        return None
    experts.fix_peft_param_wrapper()
    log.info(
        "train: LoRA on %d stacked expert tensor(s)%s%s",
        len(plan.tensors),
        f" and {len(plan.router)} router(s)" if plan.router else ", routers frozen",
        ", experts in NF4" if strategy.adapter == "qlora" else "",
    )
    return plan


def experts_after_peft(model, plan, config, strategy: Strategy) -> None:
    """On the PEFT model: under QLoRA every stacked expert tensor in NF4, checked so (after PEFT wrapped them, so
    that its wrappers nest as when merge's probe loads the adapter on the bf16 base); the config's dropout on the
    Linears."""
    from loraship.training import experts

    base = model.get_base_model()
    on_meta = any(p.is_meta for p in base.parameters())  # an FSDP2 rank's empty model: rank 0 reads the weights
    if strategy.adapter == "qlora" and not on_meta:
        experts.quantize_experts(base, plan.all_experts)
        experts.check_experts_4bit(base, plan.all_experts)
    if plan.parameters:
        linear_lora_dropout(model, config.lora_dropout)


def linear_lora_dropout(model, p: float) -> None:
    """The config's LoRA dropout on the Linear LoRA layers: PEFT's LoraConfig was built with none, which its
    ParamWrapper (the expert tensors' LoRA) requires; a stacked weight's LoRA cannot drop out its input."""
    import torch
    from peft.tuners.lora.layer import Linear as LoraLinear

    if p <= 0:
        return
    for module in model.modules():
        if isinstance(module, LoraLinear):
            for name in list(module.lora_dropout.keys()):
                module.lora_dropout[name] = torch.nn.Dropout(p=p)


def keep_nf4_trainable_on_cpu(model) -> None:
    """QLoRA on the CPU: keep bitsandbytes' NF4 layers in the layout training can run."""
    # bitsandbytes (0.50) repacks an NF4 layer, one way, into an inference-only CPU layout the first time it
    # runs in eval mode on an AVX512-BF16 CPU; training afterwards goes through that inference kernel, whose
    # in-place bias add autograd refuses. The eval before training would be that first time.
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def lora_matmuls_in_bf16(model) -> None:
    """On CUDA, the LoRA layers' inputs left in bf16."""
    # LoRA's matmuls in bf16 under autocast (see device.compute), its fp32 weights cast instead of the input: no
    # fp32 copy of the input per adapter (loraship/planning/estimate.py lora_saved_per_token counts what is kept).
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False


def fuse_lora(model, strategy: Strategy, layers: list, k: int) -> tuple[dict, int]:
    """Last, on the model as it will run (streamed weights in place): the fused LoRA nodes and the recompute that
    leaves out down_proj; what was fused (and why not), and how many layers skip down_proj in the recompute."""
    # Each LoRA Linear one autograd node whose GEMMs add the LoRA term (loraship/training/fused_lora.py); what it
    # cannot run stays PEFT's.
    from loraship.training.fused_lora import fuse_lora_linears, fused_lora_wanted

    fused_lora = fuse_lora_linears(model) if fused_lora_wanted() else {"fused": 0, "unfused": {}, "swiglu_down": 0}
    # Then the checkpointed layers' recompute leaves out down_proj's GEMM, whose output it never reads
    # (loraship/training/recompute.py).
    skips = 0
    if strategy.gradient_checkpointing and recompute_skip_wanted():
        from loraship.training.recompute import skip_down_proj_in_recompute

        skips = skip_down_proj_in_recompute(layers, k, strategy.offload_activations)
    return fused_lora, skips


def model_kwargs(
    model_dir: Path,
    config,
    strategy: Strategy,
    device: str,
    engine: distributed.Engine = distributed.ONE_PROCESS.engine,
    attention: str | None = None,
) -> tuple[dict, int]:
    """from_pretrained's arguments for `strategy` on `device` (`attention`: attention_choice's implementation), and how
    many layers stream from CPU memory; refuses, before any weight loads, what the plan cannot have meant."""
    import torch
    from transformers import BitsAndBytesConfig

    # bf16 on GPUs; fp32 on CPU, where bf16 matmuls are slow and lossy for tiny models.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kwargs = {"dtype": dtype, **torch_load_kwargs(config)}
    if attention:
        kwargs["attn_implementation"] = attention
    if strategy.adapter == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            **distributed.quantization_storage(engine, dtype),
        )
    offload = strategy.offload_layers if device == "cuda" else 0
    if offload and strategy.adapter == "qlora":
        raise LorashipError("the plan combines QLoRA with CPU offload, which loraship does not support; re-plan")
    # Streamed layers (the first n, or n spread over the first k) must be among the checkpointed first k: one that is
    # not recomputed keeps its weight's GPU copy from forward to backward. Checked before the weights load, so
    # before the layer count is known: a plan from before checkpointed_layers means every layer or none.
    checkpointed = strategy.checkpointed(offload)
    if offload and checkpointed < offload:
        raise LorashipError(
            f"the plan streams {offload} layers but checkpoints only {checkpointed}: streamed layers "
            "must be among the checkpointed ones (a plan edited by hand?); re-plan"
        )
    if offload and engine.distributed:
        raise LorashipError(
            f"the plan streams {offload} layers' weights from CPU memory and trains on "
            f"{engine.world_size} GPUs ({engine.name}), which loraship does not combine; fix: re-plan "
            "(gpus: 1 for the streamed plan, or more GPUs with fallback that leaves offload out)"
        )
    if device == "cuda" and not offload and engine.name != "fsdp2":
        # This rank's own card (torchrun's LOCAL_RANK, made current by init_rank); 0 in one process.
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    # FSDP2 loads in host memory: fully_shard moves each layer to this rank's card as it shards it, so no card ever
    # holds the whole model.
    return kwargs, offload


def stream_frozen_weights(model, streamed: list[int]):
    """Keep the `streamed` decoder layers' frozen weights in CPU memory, the rest of the model on the GPU; the
    prefetcher that streams them back (loraship/training/offload.py keeps it on the decoder stack)."""
    from loraship.training.offload import offload_frozen_layers

    log.info(
        "train: %.2f GiB of frozen weights kept in CPU memory (decoder layers %s)",
        offload_frozen_layers(model, streamed) / 2**30,
        ", ".join(map(str, streamed)),
    )
    model.to("cuda")
    return getattr(model.get_base_model().model, "_loraship_prefetcher", None)


def liger_kwargs(experts_adapted: bool) -> dict:
    """Liger's patch arguments for the train stage (and loraship/planning/trace.py, which counts the same layer)."""
    kwargs = {"fused_linear_cross_entropy": True, "cross_entropy": False, **norm_kernels.liger_norm_kwargs()}
    if experts_adapted:
        # Liger's SwiGLU patch binds its fused-MoE forward onto the experts module, which PEFT has wrapped to add the
        # expert LoRA: that forward reads the stacked weights alone, so the experts would train without their LoRA.
        kwargs["swiglu"] = False
    return kwargs


def apply_fused_loss(model, experts_adapted: bool = False) -> None:
    """Liger's kernels, its fused linear cross-entropy among them, on a model already on the GPU: applied to a
    CPU-resident model (the offload path) it left the HF loss in place (bench/results/gpu_train_stage.json).
    `experts_adapted`: a MoE whose expert tensors carry LoRA (liger_kwargs)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from loraship.planning.knobs import LIGER_NO_FUSED_LOSS

    # Liger leaves a model type it has no kernels for untouched, with an info log: the HF loss would then run
    # where the plan budgeted the fused one. (Gemma 2's fused loss applies final_logit_softcapping: liger_kernel
    # transformers/model/gemma2.py passes it to the loss.)
    model_type = model.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN or model_type in LIGER_NO_FUSED_LOSS:
        raise LorashipError(
            f"the plan uses Liger's fused loss, but liger-kernel has no fused loss for model_type "
            f"{model_type!r}; set fused_loss: off and plan again"
        )
    _apply_liger_kernel_to_instance(model=model.get_base_model(), **liger_kwargs(experts_adapted))
    loss_chunks.widen_loss_chunks()
    # The default keeps Liger's kernels everywhere: the fastest of the settings
    # (bench/results/train_bench_gemma3_kernels.json).
    norm_kernels.adjust_norms(model)
    norm_kernels.compile_decoder_layers(decoder_layers(model))


def recompute_skip_wanted() -> bool:
    """LORASHIP_RECOMPUTE_SKIP=0 recomputes down_proj's GEMM as before: for comparing the two (bench/train_bench.py's
    loraship-lean-full-recompute rows) and for ruling the skip out when a run misbehaves."""
    return os.environ.get("LORASHIP_RECOMPUTE_SKIP", "1") != "0"


def host_copy_stats(loaded: LoadedModel) -> dict | None:
    """How the prefetches of what lives in CPU memory went over the run (None when nothing does): streamed weights'
    layer passes and those not copied ahead (loraship/training/offload.py); checkpointed inputs found still on the GPU,
    prefetched in time, or copied when backward needed them (loraship/training/activation_offload.py)."""
    out = {}
    prefetcher = loaded.weight_prefetcher
    if prefetcher is not None:
        out["streamed_weights"] = {"layer_passes": prefetcher.passes, "not_copied_ahead": prefetcher.late}
    acts = loaded.activation_offload
    if acts is not None:
        out["checkpointed_inputs"] = {
            "still_on_gpu": acts.resident,
            "prefetched": acts.prefetched,
            "copied_when_needed": acts.synchronous,
        }
    return out or None


def import_training_stack(strategy: Strategy, device: str) -> None:
    """Import what train_once uses before the first attempt, not inside it.

    A library that keeps an exception raised while it is imported (bitsandbytes keeps "No module named
    'kernels'" from its CPU backend) keeps that traceback's frames alive for good, and through f_back
    every caller's frame with its locals. Imported first inside load_model, that pinned the attempt's
    model, so after an out-of-memory error the retry still found it in memory (tests/test_train.py).
    """
    import transformers  # noqa: F401

    from loraship.runtime.imports import import_peft

    import_peft()

    if device == "cuda" and strategy.fused_loss:
        import liger_kernel.transformers  # noqa: F401


def load_tokenizer(model_dir: Path, config):
    """The base's tokenizer with the config's chat template and its template arguments."""
    from transformers import AutoTokenizer

    tokenizer = use_configured_template(
        AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code), config.chat_template
    )
    set_template_kwargs(tokenizer, template_kwargs(template_of(tokenizer), config.thinking))
    return tokenizer
