"""Checks that run before any GPU is touched; every problem is reported at once."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from loraship.models import config_json
from loraship.config import Config
from loraship.data import read_dataset, read_rows, url_scheme
from loraship.errors import ConfigError, LorashipError


def output_problems(config: Config, model_dir: Path | None = None) -> list[str]:
    """Can we write where the artifact goes (local folder, fsspec URL or Hugging Face Hub repository), apart from
    the run's own folders and inputs, and over nothing loraship did not write (loraship/publishing/destination.py)?"""
    import fsspec

    from loraship.publishing import destination, hub

    if hub.is_hub_repo(config.output):
        return hub.output_problems(config.output, config.replace_output)
    overlaps = destination.overlap_problems(config, model_dir)
    if overlaps:
        return overlaps
    target = f"{config.output.rstrip('/')}/{config.run_name}"
    try:
        fs, path = fsspec.core.url_to_fs(target)
        foreign = destination.foreign_problems(config)
        if foreign:
            return foreign
        fs.makedirs(path, exist_ok=True)
        probe = f"{path}/.loraship-write-test-{uuid.uuid4().hex}"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except ImportError as e:  # a known scheme whose fsspec implementation is not installed (s3 -> s3fs)
        return [
            f"output {config.output!r}: no filesystem for this URL is installed ({e}); install the package it names "
            "into this environment (image), or choose a local folder"
        ]
    except ValueError as e:  # fsspec: "Protocol not known"
        return [
            f"output {config.output!r}: cannot write there ({type(e).__name__}: {e}); use a local folder or a URL "
            "fsspec knows (s3://, gs://, az://, hf://, file://, memory://)"
        ]
    except OSError as e:
        return [
            f"output {config.output!r}: cannot write there ({type(e).__name__}: {e}); choose a writable folder or URL"
        ]
    return []


def dataset_problems(config: Config) -> list[str]:
    problems = []
    for group in ("datasets", "eval_datasets"):
        for i, spec in enumerate(getattr(config, group)):
            try:
                read_dataset(spec)
            except LorashipError as e:
                problems.append(f"{group}[{i}]: {e}")
    if config.golden_prompts and url_scheme(config.golden_prompts):
        # The reference stage keys its results on the file's sha256, read from the local disk.
        problems.append(
            f"golden_prompts {config.golden_prompts!r}: must be a local file, not a URL; copy it beside "
            "the config and name that path"
        )
    elif config.golden_prompts:
        try:
            read_rows(config.golden_prompts, "golden")
        except LorashipError as e:
            problems.append(f"golden_prompts: {e}")
    return problems


# Below this, not even the plan, a checkpoint of a tiny adapter and the logs fit; plan.json then
# lists what each later stage needs, and each stage checks its own share before it writes.
WORKDIR_MIN_FREE = 256 * 2**20


def workdir_problems(config: Config) -> list[str]:
    folder = Path(config.workdir).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return [f"workdir {config.workdir!r}: cannot create it ({e}); choose a writable local folder"]
    free = shutil.disk_usage(folder).free
    if free < WORKDIR_MIN_FREE:
        return [
            f"workdir {config.workdir!r}: its disk is full ({free / 2**20:.0f} MiB free, at least "
            f"{WORKDIR_MIN_FREE / 2**20:.0f} MiB needed to start); free space there or point workdir at a larger disk"
        ]
    probe = folder / f".loraship-write-test-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"\0" * 65536)
    except OSError as e:  # a full disk (ENOSPC) or a read-only mount
        return [
            f"workdir {config.workdir!r}: cannot write there ({e}); free space there or choose a writable local folder"
        ]
    finally:
        probe.unlink(missing_ok=True)
    return []


def outside_link_problems(folder: Path) -> list[str]:
    """Symlinks in the base model folder that point outside it.

    Stages copy files out of this folder (tokenizer and template files into the merged model,
    the GGUF and the artifact), so a link to ~/.aws/credentials or /etc/shadow named like a model
    file would ship whatever it points to. A huggingface_hub cache snapshot is the one layout
    whose links leave the folder: its files link to ../../blobs of the same repository
    (https://huggingface.co/docs/huggingface_hub/guides/manage-cache).
    """
    if not folder.is_dir():
        return []  # base_model_problems says the folder does not exist
    root = folder.resolve()
    allowed = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        allowed.append(root.parent.parent / "blobs")
    outside = []
    for dirpath, dirnames, filenames in os.walk(folder):  # does not descend into linked folders
        for name in sorted(dirnames + filenames):
            link = Path(dirpath) / name
            if link.is_symlink():
                try:
                    target = link.resolve()
                except RuntimeError:  # Python 3.11+ raises on a loop of links
                    outside.append(f"{link.relative_to(folder)} -> a loop of links")
                    continue
                if not any(target.is_relative_to(a) for a in allowed):
                    outside.append(f"{link.relative_to(folder)} -> {target}")
    if not outside:
        return []
    shown = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
    return [
        f"base_model {str(folder)!r}: {len(outside)} symlink(s) lead outside the folder ({shown}); replace each "
        "link with a copy of the file it should hold (cp -L), or point base_model at the folder holding the real files"
    ]


# What check_inputs imports (the plan image's stage_table.TOKENIZER): the core install, which `loraship plan
# --memory-only` needs alone, has none of them.
CHECK_PACKAGES = ("transformers", "sentencepiece", "google.protobuf", "safetensors")


def missing_check_packages() -> list[str]:
    import importlib.util

    names = {"google.protobuf": "protobuf"}
    missing = []
    for module in CHECK_PACKAGES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package (google) is absent
            found = False
        if not found:
            missing.append(names.get(module, module))
    return missing


def check_inputs(config: Config) -> Path:
    """Every problem with the run's inputs, raised at once; returns the base model's folder.

    Runs before any training, in the plan stage, `loraship run` and `loraship plan`: base model folder (a GGUF
    instead, links leaving it, config, tokenizer, sentencepiece model, shard index, safetensors headers, remote
    code), an encoder or encoder-decoder, GGUF convertibility with the pinned llama.cpp, every dataset line,
    sequence_len against the model's context, the template on real rows, the tokenizer against vocab_size, golden
    prompts against target_context and min_golden_prompts, whether the shipped GGUF can fit the target GPU, workdir
    and output; last, on inputs that pass all that, the converter's own vocabulary step.
    """
    from loraship.llamacpp.llamacpp import check_convertible
    from loraship.llamacpp.vocab_export import vocab_export_problems
    from loraship.models import base_model_problems, resolve_base_model
    from loraship.planning.golden_count import golden_count_problems
    from loraship.planning.model_kind import architecture_problems

    missing = missing_check_packages()
    if missing:
        raise ConfigError(
            f"run {config.run_name!r}",
            [
                f"the input checks read the tokenizer and weights' headers with {', '.join(missing)}, which this "
                f"environment lacks; fix: install them (pip install {' '.join(missing)}, or loraship[train]), or "
                "predict memory alone with `loraship plan CONFIG --memory-only`"
            ],
        )
    model_dir = resolve_base_model(config, weights=False)
    problems = outside_link_problems(model_dir)
    problems += base_model_problems(config, model_dir, weights=config.base_model_is_local())
    if not problems:  # an encoder or encoder-decoder: one message, before any tokenizer or template check
        problems += architecture_problems(model_dir)
    if not problems:
        problems += [f"base model {config.base_model!r}: {p}" for p in check_convertible(model_dir)]
    data_problems = dataset_problems(config)
    problems += data_problems
    if not problems:
        # Only on readable inputs: render real rows with the template training will use.
        problems += (
            context_problems(config, model_dir)
            + template_problems(config, model_dir)
            + target_gpu_problems(config, model_dir)
            + lora_target_problems(config, model_dir)
        )
    if not data_problems:
        problems += golden_count_problems(config)
    problems += workdir_problems(config) + output_problems(config, model_dir)
    if not problems:  # last, on inputs that pass everything else: it runs the converter (seconds)
        problems += vocab_export_problems(config.base_model, model_dir)
    if problems:
        raise ConfigError(f"run {config.run_name!r}", problems)
    return model_dir


def check_free_disk(folder: Path, needed_bytes: float, what: str) -> None:
    """Refuse to start a stage that would run out of disk half-way."""
    folder = Path(folder)
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise LorashipError(
            f"{what} needs about {needed_bytes / 2**30:.2f} GiB free in {probe}, but only {free / 2**30:.2f} GiB is "
            "free; free space there or point workdir at a larger disk"
        )


def template_problems(config: Config, model_dir: Path) -> list[str]:
    """Render and tokenize one row of every dataset, and every golden prompt, exactly as train and
    verify will (transformers' apply_chat_template with the config's or the checkpoint's template), so
    a template that fails to render stops the run before any GPU hour is spent; then the tokenizer
    against vocab_size and the golden prompts against target_context."""
    from loraship.chat import set_template_kwargs, template_kwargs, template_of, use_configured_template
    from loraship.data import encoded_dataset

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
    except Exception as e:  # transformers raises many types for a broken tokenizer folder
        return [
            f"base model {config.base_model!r}: its tokenizer does not load ({type(e).__name__}: {e}); "
            "copy the checkpoint's original tokenizer files into the folder"
        ]
    use_configured_template(tokenizer, config.chat_template)
    # The template's arguments as train sets them (Qwen3's enable_thinking changes what a row renders to).
    set_template_kwargs(tokenizer, template_kwargs(template_of(tokenizer), config.thinking))
    problems = []
    for group in ("datasets", "eval_datasets"):
        for i, spec in enumerate(getattr(config, group)):
            try:
                # Every row, as train will: a row the template cannot split into turns stops the plan, and the
                # tokenized rows are cached under the same key for train, merge and reference.
                encoded_dataset(spec, tokenizer)
            except LorashipError as e:
                problems.append(f"{group}[{i}] ({spec.path}): {e}")
                return problems  # the same template fails every dataset alike: say it once
    chat_data = any(spec.type != "completion" for spec in (*config.datasets, *config.eval_datasets))
    if chat_data and not problems:
        problems += turn_end_problems(tokenizer)
    if not problems:
        problems += space_prefix_problems(config, tokenizer)
    if not problems:
        problems += vocabulary_problems(model_dir, tokenizer)
    if not problems:
        problems += golden_context_problems(config, tokenizer)
    if not problems:
        problems += imatrix_problems(config, tokenizer)
    return problems


def _model_text_config(model_dir: Path) -> dict:
    """config.json's text model settings (text_config for a multimodal checkpoint); {} where it cannot be read:
    base_model_problems names a config.json that is not a JSON object."""

    try:
        data = config_json(model_dir)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    text = data.get("text_config")
    return {**data, **text} if isinstance(text, dict) else data


def vocabulary_problems(model_dir: Path, tokenizer) -> list[str]:
    """Every token id that text or the chat template can produce needs a row of the embedding: a tokenizer larger
    than config.json's vocab_size (a mismatched or extended tokenizer) failed at train as a bare IndexError.

    A vocab_size larger than the tokenizer is normal (embeddings padded past it). So is a special token past it that
    nothing emits: Gemma 3 270M/1B pair 262,144 rows with 262,145 tokens, the last <image_soft_token>, which only
    image inputs produce (loraship/fixtures/families.py). Such a token counts only where it is BOS, EOS, PAD or UNK,
    or the template writes it."""
    from loraship.chat import template_of

    vocab_size = _model_text_config(model_dir).get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return []  # absent or of the wrong type: base_model_problems and the planner say so
    tokens = len(tokenizer)
    if tokens <= vocab_size:
        return []
    added = tokenizer.added_tokens_decoder
    named = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token}
    template = template_of(tokenizer) or ""
    beyond = range(vocab_size, tokens)
    reachable = [
        (i, t)
        for i, t in zip(beyond, tokenizer.convert_ids_to_tokens(list(beyond)))
        if not (i in added and added[i].special) or t in named or (t and t in template)
    ]
    if not reachable:
        return []
    shown = ", ".join(f"{t!r} ({i})" for i, t in reachable[:3]) + (
        f" and {len(reachable) - 3} more" if len(reachable) > 3 else ""
    )
    return [
        f"tokenizer: {model_dir} has a tokenizer of {tokens} tokens (added tokens included), more than "
        f"config.json's vocab_size {vocab_size}; text or the chat template can produce {shown}, ids with no row "
        "in the embedding, and training would fail on the first of them; fix: use the tokenizer files that came "
        "with this checkpoint, or resize the embedding to the tokenizer (model.resize_token_embeddings("
        "len(tokenizer)), then save_pretrained) and point base_model at that folder"
    ]


def golden_context_problems(config: Config, tokenizer) -> list[str]:
    """Every golden prompt, rendered as the reference stage renders it (the chat template with the generation
    prompt, or plain text with BOS), plus the max_new_tokens answered, must fit target_context: the context verify
    serves the GGUF with on the target GPU. A longer one ran llama.cpp past n_ctx at verify."""
    from loraship.chat import render
    from loraship.data import golden_rows

    try:
        rows = golden_rows(config)
    except LorashipError as e:
        return [f"golden prompts: {e}"]
    source = (
        f"golden_prompts {config.golden_prompts}"
        if config.golden_prompts
        else "the golden prompts taken from the eval and training rows (golden_prompts is not set)"
    )
    too_long = []
    for i, row in enumerate(rows, start=1):
        try:
            # verbose=False: no "longer than the specified maximum sequence length" warning beside the message.
            if "messages" in row:
                ids = tokenizer(
                    render(tokenizer, row["messages"], add_generation_prompt=True),
                    add_special_tokens=False,
                    verbose=False,
                )["input_ids"]
            else:
                ids = tokenizer(row["text"], add_special_tokens=True, verbose=False)["input_ids"]
        except LorashipError as e:
            return [f"golden prompts: {source}, prompt {i}: {e}"]
        needed = len(ids) + config.max_new_tokens + 1
        if needed > config.target_context:
            too_long.append((i, len(ids), needed))
    if not too_long:
        return []
    shown = ", ".join(f"prompt {i} ({n} tokens)" for i, n, _ in too_long[:3])
    more = f" and {len(too_long) - 3} more" if len(too_long) > 3 else ""
    longest = max(needed for _, _, needed in too_long)
    fix = "shorten those prompts" if config.golden_prompts else "set golden_prompts to a file of shorter prompts"
    return [
        f"golden prompts: in {source}, {shown}{more} rendered with the chat template, plus max_new_tokens "
        f"{config.max_new_tokens} and one, exceed target_context {config.target_context}, the context verify "
        f"serves the model with; fix: {fix}, or raise target_context to at least {longest}"
    ]


def context_problems(config: Config, model_dir: Path) -> list[str]:
    """sequence_len against config.json's max_position_embeddings: positions past it were never trained (and some
    architectures cannot embed them). A RoPE scaling factor (YaRN, linear, dynamic) extends it."""
    settings = _model_text_config(model_dir)
    limit = settings.get("max_position_embeddings")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return []  # absent (the architecture's default) or of the wrong type: base_model_problems says so
    # transformers 5 saves rope_parameters where 4.x saved rope_scaling; both carry the factor.
    scaling = next(
        (v for v in (settings.get("rope_scaling"), settings.get("rope_parameters")) if isinstance(v, dict)), None
    )
    factor = scaling.get("factor") if scaling else None
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
        original = scaling.get("original_max_position_embeddings")
        base = original if isinstance(original, int) and not isinstance(original, bool) else limit
        limit = max(limit, int(base * factor))
    if config.sequence_len <= limit:
        return []
    return [
        f"sequence_len {config.sequence_len}: beyond the base model's context, max_position_embeddings {limit} "
        f"in {model_dir / 'config.json'}; fix: lower sequence_len to at most {limit}, or choose a base model "
        "with a longer context"
    ]


def imatrix_text_problem(config: Config, tokens: int) -> str | None:
    """Too little training text for the importance matrix: the plan says so before training, quantize again."""
    if tokens >= config.imatrix_min_tokens:
        return None
    return (
        f"imatrix: the training texts are {tokens} tokens, fewer than imatrix_min_tokens "
        f"{config.imatrix_min_tokens}; an importance matrix from so little text would tune the quantization to a "
        "few sentences. Add training data, lower imatrix_min_tokens (at least 128), or set imatrix: false"
    )


def imatrix_problems(config: Config, tokenizer) -> list[str]:
    """The training split's tokens, as quantize will count them, against imatrix_min_tokens; the rows are the ones
    template_problems has just encoded (encoded_splits reads them from the tokenized cache)."""
    if not config.imatrix_in_use:
        return []
    from loraship.data import encoded_splits

    train, _ = encoded_splits(config, tokenizer)
    tokens = sum(len(record["input_ids"]) for _kind, record in train)
    return [] if tokens >= config.imatrix_min_tokens else [imatrix_text_problem(config, tokens)]


def target_gpu_problems(config: Config, model_dir: Path) -> list[str]:
    """The shipped GGUF's weights alone must fit the inference GPU; no context size can fix that."""

    from loraship.planning.shape import shape_from_config
    from loraship.planning.shipping import plan_disk_and_inference

    try:
        model_config = config_json(model_dir)
        inference = plan_disk_and_inference(shape_from_config(model_config), config)["inference"]
    except ConfigError as e:  # n_cpu_moe that cannot fit (planning/expert_offload.py)
        return e.problems
    except (ValueError, KeyError, TypeError):
        return []  # the plan stage reports a config.json it cannot read, with its own message
    each = inference["by_quantization"]
    if config.auto_quantization:  # auto ships one rung: only a ladder that cannot fit at all is refused
        return auto_ladder_problems(config, model_config, inference)
    # Every quantization in the list is verified on the target GPU, so each one's weights there must fit (a mixture
    # of experts' with its experts in CPU memory as n_cpu_moe keeps them).
    return [
        f"target_gpu_memory_gib {config.target_gpu_memory_gib:g}: the {q} GGUF's weights alone take about "
        f"{figures['gpu_weights_gib']:.2f} GiB on the GPU"
        + (f" with n_cpu_moe {figures['n_cpu_moe']}" if "n_cpu_moe" in figures else "")
        + "; raise target_gpu_memory_gib, choose a smaller quantization, or a smaller base model"
        for q, figures in each.items()
        if figures["gpu_weights_gib"] > config.target_gpu_memory_gib
    ]


def auto_ladder_problems(config: Config, model_config: dict, inference: dict) -> list[str]:
    """quantization auto ships the smallest rung that passes verify and fits target_gpu_memory_gib at
    target_context; verify fails every rung that does not fit, so a ladder whose smallest rung does not fit
    (plan.json's fits_target false on all of them) would train, quantize seven times and fail. Refused here, with
    the target that fits and the context at which the smallest rung does."""
    import math

    from loraship.planning.shape import shape_from_config
    from loraship.planning.shipping import plan_disk_and_inference

    each = inference["by_quantization"]
    if any(figures["fits_target"] for figures in each.values()):
        return []
    smallest = min(each, key=lambda q: each[q]["total_gib"])
    need = each[smallest]["total_gib"]
    runtime = need - each[smallest]["gpu_weights_gib"]

    def at(context: int) -> dict:
        shorter = config.model_copy(update={"target_context": context})
        return plan_disk_and_inference(shape_from_config(model_config), shorter)["inference"]["by_quantization"][
            smallest
        ]

    def fits_at(context: int) -> bool:
        return at(context)["fits_target"]

    # The largest context (a multiple of 256, at least the config's floor of 128) at which the smallest rung fits.
    contexts = [c for c in range(256, config.target_context, 256)] or [128]
    lo, hi, best = 0, len(contexts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits_at(contexts[mid]):
            best, lo = contexts[mid], mid + 1
        else:
            hi = mid - 1
    if best is None and contexts[0] != 128 and fits_at(128):
        best = 128
    shorter = (
        f", lower target_context to at most {best} (the smallest rung fits there)"
        if best
        else f" (no shorter target_context helps: at 128 it still needs {at(128)['total_gib']:.2f} GiB)"
    )
    raise_to = math.ceil(need * 2) / 2  # to the next half GiB
    return [
        f"target_gpu_memory_gib {config.target_gpu_memory_gib:g}: quantization auto fits no rung of its ladder "
        f"({', '.join(each)}) at target_context {config.target_context}; the smallest, {smallest}, needs about "
        f"{need:.2f} GiB ({each[smallest]['gpu_weights_gib']:.2f} GiB of weights, {runtime:.2f} GiB of KV cache, "
        f"compute buffer and CUDA context), and verify would fail every rung after training; fix: raise "
        f"target_gpu_memory_gib to {raise_to:g}{shorter}, or choose a smaller base model"
    ]


def lora_target_problems(config: Config, model_dir: Path) -> list[str]:
    """lora_target_modules must name Linears the architecture has (targets.lora_modules): PEFT adapts the names that
    match and skips the rest, so the default q, k, v, o on Phi-3 (qkv_proj, o_proj) would train o_proj alone."""

    from loraship.planning.shape import shape_from_config
    from loraship.planning.targets import lora_modules

    try:
        shape = shape_from_config(config_json(model_dir))
    except (ValueError, KeyError, TypeError):
        return []  # the plan stage reports a config.json it cannot read, with its own message
    try:
        lora_modules(shape, config.lora_target_modules)
    except ValueError as e:
        return [str(e)]
    return []


def space_prefix_problems(config: Config, tokenizer) -> list[str]:
    """llama.cpp must tokenize what this run serves (rendered chat, plain text) as HF trains on it; for a
    sentencepiece vocabulary that hangs on one GGUF flag that fits some texts only
    (loraship/llamacpp/space_prefix.py)."""
    from loraship.llamacpp import space_prefix

    _, problem = space_prefix.choose(tokenizer, space_prefix.served_kinds(config))
    return [f"tokenizer: {problem}"] if problem else []


def turn_end_problems(tokenizer) -> list[str]:
    """The template's assistant turn must end in one special token that llama.cpp stops on, or the
    served model runs on past its answer (or stops where HF does not)."""
    from loraship.chat import ends_generation_in_llama_cpp, turn_end

    try:
        end = turn_end(tokenizer)
    except LorashipError as e:
        return [f"chat template: {e}"]
    if not ends_generation_in_llama_cpp(end, tokenizer.eos_token_id):
        return [
            f"chat template: assistant turns end with {end['text']!r} (id {end['id']}), a special token that "
            f"llama.cpp does not treat as end-of-generation (only the EOS {tokenizer.eos_token!r} and the markers "
            "<|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>, ... are), so the served model would not stop there; "
            "end each assistant turn with {{ eos_token }} or with one of those markers"
        ]
    return []


def visible_training_devices(config: Config) -> int:
    """Devices the train stage can use here: CUDA GPUs (CUDA_VISIBLE_DEVICES applies), or with device: cpu the ranks
    LORASHIP_CPU_RANKS asks for (a CPU has no GPUs to count; 1 when unset)."""
    if config.device == "cpu":
        raw = os.environ.get("LORASHIP_CPU_RANKS", "1")
        if not raw.isdigit() or int(raw) < 1:
            raise LorashipError(
                f"LORASHIP_CPU_RANKS={raw!r} is not a whole number >= 1; fix: set it to e.g. 2, or unset it"
            )
        return int(raw)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_training_gpus(config: Config, distributed: dict | None, visible: int | None = None) -> dict:
    """The engine and GPU count to train with here, before any weight is loaded: the plan's multi-GPU record against
    the devices this machine shows (multi_gpu.choose_engine, whose errors name the fix). Checked here, in the train
    stage, and not at plan time: the plan runs on CPU pods and laptops, which see none of the training node's GPUs."""
    from loraship.planning.multi_gpu import choose_engine

    return choose_engine(distributed, visible_training_devices(config) if visible is None else visible)
