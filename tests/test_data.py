"""Data formats: ShareGPT, OpenAI messages, parquet/CSV through `datasets`, field mapping,
train_on_inputs, the tokenized cache and the one-line errors for bad input (raised at plan time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraship import data
from loraship.config import parse_config
from loraship.data import IGNORE_INDEX

CHAT = [{"role": "user", "content": "Capital of Zorvia?"}, {"role": "assistant", "content": "Kelmar."}]
SHAREGPT = {
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Capital of Zorvia?"},
        {"from": "gpt", "value": "Kelmar."},
    ]
}


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASHIP_CACHE", str(tmp_path / "cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def spec(path, kind, **extra):
    from loraship.config import DatasetSpec

    return DatasetSpec(path=str(path), type=kind, **extra)


def config_for(tmp_path, base, datasets, **extra):
    return parse_config(
        {
            "base_model": str(base),
            "datasets": datasets,
            "val_set_size": 0.0,
            "workdir": str(tmp_path / "work"),
            "output": str(tmp_path / "out"),
            **extra,
        }
    )


# -- formats ---------------------------------------------------------------------------------------
def test_sharegpt_rows_map_onto_chat_roles_and_tokenize_like_chat(tmp_path, qwen_tokenizer):
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT] * 2)
    rows = data.read_dataset(spec(path, "sharegpt"))
    messages = data.as_messages(rows[0], "sharegpt")
    assert messages == [{"role": "system", "content": "Be brief."}, *CHAT]
    as_sharegpt = data.encode_row(rows[0], "sharegpt", qwen_tokenizer)
    as_chat = data.encode_row({"messages": messages}, "chat", qwen_tokenizer)
    assert as_sharegpt == as_chat and as_chat["text"].startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_openai_messages_with_a_field_mapping(tmp_path):
    row = {"convo": [{"speaker": "user", "text": "Hi"}, {"speaker": "assistant", "text": "Hello"}], "id": 7}
    path = write_jsonl(tmp_path / "m.jsonl", [row])
    rows = data.read_dataset(spec(path, "chat", fields={"messages": "convo", "role": "speaker", "content": "text"}))
    assert rows[0]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_parquet_alpaca_with_mapped_columns(tmp_path):
    import pandas as pd

    path = tmp_path / "a.parquet"
    pd.DataFrame({"prompt": ["Name the capital.", "Spell it."], "answer": ["Kelmar.", "K-e-l"]}).to_parquet(path)
    rows = data.read_dataset(spec(path, "alpaca", fields={"instruction": "prompt", "output": "answer"}))
    assert [(r["instruction"], r["output"]) for r in rows] == [
        ("Name the capital.", "Kelmar."),
        ("Spell it.", "K-e-l"),
    ]
    assert data.dataset_identity(spec(path, "alpaca")) == data.dataset_identity(spec(path, "alpaca"))


def test_csv_completion_and_chat_with_json_cells(tmp_path):
    import pandas as pd

    text_csv = tmp_path / "t.csv"
    pd.DataFrame({"body": ["The capital of Zorvia is Kelmar.", "Kelmar lies on a river."]}).to_csv(
        text_csv, index=False
    )
    assert [r["text"] for r in data.read_dataset(spec(text_csv, "completion", fields={"text": "body"}))][
        1
    ] == "Kelmar lies on a river."
    chat_csv = tmp_path / "c.csv"
    pd.DataFrame({"messages": [json.dumps(CHAT)]}).to_csv(chat_csv, index=False)
    assert data.read_dataset(spec(chat_csv, "chat"))[0]["messages"] == CHAT


def test_hub_ids_and_local_paths_are_told_apart():
    assert data.hub_dataset_id("hf://datasets/org/name") == "org/name"
    assert data.hub_dataset_id("org/name") == "org/name"
    assert data.hub_dataset_id("data/train.jsonl") is None and data.hub_dataset_id("./org/name") is None


# -- train_on_inputs --------------------------------------------------------------------------------
def test_train_on_inputs_changes_exactly_the_prompt_labels(tmp_path, qwen_tokenizer, tiny_qwen):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}])
    prompt = qwen_tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=False)
    n_prompt = len(qwen_tokenizer(prompt, add_special_tokens=False)["input_ids"])
    for on in (False, True):
        config = config_for(tmp_path, tiny_qwen, [{"path": str(path), "type": "chat"}], train_on_inputs=on)
        train, _eval = data.load_splits(config, qwen_tokenizer)
        (example,) = train.examples
        ids, labels = example["input_ids"], example["labels"]
        if on:
            assert labels == ids
        else:
            assert labels == [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
            assert qwen_tokenizer.decode(ids[n_prompt:]) == "Kelmar.<|im_end|>\n"
    # reference scores the same positions training learns
    records = data.eval_records(
        config_for(
            tmp_path,
            tiny_qwen,
            [{"path": str(path), "type": "chat"}],
            eval_datasets=[{"path": str(path), "type": "chat"}],
        ),
        qwen_tokenizer,
    )
    assert records[0]["positions"] == list(range(n_prompt - 1, len(records[0]["input_ids"]) - 1))


def test_train_on_inputs_keys_the_stages_that_use_it():
    from loraship.stages import plan, reference, train

    assert all("train_on_inputs" in m.FIELDS for m in (plan, train, reference))


# -- cache ------------------------------------------------------------------------------------------
def test_tokenized_once_then_read_from_the_cache(tmp_path, qwen_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT] * 3)
    calls = []
    real = data.encode_row
    monkeypatch.setattr(data, "encode_row", lambda *a: calls.append(1) or real(*a))
    first = data.encoded_dataset(spec(path, "sharegpt"), qwen_tokenizer)
    assert len(calls) == 3 and len(list((tmp_path / "cache" / "tokenized").iterdir())) == 1
    second = data.encoded_dataset(spec(path, "sharegpt"), qwen_tokenizer)
    assert second == first and len(calls) == 3  # no re-tokenization
    template = qwen_tokenizer.chat_template
    qwen_tokenizer.chat_template = "{# another template #}" + template  # renders alike, but is another entry
    try:
        data.encoded_dataset(spec(path, "sharegpt"), qwen_tokenizer)
    finally:
        qwen_tokenizer.chat_template = template
    write_jsonl(path, [SHAREGPT] * 4)  # changed content: tokenized again
    data.encoded_dataset(spec(path, "sharegpt"), qwen_tokenizer)
    assert len(calls) == 3 + 3 + 4


# -- bad input: one line naming the problem and the fix ----------------------------------------------
def test_unknown_sharegpt_role(tmp_path):
    bad = {"conversations": [{"from": "narrator", "value": "Once"}, {"from": "gpt", "value": "upon"}]}
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT, bad])
    with pytest.raises(
        data.DataError,
        match=r"line 2: conversations\[0\]: unknown role from='narrator'; use one of "
        r"system, human, user, gpt",
    ):
        data.read_dataset(spec(path, "sharegpt"))


def test_field_mapping_to_a_missing_column_lists_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(data.DataError) as e:
        data.read_dataset(spec(path, "alpaca", fields={"instruction": "prompt", "output": "answer"}))
    assert "fields maps instruction to column 'prompt', which it does not have (columns: answer, question)" in str(
        e.value
    )
    assert "\n" not in str(e.value)


def test_parquet_and_csv_without_the_columns(tmp_path):
    import pandas as pd

    parquet = tmp_path / "x.parquet"
    pd.DataFrame({"q": ["a"], "a": ["b"]}).to_parquet(parquet)
    with pytest.raises(
        data.DataError,
        match=r"fields maps output to column 'answer', which it does not have "
        r"\(columns: q, a\); fix datasets\[\]\.fields",
    ):
        data.read_dataset(spec(parquet, "alpaca", fields={"instruction": "q", "output": "answer"}))
    csv = tmp_path / "x.csv"
    pd.DataFrame({"body": ["t"]}).to_csv(csv, index=False)
    with pytest.raises(
        data.DataError,
        match=r"\(completion\): no column 'text' \(columns: body\); rename the column or "
        r"map it with fields: \{text: <column>\}",
    ):
        data.read_dataset(spec(csv, "completion"))


def test_hub_dataset_missing_offline_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(data.DataError) as e:
        data.read_dataset(spec("loraship-tests/no-such-dataset", "chat"))
    text = str(e.value)
    assert (
        "not in the local Hugging Face cache and HF_HUB_OFFLINE=1" in text and "load_dataset('loraship-tests" in text
    )


def test_unknown_field_name_is_a_config_error():
    from loraship.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"fields: \['prompt'\] are not alpaca field names; map alpaca's instruction, "
        r"input, output onto your columns",
    ):
        parse_config(
            {"base_model": "m", "datasets": [{"path": "x.jsonl", "type": "alpaca", "fields": {"prompt": "q"}}]}
        )


def test_bad_data_is_refused_at_plan_time(tmp_path, tiny_model):
    import pandas as pd

    from loraship.planning.preflight import dataset_problems

    parquet = tmp_path / "x.parquet"
    pd.DataFrame({"q": ["a"]}).to_parquet(parquet)
    config = config_for(tmp_path, tiny_model, [{"path": str(parquet), "type": "chat"}])
    (problem,) = dataset_problems(config)
    assert problem.startswith("datasets[0]: dataset ") and "no column 'messages' (columns: q)" in problem


# -- init --from-axolotl -----------------------------------------------------------------------------
def test_axolotl_sharegpt_fields_and_train_on_inputs(tmp_path, tiny_model):
    import yaml

    from loraship.starter import import_axolotl

    write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT])
    write_jsonl(tmp_path / "qa.jsonl", [{"q": "Capital?", "a": "Kelmar."}])
    source = tmp_path / "axolotl.yml"
    source.write_text(
        yaml.safe_dump(
            {
                "base_model": str(tiny_model),
                "train_on_inputs": True,
                "datasets": [
                    {"path": "sg.jsonl", "type": "sharegpt"},
                    {"path": "qa.jsonl", "type": "alpaca", "field_instruction": "q", "field_output": "a"},
                ],
            }
        )
    )
    keys, _notes, ignored = import_axolotl(source, tmp_path / "out" / "c.yaml", force=False)
    assert keys["train_on_inputs"] is True and not ignored
    assert [d["type"] for d in keys["datasets"]] == ["sharegpt", "alpaca"]
    assert keys["datasets"][1]["fields"] == {"instruction": "q", "output": "a"}


# -- template variables (Qwen3's enable_thinking) -----------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    from loraship.fixtures.families import write_folder_without_weights

    folder = tmp_path_factory.mktemp("qwen3")
    write_folder_without_weights("qwen3", folder)
    return folder


@pytest.mark.parametrize("thinking", [False, True])
def test_thinking_switch_reaches_every_rendering(qwen3_folder, thinking):
    """config `thinking` becomes Qwen3's enable_thinking wherever the template renders: the training text keeps the
    template's empty <think> block in both forms; the loss covers it only when thinking (then the model writes it),
    and the generation prompt carries it only when not; the tokenized cache tells the two apart."""
    from transformers import AutoTokenizer

    from loraship.chat import render, set_template_kwargs, template_kwargs, template_of

    tok = AutoTokenizer.from_pretrained(qwen3_folder)
    kwargs = template_kwargs(template_of(tok), thinking)
    assert kwargs == {"enable_thinking": thinking}
    plain = data.tokenizer_fingerprint(tok)
    set_template_kwargs(tok, kwargs)
    assert data.tokenizer_fingerprint(tok) != plain
    record = data.encode_row({"messages": CHAT}, "chat", tok)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nKelmar.<|im_end|>" in record["text"]
    learned = tok.decode([t for t, k in zip(record["input_ids"], record["learn"]) if k])
    assert learned.rstrip("\n") == ("<think>\n\n</think>\n\nKelmar.<|im_end|>" if thinking else "Kelmar.<|im_end|>")
    prompt = render(tok, CHAT[:1], add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n" if thinking else "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_templates_without_the_switch_get_no_variables():
    from loraship.chat import NAMED_TEMPLATES, template_kwargs

    assert all(template_kwargs(t, True) == {} for t in NAMED_TEMPLATES.values())
    assert template_kwargs(None, False) == {}
