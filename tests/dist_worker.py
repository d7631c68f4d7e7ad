"""One rank of a tiny LoRA training for tests/test_distributed.py, or the same training in one process.

The train stage's step (a seeded epoch order, micro-batches weighted by their share of the step's target tokens,
clipping, AdamW, a checkpoint every step) on the library's distributed pieces, small enough for the CPU:

    python -m tests.dist_worker --model DIR --out DIR --engine single --accum 4           # one process
    python -m torch.distributed.run --nproc-per-node 2 -m tests.dist_worker ... --engine ddp --accum 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
from pathlib import Path

from loraship.data import IGNORE_INDEX
from loraship.training import distributed as dist_lib
from loraship.training.packing import collate_padded, epoch_steps, steps_per_epoch

N_EXAMPLES = 18  # micro 2 x accumulation 2 x 2 ranks = 8 a step: two full steps and one of 2 (one rank idles)
SEED = 5


def examples(skew: bool) -> list[dict]:
    rng = random.Random(SEED)
    out = []
    for _ in range(N_EXAMPLES + (1 if skew else 0)):
        ids = [rng.randrange(3, 500) for _ in range(rng.randrange(6, 30))]
        prompt = rng.randrange(1, 4)
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


LOADS = []  # this process's calls of from_pretrained: the evidence that a rank never read the weights


def load(model_dir: str, adapter: str, engine, rank):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {}
    if adapter == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
            **dist_lib.quantization_storage(engine, torch.float32),
        )

    def from_pretrained():
        LOADS.append(model_dir)
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)

    model = dist_lib.load_base(
        engine,
        rank,
        adapter,
        load=from_pretrained,
        build=lambda: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32),
    )
    meta = sum(p.is_meta for p in model.parameters())
    for module in model.modules():  # as tasks/train.py: bitsandbytes' CPU inference layout cannot train
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    model.config.use_cache = False
    # The same seed on every rank: the same LoRA initialisation (FSDP2 keeps each rank's own shard of it).
    torch.manual_seed(0)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    model.train()
    return model, [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)], meta


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--engine", default="single")
    p.add_argument("--adapter", default="lora")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=0, help="rank 1 kills itself by SIGKILL mid-way through this step")
    p.add_argument("--oom-at", type=int, default=0, help="rank 1 runs out of memory mid-way through this step")
    p.add_argument("--skew", action="store_true", help="rank 1 reads one example more")
    a = p.parse_args()
    out = Path(a.out)
    if not dist_lib.in_ranks():
        (out / "result.json").write_text(json.dumps(work(a, None)))
        return
    import torch

    raise SystemExit(
        dist_lib.serve_rank(
            lambda rank: work(a, rank),
            "cpu",
            out / "result.json",
            is_out_of_memory=lambda e: isinstance(e, torch.OutOfMemoryError),
            measure=lambda: {"peak_reserved_gib": 9.5},
        )
    )


def work(a, rank) -> dict:
    engine = dist_lib.Engine(a.engine, rank.world_size if rank else 1)
    data = examples(a.skew and rank is not None and rank.rank == 1)
    if rank:
        digest = hashlib.sha256(json.dumps([e["input_ids"] for e in data]).encode()).hexdigest()
        dist_lib.check_same_inputs(rank, {"config": json.dumps(vars(a), sort_keys=True), "data": digest})
    return train(a, Path(a.out), engine, rank, data)


def train(a, out: Path, engine, rank, data: list[dict]) -> dict:
    import torch

    model, layers, meta = load(a.model, a.adapter, engine, rank)
    wrapped = dist_lib.wrap(model, engine, rank, layers, from_rank0=dist_lib.rank0_loads_weights(engine, a.adapter))
    # Each rank's full copy of the starting adapter (rank 0's initialisation, sent to the others' shards).
    start = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
        for k, v in wrapped.model.state_dict().items()
        if "lora_" in k
    }
    trainable = [p for p in wrapped.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-3)
    lengths = [len(e["input_ids"]) for e in data]
    accum = a.accum * engine.world_size  # micro-batches of one global step, as one process would run them
    per_epoch = steps_per_epoch(len(data), a.micro, accum)
    state_file = out / "checkpoint.pt"
    step, history = 0, []
    if state_file.is_file():  # every rank loads what rank 0 saved
        state = torch.load(state_file, weights_only=True)
        dist_lib.load_adapter_file(wrapped, out / "checkpoint-adapter" / "adapter_model.safetensors")
        dist_lib.load_optimizer_state(wrapped, optimizer, state["optimizer"])
        step, history = state["step"], state["history"]
    resumed_from = step
    me = rank.rank if rank else 0
    while step < a.steps:
        epoch, within = divmod(step, per_epoch)
        group = epoch_steps(lengths, a.micro, accum, SEED, epoch, None)[within]
        step_targets = sum(
            1 for rows in group for row in rows for i in row for t in data[i]["labels"][1:] if t != IGNORE_INDEX
        )
        share = dist_lib.rank_share(group, me, engine.world_size)
        local_loss, local_tokens = 0.0, 0
        for m, (rows, counts) in enumerate(share):
            batch = [data[i] for row in rows for i in row]
            ids, labels, mask = collate_padded(batch, 0)
            n = int((labels[:, 1:] != IGNORE_INDEX).sum()) if counts else 0
            with dist_lib.accumulating(wrapped, final=m == len(share) - 1):
                loss = wrapped.module(input_ids=ids, attention_mask=mask, labels=labels).loss
                (loss * (n / step_targets) * dist_lib.gradient_scale(engine)).backward()
            local_loss += float(loss.detach()) * n / step_targets
            local_tokens += int(mask.sum()) if counts else 0
            if a.kill_at == step + 1 and me == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if a.oom_at == step + 1 and me == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a test's stand-in)")
        step_loss, tokens = dist_lib.all_sum([local_loss, local_tokens], rank)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        history.append({"step": step, "loss": step_loss, "tokens": tokens})
        # As the train stage checkpoints: PEFT's adapter files, the optimizer state keyed by parameter name.
        dist_lib.save_adapter_dir(wrapped, out / "checkpoint-adapter", me == 0)
        state = {"optimizer": dist_lib.optimizer_state(wrapped, optimizer), "step": step, "history": history}
        if me == 0:
            torch.save(state, out / "checkpoint.tmp")
            os.replace(out / "checkpoint.tmp", state_file)
        dist_lib.barrier(rank)
    dist_lib.save_adapter_dir(wrapped, out / "adapter", me == 0)
    worst = dist_lib.worst_rank_memory({"peak_reserved_gib": 1.0 + me}, rank)
    digest = hashlib.sha256(b"".join(start[k].numpy().tobytes() for k in sorted(start))).hexdigest()
    loaded = gather({"from_pretrained": len(LOADS), "meta_parameters": meta, "start_adapter": digest}, rank)
    return {"history": history, "resumed_from": resumed_from, "worst": worst, "loaded": loaded}


def gather(mine: dict, rank) -> list[dict]:
    """Every rank's `mine`, in rank order (one process: its own)."""
    if rank is None:
        return [mine]
    import torch.distributed as dist

    out: list = [None] * rank.world_size
    dist.all_gather_object(out, mine)
    return out


if __name__ == "__main__":
    main()
