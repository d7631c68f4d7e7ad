"""Ollama: the chat-template family of the shipped model, and the Modelfile beside its GGUF.

Ollama does not run the GGUF's Jinja template; it renders a Go template (the Modelfile's
TEMPLATE) and, without one, guesses a template from the GGUF's. So for the families written
out below (ChatML as in Qwen2/2.5, Llama 3, Mistral's [INST] turns) the Modelfile carries a Go
template of the same shape as Ollama's own (ollama/ollama template/chatml.gotmpl,
llama3-instruct.gotmpl, mistral-instruct.gotmpl), system prompt once from `.System`, turns from
`.Messages`.

A family is recognised by what the tokenizer's template renders, never by its source text:
transformers renders probe conversations (with and without a system message), and a family
matches only when its Go template renders the very same text, character for character, for
both (`render` below is what its Go template renders; tests/test_artifact.py runs the Go
templates themselves through Go's text/template when a Go toolchain is installed). A system
prompt the template inserts when the conversation has none (Qwen2.5's "You are Qwen, ...")
becomes the Modelfile's SYSTEM, which Ollama applies the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from loraship.sampling import GREEDY, Sampling

# Sentinels of the probe conversations: plain words no template rewrites (Llama 3 trims content).
PROBE_SYSTEM = "PROBESYSTEM"
PROBE = (
    {"role": "user", "content": "PROBEUSERONE"},
    {"role": "assistant", "content": "PROBEASSISTANTONE"},
    {"role": "user", "content": "PROBEUSERTWO"},
)


@dataclass(frozen=True)
class Family:
    name: str
    go_template: str
    # (system or None, messages without system) -> the prompt the Go template renders, ending in
    # the assistant's generation prompt.
    render: Callable[[str | None, list[dict]], str]
    # Ollama's own stop parameters for the family (template/<name>.json).
    stops: tuple[str, ...]


def _chatml(system, messages):
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return head + turns + "<|im_start|>assistant\n"


# What Qwen3's template appends to the generation prompt with enable_thinking false (`thinking: false`, the default):
# an empty think block, so the model answers at once, as it was trained to.
EMPTY_THINK = "<think>\n\n</think>\n\n"


def _chatml_no_think(system, messages):
    return _chatml(system, messages) + EMPTY_THINK


def _llama3(system, messages):
    def block(role, content):
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"

    head = block("system", system) if system else ""
    return (
        head
        + "".join(block(m["role"], m["content"]) for m in messages)
        + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def _mistral(system, messages):
    """Mistral v0.3's template: "[INST] x[/INST] y</s>", the system prompt in the last user turn."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = ""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            out += "[INST] " + (f"{system}\n\n" if system and i == last else "") + m["content"] + "[/INST]"
        else:
            out += f" {m['content']}</s>"
    return out


def _mistral_legacy(system, messages):
    """Mistral v0.1's "[INST] x [/INST]y</s>", the system prompt in the first user turn (loraship's
    `chat_template: mistral`, loraship/chat.py)."""
    first = min(i for i, m in enumerate(messages) if m["role"] == "user")
    out = ""
    for i, m in enumerate(messages):
        if m["role"] == "user":
            out += "[INST] " + (f"{system}\n\n" if system and i == first else "") + m["content"] + " [/INST]"
        else:
            out += f"{m['content']}</s>"
    return out


CHATML_GO = """{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range .Messages }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}<|im_end|>
{{ end }}
{{- end }}<|im_start|>assistant
"""

FAMILIES = (
    Family("chatml", CHATML_GO, _chatml, ("<|im_start|>", "<|im_end|>")),
    # Qwen3 served in the non-thinking form: Ollama passes no enable_thinking to a Modelfile's Go template, so the
    # empty think block is written into the template itself.
    Family("chatml-no-think", CHATML_GO + EMPTY_THINK, _chatml_no_think, ("<|im_start|>", "<|im_end|>")),
    Family(
        "llama3",
        """{{- if .System }}<|start_header_id|>system<|end_header_id|>

{{ .System }}<|eot_id|>
{{- end }}
{{- range .Messages }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}
{{- end }}<|start_header_id|>assistant<|end_header_id|>

""",
        _llama3,
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ),
    Family(
        "mistral",
        """{{- range $i, $_ := .Messages }}
{{- if eq .Role "user" }}[INST] {{ if and $.System (eq (len (slice $.Messages $i)) 1) }}{{ $.System }}

{{ end }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }} {{ .Content }}</s>
{{- end }}
{{- end }}""",
        _mistral,
        ("[INST]", "[/INST]"),
    ),
    Family(
        "mistral-legacy",
        """{{- $first := true }}
{{- range .Messages }}
{{- if eq .Role "user" }}[INST] {{ if and $.System $first }}{{ $.System }}

{{ end }}{{ .Content }} [/INST]
{{- $first = false }}
{{- else if eq .Role "assistant" }}{{ .Content }}</s>
{{- end }}
{{- end }}""",
        _mistral_legacy,
        ("[INST]", "[/INST]"),
    ),
)


def _rendered(tokenizer, messages: list[dict]) -> str | None:
    """The tokenizer's rendering with the generation prompt, without the BOS text a runtime adds
    as a token (Ollama prepends BOS itself when the GGUF says add_bos_token); None when the
    template refuses the conversation (some refuse a system message)."""
    from loraship.chat import render
    from loraship.errors import DataError

    try:
        text = render(tokenizer, messages, add_generation_prompt=True)
    except DataError:
        return None
    bos = getattr(tokenizer, "bos_token", None)
    return text[len(bos) :] if bos and text.startswith(bos) else text


def _default_system(family: Family, rendered: str) -> tuple[bool, str | None]:
    """Whether `rendered` (no system message given) is this family's output, and the system prompt
    the template put in by itself (None when it put in none)."""
    probe = list(PROBE)
    if family.render(None, probe) == rendered:
        return True, None
    # Where the family puts a system prompt: the text around a sentinel one.
    before, _, after = family.render(PROBE_SYSTEM, probe).partition(PROBE_SYSTEM)
    if rendered.startswith(before) and rendered.endswith(after) and len(rendered) > len(before) + len(after):
        system = rendered[len(before) : len(rendered) - len(after)]
        if family.render(system, probe) == rendered:
            return True, system
    return False, None


def recognise(tokenizer) -> dict:
    """{'family', 'template', 'system', 'family_stops'} for a template a Go template here renders
    identically, else {'family': None, 'reason': ...}. The tokenizer carries the shipped template."""
    from loraship.chat import template_of

    if template_of(tokenizer) is None:
        return {"family": None, "reason": "the model has no chat template"}
    plain = _rendered(tokenizer, list(PROBE))
    with_system = _rendered(tokenizer, [{"role": "system", "content": PROBE_SYSTEM}, *PROBE])
    if plain is None:
        return {"family": None, "reason": "the chat template refused a user/assistant/user probe conversation"}
    for family in FAMILIES:
        matched, system = _default_system(family, plain)
        if not matched:
            continue
        if with_system is not None and family.render(PROBE_SYSTEM, list(PROBE)) != with_system:
            continue  # same turns, but the system prompt goes elsewhere (e.g. Llama 3.1's dated header)
        return {
            "family": family.name,
            "template": family.go_template,
            "system": system,
            "family_stops": list(family.stops),
        }
    return {"family": None, "reason": "the chat template renders conversations unlike ChatML, Llama 3 or Mistral"}


def stop_tokens(model_stops: list[str], facts: dict) -> list[str]:
    """The model's own stop tokens first (what verify held the GGUF to), then the family's markers
    Ollama's own template parameters stop on, each once."""
    return list(dict.fromkeys([*model_stops, *(facts.get("family_stops") or [])]))


def _quoted(text: str) -> str:
    """A Modelfile string: Ollama's parser reads JSON-style escapes inside double quotes."""
    return json.dumps(text, ensure_ascii=False)


def _block(text: str, what: str) -> str:
    if '"""' in text:
        from loraship.errors import LorashipError

        raise LorashipError(f'the {what} contains """, which a Modelfile cannot quote; change the {what}')
    return f'"""{text}"""'


def modelfile(
    gguf_name: str,
    facts: dict,
    model_stops: list[str],
    context: int,
    sampling: Sampling = GREEDY,
    n_cpu_moe: int = 0,
) -> str:
    """The Modelfile text: FROM the GGUF beside it, the verified context, the sampling settings verify
    served it with (Ollama's own defaults, repeat_penalty 1.1 and temperature 0.8 among them, answer
    otherwise), stop tokens, and the TEMPLATE/SYSTEM of a recognised family (none otherwise: Ollama then
    derives one from the GGUF). n_cpu_moe: a comment saying so, as a Modelfile has no parameter for it."""
    lines = [f"# {line}" for line in no_n_cpu_moe_words(n_cpu_moe)]
    lines += [f"FROM ./{gguf_name}", "", f"PARAMETER num_ctx {context}"]
    lines += [f"PARAMETER {name} {value}" for name, value in sampling.ollama_parameters()]
    lines += [f"PARAMETER stop {_quoted(tok)}" for tok in stop_tokens(model_stops, facts)]
    if facts.get("family"):
        lines += ["", f"TEMPLATE {_block(facts['template'], 'chat template')}"]
        if facts.get("system"):
            lines += ["", f"SYSTEM {_block(facts['system'], 'default system prompt')}"]
    return "\n".join(lines) + "\n"


def no_n_cpu_moe_words(n_cpu_moe: int) -> list[str]:
    """What the Modelfile and the card say where verify kept experts in CPU memory: Ollama's Modelfile has no
    parameter for llama.cpp's --n-cpu-moe, so none is written."""
    if not n_cpu_moe:
        return []
    return [
        f"Verified with the routed experts of the first {n_cpu_moe} layers in CPU memory (llama.cpp's --n-cpu-moe "
        f"{n_cpu_moe}),",
        "which Ollama's Modelfile has no parameter for: Ollama places whole layers on the GPU itself. To run it",
        "as verified, use the llama-server command in README.md.",
    ]
