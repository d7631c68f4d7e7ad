"""The one record of the decoding an artifact is verified and shipped with (loraship/sampling.py), in each
runtime's own words: the openai client's request, llama-server's flags, the Modelfile, generation_config.json."""

from __future__ import annotations

import json

import pytest

from loraship.errors import LorashipError
from loraship.sampling import GREEDY, Sampling

# Qwen/Qwen2.5-7B-Instruct's generation_config.json: sampling suggestions and a repetition penalty.
QWEN25_GENERATION = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0",
}


def test_greedy_is_every_sampler_and_penalty_off():
    assert GREEDY.record() == {
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert GREEDY.greedy and not Sampling(repeat_penalty=1.1).greedy
    assert GREEDY.llama_server_flags() == (
        "--temp 0 --top-k 0 --top-p 1 --min-p 0 --repeat-penalty 1 --presence-penalty 0 --frequency-penalty 0"
    )
    assert dict(GREEDY.ollama_parameters()) == {
        "temperature": "0",
        "top_k": "0",
        "top_p": "1",
        "min_p": "0",
        "repeat_penalty": "1",
        "presence_penalty": "0",
        "frequency_penalty": "0",
    }
    request = GREEDY.openai_request()
    assert request["extra_body"] == {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0} and request["temperature"] == 0.0


def test_the_record_reads_back_and_refuses_what_it_does_not_know():
    assert Sampling.from_record(json.loads(json.dumps(GREEDY.record()))) == GREEDY
    assert Sampling.from_record({"repeat_penalty": 1.1}) == Sampling(repeat_penalty=1.1)
    with pytest.raises(LorashipError, match=r"sampling settings \['mirostat'\] are unknown"):
        Sampling.from_record({"mirostat": 2})
    with pytest.raises(LorashipError, match="are not numbers"):
        Sampling.from_record({"top_k": "forty"})


def test_generation_config_decodes_greedily_and_keeps_the_stop_tokens():
    shipped, changed = GREEDY.generation_config(QWEN25_GENERATION)
    assert shipped == {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "transformers_version": "4.37.0",
        "do_sample": False,
        "repetition_penalty": 1.0,
    }
    assert changed == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "do_sample": True, "repetition_penalty": 1.05}
    assert GREEDY.generation_config(shipped) == (shipped, {})  # idempotent: publish applies it again
    with pytest.raises(LorashipError, match="only greedy decoding"):
        Sampling(temperature=0.7).generation_config(QWEN25_GENERATION)


def test_transformers_decodes_the_written_config_greedily(tmp_path):
    from transformers import GenerationConfig

    shipped, _ = GREEDY.generation_config(QWEN25_GENERATION)
    (tmp_path / "generation_config.json").write_text(json.dumps(shipped))
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.do_sample is False and loaded.repetition_penalty == 1.0 and loaded.num_beams in (None, 1)
    assert loaded.get_generation_mode().value == "greedy_search"


def test_merge_writes_greedy_settings_over_the_bases(tmp_path):
    from loraship.stages.merge import greedy_generation_config

    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25_GENERATION))
    changed = greedy_generation_config(tmp_path)
    assert changed["repetition_penalty"] == 1.05 and changed["temperature"] == 0.7
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written["do_sample"] is False and written["repetition_penalty"] == 1.0 and "top_k" not in written
    # A base without generation_config.json gets one, its ids from config.json.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert greedy_generation_config(bare) == {}
    assert json.loads((bare / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "do_sample": False,
        "repetition_penalty": 1.0,
    }
