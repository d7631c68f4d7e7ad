"""The chunk Liger's fused linear cross-entropy runs in: plan counts it (loraship/planning/estimate.py) and train
passes it to Liger (loraship/training/loss_chunks.py), both from here."""

from __future__ import annotations

# Rows of hidden states per chunk of the fused loss, at least. Liger's default sizes a chunk's logits like the hidden
# states (T x h), which on Gemma 3's 262k vocabulary is 64 rows: each chunk rereads the 2 GB lm_head in a skinny GEMM,
# 175 ms of lm_head GEMMs over two steps against Unsloth's 47 ms in chunks of 512 rows
# (bench/results/train_bench_gemma3_profile.json).
LOSS_CHUNK_MIN_ROWS = 512


def liger_loss_chunk_rows(T: int, V: int, h: int, chunk_mem_const: int) -> int:
    """Rows per chunk of Liger's fused linear cross-entropy (liger_kernel ops/fused_linear_cross_entropy.py): logits
    bounded to chunk_mem_const x T x h entries, as a power of two, never more than T."""
    inc_factor = -(-V // (chunk_mem_const * h))
    return min(T, 1 << (-(-T // inc_factor) - 1).bit_length())


def loss_chunk_mem_const(T: int, V: int, h: int) -> int:
    """The chunk_mem_const the train stage passes Liger: the smallest power of two that gives chunks of at least
    LOSS_CHUNK_MIN_ROWS rows (or all T). Plan and train both call this, so the plan counts the chunk train runs."""
    const = 1
    while liger_loss_chunk_rows(T, V, h, const) < min(T, LOSS_CHUNK_MIN_ROWS):
        const *= 2
    return const
