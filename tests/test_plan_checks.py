"""Issue 34's plan-time checks, function by function: each fault named with its file, value and fix, and the
inputs next to it that must pass (tests/test_bad_inputs.py runs each through `loraship run` and `loraship plan`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loraship.config import parse_config
from tests.conftest import REPO, demo_config_dict
from tests.test_bad_inputs import fake_model, sentencepiece_model, write


def _shards(folder: Path, names: dict[str, str]) -> None:
    index = {"metadata": {"total_size": 32}, "weight_map": names}
    write(folder / "model.safetensors.index.json", json.dumps(index))


def test_a_shard_index_names_every_missing_shard_and_passes_a_complete_one(tmp_path):
    from loraship.models import shard_index_problems

    folder = fake_model(tmp_path)
    names = {f"t{i}": f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)}
    _shards(folder, names)
    [problem] = shard_index_problems(folder)
    assert problem == (
        f"model.safetensors.index.json names model-00001-of-00004.safetensors, "
        f"model-00002-of-00004.safetensors, model-00003-of-00004.safetensors and 1 more, which are not "
        f"in {folder} (0 of the 4 shards it names are there); fix: download the missing shard or the "
        "whole checkpoint again"
    )
    for name in list(names.values())[:3]:
        shutil.copy(folder / "model.safetensors", folder / name)
    [problem] = shard_index_problems(folder)
    assert "names model-00004-of-00004.safetensors, which is not in" in problem and "(3 of the 4" in problem
    shutil.copy(folder / "model.safetensors", folder / names["t4"])
    assert shard_index_problems(folder) == []


@pytest.mark.parametrize(
    "index,expected",
    [
        ('{"weight_map": {"w": "model-000', "model.safetensors.index.json is not valid JSON (Unterminated string"),
        ('{"weight_map": {}}', "'weight_map' is {}, not an object mapping tensor names to shard files"),
        ('{"metadata": {}}', "'weight_map' is null, not an object mapping tensor names to shard files"),
        ('{"weight_map": {"w": "../../secrets.safetensors"}}', "names '../../secrets.safetensors', outside"),
    ],
    ids=["cut short", "empty", "no weight_map", "a shard outside the folder"],
)
def test_a_shard_index_that_cannot_be_followed_is_named(tmp_path, index, expected):
    from loraship.models import shard_index_problems

    folder = fake_model(tmp_path)
    write(folder / "model.safetensors.index.json", index)
    [problem] = shard_index_problems(folder)
    assert expected in problem and "fix: download the index again" in problem


def test_a_sentencepiece_model_cut_anywhere_is_named(tmp_path):
    from loraship.models import sentencepiece_problems

    folder = fake_model(tmp_path)
    assert sentencepiece_problems(folder) == []  # no tokenizer.model: nothing to read
    data = sentencepiece_model()
    write(folder / "tokenizer.model", data)
    assert sentencepiece_problems(folder) == []
    for cut in (1, 17, len(data) // 3, len(data) // 2, len(data) - 1):
        write(folder / "tokenizer.model", data[:cut])
        [problem] = sentencepiece_problems(folder)
        assert problem.startswith(f"tokenizer.model ({cut} bytes) does not load in sentencepiece (")
        assert "it is truncated or not a sentencepiece model; fix: replace it with the file" in problem


@pytest.fixture
def tiny_copy(tiny_model, tmp_path) -> Path:
    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model, folder)
    return folder


def _set(folder: Path, **changes) -> None:
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **changes}))


def test_a_tokenizer_larger_than_vocab_size_is_named_a_smaller_one_passes(tiny_copy):
    from transformers import AutoTokenizer

    from loraship.planning.preflight import vocabulary_problems

    tokenizer = AutoTokenizer.from_pretrained(tiny_copy)
    size = len(tokenizer)
    assert vocabulary_problems(tiny_copy, tokenizer) == []
    _set(tiny_copy, vocab_size=size + 64)  # an embedding padded past the tokenizer: normal
    assert vocabulary_problems(tiny_copy, tokenizer) == []
    _set(tiny_copy, vocab_size=size - 12)
    [problem] = vocabulary_problems(tiny_copy, tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(size - 12, size - 9)))
    shown = ", ".join(f"{t!r} ({i})" for i, t in zip(range(size - 12, size - 9), pieces))
    assert problem == (
        f"tokenizer: {tiny_copy} has a tokenizer of {size} tokens (added tokens included), more than "
        f"config.json's vocab_size {size - 12}; text or the chat template can produce {shown} and 9 "
        "more, ids with no row in the embedding, and training would fail on the first of them; fix: "
        "use the tokenizer files that came with this checkpoint, or resize the embedding to the "
        "tokenizer (model.resize_token_embeddings(len(tokenizer)), then save_pretrained) and point "
        "base_model at that folder"
    )


def test_a_special_token_past_vocab_size_that_nothing_emits_passes(tiny_copy):
    """As Gemma 3 270M/1B ship: 262,144 embedding rows, 262,145 tokens, the last <image_soft_token>."""
    from transformers import AutoTokenizer

    from loraship.planning.preflight import vocabulary_problems

    tokenizer = AutoTokenizer.from_pretrained(tiny_copy)
    size = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    _set(tiny_copy, vocab_size=size)
    assert vocabulary_problems(tiny_copy, tokenizer) == []
    tokenizer.chat_template = "{% for m in messages %}<image_soft_token>{{ m['content'] }}{% endfor %}"
    [problem] = vocabulary_problems(tiny_copy, tokenizer)  # a template that writes it
    assert f"can produce '<image_soft_token>' ({size})," in problem


def test_sequence_len_past_the_models_positions_is_named(tiny_copy, tmp_path):
    from loraship.planning.preflight import context_problems

    config = parse_config(demo_config_dict(tiny_copy, tmp_path, sequence_len=512))
    assert context_problems(config, tiny_copy) == []  # the tiny model's max_position_embeddings is 512
    longer = config.model_copy(update={"sequence_len": 1024})
    [problem] = context_problems(longer, tiny_copy)
    assert problem == (
        f"sequence_len 1024: beyond the base model's context, max_position_embeddings 512 in "
        f"{tiny_copy / 'config.json'}; fix: lower sequence_len to at most 512, or choose a base model "
        "with a longer context"
    )
    _set(tiny_copy, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    assert context_problems(longer, tiny_copy) == []  # YaRN stretches 512 positions to 2048
    _set(tiny_copy, rope_scaling=None, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    assert context_problems(longer, tiny_copy) == []  # as transformers 5 saves it


def test_golden_prompts_longer_than_target_context_are_named(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from loraship.chat import render
    from loraship.planning.preflight import golden_context_problems

    rows = [
        {"prompt": "hello"},
        {"messages": [{"role": "user", "content": "zorvia " * 150}]},
        {"prompt": "kelmar " * 300},
    ]
    golden = write(tmp_path / "golden.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config(
        demo_config_dict(tiny_model, tmp_path, golden_prompts=str(golden), target_context=256, max_new_tokens=24)
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    lengths = [
        len(
            tokenizer(
                render(
                    tokenizer,
                    [{"role": "user", "content": r.get("prompt") or r["messages"][0]["content"]}],
                    add_generation_prompt=True,
                ),
                add_special_tokens=False,
            )["input_ids"]
        )
        for r in rows
    ]
    assert lengths[0] + 25 <= 256 < lengths[1] + 25  # the first fits, the others do not
    [problem] = golden_context_problems(config, tokenizer)
    assert problem == (
        f"golden prompts: in golden_prompts {golden}, prompt 2 ({lengths[1]} tokens), prompt 3 "
        f"({lengths[2]} tokens) rendered with the chat template, plus max_new_tokens 24 and one, exceed "
        "target_context 256, the context verify serves the model with; fix: shorten those prompts, or "
        f"raise target_context to at least {max(lengths) + 25}"
    )
    roomy = config.model_copy(update={"target_context": max(lengths) + 25})
    assert golden_context_problems(roomy, tokenizer) == []
    # No golden_prompts file: the prompts verify takes from the data are counted too.
    from_data = config.model_copy(update={"golden_prompts": None, "target_context": 128})
    assert golden_context_problems(from_data, tokenizer) == []  # the demo's prompts are short


def test_auto_where_no_rung_fits_names_the_smallest_rungs_need_and_what_fits(tmp_path):
    from loraship.planning.shape import shape_from_config
    from loraship.planning.shipping import plan_disk_and_inference
    from loraship.planning.preflight import target_gpu_problems

    model = tmp_path / "qwen2-7b"
    model.mkdir()
    shutil.copy(REPO / "examples/models/qwen2-7b/config.json", model / "config.json")
    model_config = json.loads((model / "config.json").read_text())
    cfg = demo_config_dict(model, tmp_path, quantization="auto", target_gpu_memory_gib=4.5, target_context=32768)
    config = parse_config(cfg)
    each = plan_disk_and_inference(shape_from_config(model_config), config)["inference"]["by_quantization"]
    assert not any(f["fits_target"] for f in each.values())  # what plan.json recorded in the run
    [problem] = target_gpu_problems(config, model)
    need = each["IQ3_M"]["total_gib"]
    assert problem.startswith(
        f"target_gpu_memory_gib 4.5: quantization auto fits no rung of its ladder (IQ3_M, "
        f"Q3_K_M, IQ4_XS, Q4_K_M, Q5_K_M, Q6_K, Q8_0) at target_context 32768; the smallest, "
        f"IQ3_M, needs about {need:.2f} GiB"
    )
    assert "fix: raise target_gpu_memory_gib to " in problem and "lower target_context to at most " in problem
    raise_to = float(problem.split("raise target_gpu_memory_gib to ")[1].split(",")[0])
    context = int(problem.split("lower target_context to at most ")[1].split(" ")[0])
    # Each fix, applied alone, fits the smallest rung; a context one step longer does not.
    assert not target_gpu_problems(parse_config({**cfg, "target_gpu_memory_gib": raise_to}), model)
    assert not target_gpu_problems(parse_config({**cfg, "target_context": context}), model)
    assert target_gpu_problems(parse_config({**cfg, "target_context": context + 256}), model)
    # Weights alone past the target: no context helps, and the message says so.
    [weights] = target_gpu_problems(parse_config({**cfg, "target_gpu_memory_gib": 2}), model)
    assert "(no shorter target_context helps: at 128 it still needs " in weights
