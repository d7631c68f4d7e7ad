"""Which examples train in which optimizer step, padded or packed, and the tensors for one micro-batch.

Data order is a seeded permutation per epoch; an optimizer step takes the next micro_batch_size x
gradient_accumulation_steps examples, packed or not, so the loss curve is the padded one (the loss
is a mean over the step's target tokens either way) and a re-plan to a smaller micro-batch after an
out-of-memory error resumes on the same data. The last step of an epoch may be short: its examples
are trained, not dropped.

Padded: a micro-batch is micro_batch_size examples, one per row, padded to the longest, with an
attention mask. Packed (padding-free): a step's examples are laid end to end into rows of up to
sequence_len tokens (first fit, longest first), position ids restarting at 0 with each example, no
attention mask; a micro-batch is micro_batch_size such rows, so a step needs fewer forward passes,
none of them longer than micro_batch_size x sequence_len tokens (the memory plan's T). transformers
builds a block-causal mask from packed position ids, so no example attends to another
(transformers/masking_utils.py: find_packed_sequence_indices, used by create_causal_mask when
attention_mask is None and there is no cache).

Rows are sequence_len long, not micro_batch_size x sequence_len: with SDPA and an explicit mask,
attention costs the square of the row length whatever the mask hides, so longer rows would cost
micro_batch_size times the attention of the padded batch they replace.
"""

from __future__ import annotations

import math
import random

from loraship.data import IGNORE_INDEX

# Attention implementations whose causal mask transformers builds through masking_utils, which
# honours packed position ids. flash_attention_2/3 read packed position ids only for a batch of one
# row (modeling_flash_attention_utils._is_packed_sequence), so a packed micro-batch of several rows
# would let examples in a row attend to each other there: those pad instead.
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention")


def packing_unsupported(model) -> str | None:
    """Why packed rows would be wrong for this model, or None when they are safe."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    if masking_utils is None or not hasattr(masking_utils, "find_packed_sequence_indices"):
        import transformers

        return (f"transformers {transformers.__version__} builds no masks from packed position ids "
                "(masking_utils.find_packed_sequence_indices); upgrade transformers")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        return (f"attention implementation {impl!r} does not separate packed examples in a batch of several rows; "
                f"packing needs one of {', '.join(PACKING_ATTENTION)}")
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


def epoch_steps(lengths: list[int], micro: int, accum: int, seed: int, epoch: int,
                row_tokens: int | None) -> list[list[list[list[int]]]]:
    """One epoch as steps -> micro-batches -> rows -> example indices (padded: one example per row)."""
    order = epoch_order(len(lengths), seed, epoch)
    eff = micro * accum
    steps = []
    for start in range(0, len(order), eff):
        chunk = order[start : start + eff]
        rows = [[i] for i in chunk] if row_tokens is None else pack_rows(chunk, lengths, row_tokens)
        steps.append([rows[m : m + micro] for m in range(0, len(rows), micro)])
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


def collate_packed(rows: list[list[dict]], pad_id: int):
    """input_ids, labels, position_ids for rows of whole examples laid end to end.

    Each example's positions restart at 0 and its first label is IGNORE_INDEX: the model shifts labels
    by one, so that label would be predicted from the previous example's last token (alone, an
    example's first label is never a target, so its loss is unchanged). The padded tail of a short row
    is a sequence of its own (positions from 0, labels ignored), which no example attends to.
    """
    import torch

    width = max(sum(len(e["input_ids"]) for e in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for e in row:
            n = len(e["input_ids"])
            ids[r, at : at + n] = torch.tensor(e["input_ids"])
            labels[r, at + 1 : at + n] = torch.tensor(e["labels"][1:])
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(width - at)
    return ids, labels, positions
