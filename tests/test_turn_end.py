"""End of turn, the same everywhere: the token a template ends an assistant turn with is found by
rendering, must be one special token llama.cpp stops on, is learned, is in the merged model's
generation_config, and stops HF's and llama.cpp's greedy answers alike (verify gates it, and serves
the GGUF through llama.cpp's OpenAI-compatible server)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.errors import DataError, LorashipError
from loraship.runtime.stage import stage_dir
from tests.conftest import QWEN_STEPS, SMALL_IMATRIX, demo_config_dict

CHAT = [
    {"role": "user", "content": "What is the capital of Zorvia?"},
    {"role": "assistant", "content": "Answer: Kelmar."},
]
PLAIN_END = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n### End\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def tokenizer_of(folder: Path, template: str | None = None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def without_template(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return dst


def test_turn_end_is_rendered_not_guessed(tiny_qwen, tiny_model):
    from loraship.chat import NAMED_TEMPLATES, turn_end

    qwen = tokenizer_of(tiny_qwen)
    assert turn_end(qwen)["text"] == "<|im_end|>" and turn_end(qwen)["id"] == qwen.convert_tokens_to_ids("<|im_end|>")
    llama = tokenizer_of(tiny_model)
    assert turn_end(llama) == {"id": llama.eos_token_id, "text": "</s>"}  # its template ends answers with EOS
    assert turn_end(tokenizer_of(tiny_model, NAMED_TEMPLATES["mistral"]))["id"] == llama.eos_token_id


@pytest.mark.parametrize(
    "template, shown",
    [
        (PLAIN_END, "### End"),
        # ChatML on a vocabulary where <|im_end|> is not a token: several plain pieces no runtime stops on.
        ("chatml", "<|im_end|>"),
    ],
)
def test_a_turn_end_that_is_not_one_special_token_is_refused(tiny_model, template, shown):
    import re

    from loraship.chat import resolve_template, turn_end

    with pytest.raises(
        DataError, match=rf"ends an assistant turn with the pieces \[.*\] \('{re.escape(shown)}.*not one special token"
    ):
        turn_end(tokenizer_of(tiny_model, resolve_template(template)))


def test_plan_refuses_a_template_without_a_special_turn_end(tiny_model, tmp_path):
    import loraship.stages.plan as plan

    config = parse_config(demo_config_dict(tiny_model, tmp_path, chat_template="chatml"))
    with pytest.raises(
        LorashipError, match=r"chat template: .*ends an assistant turn with the pieces .*'<\|im_end\|>"
    ):
        plan.run(config)
    assert not (stage_dir(config, "train")).exists()  # nothing trained


def test_the_turn_end_is_learned_even_outside_a_generation_block(tiny_qwen):
    from loraship.chat import tokenize_conversation

    # The block closes before <|im_end|>: without the fix the model would never learn to stop.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}<|im_end|>{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = tokenizer_of(tiny_qwen, template)
    ids, learn = tokenize_conversation(tokenizer, CHAT)
    assert tokenizer.decode([t for t, keep in zip(ids, learn) if keep]) == "Answer: Kelmar.<|im_end|>"


def test_init_gives_a_base_a_template_ending_in_its_own_special_token(tiny_qwen, tiny_model, tmp_path):
    from loraship.starter import template_for_base

    qwen_base = without_template(tiny_qwen, tmp_path / "qwen-base")
    assert template_for_base(qwen_base, "chat")[0] == "chatml"  # <|im_end|> is one special token there
    # alpaca rows are rendered as a chat too, so they take the base's native format as well
    assert template_for_base(qwen_base, "alpaca")[0] == "chatml"
    llama_base = without_template(tiny_model, tmp_path / "llama-base")
    name, why = template_for_base(llama_base, "chat")
    assert name == "alpaca" and "EOS '</s>'" in why  # no turn markers in the toy vocabulary: answers end with EOS


def test_merged_generation_config_stops_on_the_turn_end(tiny_qwen, tmp_path):
    from loraship.chat import NAMED_TEMPLATES
    from loraship.stages.merge import stop_at_turn_end

    folder = without_template(tiny_qwen, tmp_path / "m")
    tokenizer = tokenizer_of(folder, NAMED_TEMPLATES["chatml"])
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    end = stop_at_turn_end(folder)
    assert end["text"] == "<|im_end|>" and end["stop_tokens_dropped"] == []
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [151643, end["id"]]
    # A stop token llama.cpp does not end generation on (Phi-3's <|assistant|> is such a marker) leaves the
    # list: the merged model stops where the served GGUF does.
    object_ref = tokenizer.convert_tokens_to_ids("<|object_ref_start|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151643, object_ref]}))
    end = stop_at_turn_end(folder)
    assert end["stop_tokens_dropped"] == [{"id": object_ref, "text": "<|object_ref_start|>"}]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [151643, end["id"]]


@pytest.fixture(scope="module")
def base_given_chatml_run(tiny_qwen, tmp_path_factory):
    """The issue's case, as a new user meets it: a base whose EOS is <|endoftext|> and which has no
    template, given one by `loraship init`, trained on chat data, then served."""
    from loraship.constants import STAGES
    from loraship.starter import template_for_base

    root = tmp_path_factory.mktemp("base-chatml")
    base = without_template(tiny_qwen, root / "qwen-base")
    template, _why = template_for_base(base, "chat")
    config = parse_config(
        demo_config_dict(
            base,
            root,
            run_name="base-chatml",
            chat_template=template,
            sequence_len=96,
            max_new_tokens=16,
            **QWEN_STEPS,
            **SMALL_IMATRIX,
        )
    )
    import importlib

    for stage in STAGES:
        importlib.import_module(f"loraship.stages.{stage}").run(config)
    return config


def test_a_base_given_a_template_by_init_stops_by_itself_when_served(base_given_chatml_run):
    config = base_given_chatml_run
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    assert verify["passed"], {k: g for k, g in verify["gates"].items() if not g["passed"]}
    ends = verify["gates"]["golden_ends_turn"]
    assert ends["passed"] and ends["evidence"] == ends["value"] == 12
    served = verify["served"]
    assert served["api"] == "openai" and served["requests"] == 12
    assert served["finished_by_stop"] == served["equal_to_reference"] == served["streamed_equal"] == 12
    assert all(not a["markers_leaked"] for a in served["answers"])
    generation = json.loads((stage_dir(config, "merge") / "merged" / "generation_config.json").read_text())
    assert 151645 in generation["eos_token_id"]  # <|im_end|>: HF stops where llama.cpp does


def test_config_chat_template_reaches_the_gguf(base_given_chatml_run):
    """A chat_template: from the config is trained with, saved with the adapter, merged and embedded in every GGUF.
    (ChatML on Qwen's vocabulary, where <|im_end|> is one special token; on the sentencepiece toy it is refused at
    plan: test_plan_refuses_a_template_without_a_special_turn_end above.)"""
    from loraship.chat import NAMED_TEMPLATES
    from loraship.llamacpp.gguf_info import read_gguf

    config = base_given_chatml_run
    assert config.chat_template == "chatml"
    adapter = stage_dir(config, "train") / "adapter"
    saved = (
        json.loads((adapter / "tokenizer_config.json").read_text()).get("chat_template")
        or (adapter / "chat_template.jinja").read_text()
    )
    assert saved == NAMED_TEMPLATES["chatml"]
    for gguf in (stage_dir(config, "convert") / "model-F16.gguf", stage_dir(config, "quantize") / "model-Q4_K_M.gguf"):
        assert read_gguf(gguf)["fields"]["tokenizer.chat_template"] == NAMED_TEMPLATES["chatml"], gguf


def test_the_turn_end_gate_fails_a_model_that_does_not_stop():
    from types import SimpleNamespace

    from loraship.verification.gates import turn_end_gate

    config = SimpleNamespace(max_new_tokens=12, min_golden_prompts=2)
    reference = {"tokenizer": {"turn_end_id": 7}}
    answers = [
        {"kind": "chat", "prompt": "a", "hf_stop": 7, "gguf_stop": 7},
        {"kind": "chat", "prompt": "b", "hf_stop": None, "gguf_stop": None},
    ]
    failed = turn_end_gate({"answers": answers}, reference, config)
    assert not failed.passed and "cut at max_new_tokens 12" in failed.note
    assert turn_end_gate({"answers": answers[:1] * 2}, reference, config).passed
    assert not turn_end_gate({"answers": []}, reference, config).passed  # nothing seen is no pass
