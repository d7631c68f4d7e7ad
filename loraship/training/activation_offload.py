"""Checkpointed layers whose saved input waits in pinned CPU memory instead of on the GPU.

With gradient checkpointing every checkpointed decoder layer keeps one tensor until its backward: its
input hidden states (micro_batch x sequence_len x hidden, bf16), 1.5 GiB over the 28 layers of a 7B
at 2 x 4096 tokens. Unsloth moves those to CPU memory; this is loraship's version, installed as the
checkpointing function transformers calls for each flagged layer (`_gradient_checkpointing_func`,
called as fn(partial(forward, **kwargs), hidden_states)):

- forward: the layer runs without autograd (as reentrant checkpointing does); its input is copied
  to a pinned CPU buffer on a side CUDA stream, so the copy overlaps the next layer's compute. Two
  layers on, the compute stream waits for that copy's event (done by then) and the GPU input is let
  go, so its memory returns in stream order; the last two layers' inputs stay on the GPU for backward.
- backward (last layer first): the input comes back to the GPU, the layer is recomputed with autograd
  under the RNG state of its forward (same dropout masks), and its backward runs. Entering layer i's
  backward starts copying layer i-1's input back on the side stream, so it is on the GPU by the time
  layer i is done. A layer whose input did not arrive early is copied synchronously.

At most two layers' inputs are on the GPU at once (the one computing and the one prefetched), which is
what loraship/planning/estimate.py budgets. The pinned buffers are kept from step to step (one per layer).
"""

from __future__ import annotations

import torch

from loraship.training.offload import Transfer
from loraship.training.recompute import recomputing


class _Saved:
    __slots__ = ("device", "cpu", "done", "source", "gpu", "ready")

    def __init__(self, x: torch.Tensor):
        self.device = x.device
        self.cpu = None
        self.done = None  # event: the copy to CPU finished
        self.source = None  # the GPU input itself, held until its copy is known to be done
        self.gpu = None  # prefetched copy back
        self.ready = None  # event: the prefetched copy arrived


class ActivationOffload:
    """One per model: the checkpointing function of each checkpointed layer (`for_layer(i)`).

    Copies back to the GPU go through loraship/training/offload.py's Transfer, as the streamed weights do: its side
    stream, allocation on the compute stream, and events (on the CPU a copy is the tensor itself).
    """

    def __init__(self):
        self.transfer = Transfer()
        self.saved: dict[int, _Saved] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self.last_saved = -1
        # Backward's inputs by where they came from (the scheduling runs on the CPU too, so tests can check
        # it): still resident, prefetched in time, or copied on demand.
        self.resident = 0
        self.prefetched = 0
        self.synchronous = 0

    def for_layer(self, index: int):
        def checkpoint(fn, hidden_states, *args):
            if torch.is_grad_enabled() and not hidden_states.requires_grad:
                # The layer runs without autograd: only an input that requires grad brings its backward.
                raise RuntimeError(
                    "activation offload needs decoder-layer inputs that require grad; call "
                    "model.enable_input_require_grads() after enabling gradient checkpointing"
                )
            return _OffloadedLayer.apply(self, index, fn, hidden_states, *args)

        return checkpoint

    def _buffer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        # Flat and only ever grown: rows change length from step to step, and pinning memory costs far more
        # than the copy itself, so a step reuses the largest buffer so far through a view of its shape.
        buf = self.buffers.get(index)
        if buf is None or buf.numel() < x.numel() or buf.dtype != x.dtype:
            buf = torch.empty(x.numel(), dtype=x.dtype, pin_memory=True)
            self.buffers[index] = buf
        return buf[: x.numel()].view(x.shape)

    def _release(self, saved: _Saved) -> None:
        # The compute stream waits for the copy out (long done by now: it ran beside the layer after), then the
        # input's memory returns to the allocator in compute-stream order. Unlike record_stream, this holds no
        # block back however far the CPU runs ahead of the GPU. It also orders every later copy back (queued
        # after compute work, by Transfer) behind the copy out.
        if saved.source is not None:
            if saved.done is not None:
                torch.cuda.current_stream(saved.device).wait_event(saved.done)
            saved.source = None

    def save(self, index: int, x: torch.Tensor) -> _Saved:
        if index <= self.last_saved:  # a new forward pass: what is left of the last one is stale
            for old in self.saved.values():
                self._release(old)
            self.saved.clear()
        self.last_saved = index
        saved = _Saved(x)
        self.saved[index] = saved
        if x.device.type == "cuda":
            side = self.transfer.side(x.device)
            buf = self._buffer(index, x)
            side.wait_stream(torch.cuda.current_stream(x.device))  # x is complete before it is copied
            with torch.cuda.stream(side):
                buf.copy_(x.detach(), non_blocking=True)
                saved.done = torch.cuda.Event()
                saved.done.record(side)
            saved.cpu = buf
        else:
            saved.cpu = x.detach()  # nothing to move off a CPU device; the bookkeeping stays the same
        saved.source = x.detach()
        # Two layers back, the copy had a whole layer's compute to finish in: let that input go.
        before = self.saved.get(index - 2)
        if before is not None:
            self._release(before)
        return saved

    def prefetch(self, index: int) -> None:
        saved = self.saved.get(index)
        if saved is None or saved.gpu is not None or saved.source is not None:
            return  # unknown, already coming, or still on the GPU (the last layers of forward)
        (saved.gpu,), saved.ready = self.transfer.start([saved.cpu], saved.device)

    def load(self, index: int) -> torch.Tensor:
        saved = self.saved.pop(index)
        if saved.source is not None:  # one of the last layers of forward: never left the GPU
            self.resident += 1
            x, saved.source = saved.source, None
            return x
        if saved.gpu is None:  # released, so compute already waited for the copy out
            self.synchronous += 1
            return self.transfer.now(saved.cpu, saved.device)
        self.prefetched += 1
        return self.transfer.ready(saved.gpu, saved.ready)


class _OffloadedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, offload: ActivationOffload, index: int, fn, hidden_states: torch.Tensor, *args):
        ctx.offload, ctx.index, ctx.fn, ctx.args = offload, index, fn, args
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden_states.device) if hidden_states.is_cuda else None
        # Backward runs outside the forward's autocast region: the recompute re-enters it (as torch's checkpoint does).
        kind = hidden_states.device.type
        ctx.autocast = (kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind))
        offload.save(index, hidden_states)
        with torch.no_grad():
            out = fn(hidden_states, *args)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):
        offload, index = ctx.offload, ctx.index
        x = offload.load(index)
        if index > 0:
            offload.prefetch(index - 1)  # overlaps this layer's recompute and backward
        x = x.detach().requires_grad_(True)
        devices = [x.device] if x.is_cuda else []
        kind, dtype, enabled = ctx.autocast
        # recomputing(): a marked down_proj skips its GEMM, whose output nothing reads
        # (loraship/training/recompute.py).
        with (
            torch.random.fork_rng(devices=devices),
            torch.enable_grad(),
            torch.autocast(kind, dtype, enabled),
            recomputing(),
        ):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            out = ctx.fn(x, *ctx.args)
        outs = out if ctx.tuple_out else (out,)
        pairs = [
            (o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, x.grad) + (None,) * len(ctx.args)


def offload_checkpointed_activations(layers: list, k: int) -> ActivationOffload:
    """Make the first k decoder layers (the checkpointed ones) keep their input in pinned CPU memory."""
    offload = ActivationOffload()
    for i, layer in enumerate(layers[:k]):
        layer._gradient_checkpointing_func = offload.for_layer(i)
    return offload
