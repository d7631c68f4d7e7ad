"""The one typed config: the flow's only parameter, loaded from YAML.

Field names follow Axolotl/PEFT where those exist. Defaults live only here. The file's YAML is read by
loraship.config_yaml (duplicate keys and alias bombs refused, data paths resolved beside the file).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loraship.errors import ConfigError
from loraship.config_yaml import read_yaml, resolve_data_paths
from loraship.constants import AUTO_LADDER, IMATRIX_UNUSED, QUANT_GATES

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# The names each row type reads: top-level columns first, then keys inside each message.
# `fields` maps these names onto a file's own column (or message key) names.
DATASET_FIELDS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "input", "output"),
    "chat": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
    "completion": ("text",),
}


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        description="A local .jsonl/.json/.parquet/.csv file, or a Hugging Face Hub dataset: "
        "'hf://datasets/<org>/<name>' or '<org>/<name>' (read through the `datasets` library, from its cache when "
        "HF_HUB_OFFLINE=1), or such a file at an fsspec URL (s3://, gs://, az://, ...: its fsspec package must be "
        "installed in every stage's image)."
    )
    type: Literal["alpaca", "chat", "sharegpt", "completion"] = Field(
        description="alpaca: instruction/input/output rows; chat: {'messages': [{role, content}]} (OpenAI style) "
        "rendered by the tokenizer's chat template; sharegpt: {'conversations': [{from, value}]}, roles mapped onto "
        "chat's; completion: {'text': ...}, loss on all tokens."
    )
    split: str = Field("train", description="Split of a Hub dataset (local files are one split).")
    fields: dict[str, str] = Field(
        default_factory=dict,
        description="The type's field names -> this file's column names, e.g. {instruction: prompt, output: answer} "
        "or {messages: convo, role: speaker, content: text}.",
    )

    @model_validator(mode="after")
    def _known_fields(self):
        unknown = sorted(set(self.fields) - set(DATASET_FIELDS[self.type]))
        if unknown:
            raise ValueError(
                f"fields: {unknown} are not {self.type} field names; map {self.type}'s "
                f"{', '.join(DATASET_FIELDS[self.type])} onto your columns, e.g. "
                f"{{{DATASET_FIELDS[self.type][0]}: <your column>}}"
            )
        return self


# llama.cpp quantizations loraship ships and verifies (constants.QUANT_GATES holds each one's default gates).
Quantization = Literal[
    "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "IQ4_XS", "Q3_K_L", "Q3_K_M", "IQ3_M", "auto"
]  # auto: the smallest of constants.AUTO_LADDER that verify passes


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run_name: str = Field(
        "run",
        pattern=RUN_NAME_PATTERN,
        description="Names the run folder under `workdir` and `output`; letters, digits, '.', '_', '-' only, "
        "so it can never escape the artifact root.",
    )
    base_model: str = Field(
        description="Local folder with config.json + tokenizer + safetensors, or a Hugging Face hub id "
        "('org/name') resolved with huggingface_hub at run time."
    )
    base_model_revision: str | None = Field(None, description="Hub revision (commit, tag, branch) to pin.")
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with the checkpoint. Off unless you trust it."
    )
    allow_pickle: bool = Field(False, description="Accept pickle (.bin/.pt) checkpoints; safetensors only by default.")

    adapter: Literal["lora", "qlora"] = Field(
        "lora", description="lora: bf16 base; qlora: NF4 base with double quant (bitsandbytes)."
    )
    lora_r: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    lora_dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    lora_target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names to adapt, or 'all-linear' (every Linear except lm_head; on a mixture of experts "
        "also every routed expert). 'experts' or 'experts.<tensor>' (gate_up_proj, down_proj) name a MoE's experts.",
    )
    train_router: bool = Field(
        False,
        description="On a mixture of experts, also train the router (mlp.gate) with LoRA; it stays frozen otherwise.",
    )

    sequence_len: int = Field(2048, ge=16, le=1_048_576, description="Tokens per example after truncation.")
    truncation: Literal["truncate", "drop"] = Field(
        "truncate",
        description="Examples longer than sequence_len: 'truncate' keeps the first sequence_len tokens "
        "(counted in the train manifest), 'drop' skips them.",
    )
    micro_batch_size: int = Field(1, ge=1, le=1024, description="Examples per forward pass.")
    gradient_accumulation_steps: int = Field(8, ge=1, le=4096, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0.0, le=1.0, description="Peak learning rate (AdamW).")
    lr_scheduler: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    optimizer: Literal["adamw", "adamw_8bit"] = Field(
        "adamw",
        description="'adamw': torch AdamW, fp32 moments (8 bytes per LoRA parameter). 'adamw_8bit': bitsandbytes' "
        "AdamW8bit, blockwise 8-bit moments (about 2 bytes per LoRA parameter), what Unsloth's notebooks train with; "
        "it matters where the adapter is large (a mixture of experts' expert LoRA). Single GPU or DDP only.",
    )
    num_epochs: float = Field(
        1.0, gt=0.0, le=1000, description="Passes over the training split (ignored when max_steps is set)."
    )
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps; overrides num_epochs.")
    seed: int = Field(42, description="Seed for data order, LoRA init and dropout.")
    optimize: Literal["speed", "memory"] = Field(
        "speed",
        description="What the plan spends the training GPU on; the one switch for how training uses it. "
        "'speed': the fastest strategy that fits gpu_memory_gib with its safety margin (as few of the first layers "
        "checkpointed as fit, checkpointed activations in CPU memory only where that is what makes it fit). 'memory': "
        "the least GPU memory (every layer checkpointed, their inputs in pinned CPU memory; the last one only where "
        "that saves memory), at some speed. "
        "gradient_checkpointing and offload_activations, where set, override it.",
    )
    gradient_checkpointing: bool | None = Field(
        None,
        description="Unset: as `optimize` says. true: recompute every decoder layer's activations in backward. "
        "false: checkpoint only as many of the first layers as gpu_memory_gib needs.",
    )
    fused_loss: Literal["auto", "on", "off"] = Field(
        "auto", description="Liger fused linear cross-entropy: 'auto' uses it on CUDA when liger-kernel is installed."
    )
    offload_activations: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Checkpointed layers' inputs kept in pinned CPU memory instead of on the GPU (copied out "
        "in forward, prefetched back for backward): 'auto' when that is what makes the plan fit gpu_memory_gib (the "
        "rung before a smaller micro-batch or streamed weights; always under optimize: memory), 'on' always (the "
        "least GPU memory), 'off' never.",
    )
    fallback: list[Literal["offload", "qlora"]] = Field(
        default_factory=lambda: ["offload", "qlora"],
        description="What the planner may change, in this order, when `adapter: lora` does not fit gpu_memory_gib "
        "even at a smaller micro-batch: 'offload' keeps bf16 and streams some layers' frozen weights from CPU memory, "
        "'qlora' quantizes the base to NF4 (a precision change). [] refuses instead.",
    )
    packing: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Padding-free packing: each optimizer step's examples (the same as unpacked) laid end to end into "
        "micro-batches of up to micro_batch_size x sequence_len tokens, position ids restarting per example, each "
        "example attending to itself only (variable-length attention on CUDA: no padding computed, no mask built; "
        "a micro-batch whose examples all have one length, e.g. rows cut at sequence_len, has nothing to unpad and "
        "runs as a plain batch through SDPA's faster causal kernel). "
        "'auto' packs where that attention can run (a transformers model with AttentionInterface, no attention "
        "dropout or sliding window shorter than sequence_len, torch >= 2.10 on CUDA), else pads (the reason is in "
        "the train manifest).",
    )
    save_steps: int = Field(50, ge=1, description="Checkpoint every N optimizer steps (resume after a crash).")
    logging_steps: int = Field(1, ge=1, description="Record the loss every N optimizer steps.")

    train_on_inputs: bool = Field(
        False,
        description="As in Axolotl: true computes the loss on prompt tokens too (system/user turns, alpaca's "
        "instruction); false on assistant/completion tokens only.",
    )
    datasets: list[DatasetSpec] = Field(min_length=1, description="Training data; concatenated in order.")
    eval_datasets: list[DatasetSpec] = Field(
        default_factory=list, description="Held-out data; when empty, val_set_size of the training data is held out."
    )
    val_set_size: float = Field(
        0.1, ge=0.0, lt=1.0, description="Fraction held out for eval when eval_datasets is empty."
    )

    gpu_memory_gib: float = Field(32.0, gt=0, le=4096, description="Training GPU's memory; the plan must fit it.")
    gpus: int | Literal["auto"] = Field(
        "auto",
        description="Training GPUs (each of gpu_memory_gib), one torchrun rank each. 'auto': the plan lists 1, 2, 4 "
        "and 8 GPUs and train uses every visible GPU (the plan's engine for that count: the single-GPU strategy "
        "replicated by DDP where it fits one card, else FSDP2 sharding the frozen base). An integer N: exactly N "
        "GPUs; the plan fails, naming the count that fits, when N are too few, and train fails before any step when "
        "fewer than N are visible. See docs/multi_gpu.md.",
    )
    target_gpu_memory_gib: float = Field(
        8.0, gt=0, le=4096, description="Inference GPU's memory; verify checks the GGUF fits."
    )
    target_context: int = Field(
        4096, ge=128, description="Context the shipped model must serve on the target GPU (KV cache)."
    )
    n_cpu_moe: int | Literal["auto"] = Field(
        "auto",
        description="A mixture of experts' routed experts of the first N layers kept in CPU memory on the target GPU "
        "(llama.cpp's --n-cpu-moe N); verify, the served check, the card's llama-server command run with it. 'auto': "
        "0 where the GGUF fits target_gpu_memory_gib, else the smallest N that fits with every layer on the GPU. A "
        "number that does not fit, or any number on a dense model, fails the plan.",
    )
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where train/merge/verify run; 'auto' prefers CUDA."
    )

    quantization: list[Quantization] = Field(
        default_factory=lambda: ["Q4_K_M"],
        description="llama.cpp quantization of the shipped GGUF, or a list of them (e.g. [Q4_K_M, Q8_0]): each is "
        "made from the one F16 GGUF, verified and shipped. The first is the primary: the Modelfile and "
        "`loraship chat` open it. 'auto': the smallest of the ladder IQ3_M, Q3_K_M, IQ4_XS, Q4_K_M, Q5_K_M, Q6_K, "
        "Q8_0 that passes every verify gate (each under its own limits) and fits target_gpu_memory_gib at "
        "target_context is shipped alone.",
    )
    imatrix: bool = Field(
        True,
        description="Quantize with an importance matrix computed from this run's own training texts (chat template "
        "applied, special tokens parsed) by llama.cpp's llama-imatrix over the F16 GGUF, once per run, and used by "
        "every quantization through llama-quantize --imatrix; both tools are built once from the pinned llama.cpp "
        "(needs cmake and a C++ compiler; `loraship build-tools`). On by default: on 5,859 held-out tokens of the "
        "real model measured here it lowered mean KL at every rung, Q4_K_M 0.061 -> 0.040 (README, quantization "
        "section). false: quantize with llama-cpp-python's binding, no importance matrix, no tools to build.",
    )
    imatrix_min_tokens: int = Field(
        1024,
        ge=128,
        description="Fewest training-text tokens the importance matrix may be computed from; fewer fails the plan "
        "stage, before training (and quantize, which counts again), naming the count (add training data, lower this, "
        "or set imatrix: false). llama-imatrix reads them in chunks of min(512, imatrix_min_tokens / 2) tokens.",
    )
    imatrix_max_tokens: int = Field(
        32768,
        ge=256,
        description="Most training-text tokens the importance matrix is computed from (64 chunks of 512): "
        "llama-imatrix runs the F16 model on the CPU, about linear in tokens, so a large dataset is sampled (whole "
        "rows, seeded by `seed`, spread over the split) rather than read in full. Raise it for a finer matrix at that "
        "cost.",
    )
    golden_prompts: str | None = Field(
        None,
        description="A local JSONL of {'messages': [...]} or {'prompt': ...}: greedy answers must agree between HF "
        "and llama.cpp.",
    )
    max_new_tokens: int = Field(24, ge=1, le=4096, description="Greedy tokens generated per golden prompt.")
    golden_match_min: float = Field(
        0.75,
        ge=0.0,
        le=1.0,
        description="Fraction of golden prompts whose free-running greedy llama.cpp answer must equal the merged HF "
        "answer token for token or first part from it at a near-tie (where the merged model led by less than "
        "golden_margin nats, so either token is its answer); decisive tokens are held to full agreement.",
    )
    decisive_flips_max: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Share of decisive golden-answer tokens (see golden_margin) the GGUF may pick "
        "differently; unset: the quantization's own default (0 from Q5 up, 0.025 for 4-bit, 0.05 for 3-bit).",
    )
    golden_margin: float = Field(
        1.0,
        ge=0.0,
        description="Nats between the merged model's top two tokens that make a golden-answer token decisive; with "
        "the HF answer teacher-forced, llama.cpp must pick the same token at every decisive position.",
    )
    perplexity_ratio_max: float | None = Field(
        None,
        ge=1.0,
        description="Largest allowed GGUF/merged-HF perplexity ratio on the eval split; unset: the "
        "quantization's own default (Q4_K_M 1.1, Q8_0 1.02; loraship/constants.py QUANT_GATES).",
    )
    verify_max_examples: int = Field(64, ge=1, description="Eval examples scored by verify (both runtimes).")
    min_golden_prompts: int = Field(
        4, ge=1, description="Fewest golden prompts verify must see; fewer fails as 'not enough evidence', never 0/0."
    )
    min_decisive_positions: int = Field(
        8,
        ge=1,
        description="Fewest decisive answer tokens (see golden_margin) the teacher-forced agreement gate must see.",
    )
    min_scored_tokens: int = Field(
        64, ge=1, description="Fewest eval target tokens the perplexity gate must score under both runtimes."
    )
    reference_top_k: int = Field(
        64,
        ge=2,
        le=4096,
        description="HF log-probs kept per scored eval position by the reference stage; the rest of the distribution "
        "is kept as one lumped tail, which bounds verify's KL divergence from below (top_k_mass in reference.json "
        "says how tight).",
    )
    reference_full_logprob_tokens: int = Field(
        2048,
        ge=0,
        description="Scored eval tokens whose full-vocabulary log-probs (fp16) the reference stage stores, "
        "so verify's KL divergence there is exact, as llama-perplexity --kl-divergence computes it (capped by "
        "reference_full_logprob_mib and by the eval split).",
    )
    reference_full_logprob_mib: int = Field(
        1024,
        ge=0,
        description="Size budget of those log-probs: 2 bytes x vocabulary per token (2,048 tokens of a "
        "152k vocabulary take 594 MiB).",
    )
    kl_topk_mass_min: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description="Where too few tokens have exact KL (fewer than min_scored_tokens), KL falls "
        "back to the top-k bound, which fails unless HF's top-k covers at least this mean probability mass.",
    )
    finetune_kl_fraction_max: float = Field(
        0.5,
        gt=0,
        description="Fine-tune kept: mean KL(merged || GGUF) at most this fraction of mean KL(merged || base) "
        "on the same eval tokens; a GGUF that drifted back toward the base model fails.",
    )
    kl_mean_max: float | None = Field(
        None,
        gt=0,
        description="Largest mean KL divergence (HF -> GGUF, nats per token) on the eval split; unset: the "
        "quantization's own default (Q4_K_M 0.1, Q8_0 0.005; llama.cpp reports 0.031 and 0.0014 for Llama-3-8B).",
    )
    kl_p99_max: float | None = Field(
        None,
        gt=0,
        description="Largest 99th-percentile KL divergence per token on the eval split; unset: the "
        "quantization's own default (Q4_K_M 1.0).",
    )
    same_top_min: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Smallest fraction of eval positions where the GGUF's top token is HF's; unset: the "
        "quantization's own default (Q4_K_M 0.85, Q8_0 0.95; llama.cpp reports 91.9% and 97.7% for Llama-3-8B).",
    )
    adapter_gguf: bool = Field(
        False,
        description="Also ship the LoRA as an adapter-only GGUF (llama.cpp's convert_lora_to_gguf.py) with the base "
        "model converted and quantized like the merged one, to run as "
        "`llama-server -m base.gguf --lora adapter.gguf`; verify then gates base GGUF + adapter against the merged "
        "GGUF (adapter_kl_mean_max, adapter_same_top_min).",
    )
    adapter_kl_mean_max: float = Field(
        0.1,
        gt=0,
        description="With adapter_gguf: largest mean KL divergence (merged GGUF -> base GGUF + adapter, nats "
        "per token) on the eval split. Both sides are quantized, each from different weights, so their difference is "
        "quantization noise of the same order as kl_mean_max's.",
    )
    adapter_same_top_min: float = Field(
        0.85,
        ge=0.0,
        le=1.0,
        description="With adapter_gguf: smallest fraction of eval positions where base GGUF + "
        "adapter picks the merged GGUF's top token.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for training and the shipped GGUF: a name (chatml, llama3, mistral, alpaca) or "
        "Jinja text. Overrides the base model's template; required for chat/alpaca data on a base model that has "
        "none.",
    )
    thinking: bool = Field(
        False,
        description="Passed as enable_thinking to a chat template that reads it (Qwen3's) wherever it is rendered: "
        "training rows, the reference and verify golden prompts, and the served check (llama.cpp server's "
        "chat_template_kwargs; serve the GGUF the same way). false, the default: the non-thinking form, each "
        "assistant turn after the empty <think> block the template writes; true: the model thinks first. Templates "
        "without enable_thinking are unaffected.",
    )

    env_from_secrets: dict[str, str] = Field(
        default_factory=dict,
        description="Credentials as {ENV_VAR: Prefect Secret block name}, e.g. {HF_TOKEN: hf-token}: each stage "
        "exports the secret into its own environment at run time. Only block names are stored in the config, so "
        "secrets never reach logs, manifests or model cards.",
    )
    workdir: str = Field(
        ".loraship/work", description="Local folder for stage outputs (checkpoints, merged model, F16 GGUF)."
    )
    output: str = Field(
        "artifacts",
        description="The folder runs publish under: the artifact lands in <output>/<run_name>/ (`loraship plan` "
        "prints where), a local folder or any fsspec URL (s3://...); or a Hugging Face Hub repository, "
        "hf://<namespace>/<repo>[@<branch>][/<folder>], which holds the artifact itself, no run_name folder (token: "
        "HF_TOKEN, e.g. through env_from_secrets).",
    )
    replace_output: bool = Field(
        False,
        description="Publish into an artifact folder holding files loraship did not write by moving them aside "
        "first, to <folder>.replaced-<UTC time>/ (nothing is deleted; on the Hub, files the artifact replaces stay "
        "in the repository's history and the others stay where they are). Without it such a folder is refused. "
        "`loraship run --force` sets it for one run.",
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _targets_not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("list is empty; name modules such as q_proj, v_proj or use 'all-linear'")
        return v

    @field_validator("quantization", mode="before")
    @classmethod
    def _one_or_more_quantizations(cls, v):
        return [v] if isinstance(v, str) else v  # a single name stays the common case

    @field_validator("quantization")
    @classmethod
    def _distinct_quantizations(cls, v: list[str]):
        if not v:
            raise ValueError("list is empty; name at least one, e.g. Q4_K_M")
        twice = sorted({q for q in v if v.count(q) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} listed more than once; list each quantization once")
        if "auto" in v and len(v) > 1:
            raise ValueError("'auto' picks one quantization from its own ladder; use 'auto' alone or list names")
        return v

    @field_validator("base_model", "output", "workdir")
    @classmethod
    def _not_blank(cls, v: str):
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, v: str | None):
        from loraship.chat import NAMED_TEMPLATES

        if v is not None and "{{" not in v and "{%" not in v and v not in NAMED_TEMPLATES:
            raise ValueError(
                f"not a named template ({', '.join(sorted(NAMED_TEMPLATES))}) and not Jinja text; "
                "use one of those names or paste the template itself"
            )
        return v

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_count(cls, v):
        # YAML `gpus: true` or `gpus: 2.0` would otherwise pass as 1 or 2; a count is a whole number or 'auto'.
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError("must be 'auto' or a whole number of GPUs >= 1, e.g. gpus: 2")
        return v

    @field_validator("n_cpu_moe", mode="before")
    @classmethod
    def _expert_layers(cls, v):
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError("must be 'auto' or a whole number of layers >= 0, e.g. n_cpu_moe: 24")
        return v

    @field_validator("env_from_secrets")
    @classmethod
    def _env_names(cls, v: dict[str, str]):
        bad = [k for k in v if not re.fullmatch(r"[A-Z_][A-Z0-9_]*", k)]
        if bad:
            raise ValueError(f"{bad} are not environment variable names (UPPER_CASE letters, digits, '_')")
        return v

    @model_validator(mode="after")
    def _cross_field(self):
        if self.warmup_steps and self.max_steps and self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be smaller than max_steps ({self.max_steps})")
        if self.imatrix_max_tokens < self.imatrix_min_tokens:
            raise ValueError(
                f"imatrix_max_tokens ({self.imatrix_max_tokens}) is below imatrix_min_tokens "
                f"({self.imatrix_min_tokens}); raise imatrix_max_tokens or lower imatrix_min_tokens"
            )
        if self.adapter_gguf and self.auto_quantization:
            raise ValueError(
                "adapter_gguf quantizes the adapter's base like the shipped GGUF, which quantization 'auto' "
                "chooses only at verify; name the quantization (e.g. quantization: Q4_K_M) or set "
                "adapter_gguf: false"
            )
        return self

    # -- helpers -----------------------------------------------------------------------
    def base_model_is_local(self) -> bool:
        return is_local_path(self.base_model)

    @property
    def auto_quantization(self) -> bool:
        """quantization: auto, the ladder's smallest that passes verify is shipped."""
        return self.quantizations_as_given == ["auto"]

    @property
    def quantizations_as_given(self) -> list[str]:
        return [self.quantization] if isinstance(self.quantization, str) else list(self.quantization)

    @property
    def quantizations(self) -> list[str]:
        """Every quantization to make and verify, the primary first (also for a copy made with a plain
        string); for 'auto' the ladder, smallest first."""
        return list(AUTO_LADDER) if self.auto_quantization else self.quantizations_as_given

    @property
    def imatrix_in_use(self) -> bool:
        """imatrix: true and at least one quantization the importance matrix changes (not Q8_0 or F16 alone)."""
        return self.imatrix and any(q not in IMATRIX_UNUSED for q in self.quantizations)

    def gate_limits(self, quantization: str) -> dict[str, float]:
        """verify's quality limits for one quantization: what the config sets, else that quantization's
        calibrated default (loraship/constants.py QUANT_GATES)."""
        defaults = {gate.name: gate.limit for gate in QUANT_GATES[quantization]}
        return {
            name: default if getattr(self, name) is None else getattr(self, name) for name, default in defaults.items()
        }

    @property
    def primary_quantization(self) -> str:
        """The GGUF the Modelfile points to and `loraship chat` opens by default."""
        return self.quantizations[0]

    def subset(self, fields: tuple[str, ...]) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        return {f: data[f] for f in fields}

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def is_local_path(value: str) -> bool:
    """A hub id looks like 'org/name'; anything that exists, or starts like a path, is a folder."""
    if Path(value).expanduser().exists():
        return True
    return value.startswith(("/", "./", "../", "~")) or not HUB_ID_PATTERN.match(value)


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, list(Config.model_fields), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _describe(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        top = str(err["loc"][0]) if err["loc"] else ""
        hint = _did_you_mean(top) if len(err["loc"]) == 1 else ""
        return f"{loc}: unknown key{hint}; remove it or fix its spelling"
    if err["type"] == "missing":
        return f"{loc}: required field is missing"
    if err["type"] == "literal_error":
        return f"{loc}: {err['input']!r} is not allowed; {err['msg'].replace('Input should be', 'use')}"
    msg = err["msg"].removeprefix("Value error, ")
    shown = err.get("input")
    if isinstance(shown, (dict, list)):
        return f"{loc}: {msg}"
    return f"{loc}: {msg} (got {shown!r})"


def parse_config(data: Any, source: str = "config") -> Config:
    """Validate a mapping; every problem is reported at once."""
    if not isinstance(data, dict):
        raise ConfigError(source, [f"expected a mapping of config keys, got {type(data).__name__}"])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, [_describe(err) for err in e.errors()]) from e


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["config file not found; pass the path to a YAML file such as configs/demo.yaml"])
    try:
        data = read_yaml(path.read_bytes().decode("utf-8"), str(path)) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), [f"not UTF-8 text (byte {e.start}); save the file as UTF-8"]) from e
    except yaml.YAMLError as e:
        raise ConfigError(str(path), [f"not valid YAML: {e}"]) from e
    if isinstance(data, dict):
        resolve_data_paths(data, path.resolve().parent)
        data.setdefault("run_name", path.stem)
        data.update(overrides or {})
    return parse_config(data, source=str(path))
