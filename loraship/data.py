"""Datasets: read and validate JSONL rows, render and tokenize them with loss masks.

Row types (DatasetSpec.type):
- alpaca: {"instruction", "output", optional "input"}; rendered as a user/assistant chat, loss on the output.
- chat: {"messages": [{"role", "content"}, ...]}; loss on assistant turns only.
- completion: {"text"}; loss on every token.
Truncation policy: an example longer than sequence_len keeps its first sequence_len tokens
(config.truncation = "truncate", counted in the train manifest) or is skipped ("drop").
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from loraship.chat import require_template, tokenize_conversation
from loraship.errors import DataError

IGNORE_INDEX = -100
MAX_LISTED_PROBLEMS = 20
ROLES = ("system", "user", "assistant")

# Prompts verify derives from the data when no golden_prompts file is given.
AUTO_GOLDEN_PROMPTS = 16
# Words of a completion row kept as its prompt (the model continues the rest).
COMPLETION_PROMPT_WORDS = 32


def _row_problem(row, kind: str) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if kind == "alpaca":
        missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
        if missing:
            return f"missing or non-string field(s) {missing} (alpaca rows need instruction/output, optional input)"
        if "input" in row and not isinstance(row["input"], str):
            return "field 'input' must be a string"
    elif kind == "chat":
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "missing field 'messages' (chat rows need a non-empty list of {role, content})"
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                return f"messages[{j}] must be {{'role': one of {list(ROLES)}, 'content': string}}"
        if not any(m["role"] == "assistant" for m in msgs):
            return "no assistant message, so nothing to learn (loss is only on assistant turns)"
        if msgs[-1]["role"] != "assistant":
            # A trailing prompt teaches nothing and renders as an unanswered turn in the training text.
            return (f"the conversation ends with a {msgs[-1]['role']!r} turn; a training row must end with the "
                    "assistant's answer (remove the trailing turn or add its answer)")
    elif kind == "golden":  # verify's prompts: a conversation to answer, or a bare user prompt
        msgs = row.get("messages")
        if not isinstance(row.get("prompt"), str) and (not isinstance(msgs, list) or not msgs or any(
            not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str) for m in msgs
        )):
            return "golden rows need 'prompt' (string) or 'messages' (list of {role, content})"
        if "expect_regex" in row:
            try:
                re.compile(row["expect_regex"])
            except (re.error, TypeError) as e:
                return f"expect_regex is not a valid regular expression ({e})"
    elif kind == "completion":
        if not isinstance(row.get("text"), str) or not row["text"]:
            return "missing or empty field 'text' (completion rows need {'text': ...})"
    else:
        return f"unknown dataset type {kind!r}; use alpaca, chat or completion"
    return None


def read_rows(path: str | Path, kind: str) -> list[dict]:
    """All rows of a JSONL file, or a DataError listing every bad line (up to 20) with its number."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset {path}: file not found; check datasets[].path (relative paths start at the current folder)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"dataset {path} line {line}: not UTF-8 (byte {e.start}); re-encode the file as UTF-8") from e
    rows, problems = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"line {number}: malformed JSON ({e.msg} at column {e.colno})")
            continue
        problem = _row_problem(row, kind)
        if problem:
            problems.append(f"line {number}: {problem}")
        else:
            rows.append(row)
    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise DataError(f"dataset {path} ({kind}): {len(problems)} bad line(s):\n  " + "\n  ".join(shown) + more)
    if not rows:
        raise DataError(f"dataset {path}: empty (no rows); add at least one {kind} row")
    return rows


def as_messages(row: dict, kind: str) -> list[dict]:
    if kind == "chat":
        return row["messages"]
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


@dataclass
class TokenizedSplit:
    examples: list[dict] = field(default_factory=list)  # {"input_ids": [...], "labels": [...]}
    truncated: int = 0
    dropped: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(e["input_ids"]) for e in self.examples)


def tokenize_rows(rows: list[dict], kind: str, tokenizer, sequence_len: int, truncation: str) -> TokenizedSplit:
    out = TokenizedSplit()
    if kind != "completion" and rows:
        require_template(tokenizer, f"{kind} rows")
    for row in rows:
        if kind == "completion":
            # Special tokens as HF adds them to plain text (BOS for Llama, none for Qwen), then EOS.
            ids = tokenizer(row["text"], add_special_tokens=True)["input_ids"]
            if tokenizer.eos_token_id is not None:
                ids = ids + [tokenizer.eos_token_id]
            labels = list(ids)
        else:
            ids, learn = tokenize_conversation(tokenizer, as_messages(row, kind))
            labels = [tok if keep else IGNORE_INDEX for tok, keep in zip(ids, learn)]
        too_long = len(ids) > sequence_len
        if too_long and truncation == "drop":
            out.dropped += 1
            continue
        ids, labels = ids[:sequence_len], labels[:sequence_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            out.dropped += 1  # nothing (left) to learn: every target lies past sequence_len
            continue
        out.truncated += too_long
        out.examples.append({"input_ids": ids, "labels": labels})
    return out


def split_rows(config) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(train, eval) rows as (kind, row); eval comes from eval_datasets or a seeded val_set_size split."""
    train_rows = [(spec.type, row) for spec in config.datasets for row in read_rows(spec.path, spec.type)]
    if config.eval_datasets:
        eval_rows = [(spec.type, row) for spec in config.eval_datasets for row in read_rows(spec.path, spec.type)]
        return train_rows, eval_rows
    rng = random.Random(config.seed)
    order = list(range(len(train_rows)))
    rng.shuffle(order)
    n_eval = int(round(len(train_rows) * config.val_set_size))
    if config.val_set_size > 0 and len(train_rows) >= 2:
        n_eval = max(1, n_eval)
    held = set(order[:n_eval])
    eval_rows = [r for i, r in enumerate(train_rows) if i in held]
    train_rows = [r for i, r in enumerate(train_rows) if i not in held]
    return train_rows, eval_rows


def conversation_prompt(messages: list[dict]) -> list[dict] | None:
    """The conversation up to its first assistant turn (system and user turns kept), or None."""
    prompt = []
    for message in messages:
        if message["role"] == "assistant":
            break
        prompt.append(message)
    return prompt if any(m["role"] == "user" for m in prompt) else None


def prompt_of(kind: str, row: dict) -> dict | None:
    """A golden prompt from a training-style row: {'messages': [...]} for chat/alpaca, {'text': ...} for completion."""
    if kind == "completion":
        words = row["text"].split(" ")
        keep = max(1, min(len(words) // 2, COMPLETION_PROMPT_WORDS))
        return {"text": " ".join(words[:keep])} if len(words) > 1 else None
    messages = conversation_prompt(as_messages(row, kind))
    return {"messages": messages} if messages else None


def golden_rows(config) -> list[dict]:
    """verify's prompts: the golden_prompts file, else prompts cut from eval rows (then training rows)."""
    if config.golden_prompts:
        rows = []
        for row in read_rows(config.golden_prompts, "golden"):
            messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
            rows.append({**{k: v for k, v in row.items() if k != "prompt"}, "messages": conversation_prompt(messages) or messages})
        return rows
    train_rows, eval_rows = split_rows(config)
    prompts = []
    for kind, row in eval_rows + train_rows:
        prompt = prompt_of(kind, row)
        if prompt and prompt not in prompts:
            prompts.append(prompt)
        if len(prompts) == AUTO_GOLDEN_PROMPTS:
            break
    return prompts


def load_splits(config, tokenizer) -> tuple[TokenizedSplit, TokenizedSplit]:
    """(train, eval) tokenized; eval comes from eval_datasets or a seeded val_set_size split."""
    train_rows, eval_rows = split_rows(config)
    splits = []
    for rows in (train_rows, eval_rows):
        merged = TokenizedSplit()
        for kind in ("alpaca", "chat", "completion"):
            part = tokenize_rows([r for k, r in rows if k == kind], kind, tokenizer, config.sequence_len, config.truncation)
            merged.examples += part.examples
            merged.truncated += part.truncated
            merged.dropped += part.dropped
        splits.append(merged)
    train, evaluation = splits
    if not train.examples:
        raise DataError(
            f"no training examples left after tokenization ({train.dropped} dropped); "
            f"raise sequence_len ({config.sequence_len}) or use truncation: truncate"
        )
    return train, evaluation
