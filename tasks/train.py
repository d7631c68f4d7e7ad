"""Train: a LoRA or QLoRA adapter with transformers + PEFT, resumable step by step.

A plain loop rather than HF Trainer so that resume is exact: the data order is a seeded
permutation per epoch (loraship/training/packing.py), and a checkpoint holds adapter, optimizer, scheduler,
step and RNG state (CPU, CUDA, Python), so a rerun after kill -9 continues the same loss curve at
the same data position. Examples are packed padding-free where the model allows it, each attending to
itself only (loraship/training/packed_attention.py). On CUDA it records measured peak memory next to the
plan's prediction; an out-of-memory error releases the failed attempt, re-plans along the plan's own ladder
(smaller micro-batch, then the config's `fallback`), persists the new plan so a rerun starts from it, and
retries instead of failing.

This module is the orchestration: read the plan, load the data, train one attempt (train_once) until one fits,
write the manifest. The pieces live in loraship/training/: model_loading (the base with its adapter), batches,
step_loop, evaluation, checkpoints (resume), out_of_memory (the re-plan loop), throughput, device, distributed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loraship.models import config_json
from loraship.constants import (
    CHECKPOINTS_DIR,
    LOSS_HISTORY_FILE,
    LOSS_PLOT_FILE,
    MEMORY_PLOT_FILE,
    STRATEGY_FILE,
)
from loraship.data import load_splits
from loraship.models import check_base_model, hf_offline_if_local, resolve_base_model
from loraship.planning.plan_record import Plan
from loraship.publishing import plots
from loraship.runtime.manifest import atomic_write_json, atomic_write_text, sha256_json
from loraship.runtime.progress import Progress, artifact_key
from loraship.runtime.stage import exclusive, main, open_stage, reset_dir
from loraship.training import distributed
from loraship.training.batches import Batches, use_packing
from loraship.training.checkpoints import load_checkpoint, resume_words, save_adapter
from loraship.training.device import configure_cuda_allocator, peak_memory, pick_device, release_memory
from loraship.training.evaluation import evaluate, evaluate_base
from loraship.training.experts import ExpertGradientCheck
from loraship.training.gradient_checkpointing import decoder_layers
from loraship.training.model_loading import (
    LoadedModel,
    host_copy_stats,
    import_training_stack,
    load_model,
    load_tokenizer,
    read_model_config,
)
from loraship.training.out_of_memory import Attempts, is_out_of_memory, starting_plan, train_until_it_fits
from loraship.training.gc_pauses import setup_frozen
from loraship.training.step_loop import StepLoop, make_optimizer, run_steps
from loraship.training.throughput import flops_per_token, steady_rate, utilisation

STAGE = "train"
UPSTREAM = ("plan",)
# Training depends on the plan's strategy only, not its inference estimates (`loraship status` keys it the same way).
DEPENDS_ON = {"plan": (STRATEGY_FILE,)}
FIELDS = (
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "train_router",
    "sequence_len",
    "truncation",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "weight_decay",
    "num_epochs",
    "max_steps",
    "seed",
    "optimize",
    "gradient_checkpointing",
    "fused_loss",
    "datasets",
    "eval_datasets",
    "val_set_size",
    "device",
    "packing",
    "fallback",
    "offload_activations",
    "chat_template",
    "thinking",
    "train_on_inputs",
)
RANKS_DIR = "ranks"  # in the stage folder: what the ranks were given (job.json), their reports, rank 0's result
RANK_JOB_ARG = "--rank-job"  # python -m loraship.stages.train --rank-job FILE: one rank, as torchrun starts it
log = logging.getLogger("loraship.train")


def train_once(
    config,
    ctx,
    model_dir: Path,
    plan: Plan,
    device: str,
    tokenizer,
    train,
    evaluation,
    ranks: distributed.Ranks = distributed.ONE_PROCESS,
    model_config: dict | None = None,
) -> dict:
    """One attempt at training `plan` to the end (resuming its checkpoints), evals before and after; the adapter and
    the loss history written to the stage folder. Raises what the attempt raised (out of memory too).
    `model_config`: the base's config.json as the stage parsed it (read here when not given)."""
    import torch

    from loraship.training.fused_lora import casts_kept_until_step  # torch: not on a rerun with nothing to do

    strategy = plan.strategy
    model_config = read_model_config(model_dir) if model_config is None else model_config
    torch.manual_seed(config.seed)
    loaded = load_model(model_dir, config, plan, device, ranks.engine, ranks.rank, model_config)
    model = loaded.model
    # DDP around it, or FSDP2's shards in place (its parameters replaced: the optimizer is made after), filled from
    # rank 0's weights where only rank 0 read them.
    from_rank0 = distributed.rank0_loads_weights(ranks.engine, strategy.adapter)
    wrapped = distributed.wrap(model, ranks.engine, ranks.rank, decoder_layers(model), from_rank0=from_rank0)
    resident_gib = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else None
    packed, packing_why = use_packing(config, model, device)
    batches = Batches.of(config, strategy, train.examples, packed, tokenizer, ranks.world_size)
    opt = make_optimizer(config, model, batches.total_steps(config))
    # A MoE's expert LoRA, checked after the first optimizer step (loraship/training/experts.py).
    expert_check = ExpertGradientCheck(model, opt.optimizer, len(loaded.experts.tensors) if loaded.experts else 0)
    eval_before = eval_loss(
        config, loaded, evaluation, batches, device, "train: eval before (base model)", ranks.rank, base=True
    )
    eval_peak = peak_memory(device)
    # The evaluation's activations and logits are free now; hand their cached blocks back so that
    # training's own peak, not the eval's leftovers, shapes the allocator's segments.
    release_memory(device)
    resumed_from, history = load_checkpoint(ctx.dir / CHECKPOINTS_DIR, wrapped, opt.optimizer, opt.scheduler)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    per_token = flops_per_token(model_config, config, batches.lengths)
    progress = Progress("train", opt.total_steps, log, key=artifact_key(config.run_name, STAGE, "progress"))
    # No full collection walking the model mid-step; release_memory above was the collection before the freeze.
    # A's and B's bf16 casts made once per optimizer step, not at every forward and recompute (fused_lora.py).
    kept_casts = casts_kept_until_step(opt.optimizer, enabled=ranks.engine.name != "fsdp2")
    with setup_frozen() as gc_pauses, kept_casts:
        loop = StepLoop(resumed_from, history, started=time.perf_counter(), after_step=gc_pauses.step_done)
        run_steps(config, ctx.dir / CHECKPOINTS_DIR, wrapped, ranks, batches, opt, loop, per_token, device, progress)
        seconds = time.perf_counter() - loop.started
    measured = distributed.worst_rank_memory(peak_memory(device), ranks.rank)  # the card that limits the plan
    eval_after = eval_loss(config, loaded, evaluation, batches, device, "train: eval after", ranks.rank)
    save_adapter(ctx.dir, wrapped, tokenizer, loop.history)
    if measured:
        measured.update(
            allocated_after_load_gib=resident_gib, eval_peak_reserved_gib=eval_peak.get("peak_reserved_gib")
        )
    return {
        "steps": opt.total_steps,
        "resumed_from_step": resumed_from,
        "eval_loss_before": eval_before,
        "eval_loss_after": eval_after,
        "first_loss": loop.history[0]["loss"] if loop.history else None,
        "last_loss": loop.history[-1]["loss"] if loop.history else None,
        "packing": {"packed": packed, "why": packing_why},
        "attention": {
            "implementation": model.config._attn_implementation,
            "why": packing_why if packed else loaded.attention_why,
        },
        **attempt_metrics(loaded, loop, seconds, per_token, device),
        "python_gc": gc_pauses.as_json(),
        "expert_lora": expert_record(loaded, expert_check),
        "measured_memory": measured,
    }


def expert_record(loaded: LoadedModel, check: ExpertGradientCheck) -> dict | None:
    """What the manifest says of a MoE's experts (None for a dense model): the tensors adapted, the routers trained,
    and which experts' LoRA the first optimizer step reached."""
    plan = loaded.experts
    if plan is None:
        return None
    return {
        "tensors_adapted": len(plan.tensors),
        "tensors_in_model": len(plan.all_experts),
        "routers_trained": len(plan.router),
        "first_step_gradients": check.as_json(),
    }


def eval_loss(
    config,
    loaded: LoadedModel,
    evaluation,
    batches: Batches,
    device: str,
    title: str,
    rank: distributed.Rank | None = None,
    base: bool = False,
) -> float | None:
    """The eval split's loss per target token, of the base alone (the adapter switched off) where `base`; its
    progress under the stage's eval key."""
    progress = Progress(title, None, log, key=artifact_key(config.run_name, STAGE, "eval-progress"))
    measure = evaluate_base if base else evaluate
    examples, batch_size = evaluation.examples, max(1, batches.micro)
    return measure(loaded.model, examples, batch_size, batches.pad_id, device, progress, loaded.fused_loss, rank)


def attempt_metrics(loaded: LoadedModel, loop: StepLoop, seconds: float, per_token: float | None, device: str) -> dict:
    """The attempt's speed and what load_model applied, for the manifest."""
    steady, steady_basis = steady_rate(loop.stamps)
    return {
        "fused_lora_linears": loaded.fused_lora,
        # Checkpointed layers whose recompute leaves out down_proj's GEMM by loraship's mark (a frozen down_proj whose
        # layer input stays on the GPU is left out by torch's early stop, not counted here).
        "down_proj_skipped_in_recompute": loaded.recompute_skips,
        "host_copies": host_copy_stats(loaded),
        "train_tokens_this_run": loop.tokens_seen,
        # Steady state (warm-up steps left out), the rate the run sustains; the whole run's rate next to it.
        "tokens_per_s": steady,
        "tokens_per_s_basis": steady_basis,
        "tokens_per_s_overall": round(loop.tokens_seen / seconds, 1) if seconds > 0 else None,
        **utilisation(steady, per_token, device),
        "seconds": round(seconds, 2),
    }


def train_attempt(
    config,
    ctx,
    model_dir: Path,
    plan: Plan,
    device: str,
    tokenizer,
    train,
    evaluation,
    engine: distributed.Engine,
    model_config: dict | None = None,
) -> dict:
    """train_once in this process, or on the engine's ranks, each running train_once on its share of every step."""
    if not engine.distributed:
        return train_once(
            config, ctx, model_dir, plan, device, tokenizer, train, evaluation, model_config=model_config
        )
    return train_on_ranks(config, ctx, model_dir, plan, device, engine)


def train_on_ranks(config, ctx, model_dir: Path, plan: Plan, device: str, engine: distributed.Engine) -> dict:
    """One attempt on engine.world_size ranks: this stage again under torchrun in this container (serve_rank_job);
    rank 0's result. Raises what a rank raised: its LorashipError, RanksOutOfMemory (which the re-plan takes for its
    own out-of-memory error), or RankFailed naming a rank that died and where a rerun resumes."""
    folder = ctx.dir / RANKS_DIR
    job = distributed.RankJob(
        config=config.model_dump(mode="json"),
        stage_dir=str(ctx.dir),
        model_dir=str(model_dir),
        plan=plan.to_json(),
        engine=engine.name,
        world_size=engine.world_size,
        device=device,
        result_file=str(folder / "result.json"),
    )
    folder.mkdir(parents=True, exist_ok=True)
    job.write(folder / "job.json")
    log.info("train: %s on %d ranks (%s), under torchrun", engine.name, engine.world_size, device)
    distributed.launch_ranks(
        f"loraship.stages.{STAGE}",
        [RANK_JOB_ARG, str(folder / "job.json")],
        engine.world_size,
        folder,
        resume_hint=lambda: resume_words(ctx.dir / CHECKPOINTS_DIR),
    )
    return json.loads(Path(job.result_file).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class RankStage:
    """The stage folder as a rank sees it: train_once reads and writes there only (checkpoints, adapter, history)."""

    dir: Path


def serve_rank_job(job_file: Path) -> int:
    """One rank (python -m loraship.stages.train --rank-job FILE, as torchrun starts it): the job's config, data and
    plan, checked equal on every rank before training, then train_once on this rank's share; the exit code."""
    from loraship.config import parse_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    job = distributed.RankJob.read(job_file)
    configure_cuda_allocator()

    def work(rank: distributed.Rank) -> dict:
        config = parse_config(job.config)
        hf_offline_if_local(config)
        model_dir = Path(job.model_dir)
        tokenizer = load_tokenizer(model_dir, config)
        train, evaluation = load_splits(config, tokenizer)
        distributed.check_same_inputs(
            rank,
            {
                "config": config.fingerprint(),
                "plan": sha256_json(job.plan),
                "train data": sha256_json([e["input_ids"] for e in train.examples]),
                "eval data": sha256_json([e["input_ids"] for e in evaluation.examples]),
            },
        )
        plan = Plan.from_json(job.plan)
        import_training_stack(plan.strategy, job.device)
        ranks = distributed.Ranks(distributed.Engine(job.engine, job.world_size), rank)
        return train_once(
            config,
            RankStage(Path(job.stage_dir)),
            model_dir,
            plan,
            job.device,
            tokenizer,
            train,
            evaluation,
            ranks,
        )

    return distributed.serve_rank(
        work,
        job.device,
        Path(job.result_file),
        is_out_of_memory=is_out_of_memory,
        measure=lambda: peak_memory(job.device),
    )


def training_engine(staged: Plan, config, device: str) -> tuple[distributed.Engine, dict]:
    """The engine and number of ranks for the devices visible here, from the plan stage's multi-GPU record
    (preflight.check_training_gpus, whose errors name the fix before any weight loads); the option, for the
    manifest. On a CPU the ranks are LORASHIP_CPU_RANKS (1 when unset)."""
    from loraship.planning.preflight import check_training_gpus

    record = dict(staged.distributed) if staged.distributed is not None else None
    option = check_training_gpus(config, record, distributed.visible_devices(device))
    return distributed.engine_of(option), option


def draw_figures(config, folder: Path, result: dict, predicted: dict, device: str, trained_as: str) -> list[str]:
    """The loss curves and the memory plan as PNGs in the stage folder (outputs of its manifest)."""
    history = [json.loads(line) for line in (folder / LOSS_HISTORY_FILE).read_text(encoding="utf-8").splitlines()]
    plots.loss_curves(
        history,
        folder / LOSS_PLOT_FILE,
        eval_before=result["eval_loss_before"],
        eval_after=result["eval_loss_after"],
        steps=result["steps"],
        title=f"{config.run_name}: loss ({trained_as})",
    )
    # The budget line only where a GPU measured something: on the CPU it would dwarf the predicted bar.
    plots.memory_plan(
        predicted,
        result["measured_memory"],
        folder / MEMORY_PLOT_FILE,
        device=device,
        budget_gib=config.gpu_memory_gib if device == "cuda" else None,
        title=f"{config.run_name}: training memory, plan vs measured ({trained_as})",
    )
    return [LOSS_PLOT_FILE, MEMORY_PLOT_FILE]


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS, depends_on=DEPENDS_ON)
    if ctx.done:
        return ctx.done
    plots.require_matplotlib()
    # Keep checkpoints only when they belong to these exact inputs (resume after a crash).
    marker = ctx.dir / CHECKPOINTS_DIR / "fingerprint"
    keep = (CHECKPOINTS_DIR,) if marker.is_file() and marker.read_text() == ctx.fingerprint else ()
    reset_dir(ctx, keep=keep)
    atomic_write_text(marker, ctx.fingerprint)

    allocator = configure_cuda_allocator()
    hf_offline_if_local(config)
    model_dir = resolve_base_model(config, weights=True)
    check_base_model(config, model_dir)
    device = pick_device(config)
    tokenizer = load_tokenizer(model_dir, config)
    train, evaluation = load_splits(config, tokenizer)
    # Read once: the plan record carries what train reads of the model; the planner sees it again only to re-plan.
    model_config = config_json(model_dir)
    start, staged = starting_plan(ctx, config, model_config, device)
    engine, option = training_engine(staged, config, device)
    import_training_stack(start.strategy, device)
    result, final = train_until_it_fits(
        config,
        ctx,
        model_config,
        start,
        device,
        lambda plan: train_attempt(
            config, ctx, model_dir, plan, device, tokenizer, train, evaluation, engine, model_config
        ),
    )
    metrics = {
        **result,
        "device": device,
        # The engine and ranks it trained on (one process: single on 1), and why the plan chose them.
        "distributed": {"engine": engine.name, "ranks": engine.world_size, "why": option.get("why")},
        **trained_with(final),
        "cuda_allocator": allocator if device == "cuda" else None,
        "oom_retries": list(final.failed),
        # Re-plans that changed the base's precision and so trained again from step 0 (set_checkpoints_aside).
        "restarted_from_step_0": list(final.restarts),
        **data_metrics(config, train, evaluation),
        "predicted_reserved_gib": final.plan.memory.predicted_reserved_gib,
        "predicted_allocated_gib": final.plan.memory.predicted_allocated_gib,
        "data_fingerprint": sha256_json([e["input_ids"] for e in train.examples]),
        "figures": draw_figures(
            config, ctx.dir, result, final.plan.memory.to_json(), device, f"{final.strategy.adapter} on {device}"
        ),
    }
    atomic_write_json(ctx.dir / "train_metrics.json", metrics)
    return ctx.finish(metrics, outputs=None)


def trained_with(final: Attempts) -> dict:
    """What trained, for the manifest: the strategy, in words, the Linears adapted, and why this plan."""
    plan = final.plan
    return {
        "strategy": plan.strategy.to_json(),
        "trained_as": plan.strategy.describe(plan.model.decoder_layers),
        # The Linears adapted, as the architecture names them (Phi-3: qkv_proj, gate_up_proj), and why when a fused
        # one adapts more projections than the config named.
        "lora_modules": list(plan.lora_modules),
        "lora_modules_note": plan.lora_modules_note,
        "strategy_reason": plan.reason,
    }


def data_metrics(config, train, evaluation) -> dict:
    return {
        "train_examples": len(train.examples),
        "eval_examples": len(evaluation.examples),
        "train_tokens": train.tokens,
        "truncated_examples": train.truncated + evaluation.truncated,
        "dropped_examples": train.dropped + evaluation.dropped,
        "truncation_policy": config.truncation,
    }


if __name__ == "__main__":
    if sys.argv[1:2] == [RANK_JOB_ARG]:
        sys.exit(serve_rank_job(Path(sys.argv[2])))
    main(run)
