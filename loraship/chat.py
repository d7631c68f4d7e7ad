"""Chat templates: chosen from the config or the checkpoint, rendered by transformers itself.

Rendering goes through `tokenizer.apply_chat_template`, i.e. transformers' own sandboxed Jinja
environment (loopcontrols, `raise_exception`, `strftime_now`, non-escaping `tojson`, `tools`
defined), so real templates such as Qwen2.5's (`{%- if tools %}`) behave here exactly as they do
for everyone else who uses the checkpoint. A template is code shipped with a checkpoint; the
sandbox keeps it away from Python internals.

Loss masks: where the template marks assistant text with `{% generation %}`, transformers'
assistant-token mask is used. Otherwise the conversation is rendered once, as a served model sees it
later in the chat, and each assistant turn is located in that one rendering:
- where the template renders conversations as prefixes of each other, the turn is the text between
  the conversation rendered up to it (with the generation prompt) and rendered through it;
- where it rewrites a turn once later ones follow (Qwen3 drops the think block of every turn before
  the last user message), the turn's text is found by rendering the conversation again with that
  message replaced by two different sentinels: the region that differs is the message as the template
  rendered it there, and the turn-end marker after it ends the span. The last turn is what a served
  model writes after the generation prompt, so the rendering must continue that prompt.
"""

from __future__ import annotations

import re

from loraship.errors import ConfigError, DataError

# Named templates for base models that ship none (`chat_template: chatml` in the config).
# Each is the de-facto standard text of its family; the GGUF carries the same string.
NAMED_TEMPLATES: dict[str, str] = {
    # ChatML (Qwen and many fine-tunes): <|im_start|>role, newline, content, <|im_end|>, newline.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama 3 instruct headers.
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
        "'<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # Mistral [INST] turns; a system message is prepended to the first user turn.
    "mistral": (
        "{{ bos_token }}"
        "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' %}"
        "{% for message in messages if message['role'] != 'system' %}"
        "{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + ((system + '\\n\\n') if system and loop.first else '') + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('mistral template: unknown role ' + message['role']) }}{% endif %}"
        "{% endfor %}"
    ),
    # Gemma's turns (user / model); no system role, so a system message opens the first user turn, as Gemma's own.
    "gemma": (
        "{{ bos_token }}"
        "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' %}"
        "{% for message in messages if message['role'] != 'system' %}"
        "{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
        "{{ '<start_of_turn>' + role + '\\n' + ((system + '\\n\\n') if system and loop.first else '') "
        "+ message['content'] | trim + '<end_of_turn>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    # Phi-3's <|role|> turns, each ended by <|end|>.
    "phi3": (
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
    # Alpaca's instruction/response layout, for instruction data on a plain base model.
    "alpaca": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ '### Response:\\n' + message['content'] + eos_token + '\\n\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    ),
}

_JINJA_MARKERS = ("{{", "{%")
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


def resolve_template(value: str) -> str:
    """The Jinja text for a `chat_template:` config value: a name from NAMED_TEMPLATES or Jinja itself."""
    if any(marker in value for marker in _JINJA_MARKERS):
        return value
    if value in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[value]
    raise ConfigError(
        "chat_template",
        [
            f"{value!r} is neither a named template ({', '.join(sorted(NAMED_TEMPLATES))}) nor Jinja text; "
            "use one of those names or paste the template itself"
        ],
    )


def use_configured_template(tokenizer, configured: str | None):
    """Give the tokenizer the config's template (it wins over the checkpoint's); returns the tokenizer."""
    if configured:
        tokenizer.chat_template = resolve_template(configured)
    return tokenizer


def template_kwargs(template: str | None, thinking: bool) -> dict:
    """The variables the config passes to a chat template: enable_thinking (the config's `thinking`) to a template
    that reads it (Qwen3's: False renders the empty <think> block into the generation prompt), nothing otherwise."""
    return {"enable_thinking": thinking} if template and "enable_thinking" in template else {}


def set_template_kwargs(tokenizer, kwargs: dict) -> None:
    """Kept on the tokenizer, so that every rendering of it (training rows, their loss masks, the turn-end probe,
    golden prompts) passes the same variables; part of data.tokenizer_fingerprint."""
    tokenizer._loraship_template_kwargs = dict(kwargs)


def template_kwargs_of(tokenizer) -> dict:
    return dict(getattr(tokenizer, "_loraship_template_kwargs", {}))


def template_of(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one is what a runtime uses
        template = template.get("default")
    return template or None


def require_template(tokenizer, what: str) -> str:
    template = template_of(tokenizer)
    if template is None:
        raise DataError(
            f"{what} need a chat template, but the base model's tokenizer has none; set `chat_template:` in the "
            f"config to a named template ({', '.join(sorted(NAMED_TEMPLATES))}) or to Jinja text"
        )
    return template


def render(
    tokenizer, messages: list[dict], *, add_generation_prompt: bool = False, template: str | None = None
) -> str:
    """The conversation as text, rendered by transformers with the tokenizer's (or the given) template."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs_of(tokenizer),
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise DataError(f"chat template failed to render: {type(e).__name__}: {e}") from e


def has_generation_blocks(template: str | None) -> bool:
    return bool(template and _GENERATION_BLOCK.search(template))


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered once and the character spans of each assistant turn in it (content + end
    marker): the text between the renderings up to the turn (with the generation prompt) and through it where
    those are prefixes of the whole, else the turn located in the whole rendering (located_span)."""
    full = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1])
        if full.startswith(through) and through.startswith(prompt):
            spans.append((len(prompt), len(through)))
        elif i == len(messages) - 1:
            raise DataError(_last_turn_problem(tokenizer, message, full, prompt))
        else:
            spans.append(located_span(tokenizer, messages, i, full, prompt, through))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise DataError(
                f"the chat template's rendering of this conversation cannot be split into its assistant turns (two "
                f"overlap at characters {start}..{end}); {_TEMPLATE_FIX}"
            )
    return full, spans


_TEMPLATE_FIX = (
    f"set `chat_template:` to a named template ({', '.join(sorted(NAMED_TEMPLATES))}), or mark assistant text with "
    "{% generation %} ... {% endgeneration %} in the template"
)
# Two texts no template rewrites (no whitespace to trim, no markup), differing in their first and last characters:
# whatever content starts or ends like one of them, the other marks the message's exact edges.
_SENTINELS = ("LorashipTurnA", "lorashipturnb")


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # bisection over slice comparisons: a row's renderings run to thousands of characters
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def located_span(tokenizer, messages: list[dict], i: int, full: str, prompt: str, through: str) -> tuple[int, int]:
    """The span of assistant message i (not the last message) in `full`, the whole conversation rendered once.

    Its text is the region that changes when the message is replaced by a sentinel: the message as the template
    renders it there (an earlier Qwen3 turn without its reasoning). The span starts where `prompt` (the conversation
    up to the turn with the generation prompt) stops matching `full`, if that is no earlier than the end of the
    messages before it (so Mistral's space before the content is learned, as the prefix method learns it), and ends
    after the turn-end marker and what `through` (the conversation through this turn) writes after it."""
    start, end = len(full), 0
    for sentinel in _SENTINELS:
        other = render(tokenizer, [*messages[:i], {"role": "assistant", "content": sentinel}, *messages[i + 1 :]])
        head = _common_prefix(full, other)
        tail = _common_prefix(full[head:][::-1], other[head:][::-1])
        if other.count(sentinel) != 1 or sentinel not in other[head : len(other) - tail]:
            raise DataError(
                f"the chat template does not render assistant message {i} (messages[{i}]) once as text of its own, so "
                f"its tokens cannot be located for the loss (a sentinel in its place was rendered "
                f"{other.count(sentinel)} times); {_TEMPLATE_FIX}"
            )
        start, end = min(start, head), max(end, len(full) - tail)
    before = render(tokenizer, messages[:i])
    if full.startswith(before):
        start = max(min(start, _common_prefix(full, prompt)), len(before))
    end_id = turn_end_id(tokenizer)
    if end_id is None:
        raise DataError(
            f"assistant message {i} (messages[{i}]) is rewritten once later turns follow, and the tokenizer has no "
            f"turn-end token to end its span with; {_TEMPLATE_FIX}"
        )
    marker = tokenizer.convert_ids_to_tokens(end_id)
    found = re.compile(r"\s*" + re.escape(marker) + r"\s*").match(full, end)
    if found is None:
        raise DataError(
            f"assistant message {i} (messages[{i}], {messages[i]['content'][:40]!r}) is not followed by the turn end "
            f"{marker!r} where the chat template renders it in the whole conversation "
            f"({full[end : end + 40]!r} follows), so the model would not learn to stop there; {_TEMPLATE_FIX}"
        )
    # The whitespace after the marker as far as this turn's own rendering writes it (ChatML's newline; none where
    # the template writes it only between turns, as OLMo 2's), so located turns learn what the prefix method learns.
    stop = found.end()
    marker_end = full.index(marker, end) + len(marker)
    while stop > marker_end and not through.endswith(full[end:stop]):
        stop -= 1
    return start, stop


def _last_turn_problem(tokenizer, message: dict, full: str, prompt: str) -> str:
    at = _common_prefix(full, prompt)
    reasoning = "</think>" in message["content"] or bool(message.get("reasoning_content"))
    if reasoning and template_kwargs_of(tokenizer).get("enable_thinking") is False:
        return (
            f"the last assistant turn ({message['content'][:40]!r}) carries reasoning (a <think> block or "
            "reasoning_content), but with `thinking: false` a served prompt already ends with an empty think block, "
            "so the model would never write it; set `thinking: true` to train the reasoning, or remove it from the "
            "row's last assistant turn"
        )
    return (
        f"the chat template renders this conversation otherwise than the prompt a served model answers with its last "
        f"turn: at character {at} the conversation has {full[at : at + 40]!r} where that prompt has "
        f"{prompt[at : at + 40]!r}, so the model would learn an answer to a prompt it is never served; "
        f"{_TEMPLATE_FIX}"
    )


def tokenize_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is assistant text to learn."""
    template = template_of(tokenizer)
    if has_generation_blocks(template):
        from jinja2.exceptions import TemplateError

        try:
            enc = tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **template_kwargs_of(tokenizer),
            )
        except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise DataError(f"chat template failed to render: {type(e).__name__}: {e}") from e
        ids = list(enc["input_ids"])
        mask = [bool(m) for m in enc["assistant_masks"]]
        if not any(mask):
            raise DataError("the template's {% generation %} blocks marked no assistant tokens in this conversation")
        return ids, learn_turn_ends(ids, mask, turn_end_id(tokenizer))
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = [any(start <= s < end for start, end in spans) for s, _e in enc["offset_mapping"]]
    return ids, mask


def learn_turn_ends(ids: list[int], mask: list[bool], end_id: int | None) -> list[bool]:
    """Put the turn-end token right after each learned run inside the loss: a model that never learns
    to emit it never stops when served (a `{% generation %}` block may close before it)."""
    if end_id is None:
        return mask
    mask = list(mask)
    for i in range(len(ids) - 1):
        if mask[i] and not mask[i + 1] and ids[i] != end_id and ids[i + 1] == end_id:
            mask[i + 1] = True
    return mask


def special_tokens(tokenizer) -> dict[int, str]:
    """Every special token of the vocabulary, id -> text: the named ones (bos, eos, ...) and the added
    tokens marked special (Llama 3's header tokens, ChatML's markers)."""
    named = {int(i): tokenizer.convert_ids_to_tokens(int(i)) for i in tokenizer.all_special_ids}
    added = {
        int(i): token.content
        for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(token, "special", False)
    }
    return {**named, **added}


# The assistant text the turn-end probe renders; no template changes it.
_TURN_PROBE = "loraship-turn-probe"


def turn_end(tokenizer) -> dict:
    """The token that ends an assistant turn, found by rendering one with the template (never guessed):
    {"id", "text"}. It must be ONE special token, or no runtime stops where training taught it to:
    a plain-text end marker becomes several ordinary pieces that llama.cpp never treats as an end."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": _TURN_PROBE},
        {"role": "user", "content": "Hi"},
    ]
    text = render(tokenizer, messages)
    at = text.find(_TURN_PROBE)
    if at < 0:
        raise DataError(
            "the chat template does not render the assistant's message text, so no turn end can be "
            "found; use a template that writes message['content'] for assistant turns"
        )
    after = text[at + len(_TURN_PROBE) :].lstrip(" \n")
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids or ids[0] not in special_tokens(tokenizer):
        pieces = tokenizer.convert_ids_to_tokens(ids[:6])
        shown = f"the pieces {pieces} ({after[:40]!r})" if ids else "nothing"
        raise DataError(
            f"the chat template ends an assistant turn with {shown}, not one special token of the vocabulary, so a "
            "served model never stops by itself; use a template whose turn end is a special token of this base "
            f"({', '.join(sorted(NAMED_TEMPLATES))} where the vocabulary has their markers), or end each assistant "
            "turn with {{ eos_token }}"
        )
    return {"id": int(ids[0]), "text": tokenizer.convert_ids_to_tokens(ids[0])}


def turn_end_id(tokenizer) -> int | None:
    """turn_end's id, or None where the tokenizer has no template (completion data ends with EOS)."""
    template = template_of(tokenizer)
    if template is None:
        return None
    # Cached on the tokenizer per template: every training row asks.
    cached = getattr(tokenizer, "_loraship_turn_end", None)
    if cached is None or cached[0] != template:
        cached = (template, turn_end(tokenizer)["id"])
        tokenizer._loraship_turn_end = cached
    return cached[1]


def stop_ids(tokenizer, merged_dir) -> list[int]:
    """Every token that ends generation for HF: the tokenizer's EOS and generation_config's eos ids."""
    import json

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = merged_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def ends_generation_in_llama_cpp(token: dict, eos_id: int | None) -> bool:
    """Whether llama.cpp stops on this token: its EOS, or a text llama.cpp marks end-of-generation by name."""
    from loraship.constants import LLAMA_CPP_EOG_TEXTS

    return token["id"] == eos_id or token["text"] in LLAMA_CPP_EOG_TEXTS
