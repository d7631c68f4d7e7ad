"""loraship/training/loss_chunks.py: Liger's fused loss runs the chunks the plan counts, and the same loss."""

import pytest

from loraship import fused_loss


class RecordingKernel:
    """Stands in for liger_cross_entropy_kernel (a Triton kernel, CUDA only) with its arithmetic for reduction mean:
    records each launch's rows (one program per row), writes each row's loss and its logits' gradient in place."""

    def __init__(self):
        self.rows = []

    def __getitem__(self, grid):
        self.rows.append(grid[0])

        def launch(X_ptr, Y_ptr, loss_ptr, n_non_ignore, ignore_index, reduction, HAS_GRADIENTS, **_):
            import torch

            assert reduction == "mean"
            logits = X_ptr.float()
            keep = Y_ptr != ignore_index
            target = Y_ptr.clamp(min=0)
            loss = logits.logsumexp(-1) - logits.gather(1, target[:, None])[:, 0]
            loss_ptr.copy_(torch.where(keep, loss, 0.0) / n_non_ignore)
            grad = torch.softmax(logits, -1) - torch.nn.functional.one_hot(target, logits.shape[1])
            if HAS_GRADIENTS:
                X_ptr.copy_((grad * keep[:, None] / n_non_ignore).to(X_ptr.dtype))

        return launch


@pytest.mark.parametrize("batch, seq, vocab, width", [(2, 512, 4096, 64), (1, 96, 1000, 32), (4, 300, 2048, 128)])
def test_the_fused_loss_runs_the_chunks_the_plan_counts(monkeypatch, batch, seq, vocab, width):
    import liger_kernel.ops.fused_linear_cross_entropy as liger_flce
    import liger_kernel.transformers.functional as liger_functional
    import torch
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss

    from loraship.training.loss_chunks import widen_loss_chunks

    kernel = RecordingKernel()
    monkeypatch.setattr(liger_flce, "liger_cross_entropy_kernel", kernel)
    # monkeypatch puts Liger's own function back after the test
    monkeypatch.setattr(
        liger_functional, "liger_fused_linear_cross_entropy", liger_functional.liger_fused_linear_cross_entropy
    )
    widen_loss_chunks()
    widen_loss_chunks()  # idempotent: one wrapper, not two

    torch.manual_seed(0)
    hidden = torch.randn(batch, seq, width, requires_grad=True)
    weight = torch.randn(vocab, width) / width**0.5
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, :5] = -100  # a masked prompt
    loss = LigerForCausalLMLoss(hidden, weight, labels, hidden_size=width)
    loss.backward()

    T = batch * seq  # Liger flattens the rows; the shifted labels keep T of them, the last ignored
    rows = fused_loss.liger_loss_chunk_rows(T, vocab, width, fused_loss.loss_chunk_mem_const(T, vocab, width))
    assert kernel.rows[:-1] == [rows] * (len(kernel.rows) - 1) and 0 < kernel.rows[-1] <= rows
    assert sum(kernel.rows) == T
    assert rows == min(T, fused_loss.LOSS_CHUNK_MIN_ROWS) or rows >= fused_loss.LOSS_CHUNK_MIN_ROWS
    assert rows > fused_loss.liger_loss_chunk_rows(T, vocab, width, 1)  # wider than Liger's default

    reference_hidden = hidden.detach().clone().requires_grad_(True)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    reference = torch.nn.functional.cross_entropy((reference_hidden @ weight.T).flatten(0, 1), shifted.flatten())
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(hidden.grad, reference_hidden.grad, rtol=1e-4, atol=1e-6)


def test_the_chunk_rule_matches_liger_and_reaches_the_rows():
    # Gemma 3's 262k vocabulary at 4096 rows: Liger's default is 64 rows a chunk, the rule's 512 (chunk_mem_const 8).
    assert fused_loss.liger_loss_chunk_rows(4096, 262144, 3840, 1) == 64
    assert fused_loss.loss_chunk_mem_const(4096, 262144, 3840) == 8
    # A chunk never exceeds the rows there are, and a vocabulary narrow enough keeps Liger's default.
    const = fused_loss.loss_chunk_mem_const(300, 262144, 3840)
    assert fused_loss.liger_loss_chunk_rows(300, 262144, 3840, const) == 300
    assert fused_loss.loss_chunk_mem_const(16384, 152064, 5120) == 1
