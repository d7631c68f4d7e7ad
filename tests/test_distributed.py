"""Training on several ranks (loraship/training/distributed.py), 2 ranks on the CPU with gloo, launched as the train
stage launches them (torchrun), on the tiny model: the same losses and adapter as one process at the same global
batch, for DDP and FSDP2 (LoRA, and QLoRA's NF4 weights sharded); under FSDP2 with LoRA rank 0 alone reads the
weights and the others build the model on the meta device; a killed rank is one clear error and the rerun
resumes; ranks that read different data stop before training. tests/dist_worker.py is the rank's training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loraship.errors import LorashipError
from loraship.training import distributed as dist_lib

REPO = Path(__file__).resolve().parents[1]
ONE_CORE = {"OMP_NUM_THREADS": "1"}  # 2 ranks on a 2-core machine


def run_ranks(tiny_model: Path, out: Path, *args: str, engine: str = "ddp") -> dict:
    out.mkdir(parents=True, exist_ok=True)
    dist_lib.launch_ranks(
        "tests.dist_worker",
        ["--model", str(tiny_model), "--out", str(out), "--engine", engine, "--accum", "2", *args],
        2,
        out / "reports",
        resume_hint="a rerun resumes from the last checkpoint",
        env=ONE_CORE,
    )
    return json.loads((out / "result.json").read_text())


def run_one_process(tiny_model: Path, out: Path, *args: str) -> dict:
    """The same training in one process: accumulation 2 x 2 ranks = 4 micro-batches a step."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.dist_worker",
            "--model",
            str(tiny_model),
            "--out",
            str(out),
            "--engine",
            "single",
            "--accum",
            "4",
            *args,
        ],
        cwd=REPO,
        check=True,
        env={**os.environ, **ONE_CORE},
    )
    return json.loads((out / "result.json").read_text())


def adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "adapter" / "adapter_model.safetensors")


def same_training(got: dict, want: dict, got_out: Path, want_out: Path) -> None:
    assert [h["step"] for h in got["history"]] == [h["step"] for h in want["history"]] == [1, 2, 3, 4, 5]
    assert [h["tokens"] for h in got["history"]] == [h["tokens"] for h in want["history"]]
    assert [h["loss"] for h in got["history"]] == pytest.approx([h["loss"] for h in want["history"]], rel=1e-5)
    a, b = adapter(got_out), adapter(want_out)
    assert sorted(a) == sorted(b) and len(a) == 28  # 7 Linears x 2 layers x (A, B)
    # Trained away from PEFT's zero-initialised B, so the comparison below is not of two untouched adapters.
    assert max(float(t.abs().max()) for k, t in b.items() if "lora_B" in k) > 5e-3
    # Adam divides by the root of the squared gradients: where a gradient is near 0, the sum's rounding (another
    # order over 2 ranks) moves the update by up to lr; 1e-4 is 1% of the largest B after 5 steps.
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3, msg=k)


@pytest.fixture(scope="module")
def one_process(tiny_model, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("one-process")
    return run_one_process(tiny_model, out), out


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_two_ranks_train_the_same_losses_and_adapter_as_one_process(engine, tiny_model, tmp_path, one_process):
    got = run_ranks(tiny_model, tmp_path, engine=engine)
    same_training(got, one_process[0], tmp_path, one_process[1])
    # Step 3 is the epoch's last, of 2 examples: one micro-batch, which rank 1 ran as a stand-in weighing 0.
    assert got["history"][2]["tokens"] < got["history"][1]["tokens"] / 2
    assert got["worst"] == {
        "peak_reserved_gib": 2.0,
        "worst_rank": 1,
        "per_rank": [{"peak_reserved_gib": 1.0}, {"peak_reserved_gib": 2.0}],
    }
    # Each rank starts from one process's adapter: under FSDP2 rank 1's came from rank 0 (its own init was on meta).
    assert [r["start_adapter"] for r in got["loaded"]] == [one_process[0]["loaded"][0]["start_adapter"]] * 2
    if engine == "fsdp2":  # one copy of the weights in host memory: rank 1 never read them, it built them empty
        assert [(r["from_pretrained"], r["meta_parameters"] > 0) for r in got["loaded"]] == [(1, False), (0, True)]
    else:  # DDP holds the whole model on every rank
        assert [(r["from_pretrained"], r["meta_parameters"]) for r in got["loaded"]] == [(1, 0), (1, 0)]


def test_fsdp2_shards_qlora_nf4_weights_and_trains_as_one_process(tiny_model, tmp_path):
    """bnb_4bit_quant_storage as the model's float dtype: fully_shard splits the packed NF4 bytes like any weight,
    and bitsandbytes finds each layer's quantization state again after the all-gather."""
    want = run_one_process(tiny_model, tmp_path / "one", "--adapter", "qlora")
    got = run_ranks(tiny_model, tmp_path / "two", "--adapter", "qlora", engine="fsdp2")
    same_training(got, want, tmp_path / "two", tmp_path / "one")
    # QLoRA loads on every rank, by choice (distributed.QLORA_EVERY_RANK_WHY): NF4's quantization state is no tensor
    # that set_model_state_dict sends. Each rank's seeded LoRA initialisation is the same.
    assert [(r["from_pretrained"], r["meta_parameters"]) for r in got["loaded"]] == [(1, 0), (1, 0)]
    assert len({r["start_adapter"] for r in got["loaded"] + want["loaded"]}) == 1


def test_fsdp2_from_rank_0_keeps_tied_weights_tied(tiny_model, tmp_path):
    """An lm_head sharing the embedding (tie_word_embeddings, as small Qwen and Gemma models): rank 1's empty model
    ties as rank 0's does, and stays tied after its shards arrive, so the ranks shard and gather the same tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    shutil.copytree(tiny_model, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    want = run_one_process(tied, tmp_path / "one")
    got = run_ranks(tied, tmp_path / "two", engine="fsdp2")
    assert [r["from_pretrained"] for r in got["loaded"]] == [1, 0]
    same_training(got, want, tmp_path / "two", tmp_path / "one")


def test_a_killed_rank_is_one_clear_error_and_the_rerun_resumes(tiny_model, tmp_path, one_process):
    with pytest.raises(dist_lib.RankFailed) as e:
        run_ranks(tiny_model, tmp_path, "--kill-at", "3", engine="fsdp2")
    assert "training rank 1 of 2 was killed by SIGKILL" in str(e.value)
    assert "resumes from the last checkpoint" in str(e.value) and "fix:" in str(e.value)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 2
    assert not (tmp_path / "result.json").exists()
    got = run_ranks(tiny_model, tmp_path, engine="fsdp2")
    assert got["resumed_from"] == 2
    same_training(got, one_process[0], tmp_path, one_process[1])


def test_a_rank_out_of_memory_stops_every_rank_as_an_out_of_memory_error(tiny_model, tmp_path):
    """What the train stage's re-plan needs: an error its is_out_of_memory takes, with that rank's measured peak."""
    with pytest.raises(dist_lib.RanksOutOfMemory) as e:
        run_ranks(tiny_model, tmp_path, "--oom-at", "2")
    assert e.value.rank == 1 and e.value.measured == {"peak_reserved_gib": 9.5}
    assert str(e.value).startswith("rank 1: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 1


def test_ranks_that_read_different_data_stop_before_training(tiny_model, tmp_path):
    with pytest.raises(
        LorashipError, match=r"2 training ranks disagree before training: data: rank\(s\) 1 differ"
    ) as e:
        run_ranks(tiny_model, tmp_path, "--skew")
    assert "config" not in str(e.value).split("fix:")[0] and "fix: every rank must read the same" in str(e.value)
    assert not (tmp_path / "checkpoint.pt").exists()


# --- the pieces, without processes -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n,world,want",
    [
        (4, 2, [[0, 1], [2, 3]]),
        (3, 2, [[0, 1], [2, None]]),  # the short last step: rank 1 pads with a stand-in
        (1, 2, [[0], [None]]),
        (5, 4, [[0, 1], [2, 3], [4, None], [None, None]]),
    ],
)
def test_every_rank_runs_as_many_micro_steps_and_each_micro_batch_trains_once(n, world, want):
    group = list(range(n))
    shares = [dist_lib.rank_share(group, r, world) for r in range(world)]
    assert [[g if counts else None for g, counts in share] for share in shares] == want
    assert sorted(g for share in shares for g, counts in share if counts) == group


def test_engine_and_rank_count_are_checked():
    assert dist_lib.engine_of(None) == dist_lib.Engine("single", 1)
    assert dist_lib.engine_of({"gpus": 2, "engine": "fsdp2", "fits": True}) == dist_lib.Engine("fsdp2", 2)
    with pytest.raises(LorashipError, match="unknown distributed engine 'zero3'; fix"):
        dist_lib.Engine("zero3", 2)
    with pytest.raises(LorashipError, match="engine ddp on 1 rank"):
        dist_lib.engine_of({"gpus": 1, "engine": "ddp"})


def test_only_fsdp2_with_lora_leaves_the_weights_to_rank_0():
    fsdp2, ddp = dist_lib.Engine("fsdp2", 4), dist_lib.Engine("ddp", 4)
    rank = {r: dist_lib.Rank(r, 4, r, "cpu", "gloo") for r in (0, 3)}
    assert dist_lib.rank0_loads_weights(fsdp2, "lora") and not dist_lib.rank0_loads_weights(fsdp2, "qlora")
    assert not dist_lib.rank0_loads_weights(ddp, "lora")
    assert [dist_lib.loads_weights(fsdp2, rank[r], "lora") for r in (0, 3)] == [True, False]
    assert dist_lib.loads_weights(fsdp2, rank[3], "qlora") and dist_lib.loads_weights(ddp, rank[3], "lora")
    assert dist_lib.loads_weights(dist_lib.ONE_PROCESS.engine, None, "lora")


def test_cpu_ranks_from_the_environment(monkeypatch):
    monkeypatch.delenv(dist_lib.CPU_RANKS_ENV, raising=False)
    assert dist_lib.cpu_ranks() is None
    monkeypatch.setenv(dist_lib.CPU_RANKS_ENV, "2")
    assert dist_lib.cpu_ranks() == 2
    monkeypatch.setenv(dist_lib.CPU_RANKS_ENV, "two")
    with pytest.raises(LorashipError, match="LORASHIP_CPU_RANKS='two' is not a number of ranks; fix"):
        dist_lib.cpu_ranks()


def test_a_rank_out_of_memory_is_an_out_of_memory_error_for_the_re_plan(tmp_path):
    (tmp_path / "rank-1.json").write_text(
        json.dumps(
            {
                "rank": 1,
                "kind": "out_of_memory",
                "measured": {"x": 1},
                "message": "CUDA out of memory. Tried to allocate 2 GiB",
            }
        )
    )
    error = dist_lib.failure_of(tmp_path, 2, 1, "resumes")
    assert isinstance(error, dist_lib.RanksOutOfMemory) and error.rank == 1 and error.measured == {"x": 1}
    assert "out of memory" in str(error).lower() and isinstance(error, RuntimeError)


def test_the_rank_killed_by_a_signal_is_named_not_the_peers_it_broke(tmp_path):
    (tmp_path / dist_lib.FAILURES_FILE).write_text(
        json.dumps(
            [
                {
                    "rank": 0,
                    "exitcode": 1,
                    "signal": None,
                    "timestamp": 10,
                    "message": "RuntimeError: Connection closed by peer",
                },
                {
                    "rank": 1,
                    "exitcode": -9,
                    "signal": "SIGKILL",
                    "timestamp": 10,
                    "message": "Signal 9 (SIGKILL) received",
                },
                {"rank": 2, "exitcode": -15, "signal": "SIGTERM", "timestamp": 9, "message": ""},
            ]
        )
    )
    error = dist_lib.failure_of(tmp_path, 3, 1, "a rerun resumes from step 4")
    assert isinstance(error, dist_lib.RankFailed)
    assert str(error).startswith(
        "training rank 1 of 3 was killed by SIGKILL; torchrun stopped the other ranks. "
        "a rerun resumes from step 4; fix:"
    )


# --- the train stage on 2 CPU ranks --------------------------------------------------------------------------
def test_the_train_stage_on_two_cpu_ranks_trains_as_one_process(tiny_model, tmp_path, monkeypatch, capfd):
    """`gpus: 2` with LORASHIP_CPU_RANKS=2: the stage starts itself under torchrun (DDP, the plan's choice where the
    model fits one device), checkpoints on the way, and leaves one adapter and train_metrics.json whose losses are
    those of one process at the same global batch (micro-batch 4 x accumulation 2). FSDP2 too (forced: the tiny
    model fits one device), its rank 1 building the model empty and getting its shards from rank 0."""
    import importlib

    from loraship.config import parse_config
    from loraship.runtime.stage import stage_dir
    from tests.conftest import demo_config_dict

    common = dict(max_steps=4, num_epochs=1, micro_batch_size=4, save_steps=2, warmup_steps=0, device="cpu")
    configs = {
        "one": parse_config(
            demo_config_dict(tiny_model, tmp_path / "one", run_name="one", gradient_accumulation_steps=2, **common)
        ),
        **{
            name: parse_config(
                demo_config_dict(
                    tiny_model, tmp_path / name, run_name=name, gradient_accumulation_steps=1, gpus=2, **common
                )
            )
            for name in ("two", "fsdp2")
        },
    }
    train_stage = importlib.import_module("loraship.stages.train")
    planned = train_stage.training_engine
    metrics = {}
    for name, config in configs.items():
        if name != "one":
            monkeypatch.setenv(dist_lib.CPU_RANKS_ENV, "2")
        if name == "fsdp2":
            monkeypatch.setattr(
                train_stage,
                "training_engine",
                lambda ctx, c, device: (
                    dist_lib.Engine("fsdp2", 2),
                    {**planned(ctx, c, device)[1], "engine": "fsdp2"},
                ),
            )
        capfd.readouterr()
        for stage in ("plan", "train"):
            manifest = importlib.import_module(f"loraship.stages.{stage}").run(config)
        said = "".join(capfd.readouterr())  # the ranks log to the stage's own output
        assert (
            "FSDP2: rank 0 alone reads the base weights; the other 1 rank(s) build the model on the meta device"
            in said
        ) == (name == "fsdp2")
        metrics[name] = json.loads((stage_dir(config, "train") / "train_metrics.json").read_text())
        assert manifest["metrics"]["steps"] == metrics[name]["steps"] == 4
    assert metrics["fsdp2"]["distributed"]["engine"] == "fsdp2"
    one, two = metrics["one"], metrics["two"]
    assert one["distributed"]["engine"] == "single" and one["distributed"]["ranks"] == 1
    assert two["distributed"]["engine"] == "ddp" and two["distributed"]["ranks"] == 2
    assert (two["strategy"]["micro_batch_size"], two["strategy"]["gradient_accumulation_steps"]) == (4, 1)
    assert (one["strategy"]["micro_batch_size"], one["strategy"]["gradient_accumulation_steps"]) == (4, 2)
    assert two["train_tokens_this_run"] == one["train_tokens_this_run"] > 0
    curves = {
        name: [json.loads(line) for line in (stage_dir(c, "train") / "loss_history.jsonl").read_text().splitlines()]
        for name, c in configs.items()
    }
    from safetensors.torch import load_file

    for name in ("two", "fsdp2"):
        assert [h["step"] for h in curves[name]] == [h["step"] for h in curves["one"]] == [1, 2, 3, 4]
        assert [h["loss"] for h in curves[name]] == pytest.approx(
            [h["loss"] for h in curves["one"]], rel=1e-5, abs=2e-6
        )
        assert metrics[name]["eval_loss_after"] == pytest.approx(one["eval_loss_after"], rel=1e-5)
        assert metrics[name]["eval_loss_after"] < metrics[name]["eval_loss_before"]
        a, b = (
            load_file(stage_dir(configs[n], "train") / "adapter" / "adapter_model.safetensors") for n in (name, "one")
        )
        assert sorted(a) == sorted(b) and a
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3, msg=f"{name}: {k}")
    # The checkpoint rank 0 wrote at step 2, in the one format any number of ranks resumes.
    state = torch.load(
        stage_dir(configs["two"], "train") / "checkpoints" / "last" / "trainer_state.pt", weights_only=True
    )
    assert state["step"] == 2 and state["world_size"] == 2


@pytest.mark.parametrize("world_size, batches", [(2, 5), (3, 5), (2, 4), (4, 2)])
def test_ranks_share_the_eval_and_add_up_to_one_processs_loss(monkeypatch, world_size, batches):
    """Each rank evaluates every world_size-th batch and the sums are added: one process's mean loss, each rank
    running as many forwards (FSDP2's forward is a collective), a padding forward counted for nothing."""
    from types import SimpleNamespace

    from loraship.data import IGNORE_INDEX
    from loraship.training import evaluation

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.forwards = 0

        def forward(self, input_ids, attention_mask, labels):
            self.forwards += 1
            return SimpleNamespace(loss=input_ids.float().mean() / 10)  # differs per batch

    examples = [
        {"input_ids": [i + 1] * (3 + i % 4), "labels": [IGNORE_INDEX] + [i + 1] * (2 + i % 4)}
        for i in range(batches * 2)
    ]
    one = evaluation.evaluate(Model(), examples, 2, 0, "cpu")
    partial, forwards = [], []
    monkeypatch.setattr(dist_lib, "all_sum", lambda values, rank: partial.append(values) or values)
    for r in range(world_size):
        model = Model()
        evaluation.evaluate(model, examples, 2, 0, "cpu", rank=SimpleNamespace(rank=r, world_size=world_size))
        forwards.append(model.forwards)
    total, count = (sum(p[i] for p in partial) for i in (0, 1))
    assert total / count == pytest.approx(one, rel=1e-12)
    assert len(set(forwards)) == 1 and forwards[0] == -(-batches // world_size)
