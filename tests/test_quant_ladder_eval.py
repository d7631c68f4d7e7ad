"""bench/quant_ladder.py --eval-source pydoc: the held-out eval is fixed, and under SmolLM2's real tokenizer it has
at least 2,048 scored assistant tokens, none cut by sequence_len, every one with an exact full-vocabulary KL."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quant_ladder():
    sys.path.insert(0, str(ROOT / "bench"))
    import quant_ladder

    return quant_ladder


def test_pydoc_eval_is_every_topic_in_name_order_and_the_same_each_time():
    from pydoc_data.topics import topics

    ql = quant_ladder()
    rows = ql.pydoc_eval_rows()
    assert rows == ql.pydoc_eval_rows()
    assert [r["messages"][0]["content"] for r in rows] == [f"Explain the Python topic '{n}'." for n in sorted(topics)]
    for r in rows:
        words = r["messages"][1]["content"].split()
        assert 0 < len(words) <= ql.PYDOC_WORDS
        # No reST section underline left (a bullet "*" or an "=" in code is text, a run of them is markup).
        assert not any(len(w) >= 3 and set(w) <= set("*=-~^#") for w in words)


def test_pydoc_eval_is_scored_whole_and_exactly_under_smollm2s_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from loraship.data import eval_records
    from loraship.fixtures.families import smollm2_tokenizer
    from loraship.stages.reference import full_rows_budget

    ql = quant_ladder()
    folder = tmp_path / "smollm2-tokenizer"
    folder.mkdir()
    smollm2_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = ql.config_for(folder, tmp_path, ["Q4_K_M"], eval_source="pydoc")
    records = eval_records(config, tokenizer)  # what the reference stage scores
    assert len(records) == len(ql.pydoc_eval_rows())  # verify_max_examples cuts none off
    assert all(r["input_ids"] == r["served_ids"] for r in records)  # sequence_len truncates none
    scored = sum(len(r["positions"]) for r in records)
    assert scored >= ql.MIN_EVAL_TOKENS
    vocab = len(tokenizer)
    assert (
        full_rows_budget(scored, vocab, config.reference_full_logprob_tokens, config.reference_full_logprob_mib)
        == scored
    )


def test_the_default_eval_is_still_the_demos(tmp_path):
    config = quant_ladder().config_for(tmp_path / "model", tmp_path, ["Q4_K_M"])
    assert [Path(d.path) for d in config.eval_datasets] == [ROOT / "data/demo/eval.jsonl"]
    assert config.sequence_len == 96 and not (tmp_path / "eval-pydoc.jsonl").exists()
