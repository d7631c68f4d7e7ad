"""The eval loss: mean loss per target token over the eval split, of the model with its adapter and of the base
alone (the adapter switched off), as the train stage reports before and after training."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from loraship.data import IGNORE_INDEX
from loraship.training.device import compute
from loraship.training.packing import collate_padded as collate

if TYPE_CHECKING:
    from loraship.runtime.progress import Progress
    from loraship.training.distributed import Rank


def evaluate(
    model,
    examples: list[dict],
    batch_size: int,
    pad_id: int,
    device: str,
    progress: Progress | None = None,
    fused_loss: bool = False,
    rank: Rank | None = None,
) -> float | None:
    """Mean loss per target token over the eval split; `fused_loss`: the model runs Liger's
    (LoadedModel.fused_loss). Under several ranks each evaluates every world_size-th batch and the sums are
    added up: the same mean as one process, in 1/world_size of the time. Every rank runs as many forwards (one
    counted for nothing where the batches do not divide): FSDP2's forward is a collective."""
    import torch

    from loraship.training.distributed import all_sum

    if not examples:
        return None
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    starts = list(range(0, len(examples), batch_size))
    world, me = (rank.world_size, rank.rank) if rank is not None else (1, 0)
    mine = starts[me::world] + [None] * (math.ceil(len(starts) / world) - len(starts[me::world]))
    batches = len(mine)
    # In eval mode Liger's forward materialises the fp32 logits (T x vocab: 4.6 GiB at 1 x 8192 on a 152k
    # vocabulary) unless told to skip them: on the H200 that made the eval before training, not training, the
    # peak, and a 14B plan that fits ran out of memory there (bench/results/train_bench.json).
    options = {"skip_logits": True} if fused_loss else {}
    with torch.no_grad():
        for batch, i in enumerate(mine, start=1):
            ids, labels, mask = (t.to(device) for t in collate(examples[i or 0 : (i or 0) + batch_size], pad_id))
            n = int((labels[:, 1:] != IGNORE_INDEX).sum()) if i is not None else 0
            with compute(device):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels, **options).loss
            total += float(loss) * n
            count += n
            if progress is not None:
                progress.update(
                    batch, f"batch {batch}/{batches}, loss so far {total / max(count, 1):.4f}", total=batches
                )
    model.train(was_training)
    total, count = all_sum([total, count], rank)
    return total / max(count, 1)


def evaluate_base(
    model,
    examples,
    batch_size,
    pad_id,
    device,
    progress: Progress | None = None,
    fused_loss: bool = False,
    rank: Rank | None = None,
):
    """Eval loss of the base model alone: the adapter switched off."""
    with model.disable_adapter():
        return evaluate(model, examples, batch_size, pad_id, device, progress, fused_loss, rank)
