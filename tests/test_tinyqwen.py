"""The tiny Qwen2 model carries Qwen's real vocabulary, and llama.cpp converts and tokenizes it like HF."""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path

import pytest

from loraship.fixtures.tinyqwen import (
    ADDED_TOKENS,
    IM_END_ID,
    QWEN25_CHAT_TEMPLATE,
    QWEN_BPE_SIZE,
    VOCAB_SIZE,
    reference_encoder,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it; it's HE'S and WE'LL, isn't it?",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "日本語のテキストと한국어 텍스트, и немного русского текста.",
    "def square(x: int) -> int:\n    return x ** 2  # power\n\n\nclass A:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { sum += a[i]; }  // C\n{"key": [1, 2.5, null, true]}',
    "1234567890 3.14159 -42 1e-6 0x1F 2024-06-01 12:30:45 $1,000,000.00",
    "😀🚀 emoji 👍🏽 family 👨‍👩‍👧‍👦 flags 🇨🇳🇺🇸",
    "   leading spaces\t\ttabs    inner   runs   \n\n\n  \r\n trailing   ",
    "naïve café résumé Ünïcödé ÅÄÖ straße ﬁ",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|><tool_call>x</tool_call><|fim_prefix|>",
    "",
    " ",
]


@pytest.fixture(scope="module")
def hf_tok(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


def _chat_prompts(tok) -> list[str]:
    msgs = [{"role": "user", "content": "What is the capital of Zorvia? 用中文回答。"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Kelmar?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Kelmar"}}}],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "21 °C."},
    ]
    return [
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True),
        tok.apply_chat_template(conversation, tools=tools, tokenize=False),
    ]


def test_folder_mimics_qwen25_instruct(tiny_qwen, hf_tok):
    config = json.loads((tiny_qwen / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (VOCAB_SIZE, 151643, IM_END_ID)
    assert config["tie_word_embeddings"] is True and config["use_sliding_window"] is False
    assert config["hidden_size"] % 256 == 0 and config["intermediate_size"] % 256 == 0
    gen = json.loads((tiny_qwen / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["bos_token_id"], gen["pad_token_id"]) == ([151645, 151643], 151643, 151643)
    tok_config = json.loads((tiny_qwen / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == QWEN25_CHAT_TEMPLATE and hf_tok.chat_template == QWEN25_CHAT_TEMPLATE
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    assert len(hf_tok) == QWEN_BPE_SIZE + len(ADDED_TOKENS) == 151665
    for i, (content, special) in enumerate(ADDED_TOKENS):
        assert hf_tok.convert_tokens_to_ids(content) == QWEN_BPE_SIZE + i
        assert hf_tok.added_tokens_decoder[QWEN_BPE_SIZE + i].special is special
    backend = json.loads((tiny_qwen / "tokenizer.json").read_text())
    assert backend["normalizer"] == {"type": "NFC"}
    assert [p["type"] for p in backend["pre_tokenizer"]["pretokenizers"]] == ["Split", "ByteLevel"]
    assert backend["model"]["type"] == "BPE" and len(backend["model"]["vocab"]) == QWEN_BPE_SIZE
    # No BOS, and the chat template renders with and without tools.
    assert hf_tok.encode("hi") == hf_tok.encode("hi", add_special_tokens=False)
    plain, with_tools, conversation = _chat_prompts(hf_tok)
    assert plain.startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    assert plain.endswith("<|im_start|>assistant\n")
    assert "# Tools" in with_tools and '"name": "get_weather"' in with_tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kelmar"}}\n</tool_call>' in conversation
    assert "<|im_start|>user\n<tool_response>\n" in conversation


def test_hf_tokenizes_like_qwens_tiktoken(hf_tok):
    ref = reference_encoder()
    texts = TEXTS + _chat_prompts(hf_tok)
    for text in texts:
        ids = hf_tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        assert hf_tok.decode(ids) == text
    assert max(hf_tok.encode("".join(TEXTS), add_special_tokens=False)) > 100_000  # deep in the real vocab


def test_llama_cpp_converter_recognises_the_pre_tokenizer(tiny_qwen, hf_tok):
    from loraship.llamacpp.llamacpp import check_convertible, pre_tokenizer_table

    assert check_convertible(tiny_qwen) == []
    chktxt, table = pre_tokenizer_table()
    assert table[sha256(str(hf_tok.encode(chktxt)).encode()).hexdigest()] == "qwen2"


def test_gguf_keeps_vocab_template_and_tokenizes_like_hf(tiny_qwen, hf_tok, tmp_path):
    from llama_cpp import Llama

    from loraship.llamacpp.gguf_info import read_gguf
    from loraship.stages.convert import convert

    gguf = tmp_path / "tiny-qwen2-f16.gguf"
    convert(tiny_qwen, gguf, "f16")
    fields = read_gguf(gguf)["fields"]
    assert fields["general.architecture"] == "qwen2"
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "qwen2"
    assert fields["tokenizer.chat_template"] == hf_tok.chat_template == QWEN25_CHAT_TEMPLATE
    assert fields["tokenizer.ggml.eos_token_id"] == IM_END_ID
    assert fields["tokenizer.ggml.padding_token_id"] == 151643
    # What the converter writes: config.json's bos_token_id, but no BOS added (add_bos_token false).
    assert fields["tokenizer.ggml.bos_token_id"] == 151643
    assert fields["tokenizer.ggml.add_bos_token"] is False
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB_SIZE and tokens[IM_END_ID] == "<|im_end|>" and tokens[-1] == f"[PAD{VOCAB_SIZE - 1}]"

    llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        for text in TEXTS + _chat_prompts(hf_tok):
            assert llm.tokenize(text.encode(), add_bos=False, special=True) == hf_tok.encode(
                text, add_special_tokens=False
            ), text
        assert llm.token_eos() == IM_END_ID
    finally:
        llm.close()
    _read_gguf_matches_gguf_reader(gguf)


def _read_gguf_matches_gguf_reader(gguf: Path) -> None:
    """read_gguf's faster array parsing (loraship/llamacpp/gguf_info.py) gives every field as gguf's own
    GGUFReader does, on a real 151k vocabulary (token strings, merges, token types); cut inside the token
    strings, the file is refused with its name."""
    from gguf import GGUFReader

    from loraship.errors import IntegrityError
    from loraship.llamacpp.gguf_info import read_gguf

    reader = GGUFReader(str(gguf))
    expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    info = read_gguf(gguf)
    assert info["fields"] == expected and info["tensor_count"] == len(reader.tensors)
    assert len(info["fields"]["tokenizer.ggml.merges"]) > 100_000
    cut = gguf.with_name("cut.gguf")
    tokens_at = reader.fields["tokenizer.ggml.tokens"].offset
    cut.write_bytes(gguf.read_bytes()[: tokens_at + 500_000])
    with pytest.raises(IntegrityError, match="cut.gguf"):
        read_gguf(cut)


def test_pretrained_not_noise(tiny_qwen):
    log = json.loads((Path(tiny_qwen) / "pretrain_log.json").read_text())
    assert log["full_vocab_loss"] < 2.0 < log["first_loss"]
