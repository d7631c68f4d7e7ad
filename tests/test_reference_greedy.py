"""The reference stage's greedy answers are the argmax, whatever the model's generation_config suggests: a base
shipping repetition_penalty (Qwen2.5-Instruct's 1.05) must not shape the answer the fine-tune is judged against."""

from __future__ import annotations

import pytest


def _argmax_answer(model, prompt: list[int], max_new: int, stops: list[int]) -> list[int]:
    import torch

    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token in stops:
                break
            out.append(token)
            ids.append(token)
    return out


@pytest.mark.parametrize("function", ["base_answers", "greedy_answers"])
def test_answers_are_argmax_under_a_repetition_penalty(tiny_model, function):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraship.stages import reference

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    model.generation_config.repetition_penalty = 50.0  # would forbid every repeated token
    prompt = tok("The capital of Zorvia is Kelmar. The capital of Zorvia is")["input_ids"]
    stops = [tok.eos_token_id]
    expected = _argmax_answer(model, prompt, 12, stops)
    records = [{"prompt_ids": prompt}]
    getattr(reference, function)(model, records, 12, stops)
    got = records[0]["base_answer_ids" if function == "base_answers" else "answer_ids"]
    assert got == expected and len(expected) > 0
