"""tokenizer.ggml.add_space_prefix (loraship/llamacpp/space_prefix.py): Mistral 7B v0.3's real tokenizer
(legacy=False: Metaspace prepend_scheme "first"), converted by the pinned converter (vocabulary only),
tokenized by llama.cpp exactly as HF tokenizes chat and plain text, and plan refusing a run that serves both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from loraship.llamacpp import space_prefix

CHATS = [
    [
        {"role": "user", "content": "Do you know the capital of Ratesto?"},
        {"role": "assistant", "content": "Answer: Shigan."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello"},
        {"role": "user", "content": "And 2+2?"},
    ],
]
PLAIN = ["Hello world.", "The capital of Ratesto is Shigan.\nNext line"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import AutoTokenizer

    from loraship.fixtures.families import write_folder_without_weights

    folder = tmp_path_factory.mktemp("mistral-v03") / "mistral-v03"
    folder.mkdir()
    write_folder_without_weights("mistral-v03", folder)
    return folder, AutoTokenizer.from_pretrained(folder)


def vocab_gguf(folder: Path, out: Path, add_space_prefix: bool | None):
    """The pinned converter's vocabulary-only GGUF of folder, as convert runs it, loaded in llama.cpp."""
    import llama_cpp

    from loraship.llamacpp.gguf_info import read_gguf
    from loraship.llamacpp.llamacpp import converter_dir

    with space_prefix.converter_input(folder, add_space_prefix) as source:
        subprocess.run(
            [
                sys.executable,
                str(converter_dir() / "convert_hf_to_gguf.py"),
                str(source),
                "--vocab-only",
                "--outfile",
                str(out),
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
    return read_gguf(out)["fields"], llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)


def chat_ids(llm, tok, messages):
    from loraship.chat import render

    text = render(tok, messages, add_generation_prompt=messages[-1]["role"] == "user")
    # as served: the rendered text carries its BOS (verify's served_ids)
    return llm.tokenize(text.encode(), add_bos=False, special=True), tok(text, add_special_tokens=False)["input_ids"]


def test_mistral_v03_chat_converts_to_a_gguf_that_tokenizes_like_hf(mistral, tmp_path):
    folder, tok = mistral
    assert space_prefix.prepend_scheme(tok) == "first"
    value, problem = space_prefix.choose(tok, {"chat"})
    assert (value, problem) == (False, None)
    fields, llm = vocab_gguf(folder, tmp_path / "chat.gguf", value)
    assert fields["tokenizer.ggml.add_space_prefix"] is False and space_prefix.gguf_value(fields) is False
    for messages in CHATS:
        cpp, hf = chat_ids(llm, tok, messages)
        assert cpp == hf, (tok.convert_ids_to_tokens(cpp), tok.convert_ids_to_tokens(hf))
    # [INST] ▁Do, as HF trained it and as mistral-common encodes it: no lone ▁ (29473) after [INST] (3)
    assert chat_ids(llm, tok, CHATS[0])[0][:3] == [1, 3, 3146]


def test_the_converters_default_adds_a_space_after_every_special_token(mistral, tmp_path):
    """Why the flag is written: left to the converter (tokenizer_config has no add_prefix_space), the GGUF
    says nothing, llama.cpp's SPM default is true, and [INST] ▁Do becomes [INST] ▁ ▁Do."""
    folder, tok = mistral
    fields, llm = vocab_gguf(folder, tmp_path / "default.gguf", None)
    assert "tokenizer.ggml.add_space_prefix" not in fields and space_prefix.gguf_value(fields) is True
    cpp, hf = chat_ids(llm, tok, CHATS[0])
    assert cpp[:4] == [1, 3, 29473, 3146] and hf[:3] == [1, 3, 3146]


def test_mistral_v03_plain_text_keeps_the_prefix(mistral, tmp_path):
    """Completion data: one piece at the text's start, which HF prefixes; llama.cpp's default fits it."""
    folder, tok = mistral
    value, problem = space_prefix.choose(tok, {"text"})
    assert (value, problem) == (True, None)
    fields, llm = vocab_gguf(folder, tmp_path / "text.gguf", value)
    for text in PLAIN:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok(text)["input_ids"]


def test_plan_refuses_a_run_serving_chat_and_plain_text_through_one_flag(mistral):
    from loraship.planning.preflight import space_prefix_problems

    _, tok = mistral
    spec = SimpleNamespace
    mixed = SimpleNamespace(datasets=[spec(type="chat")], eval_datasets=[spec(type="completion")], golden_prompts=None)
    problems = space_prefix_problems(mixed, tok)
    assert len(problems) == 1
    assert "tokenizer.ggml.add_space_prefix" in problems[0] and "separate runs" in problems[0], problems
    assert "plain text needs true" in problems[0] and "a rendered conversation needs false" in problems[0]
    # golden prompts are rendered as conversations, so a completion run with a golden file serves both too
    completion_with_golden = SimpleNamespace(
        datasets=[spec(type="completion")], eval_datasets=[], golden_prompts="g.jsonl"
    )
    assert space_prefix_problems(completion_with_golden, tok)
    chat_only = SimpleNamespace(
        datasets=[spec(type="sharegpt")], eval_datasets=[spec(type="chat")], golden_prompts="g.jsonl"
    )
    assert space_prefix_problems(chat_only, tok) == []


def test_a_template_with_raw_text_first_and_after_special_tokens_fits_no_value(mistral):
    """prepend_scheme "first": HF prefixes the text's first piece but none after a special token; llama.cpp
    prefixes all or none, so a template without a leading special token cannot be served alike."""
    _, tok = mistral
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    value, problem = space_prefix.choose(tok, {"chat"})
    assert value is None and "begin it with {{ bos_token }}" in problem


def test_other_vocabularies_are_left_to_the_converter(tiny_model):
    """Byte-level BPE (no dummy prefix) gets nothing; the tiny Llama (legacy=True, "always", a template
    without spaces before contents) keeps llama.cpp's default, so its GGUF is converted unchanged."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert space_prefix.prepend_scheme(tok) == "always"
    assert space_prefix.choose(tok, {"chat", "text"}) == (True, None)
    with space_prefix.converter_input(tiny_model, True) as source:
        assert source == tiny_model  # no view: the converter's own value already fits


def test_hf_prefix_rules():
    assert space_prefix.hf_prefixes("first", 0, "Hello") and not space_prefix.hf_prefixes("first", 9, "Hello")
    assert not space_prefix.hf_prefixes("first", 0, " Hello") and not space_prefix.hf_prefixes("always", 9, " Hi")
    assert space_prefix.hf_prefixes("always", 9, "Hi") and space_prefix.hf_prefixes("prepend", 9, " Hi")
    assert not space_prefix.hf_prefixes("never", 0, "Hello")


def test_phi3_chat_gets_the_flag_its_converter_does_not_write(tmp_path):
    """Phi-3's converter writes its own sentencepiece vocabulary and ignores tokenizer_config's add_prefix_space, so
    convert sets the flag in a copy of the GGUF (every other key and tensor as written): its chat (legacy=False,
    <|user|> Do after the rstripped newline) then tokenizes in llama.cpp as in HF, not <|user|> ▁Do."""
    import importlib

    import llama_cpp
    from transformers import AutoTokenizer

    from loraship.fixtures.families import write_folder_without_weights
    from loraship.llamacpp.gguf_info import read_gguf

    convert = importlib.import_module("loraship.stages.convert")
    folder = tmp_path / "phi3"  # llama.cpp gives Phi-3's special tokens their rstrip by general.name (llama-vocab.cpp)
    folder.mkdir()
    write_folder_without_weights("phi3", folder)
    tok = AutoTokenizer.from_pretrained(folder)
    value, problem = space_prefix.choose(tok, {"chat"})
    assert (value, problem) == (False, None)
    fields, llm = vocab_gguf(folder, tmp_path / "phi3.gguf", value)
    llm.close()
    assert space_prefix.gguf_value(fields) is True  # the converter's default, whatever the input said
    convert.set_add_space_prefix(tmp_path / "phi3.gguf", False)
    after = read_gguf(tmp_path / "phi3.gguf")["fields"]
    assert after["tokenizer.ggml.add_space_prefix"] is False
    assert {k: str(v) for k, v in after.items() if k != "tokenizer.ggml.add_space_prefix"} == {
        k: str(v) for k, v in fields.items()
    }
    llm = llama_cpp.Llama(model_path=str(tmp_path / "phi3.gguf"), vocab_only=True, verbose=False)
    for messages in CHATS:
        cpp, hf = chat_ids(llm, tok, messages)
        assert cpp == hf, (tok.convert_ids_to_tokens(cpp), tok.convert_ids_to_tokens(hf))
