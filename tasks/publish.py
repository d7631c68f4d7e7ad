"""Publish: the artifact folder at `output/<run_name>/` (local or any fsspec URL).

Holds the quantized GGUF (one per quantization listed; the first, the primary, is the one the
Modelfile and the card's llama-server command use), an Ollama Modelfile beside it, the adapter, every stage's manifest,
plan.json, verify.json and a model card (huggingface_hub's ModelCard: YAML front matter, how to
run it with llama-server and Ollama, the strategy that really trained, memory and verify figures). Files are
uploaded first and manifest.json last, so a destination with a manifest is complete; local destinations get
each file under a temporary name, then renamed. Every file is read back from the destination (size and sha256);
a rerun sends only what is missing or differs there, and removes what an earlier publish there wrote that this
artifact no longer ships: nothing loraship did not write is removed or overwritten (loraship/publishing/store.py,
destination.py). An `hf://<namespace>/<repo>` output is a Hugging Face Hub repository, published in one atomic
commit (loraship/publishing/hub.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from loraship.publishing import hub
from loraship.publishing.destination import destination_of, foreign_problems, overlap_problems
from loraship.publishing.store import sync

from loraship.llamacpp import ollama
from loraship.constants import (
    ADAPTER_DIR,
    ADAPTER_GGUF,
    GENERATION_CONFIG_FILE,
    GGUF_METADATA_FILE,
    LADDER_PLOT_FILE,
    LOSS_PLOT_FILE,
    MANIFEST_NAME,
    MEMORY_PLOT_FILE,
    MERGED_DIR,
    MODEL_CARD,
    MODELFILE,
    OLLAMA_FILE,
    PLAN_FILE,
    STAGES,
    VERIFY_FILE,
    base_gguf_name,
    quantized_gguf_name,
)
from loraship.errors import OutputError
from loraship.runtime.manifest import (
    DigestCache,
    atomic_write_json,
    describe_files,
    sha256_json,
)
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir, stage_dir
from loraship.sampling import GREEDY, Sampling
from loraship.verification.figures import figures

STAGE = "publish"
UPSTREAM = ("plan", "train", "merge", "convert", "quantize", "verify")
FIELDS = ("output", "run_name", "quantization", "adapter_gguf")


def _gib(value) -> str:
    return f"{value:.2f} GiB" if isinstance(value, (int, float)) else "n/a"


def shipped_sampling(verify: dict) -> Sampling:
    """The sampling settings verify served the GGUF with (verify.json's "sampling"); a verify.json written
    before it recorded them checked llama.cpp's argmax answers, which greedy is."""
    return Sampling.from_record(verify["sampling"]) if "sampling" in verify else GREEDY


def serve_commands(config, verify: dict) -> dict:
    """The llama-server and Ollama commands for this artifact, at the context verify checked and with the
    sampling settings it served the GGUF with (llama-server's flags are every request's defaults)."""
    gguf = quantized_gguf_name(config.primary_quantization)
    flags = shipped_sampling(verify).llama_server_flags()
    memory = verify.get("memory") or {}
    # All layers where verify found the whole model fits the target GPU at target_context (999 is
    # llama.cpp's idiom for "every layer"); otherwise as many as verify found fit.
    layers = 999 if memory.get("fits", True) else memory.get("gpu_layers_at_target_context", 0)
    name = config.run_name.lower()  # Ollama model names are lower case
    adapter = (
        (
            f"llama-server -m {base_gguf_name(config.primary_quantization)} --lora {ADAPTER_GGUF} --jinja "
            f"-c {config.target_context} -ngl {layers} {flags}"
        )
        if config.adapter_gguf
        else None
    )
    return {
        "llama_server": f"llama-server -m {gguf} --jinja -c {config.target_context} -ngl {layers} {flags}",
        "llama_server_adapter": adapter,
        "ollama_create": f"ollama create {name} -f {MODELFILE}",
        "ollama_run": f"ollama run {name}",
        "gpu_layers": layers,
    }


def sampling_note(verify: dict) -> str:
    """The card's paragraph on the sampling settings: what verify served the model with, where each runtime
    gets them, and what the server's defaults answered instead (verify's served report)."""
    sampling = shipped_sampling(verify)
    defaults = (verify.get("served") or {}).get("server_defaults")
    measured = ""
    if defaults:
        settings = defaults.get("settings") or {}
        named = ", ".join(
            f"{k} {v:g}"
            for k, v in settings.items()
            if isinstance(v, (int, float)) and k in ("repeat_penalty", "top_k", "min_p")
        )
        measured = (
            f" Verify asked every golden chat prompt once more as a plain OpenAI request at temperature 0, "
            f"the rest left to llama-cpp-python's server defaults ({named}): "
            f"{defaults['differ_from_gguf_greedy']} of {defaults['requests']} answers differed from the "
            "verified ones."
        )
    if not sampling.greedy:
        return f"Sampling settings verify served the model with: {sampling.record()}.{measured}"
    return (
        "The answers verify checked are greedy: temperature 0, no repeat, presence or frequency penalty, "
        "top-k/top-p/min-p off. The llama-server flags above make those every request's defaults, and the Modelfile "
        f"sets the same (`PARAMETER temperature {sampling.temperature:g}`, "
        f"`PARAMETER repeat_penalty {sampling.repeat_penalty:g}`, ...). "
        "Ollama and llama-cpp-python's server default to `repeat_penalty` 1.1, which changes answers that repeat "
        "words of the question, and OpenAI clients never send it: served without these settings, send "
        '`repeat_penalty: 1.0` in each request (`extra_body={"repeat_penalty": 1.0}` with the openai client).'
        + measured
    )


def card_data(config, metadata: dict, adapter: str):
    """The card's YAML front matter (the Hub reads base_model, license, tags and pipeline_tag)."""
    from huggingface_hub import ModelCardData

    hub_base = not config.base_model_is_local()
    return ModelCardData(
        base_model=config.base_model if hub_base else None,
        base_model_relation="finetune" if hub_base else None,
        library_name="gguf",
        license=metadata.get("general.license"),
        pipeline_tag="text-generation",
        tags=["gguf", *config.quantizations, "llama.cpp", "ollama", adapter, "loraship"],
    )


def quantization_figures(config, verify: dict) -> dict[str, dict]:
    """Each quantization's verify figures, the primary first. A verify.json written before it had a
    section per quantization holds the one quantization's figures at its top level."""
    sections = verify.get("quantizations") or {config.primary_quantization: verify}
    return {q: figures(sections[q]) for q in config.quantizations if q in sections}


def ladder_table(verify: dict) -> str:
    """quantization auto's ladder in the card: every rung, smallest first, and why the smaller ones lost."""
    if not verify.get("ladder"):
        return ""
    rows = "\n".join(
        f"| {r['quant']} | {_figure((r['bytes'] or 0) / 2**20, 1)} MiB | {_figure(r['kl_mean'], 4)} | "
        f"{_figure(r['kl_p99'], 4)} | {_figure(r['same_top'], 1, percent=True)} | {_figure(r['ppl_ratio'], 4)} | "
        f"{'yes' if r['fits'] else 'no'} | "
        f"{'shipped' if r['quant'] == verify['shipped_quantization'] else 'FAIL: ' + ', '.join(r['failed_gates'])} |"
        if r["tried"]
        else f"| {r['quant']} | | | | | | | not tried: a smaller rung passed |"
        for r in verify["ladder"]
    )
    return (
        "\n`quantization: auto` verified the ladder smallest first and shipped the first rung that passed every "
        "gate under its own limits:\n\n| rung | size | KL mean | KL p99 | same top token | perplexity ratio | "
        "fits the target | result |\n|---|---|---|---|---|---|---|---|\n" + rows + "\n"
    )


def _figure(value, digits: int, percent: bool = False) -> str:
    if not isinstance(value, (int, float)):
        return "n/a"
    return f"{value:.{digits}%}" if percent else f"{value:.{digits}f}"


# The train stage's pictures and their captions in the card.
PICTURES = {
    LOSS_PLOT_FILE: "training and eval loss",
    MEMORY_PLOT_FILE: "memory plan: predicted components and measured peak",
}


def shipped_pictures(train_manifest: dict) -> list[str]:
    """The pictures the train stage drew (a run trained before it drew them has none)."""
    return [name for name in PICTURES if name in train_manifest.get("outputs", {})]


def imatrix_line(quant: dict) -> str:
    """How the GGUFs were quantized: with the run's own importance matrix (what it was computed from) or without."""
    made = quant.get("imatrix")
    if not made and quant.get("imatrix_unused"):
        return f"Quantized with llama-cpp-python's quantize binding, {quant['imatrix_unused']}."
    if not made:
        return "Quantized without an importance matrix (`imatrix: false`: llama-cpp-python's quantize binding)."
    split = made.get("split_texts")
    drawn = (
        f", drawn by seed from the split's {split} texts of {made['split_tokens']:,} tokens"
        if split and split > made["texts"]
        else ""
    )
    return (
        f"Quantized with an importance matrix computed by llama.cpp's `llama-imatrix` over this run's own "
        f"training texts ({made['text_tokens']:,} tokens in {made['texts']} texts{drawn}, chat template applied, "
        f"{made['chunks']} chunks of {made['chunk_tokens']} tokens; sha256 `{made['sha256'][:16]}…`) and "
        "`llama-quantize --imatrix`, both built from the same pinned llama.cpp."
    )


def ladder_picture(verify_manifest: dict) -> str:
    return LADDER_PLOT_FILE if LADDER_PLOT_FILE in verify_manifest.get("outputs", {}) else ""


def model_card(config, manifests: dict[str, dict], verify: dict, plan: dict, facts: dict, metadata: dict) -> str:
    """README.md of the artifact: a huggingface_hub ModelCard (YAML front matter + text), one section at a time."""
    from huggingface_hub import ModelCard

    train = manifests["train"]["metrics"]
    adapter = (train.get("strategy") or {}).get("adapter", config.adapter)  # the planner may have fallen back to QLoRA
    body = "".join(
        (
            card_header(config, adapter, manifests, metadata),
            run_section(config, verify, facts),
            training_section(train),
            memory_section(config, plan, manifests["train"]),
            quantizations_section(config, verify, manifests),
            verification_section(config, verify),
            files_section(config, facts, manifests),
        )
    )
    return str(ModelCard(f"---\n{card_data(config, metadata, adapter).to_yaml()}\n---\n\n{body}"))


def card_header(config, adapter: str, manifests: dict[str, dict], metadata: dict) -> str:
    """The title: what was fine-tuned from what into which GGUF, its license, the llama.cpp that verified it."""
    kind = "QLoRA" if adapter == "qlora" else "LoRA"
    gguf = quantized_gguf_name(config.primary_quantization)
    size = manifests["quantize"]["metrics"]["bytes"] / 2**20
    name = metadata.get("general.name", config.run_name)
    llama_cpp = manifests["verify"]["versions"].get("llama-cpp-python", "?")
    license_line = (
        f"License: {metadata['general.license']} (from the base model's card).\n\n"
        if metadata.get("general.license")
        else ""
    )
    return f"""# {config.run_name}

Fine-tuned from `{config.base_model}` with a {kind} adapter (r={config.lora_r},
alpha={config.lora_alpha}, targets {config.lora_target_modules}) and shipped as
`{gguf}` ({size:.1f} MiB, GGUF `general.name` `{name}`) by loraship.

{license_line}Verified with llama.cpp from llama-cpp-python {llama_cpp}: load it with the
same or a newer llama.cpp.

"""


def run_section(config, verify: dict, facts: dict) -> str:
    """## Run it: the llama-server and Ollama commands, what their context and layers mean, the chat template
    and stop tokens, and the sampling settings."""
    commands = serve_commands(config, verify)
    adapter_block = (
        (
            f"The adapter alone (`{ADAPTER_GGUF}`) on the base model quantized the same way (verify gated the pair "
            f"against the merged GGUF):\n\n```bash\n{commands['llama_server_adapter']}\n```\n\n"
        )
        if commands["llama_server_adapter"]
        else ""
    )
    layers = commands["gpu_layers"]
    on_gpu = "every layer" if layers == 999 else f"{layers} layers"
    target = f"{config.target_gpu_memory_gib:g} GiB"
    stops = ", ".join(f"`{t}`" for t in facts.get("stop_tokens") or []) or "none"
    return f"""## Run it

```bash
{commands["llama_server"]}
```

{adapter_block}```bash
{commands["ollama_create"]}
{commands["ollama_run"]}
```

`-c {config.target_context}` is the context verify checked against the target GPU ({target});
`-ngl {layers}` puts {on_gpu} on it.
Stop tokens: {stops}. {template_note(config, facts)}

{sampling_note(verify)}

"""


def template_note(config, facts: dict) -> str:
    """What the Modelfile's TEMPLATE is: the family's Go template, or none (Ollama derives one from the GGUF)."""
    if facts.get("family"):
        return (
            f"The Modelfile carries the chat template as an Ollama Go template ({facts['family']} family), which "
            "renders the same prompt text as the model's own template"
            + (", and its default system prompt (`SYSTEM`)" if facts.get("system") else "")
            + "."
        )
    return (
        f"The Modelfile has no TEMPLATE ({facts.get('reason', 'template not recognised')}): Ollama will use the "
        "GGUF's template, deriving its own from the chat template stored in the GGUF. Check what it made with "
        f"`ollama show --template {config.run_name.lower()}`; llama-server `--jinja` runs the GGUF's template "
        "as is."
    )


def training_section(train: dict) -> str:
    """## Training: the strategy that really trained and why (out-of-memory retries included), speed, losses."""
    speed = (
        f"{train['tokens_per_s']:,.0f} tokens/s, {train.get('tokens_per_s_basis')}"
        if train.get("tokens_per_s")
        else "n/a"
    )
    mfu = (
        f"{train['mfu']:.1%} ({train.get('mfu_basis')})"
        if train.get("mfu") is not None
        else f"n/a ({train.get('mfu_basis') or 'not measured'})"
    )
    retried = "".join(
        f"\n- out of memory with {r['strategy']} ({r['error']}); "
        f"under-predicted: {r.get('under_predicted') or 'unknown'}"
        for r in train.get("oom_retries") or []
    )
    return f"""## Training
- trained as: {train.get("trained_as", "n/a")}
- why: {train.get("strategy_reason") or "n/a"}{retried}
- steps: {train["steps"]}, train examples: {train["train_examples"]}, eval examples: {train["eval_examples"]}
- speed: {speed}; model FLOPs utilisation {mfu}
- eval loss: {train["eval_loss_before"]:.4f} (base) -> {train["eval_loss_after"]:.4f} (fine-tuned)
- truncation policy: {train["truncation_policy"]} ({train["truncated_examples"]} examples truncated)

"""


def memory_section(config, plan: dict, train_manifest: dict) -> str:
    """## Memory: the plan's predicted peak and components against what the training GPU measured, and the
    train stage's pictures."""
    train = train_manifest["metrics"]
    predicted = plan["memory"]
    measured = train.get("measured_memory") or {}
    measured_line = (
        f"measured on the training GPU: peak reserved {_gib(measured.get('peak_reserved_gib'))}, peak allocated "
        f"{_gib(measured.get('peak_allocated_gib'))}"
        if measured.get("peak_reserved_gib") is not None
        else f"not measured: trained on the {train.get('device', 'cpu')}, where there is no GPU memory to measure"
    )
    budget = plan.get("budget_gib", config.gpu_memory_gib)
    peak = _gib(predicted.get("predicted_total_gib"))
    reserved = _gib(predicted.get("predicted_reserved_gib"))
    components = "\n".join(f"| {name} | {value:.3f} |" for name, value in predicted["components_gib"].items())
    picture_lines = "".join(f"\n![{PICTURES[name]}]({name})\n" for name in shipped_pictures(train_manifest))
    return f"""## Memory
Planned for a {budget:g} GiB training GPU: {plan.get("reason", "n/a")}. Predicted peak
{peak} (reserved {reserved}); for the strategy that
trained, predicted reserved {_gib(train.get("predicted_reserved_gib"))}, {measured_line}.

| component | predicted GiB |
|---|---|
{components}
{picture_lines}
"""


def quantizations_section(config, verify: dict, manifests: dict[str, dict]) -> str:
    """## Quantizations: how they were made, each one's verify figures, and quantization auto's ladder."""
    rows = "\n".join(
        f"| {q}{' (primary)' if q == config.primary_quantization else ''} | `{quantized_gguf_name(q)}` | "
        f"{_figure((f['gguf_bytes'] or 0) / 2**20, 1)} MiB | {_figure(f['perplexity_ratio'], 4)} | "
        f"{_figure(f['kl_mean'], 4)} | {_figure(f['same_top_rate'], 1, percent=True)} | "
        f"{'pass' if f['passed'] else 'FAIL'} |"
        for q, f in quantization_figures(config, verify).items()
    )
    picture = ladder_picture(manifests["verify"])
    ladder_block = (
        f"\n![each quantization's size against its KL divergence; passed green, failed red]({picture})\n"
        if picture
        else ""
    )
    return f"""## Quantizations
Each made from the same F16 GGUF and verified against the merged HF model on the eval split.
{imatrix_line(manifests["quantize"]["metrics"])}

| quantization | file | size | perplexity ratio | KL mean | same top token | verify |
|---|---|---|---|---|---|---|
{rows}
{ladder_table(verify)}{ladder_block}
"""


def verification_section(config, verify: dict) -> str:
    """## Verification gates: every gate's value against its threshold, the eval-split agreement between the
    merged HF model and the GGUF, and the GPU memory verify predicted and measured."""
    gates = "\n".join(
        f"| {name} | {'pass' if g['passed'] else 'FAIL'} | {g['value']} | {g['threshold']} |"
        for name, g in verify["gates"].items()
    )
    agreement = verify["eval_agreement"]
    gpu = verify["gpu_memory"]
    measured = f"{gpu['measured_gib']:.2f} GiB" if gpu["measured_gib"] is not None else "n/a (verified on CPU)"
    return f"""## Verification gates
| gate | result | value | threshold |
|---|---|---|---|
{gates}

On the eval split ({agreement["scored_tokens"]} scored tokens): perplexity merged HF
{agreement["hf_perplexity"]:.4f}, GGUF {agreement["gguf_perplexity"]:.4f}; mean KL divergence
{agreement["kl_mean"]:.4f} nats/token (99th percentile {agreement["kl_p99"]:.4f}); same top
token {agreement["same_top_rate"]:.1%}. GPU memory at n_ctx {config.target_context}: predicted
{gpu["predicted_gib"]:.2f} GiB, measured {measured}
(target {config.target_gpu_memory_gib:g} GiB).

"""


def files_section(config, facts: dict, manifests: dict[str, dict]) -> str:
    """## Files: what the artifact folder holds."""
    other_ggufs = "".join(
        f"- `{quantized_gguf_name(q)}`: the same model quantized to {q} (verified the same way)\n"
        for q in config.quantizations[1:]
    )
    pictures = shipped_pictures(manifests["train"])
    picture_files = (
        f"- {', '.join(f'`{name}`' for name in pictures)}: loss curves and the memory plan against the measured peak\n"
        if pictures
        else ""
    )
    if ladder_picture(manifests["verify"]):
        picture_files += f"- `{LADDER_PLOT_FILE}`: each verified quantization's size against its KL divergence\n"
    return f"""## Files
- `{quantized_gguf_name(config.primary_quantization)}`: the model for llama.cpp / Ollama / LM Studio
{other_ggufs}- `{MODELFILE}`: `ollama create` reads it (FROM the GGUF beside it, context, sampling settings, stop \
tokens{", template" if facts.get("family") else ""})
- `{GENERATION_CONFIG_FILE}`: the same greedy decoding for transformers (`do_sample` false, `repetition_penalty` \
1.0), with the merged model's stop tokens
- `adapter/`: the PEFT LoRA adapter (safetensors)
- `manifests/<stage>.json`: inputs, outputs (sha256), library versions and figures of each stage
{picture_files}- `plan.json`, `verify.json`, `manifest.json` (this folder's checksums)
"""


def stage_artifact(config, ctx) -> Path:
    """Assemble the artifact locally inside the stage folder (each file written whole)."""
    root = ctx.dir / "artifact"
    root.mkdir(parents=True)
    gguf = quantized_gguf_name(config.primary_quantization)
    for name in map(quantized_gguf_name, config.quantizations):
        _link_or_copy(ctx.upstream_dir("quantize") / name, root / name)
    shutil.copytree(ctx.upstream_dir("train") / ADAPTER_DIR, root / ADAPTER_DIR)
    (root / "manifests").mkdir()
    for name in STAGES[:-1]:
        shutil.copy(stage_dir(config, name) / MANIFEST_NAME, root / "manifests" / f"{name}.json")
    shutil.copy(ctx.upstream_dir("plan") / PLAN_FILE, root / PLAN_FILE)
    shutil.copy(ctx.upstream_dir("verify") / VERIFY_FILE, root / VERIFY_FILE)
    for picture in shipped_pictures(ctx.upstream["train"]):
        shutil.copy(ctx.upstream_dir("train") / picture, root / picture)
    if ladder_picture(ctx.upstream["verify"]):
        shutil.copy(ctx.upstream_dir("verify") / LADDER_PLOT_FILE, root / LADDER_PLOT_FILE)
    if config.adapter_gguf:
        for name in (ADAPTER_GGUF, base_gguf_name(config.primary_quantization)):
            _link_or_copy(ctx.upstream_dir("convert") / name, root / name)
    verify = json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))
    plan = json.loads((root / PLAN_FILE).read_text(encoding="utf-8"))
    convert_dir = ctx.upstream_dir("convert")
    facts = json.loads((convert_dir / OLLAMA_FILE).read_text(encoding="utf-8"))
    metadata = json.loads((convert_dir / GGUF_METADATA_FILE).read_text(encoding="utf-8"))
    sampling = shipped_sampling(verify)
    (root / MODELFILE).write_text(
        ollama.modelfile(gguf, facts, facts.get("stop_tokens") or [], config.target_context, sampling),
        encoding="utf-8",
    )
    write_generation_config(
        ctx.upstream_dir("merge") / MERGED_DIR / GENERATION_CONFIG_FILE, root / GENERATION_CONFIG_FILE, sampling
    )
    (root / MODEL_CARD).write_text(model_card(config, ctx.upstream, verify, plan, facts, metadata), encoding="utf-8")
    return root


def write_generation_config(merged: Path, out: Path, sampling: Sampling) -> dict:
    """The merged model's generation_config.json (its stop tokens) with the shipped decoding: for
    transformers users of the adapter, and so a merge made before merge wrote greedy settings ships them."""
    gen = json.loads(merged.read_text(encoding="utf-8")) if merged.is_file() else {}
    shipped, _changed = sampling.generation_config(gen)
    out.write_text(json.dumps(shipped, indent=2) + "\n", encoding="utf-8")
    return shipped


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link saves copying gigabytes inside the workdir; other filesystems get a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def send(root: Path, files: dict, destination: str, cache: DigestCache, config) -> dict:
    """Publish to a Hub repository or any fsspec destination."""
    if hub.is_hub_repo(destination):
        return hub.sync(root, files, destination, config.run_name, force=config.replace_output)
    return sync(root, files, destination, cache, force=config.replace_output)


def check_destination(config, ctx) -> None:
    """The plan's checks of the artifact folder again, before anything is staged: apart from the workdir and every
    input (the base model's folder as the plan resolved it), and holding nothing loraship did not write. The folder
    may have changed since the plan, and `--only publish` runs without it."""
    plan = json.loads((ctx.upstream_dir("plan") / PLAN_FILE).read_text(encoding="utf-8"))
    problems = overlap_problems(config, Path(plan["model_dir"]) if plan.get("model_dir") else None)
    problems = problems or foreign_problems(config)
    if problems:
        raise OutputError("; ".join(problems))


# Publish reads these upstream files; the merged weights and the F16 GGUF (tens of GB on a
# 7B model) only through their manifests, so it does not hash them again.
CONSUMES = {
    "plan": (PLAN_FILE,),
    "train": (ADAPTER_DIR, *PICTURES),
    "merge": (f"{MERGED_DIR}/{GENERATION_CONFIG_FILE}",),
    "convert": (GGUF_METADATA_FILE, OLLAMA_FILE),
    "verify": (VERIFY_FILE, LADDER_PLOT_FILE),
}


def shipping_config(config):
    """The config as publish ships it: for quantization auto, the one rung verify chose (its manifest)."""
    if not config.auto_quantization:
        return config
    from loraship.runtime.manifest import read_manifest

    chosen = ((read_manifest(stage_dir(config, "verify")) or {}).get("metrics") or {}).get("shipped_quantization")
    if not chosen:
        raise OutputError("quantization auto: verify has not chosen a quantization yet; run the verify stage first")
    return config.model_copy(update={"quantization": [chosen]})


@exclusive
def run(config) -> dict:
    stage_config, config = config, shipping_config(config)
    gguf = quantized_gguf_name(config.primary_quantization)
    consumes = {**CONSUMES, "quantize": tuple(map(quantized_gguf_name, config.quantizations))}
    if config.adapter_gguf:  # the adapter alone and the base it applies to, beside the merged GGUF
        consumes["convert"] += (ADAPTER_GGUF, base_gguf_name(config.primary_quantization))
    ctx = open_stage(stage_config, STAGE, UPSTREAM, FIELDS, consumes=consumes)
    check_destination(config, ctx)
    destination = destination_of(config)
    cache = DigestCache.of_run(ctx.dir)
    if ctx.done and "artifact_files" in ctx.done["metrics"]:
        # The stage folder still holds the artifact it published; the destination may not (an
        # interrupted upload, a deleted or altered object): put back whatever differs.
        root = ctx.dir / "artifact"
        send(root, ctx.done["metrics"]["artifact_files"], destination, cache, config)
        return ctx.done
    reset_dir(ctx)
    root = stage_artifact(config, ctx)
    files = describe_files(root, cache=cache)
    verify = json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))
    published = {
        "run_name": config.run_name,
        "base_model": config.base_model,
        "quantization": config.primary_quantization,
        "gguf": gguf,
        "verified": verify["passed"],
        # The decoding verify served the GGUF with, which the Modelfile, the card and generation_config.json carry.
        "sampling": shipped_sampling(verify).record(),
        # Every GGUF shipped, the primary first: its file's checksum beside the figures verify measured for it.
        "quantizations": {
            q: {
                "gguf": quantized_gguf_name(q),
                "sha256": files[quantized_gguf_name(q)]["sha256"],
                "size": files[quantized_gguf_name(q)]["size"],
                "verify": figures,
            }
            for q, figures in quantization_figures(config, verify).items()
        },
        "files": files,
    }
    atomic_write_json(root / MANIFEST_NAME, published)
    sent = send(root, files, destination, cache, config)
    return ctx.finish(
        {
            "destination": destination,
            "files": len(files),
            "files_sha256": sha256_json(files),
            "artifact_files": files,
            "uploaded": len(sent["uploaded"]),
            "removed": sent["removed"],
            # Where --force put what loraship did not write: a sibling folder, or on the Hub the commit before.
            **{k: sent[k] for k in ("moved_aside", "replaced_from_commit") if k in sent},
            **({"hub_commit": sent["commit"]} if "commit" in sent else {}),
        }
    )


if __name__ == "__main__":
    main(run)
