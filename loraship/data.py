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

from loraship.chat import assistant_spans
from loraship.errors import DataError

IGNORE_INDEX = -100
MAX_LISTED_PROBLEMS = 20
ROLES = ("system", "user", "assistant")

# Used when the tokenizer has no chat template of its own (many base models).
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "### {{ message['role'] | capitalize }}:\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n\n"
    "{% endfor %}{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


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


def chat_template_of(tokenizer) -> str:
    return getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE


def tokenize_rows(rows: list[dict], kind: str, tokenizer, sequence_len: int, truncation: str) -> TokenizedSplit:
    out = TokenizedSplit()
    template = chat_template_of(tokenizer)
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    for row in rows:
        if kind == "completion":
            ids = tokenizer(bos + row["text"] + eos, add_special_tokens=False)["input_ids"]
            labels = list(ids)
        else:
            text, spans = assistant_spans(template, as_messages(row, kind), bos_token=bos, eos_token=eos)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = enc["input_ids"]
            labels = [
                tok if any(start <= s < end for start, end in spans) else IGNORE_INDEX
                for tok, (s, _e) in zip(ids, enc["offset_mapping"])
            ]
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


def load_splits(config, tokenizer) -> tuple[TokenizedSplit, TokenizedSplit]:
    """(train, eval) tokenized; eval comes from eval_datasets or a seeded val_set_size split."""
    train_rows = [(spec.type, row) for spec in config.datasets for row in read_rows(spec.path, spec.type)]
    if config.eval_datasets:
        eval_rows = [(spec.type, row) for spec in config.eval_datasets for row in read_rows(spec.path, spec.type)]
    else:
        rng = random.Random(config.seed)
        order = list(range(len(train_rows)))
        rng.shuffle(order)
        n_eval = int(round(len(train_rows) * config.val_set_size))
        if config.val_set_size > 0 and len(train_rows) >= 2:
            n_eval = max(1, n_eval)
        held = set(order[:n_eval])
        eval_rows = [r for i, r in enumerate(train_rows) if i in held]
        train_rows = [r for i, r in enumerate(train_rows) if i not in held]
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
