"""Real tokenizers and real chat templates: a tiny Qwen2 with Qwen's 151,643-token BPE vocabulary and
Qwen2.5's template (`{%- if tools %}`, no BOS, eos <|im_end|>), next to the sentencepiece Llama.

The whole pipeline must pass on it with chat data, and with alpaca data and no golden file; bad
template/tokenizer/target-GPU input stops at plan time with one message and trains nothing.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.constants import MANIFEST_NAME, STAGES
from loraship.errors import ConfigError, DataError, LorashipError
from loraship.runtime.stage import stage_dir
from tests.conftest import QWEN_STEPS, REPO, SMALL_IMATRIX, demo_config_dict

CHAT = [
    {"role": "user", "content": "What is the capital of Zorvia?"},
    {"role": "assistant", "content": "Answer: Kelmar."},
]


def qwen_config(tiny_qwen: Path, root: Path, **overrides):
    # The Qwen2.5 template adds its default system prompt (about 20 tokens) to every row.
    return parse_config(
        demo_config_dict(tiny_qwen, root, sequence_len=96, **{**QWEN_STEPS, **SMALL_IMATRIX, **overrides})
    )


def run_stages(config, stages=STAGES) -> dict:
    return {stage: importlib.import_module(f"loraship.stages.{stage}").run(config) for stage in stages}


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


# -- rendering with transformers --------------------------------------------------------------
def test_qwen25_template_renders_and_masks_only_the_answer(qwen_tokenizer):
    """Qwen2.5's template (`{%- if tools %}`, default system prompt) renders through transformers;
    the loss mask covers the answer and its <|im_end|> turn end, nothing of the prompt."""
    from loraship.chat import render, tokenize_conversation

    text = render(qwen_tokenizer, CHAT)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    ids, learn = tokenize_conversation(qwen_tokenizer, CHAT)
    learned = qwen_tokenizer.decode([t for t, keep in zip(ids, learn) if keep])
    assert learned.startswith("Answer: Kelmar.<|im_end|>")
    assert "Zorvia" not in learned and "system" not in learned


def test_generation_blocks_use_transformers_assistant_mask(qwen_tokenizer):
    from loraship.chat import tokenize_conversation

    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    qwen_tokenizer = qwen_tokenizer.__class__.from_pretrained(qwen_tokenizer.name_or_path)
    qwen_tokenizer.chat_template = template
    ids, learn = tokenize_conversation(qwen_tokenizer, CHAT)
    assert qwen_tokenizer.decode([t for t, keep in zip(ids, learn) if keep]) == "Answer: Kelmar.<|im_end|>"


@pytest.mark.parametrize(
    "template",
    [
        # loopcontrols, strftime_now and an unescaped tojson: what real templates use and a bare Jinja lacks.
        "{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}",
        "Today is {{ strftime_now('%Y') }}.{% for m in messages %}{{ m.content }}{% endfor %}",
        "{{ messages | tojson }}{% if add_generation_prompt %}>{% endif %}",
    ],
)
def test_real_template_features_render(qwen_tokenizer, template):
    from loraship.chat import render

    assert render(qwen_tokenizer, CHAT, template=template)
    assert "<" not in render(qwen_tokenizer, [{"role": "user", "content": "a<b"}], template=template).replace(
        "a<b", ""
    )


def test_named_and_inline_templates(qwen_tokenizer, tmp_path, tiny_model):
    from loraship.chat import NAMED_TEMPLATES, render, resolve_template

    assert resolve_template("chatml") == NAMED_TEMPLATES["chatml"]
    assert resolve_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    for name in NAMED_TEMPLATES:
        assert render(qwen_tokenizer, CHAT, template=resolve_template(name))
    with pytest.raises(ConfigError, match="'chatmlx' is neither a named template"):
        resolve_template("chatmlx")
    with pytest.raises(ConfigError, match="not a named template"):
        parse_config(demo_config_dict(tiny_model, tmp_path, chat_template="chatmlx"))


# -- golden prompts ---------------------------------------------------------------------------
def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_golden_prompt_keeps_the_system_turn_and_stops_before_the_answer(tiny_model, tmp_path):
    from loraship.data import golden_rows

    system = {"role": "system", "content": "Answer tersely."}
    golden = write_jsonl(tmp_path / "golden.jsonl", [{"messages": [system, *CHAT], "expect_regex": "^Answer"}])
    rows = golden_rows(parse_config(demo_config_dict(tiny_model, tmp_path, golden_prompts=golden)))
    assert rows == [{"messages": [system, CHAT[0]], "expect_regex": "^Answer"}]


def test_alpaca_and_completion_data_give_golden_prompts(tiny_model, tmp_path):
    from loraship.data import golden_rows

    alpaca = write_jsonl(
        tmp_path / "a.jsonl", [{"instruction": f"Capital of X{i}?", "output": "Y."} for i in range(6)]
    )
    text = write_jsonl(
        tmp_path / "c.jsonl", [{"text": f"The capital of X{i} is Y{i} and it is old."} for i in range(6)]
    )
    config = parse_config(
        demo_config_dict(
            tiny_model,
            tmp_path,
            golden_prompts=None,
            eval_datasets=[],
            datasets=[{"path": alpaca, "type": "alpaca"}, {"path": text, "type": "completion"}],
        )
    )
    rows = golden_rows(config)
    assert {"messages": [{"role": "user", "content": "Capital of X0?"}]} in rows
    assert {"text": "The capital of X0 is"} in rows
    assert len(rows) == 12


# -- the whole pipeline on a real vocabulary --------------------------------------------------
@pytest.fixture(scope="module")
def qwen_mixed_run(tiny_qwen, tmp_path_factory):
    """One Qwen run for what two datasets of a user look like: half the demo rows as chat, half as alpaca
    instructions, no golden file (its prompts drawn from the data) and no eval file (a validation split)."""
    root = tmp_path_factory.mktemp("qwen-mixed")
    rows = [json.loads(line) for line in (REPO / "data/demo/train.jsonl").read_text().splitlines()]
    half = len(rows) // 2
    chat = write_jsonl(root / "chat.jsonl", rows[:half])
    alpaca = write_jsonl(
        root / "alpaca.jsonl",
        [{"instruction": r["messages"][0]["content"], "output": r["messages"][1]["content"]} for r in rows[half:]],
    )
    config = qwen_config(
        tiny_qwen,
        root,
        run_name="qwen-mixed",
        golden_prompts=None,
        eval_datasets=[],
        datasets=[{"path": chat, "type": "chat"}, {"path": alpaca, "type": "alpaca"}],
        val_set_size=0.15,
    )
    return config, run_stages(config)


def test_qwen_pipeline_passes_every_gate_with_chat_and_alpaca_data(qwen_mixed_run):
    from loraship.llamacpp.gguf_info import read_gguf

    config, manifests = qwen_mixed_run
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    assert verify["passed"], {k: g for k, g in verify["gates"].items() if not g["passed"]}
    assert verify["gates"]["golden_match"]["evidence"] >= config.min_golden_prompts
    tokens = verify["gates"]["special_tokens"]["value"]
    # Qwen: no BOS from HF, none from llama.cpp, although the converter copies config.json's bos id.
    assert tokens["llama_cpp_adds_bos"] is False and tokens["gguf_bos"] == 151643
    gguf = read_gguf(Path(verify["gguf"]))["fields"]
    assert gguf["tokenizer.ggml.pre"] == "qwen2"
    assert gguf["tokenizer.chat_template"].startswith("{%- if tools %}")
    assert verify["tokenizer_parity"]["equal"] == verify["tokenizer_parity"]["checked"] > 0
    assert manifests["publish"]["metrics"]


# -- gates need evidence ----------------------------------------------------------------------
def test_a_gate_with_too_little_evidence_fails(pipeline_run):
    config, _ = pipeline_run
    strict = config.model_copy(update={"min_golden_prompts": 1000})
    with pytest.raises(LorashipError, match=r"golden_match .*not enough evidence: 12 < 1000 \(min_golden_prompts\)"):
        importlib.import_module("loraship.stages.verify").run(strict)
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    assert not verify["gates"]["golden_match"]["passed"] and verify["gates"]["golden_match"]["evidence"] == 12
    # Back to the fixture's state: verify's verdict, and publish after it (it consumed the verify.json this test
    # rewrote), so tests that expect every stage of the shared run up to date still find it so.
    for stage in ("verify", "publish"):
        importlib.import_module(f"loraship.stages.{stage}").run(config)


# -- bad input stops at plan time -------------------------------------------------------------
def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _no_template(model: Path, root: Path, cfg: dict) -> None:
    folder = _copy_model(model, root / "no-template")
    for name in ("chat_template.jinja",):
        (folder / name).unlink(missing_ok=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    cfg["base_model"] = str(folder)


def _broken_template(model: Path, root: Path, cfg: dict) -> None:
    cfg["chat_template"] = "{{ raise_exception('this template needs tools') }}"


def _unrecognised_pretokenizer(model: Path, root: Path, cfg: dict) -> None:
    """An edited vocabulary (two digit ids swapped, as a careless vocabulary extension might do): the
    converter's check text then tokenizes to ids whose hash it has no entry for."""
    folder = _copy_model(model, root / "odd-tokenizer")
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab_json = json.loads((folder / "vocab.json").read_text())
    for vocab in (tok["model"]["vocab"], vocab_json):
        vocab["3"], vocab["4"] = vocab["4"], vocab["3"]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "vocab.json").write_text(json.dumps(vocab_json))
    cfg["base_model"] = str(folder)


def _target_gpu_too_small(model: Path, root: Path, cfg: dict) -> None:
    cfg["target_gpu_memory_gib"] = 0.001


@pytest.mark.parametrize(
    "breaker, expected",
    [
        (_no_template, "need a chat template, but the base model's tokenizer has none; set `chat_template:`"),
        (_broken_template, "chat template failed to render"),
        (_unrecognised_pretokenizer, "is not one this converter knows"),
        (_target_gpu_too_small, "target_gpu_memory_gib 0.001: the Q4_K_M GGUF's weights alone take about"),
    ],
    ids=["no-template", "template-fails", "unrecognised-tokenizer", "target-gpu-too-small"],
)
def test_bad_model_input_stops_at_plan_time(tiny_qwen, tmp_path, breaker, expected):
    cfg = demo_config_dict(tiny_qwen, tmp_path, sequence_len=96)
    breaker(tiny_qwen, tmp_path, cfg)
    config = parse_config(cfg)
    with pytest.raises((ConfigError, DataError)) as caught:
        importlib.import_module("loraship.stages.plan").run(config)
    assert expected in str(caught.value)
    assert str(caught.value).count("\n") <= 1, str(caught.value)  # one problem, one message
    assert not (stage_dir(config, "train") / MANIFEST_NAME).exists()
    assert not stage_dir(config, "train").exists()


def test_unknown_template_name_is_refused_by_the_cli(tiny_qwen, tmp_path):
    import subprocess
    import sys

    import yaml

    cfg = demo_config_dict(tiny_qwen, tmp_path, chat_template="qwen25")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run(
        [sys.executable, "-m", "loraship.cli", "plan", str(path)], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 2, result.stderr
    assert "chat_template: not a named template" in result.stderr and "Traceback" not in result.stderr


# -- Gemma 3: the real 270M's vocabulary and GGUF -----------------------------------------------------
GEMMA3_SAMPLES = [
    "What is the capital of Zorvia?",
    "  two  spaces\tand a tab\n\nnewlines",
    "ünïcödé 日本語 🙂 123456789",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x ** 2",
]


@pytest.fixture(scope="module")
def gemma3_folder(tmp_path_factory):
    from loraship.fixtures.families import write_folder_without_weights

    folder = tmp_path_factory.mktemp("gemma3")
    write_folder_without_weights("gemma3", folder)
    return folder


def test_gemma3_tokenizer_matches_the_real_gguf(gemma3_folder):
    """The HF tokenizer built for Gemma 3 (npm tokenizer.json, tokenizer.model from the real GGUF's pieces) and
    llama.cpp reading the real google/gemma-3-270m GGUF tokenize alike, and <end_of_turn> (the template's turn end)
    ends generation there. The whole pipeline on the real weights: test_real_gemma3_passes_every_gate (slow)."""
    import llama_cpp
    from transformers import AutoTokenizer

    from loraship.chat import turn_end
    from loraship.fixtures.families import gemma3_gguf

    tok = AutoTokenizer.from_pretrained(gemma3_folder)
    end = turn_end(tok)
    assert end == {"id": 106, "text": "<end_of_turn>"}
    llm = llama_cpp.Llama(model_path=str(gemma3_gguf()), vocab_only=True, verbose=False)
    try:
        for text in GEMMA3_SAMPLES:
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == tok(text)["input_ids"], text
        assert llama_cpp.llama_vocab_is_eog(llm._model.vocab, end["id"])
    finally:
        llm.close()


@pytest.mark.slow
def test_real_gemma3_passes_every_gate(tmp_path):
    """google/gemma-3-270m with its real weights (dequantized from the packaged Q4_K_M GGUF) plan -> publish, shipped
    as Q8_0. Its Q4_K_M failed verify here, rightly: KL 0.305 (gate 0.1), same top token 81.7% (gate 85%),
    perplexity ratio 1.126 (gate 1.1) over 82 positions; at 270M the 4-bit file would save about 100 MB. After 4
    steps of 4 rows neither HF nor llama.cpp ended an answer with <end_of_turn>, so it trains 16."""
    from loraship.fixtures.families import FAMILIES, real_gemma3
    from tests.test_families import run_family

    model = real_gemma3(REPO / ".loraship" / "models" / "real-gemma-3-270m")
    golden = tmp_path / "golden.jsonl"
    rows = [json.loads(line) for line in (REPO / "data/demo/golden.jsonl").read_text().splitlines()]
    golden.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    config, manifests, verify = run_family(
        model,
        FAMILIES["gemma3"],
        tmp_path,
        "real-gemma3",
        golden_prompts=str(golden),
        quantization="Q8_0",
        max_steps=16,
        save_steps=16,
        warmup_steps=1,
        micro_batch_size=4,
    )
    assert verify["passed"], {k: g for k, g in verify["gates"].items() if not g["passed"]}
    assert "publish" in manifests


@pytest.mark.slow
def test_real_gemma3_q4_k_m_failure_names_its_way_out(tmp_path):
    """The failure of a real run whose K-quant rows fall back: google/gemma-3-270m's real weights (rows of 640),
    dequantized from llama.cpp's Q4_K_M, fine-tuned 6 steps and quantized to Q4_K_M (the default) with no importance
    matrix. Most of its tensors go back on the base's Q5_0 grid, which takes a small fine-tune back: measured, it
    failed perplexity ratio and same top token after 6 steps (bench/results/quant_ladder_gemma3.json) and passed every
    gate after 16. verify's error names the way out: quantization: auto, or a larger rung with its size estimated from
    the run's GGUF (Q8_0's matches the 291,545,760-byte file of bench/results/quant_ladder_gemma3_imatrix.json to the
    MB); and the fallback. The message's code on a real default-suite run: test_families.py
    test_a_failed_quantization_names_its_way_out."""
    from loraship.errors import StageFailed
    from loraship.fixtures.families import FAMILIES, real_gemma3
    from tests.conftest import demo_config_dict
    from tests.test_families import FAMILY_OVERRIDES

    model = real_gemma3(REPO / ".loraship" / "models" / "real-gemma-3-270m")
    golden = tmp_path / "golden.jsonl"
    rows = [json.loads(line) for line in (REPO / "data/demo/golden.jsonl").read_text().splitlines()]
    golden.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    overrides = dict(
        FAMILY_OVERRIDES,
        run_name="real-gemma3-q4",
        sequence_len=64,
        golden_prompts=str(golden),
        quantization="Q4_K_M",
        imatrix=False,
        max_steps=6,
        save_steps=6,
        warmup_steps=1,
        micro_batch_size=4,
        chat_template=FAMILIES["gemma3"].chat_template,
    )
    config = parse_config(demo_config_dict(model, tmp_path, **overrides))
    run_stages(config, STAGES[: STAGES.index("verify")])
    with pytest.raises(StageFailed) as failed:
        run_stages(config, ("verify",))
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    assert not verify["passed"]
    text = str(failed.value)
    for part in (
        "verify failed for Q4_K_M: ",
        "\nWay out: set quantization: auto (verify tries IQ3_M, Q3_K_M, IQ4_XS, Q4_K_M, Q5_K_M, Q6_K, Q8_0",
        "or name a larger rung: Q5_K_M (about 260 MB), Q6_K (about 283 MB), Q8_0 (about 292 MB)",
        "Q4_K_M: 90 of 127 quantized tensors fall back to Q5_0/Q8_0 (rows of 640 are not a multiple of 256)",
    ):
        assert part in text, (part, text)
