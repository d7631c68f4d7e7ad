"""Datasets: read and validate rows, render and tokenize them with loss masks.

Row types (DatasetSpec.type):
- alpaca: {"instruction", "output", optional "input"}; rendered as a user/assistant chat, loss on the output.
- chat: {"messages": [{"role", "content"}, ...]} (OpenAI style); loss on assistant turns only.
- sharegpt: {"conversations": [{"from", "value"}, ...]}; `from` mapped onto chat roles (SHAREGPT_ROLES), then as chat.
- completion: {"text"}; loss on every token.
`train_on_inputs: true` puts the loss on prompt tokens too (Axolotl's meaning).
Sources: local .jsonl/.json read here, compressed too (.jsonl.gz, .json.bz2, .jsonl.xz, .jsonl.zst:
loraship/dataset_files.py); .parquet/.csv and Hugging Face Hub datasets through the `datasets` library,
imported only for them (JSONL needs nothing beyond the core). A URL (s3://, gs://, file://, ...) is read
through fsspec; a scheme no installed fsspec implementation serves is refused, naming the package to
install. `fields` maps the type's names onto the file's columns.
Tokenized rows are cached under LORASHIP_CACHE by a fingerprint of the data, the tokenizer and its
chat template, the type and the field mapping, so train, merge and reference tokenize each row once.
Truncation policy: an example longer than sequence_len keeps its first sequence_len tokens
(config.truncation = "truncate", counted in the train manifest) or is skipped ("drop").
Rows are read and validated by loraship.dataset_rows (the readers here re-exported); this module renders,
tokenizes, caches and splits them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass, field

from loraship.cache import cache_root
from loraship.chat import render, require_template, template_kwargs_of, template_of, tokenize_conversation
from loraship.config import DATASET_FIELDS
from loraship.dataset_rows import as_messages, dataset_identity, read_dataset, read_rows
from loraship.errors import DataError

# Re-exported: the stages, the planner, starter and tests read rows through loraship.data.
from loraship.dataset_rows import hub_dataset_id, url_scheme  # noqa: F401

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Bumped when the cached record's layout or the tokenization code changes meaning.
TOKENIZED_CACHE_VERSION = 1

# Prompts verify derives from the data when no golden_prompts file is given.
AUTO_GOLDEN_PROMPTS = 16
# Words of a completion row kept as its prompt (the model continues the rest).
COMPLETION_PROMPT_WORDS = 32


@dataclass
class TokenizedSplit:
    examples: list[dict] = field(default_factory=list)  # {"input_ids": [...], "labels": [...]}
    truncated: int = 0
    dropped: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(e["input_ids"]) for e in self.examples)


def encode_row(row: dict, kind: str, tokenizer) -> dict:
    """One row at full length: its text as served, ids, which tokens are the answer (learn) and, for
    completion rows, the ids a runtime is served (without the EOS training appends)."""
    if kind == "completion":
        # Special tokens as HF adds them to plain text (BOS for Llama, none for Qwen), then EOS.
        served = tokenizer(row["text"], add_special_tokens=True)["input_ids"]
        ids = served + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        return {"text": row["text"], "input_ids": ids, "learn": [1] * len(ids), "served_ids": served}
    messages = as_messages(row, kind)
    ids, learn = tokenize_conversation(tokenizer, messages)
    return {"text": render(tokenizer, messages), "input_ids": list(ids), "learn": [int(k) for k in learn]}


def labels_of(record: dict, train_on_inputs: bool) -> list[int]:
    if train_on_inputs:
        return list(record["input_ids"])
    return [tok if keep else IGNORE_INDEX for tok, keep in zip(record["input_ids"], record["learn"])]


def examples_from(
    records: list[dict], sequence_len: int, truncation: str, train_on_inputs: bool = False
) -> TokenizedSplit:
    out = TokenizedSplit()
    for record in records:
        ids, labels = record["input_ids"], labels_of(record, train_on_inputs)
        too_long = len(ids) > sequence_len
        if too_long and truncation == "drop":
            out.dropped += 1
            continue
        ids, labels = ids[:sequence_len], labels[:sequence_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            out.dropped += 1  # nothing (left) to learn: every target lies past sequence_len
            continue
        out.truncated += too_long
        out.examples.append({"input_ids": list(ids), "labels": labels})
    return out


def tokenize_rows(
    rows: list[dict], kind: str, tokenizer, sequence_len: int, truncation: str, train_on_inputs: bool = False
) -> TokenizedSplit:
    if kind != "completion" and rows:
        require_template(tokenizer, f"{kind} rows")
    return examples_from([encode_row(row, kind, tokenizer) for row in rows], sequence_len, truncation, train_on_inputs)


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer by content (vocabulary, merges, normalizer, special tokens, chat template), not by
    folder, so the merged model's copy of the training tokenizer finds the same cache entry."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        # BOS/EOS insertion can live outside the backend (add_bos_token), so probe it.
        "probe": tokenizer("a b", add_special_tokens=True)["input_ids"],
        "eos": tokenizer.eos_token_id,
        "template": template_of(tokenizer),
        "template_kwargs": template_kwargs_of(tokenizer),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def encoded_dataset(spec, tokenizer) -> list[dict]:
    """read_dataset's rows encoded (encode_row), cached by fingerprint so each row is tokenized once.

    The key is the data (file hash or the `datasets` fingerprint), the tokenizer with its chat
    template, the row type and the field mapping. Records are kept at full length with the
    assistant mask, and sequence_len, truncation and train_on_inputs are applied on read
    (examples_from): changing them retrains without re-tokenizing."""
    from loraship.runtime.manifest import atomic_write_json

    key = hashlib.sha256(
        json.dumps(
            {
                "version": TOKENIZED_CACHE_VERSION,
                "data": dataset_identity(spec),
                "tokenizer": tokenizer_fingerprint(tokenizer),
                "type": spec.type,
                "fields": spec.fields,
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()
    cached = cache_root() / "tokenized" / f"{key}.json"
    if cached.is_file():
        try:
            records = json.loads(cached.read_text(encoding="utf-8"))
            log.info("dataset %s: %d tokenized rows from the cache (%s)", spec.path, len(records), cached.name)
            return records
        except (OSError, ValueError):
            log.warning("dataset %s: unreadable tokenized cache %s; tokenizing again", spec.path, cached)
    rows = read_dataset(spec)
    if spec.type != "completion":
        require_template(tokenizer, f"{spec.type} rows")
    records = []
    for n, row in enumerate(rows, 1):
        try:
            records.append(encode_row(row, spec.type, tokenizer))
        except DataError as e:
            raise DataError(f"row {n}: {e}") from e
    cached.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cached, records)
    return records


def _split(config, items_of):
    """(train, eval) items; eval comes from eval_datasets or a seeded val_set_size split of the training items."""
    train_items = [item for spec in config.datasets for item in items_of(spec)]
    if config.eval_datasets:
        return train_items, [item for spec in config.eval_datasets for item in items_of(spec)]
    rng = random.Random(config.seed)
    order = list(range(len(train_items)))
    rng.shuffle(order)
    n_eval = int(round(len(train_items) * config.val_set_size))
    if config.val_set_size > 0 and len(train_items) >= 2:
        n_eval = max(1, n_eval)
    held = set(order[:n_eval])
    eval_items = [r for i, r in enumerate(train_items) if i in held]
    train_items = [r for i, r in enumerate(train_items) if i not in held]
    return train_items, eval_items


def split_rows(config) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(train, eval) rows as (kind, row); eval comes from eval_datasets or a seeded val_set_size split."""
    return _split(config, lambda spec: [(spec.type, row) for row in read_dataset(spec)])


def encoded_splits(config, tokenizer) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """split_rows' split (the same rows, in the same order) as (kind, encoded record)."""
    return _split(config, lambda spec: [(spec.type, record) for record in encoded_dataset(spec, tokenizer)])


def eval_records(config, tokenizer) -> list[dict]:
    """Eval texts as training tokenized them, for the reference stage: text, HF ids (truncated like
    training), the ids a runtime is served, and the scored positions (whose next token has a label)."""
    _train, items = encoded_splits(config, tokenizer)
    records = []
    for kind, record in items:
        ids = record["input_ids"][: config.sequence_len]
        labels = labels_of(record, config.train_on_inputs)[: config.sequence_len]
        positions = [i for i in range(len(ids) - 1) if labels[i + 1] != IGNORE_INDEX]
        if not positions:
            continue
        completion = kind == "completion"  # a rendered template carries its own BOS text
        records.append(
            {
                "kind": kind,
                "text": record["text"],
                "add_bos": completion,
                "served_ids": record["served_ids"] if completion else list(record["input_ids"]),
                "input_ids": ids,
                "positions": positions,
            }
        )
        if len(records) == config.verify_max_examples:
            break
    return records


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
            rows.append(
                {
                    **{k: v for k, v in row.items() if k != "prompt"},
                    "messages": conversation_prompt(messages) or messages,
                }
            )
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
    """(train, eval) tokenized (through the cache); eval comes from eval_datasets or a seeded val_set_size split."""
    splits = []
    for items in encoded_splits(config, tokenizer):
        merged = TokenizedSplit()
        for kind in DATASET_FIELDS:  # grouped by row type, as before the cache
            part = examples_from(
                [r for k, r in items if k == kind], config.sequence_len, config.truncation, config.train_on_inputs
            )
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
