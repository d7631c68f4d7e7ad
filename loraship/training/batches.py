"""How a run draws its optimizer steps: packed or padded micro-batches (use_packing decides, and says why), the
seeded order of each epoch, and one micro-batch's model inputs on the device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraship.data import IGNORE_INDEX
from loraship.errors import LorashipError
from loraship.training import packed_attention
from loraship.training.packing import collate_packed, epoch_steps, packing_unsupported, steps_per_epoch
from loraship.training.packing import collate_padded as collate

if TYPE_CHECKING:
    from loraship.planning.strategy_record import Strategy


def use_packing(config, model, device: str) -> tuple[bool, str]:
    """Whether this run packs examples, and why (recorded in the manifest). Packing sets the model's attention
    to loraship/training/packed_attention.py."""
    if config.packing == "off":
        return False, "packing: off"
    why_not = packing_unsupported(model, config.sequence_len)
    kernel = packed_attention.kernel_for(device)
    if why_not is None and kernel != "varlen" and device == "cuda" and config.packing == "auto":
        import torch

        # One SDPA call per example is right but slow on a GPU: padding wins there.
        why_not = (
            f"torch {torch.__version__} has no variable-length attention (torch.nn.attention.varlen, torch >= 2.10)"
        )
    if why_not is None:
        model.set_attn_implementation(packed_attention.register())
        return True, (
            f"packing: {config.packing}; examples laid end to end, each attending to itself only "
            f"({kernel} attention; a micro-batch of one length runs as a plain batch)"
        )
    if config.packing == "on":
        raise LorashipError(
            f"packing: on, but {why_not}; set packing: auto (pads where packing is unsupported) or off"
        )
    return False, f"padded batches: {why_not}"


@dataclass(frozen=True)
class Batches:
    """How a run draws its optimizer steps: the examples, their lengths and the micro-batch layout."""

    examples: list[dict]
    lengths: list[int]
    micro: int  # micro_batch_size
    accum: int  # gradient_accumulation_steps
    per_epoch: int  # optimizer steps an epoch, the last, short one included
    packed: bool
    pad_id: int
    seed: int
    sequence_len: int

    @classmethod
    def of(cls, config, strategy: Strategy, examples: list[dict], packed: bool, tokenizer, world_size: int) -> Batches:
        """The layout `strategy` trains `examples` in, on `world_size` ranks."""
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # A global step is micro-batch x accumulation x ranks, laid out as one process would run it (each rank then
        # trains its share: distributed.rank_share), so the losses and the adapter are those of one process.
        micro, accum = strategy.micro_batch_size, strategy.gradient_accumulation_steps * world_size
        lengths = [len(e["input_ids"]) for e in examples]
        per_epoch = steps_per_epoch(len(examples), micro, accum)
        return cls(examples, lengths, micro, accum, per_epoch, packed, pad_id, config.seed, config.sequence_len)

    def total_steps(self, config) -> int:
        """The run's optimizer steps: max_steps, else num_epochs of this layout's."""
        return config.max_steps or max(1, math.ceil(self.per_epoch * config.num_epochs))

    def epoch(self, epoch: int) -> list:
        """The epoch's steps, each a list of micro-batches of rows of example indices (a seeded permutation)."""
        budget = self.micro * self.sequence_len if self.packed else None
        return epoch_steps(self.lengths, self.micro, self.accum, self.seed, epoch, budget)


def micro_batch(
    examples: list[dict], rows: list[list[int]], packed: bool, pad_id: int, device: str
) -> tuple[dict, int, int]:
    """Model inputs for one micro-batch, its number of real (non-pad) tokens and of target tokens."""
    batch = [examples[i] for row in rows for i in row]
    if packed and len({len(e["input_ids"]) for e in batch}) == 1:
        # Examples of one length (e.g. long rows cut at sequence_len) leave no padding to remove: as a plain batch
        # with no mask, attention runs SDPA's causal kernel (cuDNN's on Hopper), which on the H200 took 0.54x the
        # time of variable-length FlashAttention on the same tokens (bench/results/train_bench_profile.json).
        ids, labels, _mask = collate(batch, pad_id)
        inputs = {"input_ids": ids, "labels": labels}
    elif packed:
        inputs = collate_packed(batch)
    else:
        ids, labels, mask = collate(batch, pad_id)
        inputs = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    tokens = sum(len(e["input_ids"]) for e in batch)
    # Counted on the CPU: on the GPU it would wait for the copy (a sync per micro-batch).
    targets = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
    on_device = {k: v.to(device, non_blocking=True) if hasattr(v, "to") else v for k, v in inputs.items()}
    return on_device, tokens, targets


def target_tokens(example: dict) -> int:
    """Labels the model predicts (it shifts by one: the first label is never a target)."""
    return sum(1 for lab in example["labels"][1:] if lab != IGNORE_INDEX)
