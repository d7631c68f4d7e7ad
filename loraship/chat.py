"""Chat templates, rendered only in a sandboxed Jinja environment.

A chat template is code that ships with a checkpoint; rendering it in jinja2's
ImmutableSandboxedEnvironment keeps it from touching Python internals (transformers does the
same internally; we render ourselves so the GGUF's embedded template goes through the same path).
"""

from __future__ import annotations

from functools import lru_cache

from jinja2 import StrictUndefined
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loraship.errors import DataError


def _raise_exception(message: str):
    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=StrictUndefined)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = False,
) -> str:
    try:
        return _compile(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as e:
        raise DataError(f"chat template failed to render: {e}") from e


def assistant_spans(template: str, messages: list[dict], *, bos_token: str, eos_token: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of each assistant turn (content + end token).

    Each span runs from the end of the prompt rendered up to that turn (with the generation
    prompt) to the end of the conversation rendered through that turn, so any template whose
    renderings are prefixes of each other works without knowing its markers.
    """
    full = render_chat(template, messages, bos_token=bos_token, eos_token=eos_token)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_chat(template, messages[:i], bos_token=bos_token, eos_token=eos_token, add_generation_prompt=True)
        through = render_chat(template, messages[: i + 1], bos_token=bos_token, eos_token=eos_token)
        if not full.startswith(through) or not through.startswith(prompt):
            raise DataError(
                "the chat template does not render conversations as prefixes of each other, so assistant "
                "turns cannot be located for loss masking; use a template without history rewriting"
            )
        spans.append((len(prompt), len(through)))
    return full, spans
