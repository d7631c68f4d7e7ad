"""Which examples train in which optimizer step, padded or packed, and the tensors for one micro-batch.

Data order is a seeded permutation per epoch; an optimizer step takes the next micro_batch_size x
gradient_accumulation_steps examples, packed or not, so the loss curve is the padded one (the loss
is a mean over the step's target tokens either way) and a re-plan to a smaller micro-batch after an
out-of-memory error resumes on the same data. The last step of an epoch may be short: its examples
are trained, not dropped.

Padded: a micro-batch is micro_batch_size examples, one per row, padded to the longest, with an
attention mask. Packed (padding-free): a step's examples are laid end to end into micro-batches of
up to micro_batch_size x sequence_len tokens (the memory plan's T; first fit, longest first), each
one row with position ids restarting at 0 for every example and the examples' boundaries as
cumulative lengths, which loraship/training/packed_attention.py reads so that no example attends to another
and none pays for another's length. A step then needs fewer forward passes and computes no padding.
"""

from __future__ import annotations

import math
import random

from loraship.data import IGNORE_INDEX


def packing_unsupported(model, sequence_len: int) -> str | None:
    """Why packed rows would be wrong for this model, or None when they are safe."""
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError:
        import transformers

        return (
            f"transformers {transformers.__version__} cannot take a registered attention function "
            "(AttentionInterface / AttentionMaskInterface); upgrade transformers"
        )
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        # Gemma 2: neither torch's variable-length kernel nor SDPA caps the scores; packed rows would train a
        # different model from the one llama.cpp runs. Padded batches keep the model's eager attention.
        return (
            f"its attention logits are soft-capped (attn_logit_softcapping {cfg.attn_logit_softcapping}), which "
            "packed attention does not apply"
        )
    if getattr(cfg, "attention_dropout", 0.0):
        return f"the model's attention_dropout is {cfg.attention_dropout}; packed attention has none"
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    uses_window = getattr(cfg, "use_sliding_window", True) or "sliding_attention" in layer_types
    if window and uses_window and window < sequence_len:
        return (
            f"its sliding window ({window} tokens) is shorter than sequence_len {sequence_len}; "
            "packed attention is full causal attention"
        )
    return None


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    return order


def pack_rows(indices: list[int], lengths: list[int], row_tokens: int) -> list[list[int]]:
    """First fit, longest first: each example into the first row with room, else a new row."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        at = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if at is None:
            rows.append([])
            room.append(row_tokens)
            at = len(rows) - 1
        rows[at].append(i)
        room[at] -= lengths[i]
    return rows


def steps_per_epoch(n: int, micro: int, accum: int) -> int:
    return max(1, math.ceil(n / (micro * accum)))


def epoch_steps(
    lengths: list[int], micro: int, accum: int, seed: int, epoch: int, budget: int | None
) -> list[list[list[list[int]]]]:
    """One epoch as steps -> micro-batches -> rows -> example indices.

    Padded (budget None): micro-batches of `micro` rows, one example each. Packed: micro-batches of one
    row each, holding up to `budget` tokens of the step's examples.
    """
    order = epoch_order(len(lengths), seed, epoch)
    eff = micro * accum
    steps = []
    for start in range(0, len(order), eff):
        chunk = order[start : start + eff]
        if budget is None:
            rows = [[i] for i in chunk]
            steps.append([rows[m : m + micro] for m in range(0, len(rows), micro)])
        else:
            steps.append([[row] for row in pack_rows(chunk, lengths, budget)])
    return steps


def collate_padded(examples: list[dict], pad_id: int):
    """input_ids, labels, attention_mask: one example per row, right-padded to the longest."""
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        labels[row, :n] = torch.tensor(e["labels"])
        mask[row, :n] = 1
    return ids, labels, mask


def collate_packed(examples: list[dict]) -> dict:
    """Model inputs for whole examples laid end to end in one row, with their boundaries.

    input_ids, labels and position_ids are (1, total); cu_seq_lens_q/k (int32, boundaries as cumulative
    lengths) and max_length_q/k are transformers' keyword arguments for variable-length attention
    (loraship/training/packed_attention.py). Each example's positions restart at 0 and its first label is
    IGNORE_INDEX: the model shifts labels by one, so that label would be predicted from the previous
    example's last token (alone, an example's first label is never a target, so its loss is unchanged).
    """
    import torch

    lengths = [len(e["input_ids"]) for e in examples]
    ids = torch.tensor([[t for e in examples for t in e["input_ids"]]], dtype=torch.long)
    labels = torch.tensor(
        [[IGNORE_INDEX if j == 0 else lab for e in examples for j, lab in enumerate(e["labels"])]], dtype=torch.long
    )
    positions = torch.tensor([[j for n in lengths for j in range(n)]], dtype=torch.long)
    bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(lengths)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": longest,
        "max_length_k": longest,
    }
