"""Fewer golden prompts than min_golden_prompts: verify fails its golden_match gate for lack of evidence, after the
whole pipeline; counted at plan instead, as verify will count them (loraship/data.py golden_rows)."""

from __future__ import annotations

from loraship.config import Config
from loraship.errors import LorashipError


def golden_count_problems(config: Config) -> list[str]:
    from loraship.data import AUTO_GOLDEN_PROMPTS, golden_rows

    try:
        n = len(golden_rows(config))
    except LorashipError:
        return []  # an unreadable golden file or dataset: dataset_problems names it
    minimum = config.min_golden_prompts
    if n >= minimum:
        return []
    if config.golden_prompts:
        return [
            f"golden_prompts {config.golden_prompts}: {n} prompt(s), fewer than min_golden_prompts {minimum}, so "
            "verify would fail golden_match for lack of evidence after the whole pipeline; fix: add prompts to the "
            f"file (at least {minimum}), or lower min_golden_prompts to {n}"
        ]
    return [
        f"golden prompts: golden_prompts is not set, and the eval and training rows give {n} distinct prompt(s) "
        f"(verify takes up to {AUTO_GOLDEN_PROMPTS}), fewer than min_golden_prompts {minimum}, so verify would fail "
        "golden_match for lack of evidence after the whole pipeline; fix: set golden_prompts to a JSONL file of at "
        f"least {minimum} prompts, add rows with distinct prompts, or lower min_golden_prompts to {max(n, 1)}"
    ]
