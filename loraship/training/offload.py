"""Partial CPU offload of frozen base weights for bf16 LoRA training.

Some decoder layers keep their frozen Linear weights in pinned CPU memory; each forward
(and each recompute under gradient checkpointing) copies the weight to the GPU just for that
matmul, and autograd frees the copy once backward no longer needs it. LoRA weights, norms,
embeddings and every other layer stay on the GPU.

Which layers: the train stage checkpoints the first k layers (loraship/training/gradient_checkpointing.py), and a
streamed layer must be one of them (otherwise autograd keeps its copy from forward to backward). Streaming n of the
first k lets a plan checkpoint only k of L: the memory streaming frees pays for the later layers' saved activations,
whose recompute is then saved (loraship/planning/strategy.py trades the two). The plan streams the first n, or spreads
them evenly over the first k (Strategy.streamed): then a copy has the forward of the layers between two streamed
ones to hide behind, where one layer's forward can be shorter than its copy (a 14B layer on a PCIe 5.0 H100).

Overlap: the copies are prefetched. When a streamed layer starts, its weights were already
copied on a side CUDA stream, and the copy of the streamed layer that runs next starts, so the PCIe
transfer runs while the layers up to it compute. Forward visits the streamed layers in ascending
order; non-reentrant gradient checkpointing recomputes them in descending order during backward,
so the prefetch follows that direction there. The last streamed layer's recompute is copied ahead
when backward starts recomputing the layer after it (or, where it is the model's last layer, as soon as
forward is done with it, whose recompute is backward's first work). At most two layers'
copies are waiting at once, the current one and the next: loraship/planning/estimate.py budgets exactly two
layers on the GPU. A prefetch is only a head start: a layer that was not prefetched is copied when
it starts, and waited for, so a wrong guess costs time, never correctness.

Why not accelerate's device_map={"...": "cpu"}: its offload hooks leave the weights on the meta
device, PEFT then creates the layers' LoRA weights there too, and training fails (seen on the
H200: "CUDA error: an illegal memory access", bench/results/gpu_train_stage.json).
"""

from __future__ import annotations


class Transfer:
    """Copies weights to the device. On CUDA prefetches go on a side stream; elsewhere (CPU tests)
    a copy is the tensor itself, so the scheduling logic runs unchanged without a GPU."""

    def __init__(self):
        self.streams = {}

    def now(self, cpu_weight, device):
        # On the current stream: ordered with the compute that uses it, no event needed.
        return cpu_weight.to(device, non_blocking=True)

    def side(self, device):
        """The side stream of `device` (one per device, created on first use)."""
        import torch

        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def start(self, cpu_weights, device):
        """Begin copying; returns (copies, done). Each copy then goes through `ready` or `drop`."""
        import torch

        if device.type != "cuda":
            return [w.to(device) for w in cpu_weights], None
        side, compute = self.side(device), torch.cuda.current_stream(device)
        # Allocated on the compute stream, like the copies before prefetch: its blocks come back in
        # stream order, so the memory of a layer that compute is done with serves the next prefetch,
        # however far the CPU runs ahead (side-stream blocks would need record_stream, whose events
        # hold memory back until the GPU catches up: more than two layers' worth).
        copies = [torch.empty_like(w, device=device) for w in cpu_weights]
        side.wait_stream(compute)  # those blocks may still be read by compute work already queued
        with torch.cuda.stream(side):
            for copy, w in zip(copies, cpu_weights):
                copy.copy_(w, non_blocking=True)  # async: the source is pinned
            done = torch.cuda.Event()
            done.record(side)
        return copies, done

    def ready(self, copy, done):
        """Make a prefetched copy safe to use on the current (compute) stream."""
        if done is not None:
            import torch

            done.wait(torch.cuda.current_stream(copy.device))  # compute must not read a half-copied weight
        return copy

    def drop(self, copies, done):
        """Prefetched copies never used: order their write before compute reuses the memory."""
        for copy in copies[:1]:  # one event covers the whole layer
            self.ready(copy, done)


class Prefetcher:
    """Decides which offloaded layer to copy next and holds the copies until their matmul runs.

    `layers[i]` are the streaming Linear modules of the i-th offloaded layer, in model order. A layer
    pass (its forward, or its recompute) starts when one of its modules asks for a weight and either
    another layer asked last or this module was already served in the current pass. A pass at or
    below the previous one in the same step is a recompute: backward is walking down.
    """

    def __init__(self, layers, recompute_follows, transfer=None, ends_model=True):
        self.layers = layers
        self.recompute_follows = recompute_follows  # () -> bool: will backward recompute these layers?
        self.transfer = transfer or Transfer()
        # Whether the last streamed layer is the model's last decoder layer: then backward starts with its
        # recompute; otherwise with the layers after it, and next_layer_ran() says when to copy it ahead.
        self.ends_model = ends_model
        self.held = {}  # layer -> ({module: copy}, done): copied, not used yet
        self.current, self.backward, self.used = None, False, set()
        self.next_layer_runs = 0
        # Since the start, for the train manifest: layer passes (a forward or a recompute of one streamed layer) and
        # those whose layer was not copied ahead (each then waits for its copy).
        self.passes, self.late = 0, 0

    def step(self, device):
        """A new forward pass: drop what the previous one copied and never used; copy the first layer."""
        for k in list(self.held):
            self._drop(k)
        self.current, self.backward, self.used = None, False, set()
        self.next_layer_runs = 0
        self._prefetch(0, device)

    def next_layer_ran(self, device):
        """The decoder layer after the last streamed one starts: its forward, then (when checkpointed) its recompute in
        backward, which comes right before the last streamed layer's own recompute: copy that one now."""
        self.next_layer_runs += 1
        if self.next_layer_runs == 2 and self.recompute_follows():
            self._prefetch(len(self.layers) - 1, device)

    def weight(self, i, module, device):
        """The weight of `module` (in offloaded layer i) on `device`, ready for the current stream."""
        if i != self.current or module in self.used:
            self.backward = self.current is not None and i <= self.current
            self.current, self.used = i, set()
            self.passes += 1
            if i not in self.held:  # not foreseen: the whole layer now, in one go, rather than a matmul at a time
                self.late += 1
                self._prefetch(i, device)
            self._prefetch(i - 1 if self.backward else i + 1, device)
        self.used.add(module)
        copies, done = self.held.get(i, ({}, None))
        copy = copies.pop(module, None)  # let go of it: from here autograd alone keeps it alive
        if not copies:
            self.held.pop(i, None)
        if copy is None:  # a safety net (a pass copies its whole layer): copy it now, on the compute stream
            weight = self.transfer.now(module._loraship_cpu_weight, device)
        else:
            weight = self.transfer.ready(copy, done)
        if (
            self.ends_model
            and not self.backward
            and i == len(self.layers) - 1
            and len(self.used) == len(self.layers[i])
            and self.recompute_follows()
        ):
            self._prefetch(i, device)  # backward starts with this layer's recompute
        return weight

    def _prefetch(self, j, device):
        # Only the current layer's copies may stay: anything else is a guess that did not come true.
        for k in [k for k in self.held if k != self.current]:
            self._drop(k)
        if 0 <= j < len(self.layers) and j not in self.held:
            modules = self.layers[j]
            copies, done = self.transfer.start([m._loraship_cpu_weight for m in modules], device)
            self.held[j] = (dict(zip(modules, copies)), done)

    def _drop(self, k):
        copies, done = self.held.pop(k)
        self.transfer.drop(list(copies.values()), done)


def _streaming_forward(module, prefetcher, i):
    import torch.nn.functional as F

    def forward(x):
        # A fresh GPU tensor per call: autograd keeps it alive exactly as long as backward needs it.
        return F.linear(x, prefetcher.weight(i, module, x.device), module.bias)

    return forward


def offload_frozen_layers(model, layers: int | list[int], transfer: Transfer | None = None) -> int:
    """Move the frozen Linear weights of some decoder layers to pinned CPU memory.

    `layers`: their indices (the plan's Strategy.streamed), or n for the first n. Call on the PEFT model while it is
    still on the CPU, before `model.to("cuda")`. Those layers must be among the checkpointed ones (the
    first k). Returns the number of bytes kept off the GPU. `transfer` replaces the copy mechanism (tests).
    """
    import torch

    stack = model.get_base_model().model
    all_layers = list(stack.layers)
    positions = list(range(layers)) if isinstance(layers, int) else sorted(set(layers))
    if positions and not 0 <= positions[0] <= positions[-1] < len(all_layers):
        raise ValueError(f"streamed layers {positions} outside the model's {len(all_layers)} decoder layers")
    decoder_layers = [all_layers[i] for i in positions]
    kept, streamed = 0, []
    for layer in decoder_layers:
        modules = [m for m in layer.modules() if type(m) is torch.nn.Linear and not m.weight.requires_grad]
        for module in modules:
            cpu_weight = module.weight.data.pin_memory() if torch.cuda.is_available() else module.weight.data
            kept += cpu_weight.numel() * cpu_weight.element_size()
            module._loraship_cpu_weight = cpu_weight  # a plain attribute: .to("cuda") leaves it alone
            module.weight = torch.nn.Parameter(torch.empty(0, dtype=cpu_weight.dtype), requires_grad=False)
        streamed.append(modules)
    if not any(streamed):
        return kept

    grad_at_step = {"enabled": False}  # autograd's mode when the decoder stack started this forward

    def recompute_follows():
        # The conditions under which transformers' GradientCheckpointingLayer checkpoints a layer. Grad mode as the
        # stack started: loraship/training/activation_offload.py runs a checkpointed layer's forward without autograd.
        layer = decoder_layers[-1]
        return getattr(layer, "gradient_checkpointing", False) and layer.training and grad_at_step["enabled"]

    def start_step(device):
        grad_at_step["enabled"] = torch.is_grad_enabled()
        prefetcher.step(device)

    ends_model = positions[-1] == len(all_layers) - 1
    prefetcher = Prefetcher(streamed, recompute_follows, transfer, ends_model=ends_model)
    stack._loraship_prefetcher = prefetcher  # its passes and late counts: the train manifest's host_copies
    for i, modules in enumerate(streamed):
        for module in modules:
            module.forward = _streaming_forward(module, prefetcher, i)
            # The same copy for a fused LoRA Linear above it (loraship/training/fused_lora.py), which keeps it
            # for backward as F.linear would.
            module._loraship_weight_on = (lambda m, k: lambda device: (prefetcher.weight(k, m, device), None))(
                module, i
            )
    first = next(m for modules in streamed for m in modules)
    # The decoder stack runs once per forward pass (only the layers inside it are recomputed).
    stack.register_forward_pre_hook(lambda mod, args: start_step(first.weight.device))
    if not ends_model:
        # transformers' checkpointing recomputes a layer's forward without its module hooks, but its submodules run
        # through theirs: the input norm starts the layer in forward and again in its recompute, right before the
        # last streamed layer's. A layer without one (no family loraship trains) only loses the head start.
        after = all_layers[positions[-1] + 1]
        norm = getattr(after, "input_layernorm", None)
        if isinstance(norm, torch.nn.Module):
            norm.register_forward_pre_hook(lambda mod, args: prefetcher.next_layer_ran(first.weight.device))
    return kept
