"""The artifact's model card (README.md): a huggingface_hub ModelCard whose front matter the Hub reads, then how to run
the GGUF with llama-server and Ollama at the sampling settings verify served it with, the strategy that really
trained, the memory plan against the measured peak, each quantization's verify figures and gates, and the files.
tasks/publish.py writes it from the upstream manifests, plan.json and verify.json.
"""

from __future__ import annotations

from loraship.constants import (
    ADAPTER_GGUF,
    GENERATION_CONFIG_FILE,
    LADDER_PLOT_FILE,
    LOSS_PLOT_FILE,
    MEMORY_PLOT_FILE,
    MODELFILE,
    base_gguf_name,
    quantized_gguf_name,
)
from loraship.sampling import GREEDY, Sampling


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
    # A mixture of experts' n_cpu_moe, exactly as verify ran it (llama-server takes the same flag).
    n_cpu_moe = verify.get("n_cpu_moe") or 0
    if n_cpu_moe:
        flags = f"--n-cpu-moe {n_cpu_moe} {flags}"
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
        "n_cpu_moe": n_cpu_moe,
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
    # verify's own reading of a section (publishing sits below verification, so imported here).
    from loraship.verification.figures import figures

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
`-ngl {layers}` puts {on_gpu} on it.{experts_note(commands["n_cpu_moe"], verify)}
Stop tokens: {stops}. {template_note(config, facts)}

{sampling_note(verify)}

"""


def experts_note(n_cpu_moe: int, verify: dict) -> str:
    """The card's words on --n-cpu-moe where verify kept experts in CPU memory: what it does, the speed model, and
    that Ollama's Modelfile cannot say it."""
    if not n_cpu_moe:
        return ""
    speed = (verify.get("memory") or {}).get("tokens_per_s") or {}
    model = (
        f" Expected generation speed, {speed['note']}: {speed['with_n_cpu_moe']:g} tokens/s with it, "
        f"{speed['all_on_gpu']:g} with every expert on a GPU large enough."
        if speed
        else ""
    )
    return (
        f"\n`--n-cpu-moe {n_cpu_moe}` keeps the routed experts of the first {n_cpu_moe} layers in CPU memory, "
        f"as verify ran it; only a token's top experts are read from there.{model} Ollama's Modelfile has no "
        "parameter for this (the Modelfile says so in a comment): Ollama places whole layers on the GPU itself, so "
        "serve it with the llama-server command above to run it as verified."
    )


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
