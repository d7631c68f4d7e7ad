"""Live progress and pictures: llama.cpp's output read as progress (recorded and live), rate-limited
log lines, Prefect progress artifacts only inside a run, the train stage's PNGs."""

from __future__ import annotations

import base64
import importlib
import json
import logging
import re
import struct
import sys
import zlib

import pytest

from loraship.config import parse_config
from loraship.runtime.progress import LlamaCppProgress, Progress, in_prefect_run, parse_llamacpp_line
from loraship.runtime.proc import run_child
from tests.conftest import REPO, demo_config_dict

# Recorded from convert_hf_to_gguf.py of llama-cpp-python 0.3.36 on the tiny model's merged folder
# (stderr; tqdm's bar arrives as \r-separated parts) ...
CONVERTER_OUTPUT = (
    "INFO:hf-to-gguf:Loading model: merged\n"
    "INFO:hf-to-gguf:Model architecture: LlamaForCausalLM\n"
    "INFO:hf-to-gguf:gguf: indexing model part 'model.safetensors'\n"
    "INFO:gguf.gguf_writer:gguf: This GGUF file is for Little Endian only\n"
    "INFO:hf-to-gguf:Exporting model...\n"
    "INFO:hf-to-gguf:output.weight,              torch.bfloat16 --> F16, shape = {256, 512}\n"
    "INFO:hf-to-gguf:token_embd.weight,          torch.bfloat16 --> F16, shape = {256, 512}\n"
    "INFO:hf-to-gguf:blk.0.attn_norm.weight,     torch.bfloat16 --> F32, shape = {256}\n"
    "INFO:hf-to-gguf:blk.0.ffn_down.weight,      torch.bfloat16 --> F16, shape = {768, 256}\n"
    "INFO:hf-to-gguf:output_norm.weight,         torch.bfloat16 --> F32, shape = {256}\n"
    "INFO:hf-to-gguf:Set meta model\n"
    "INFO:hf-to-gguf:gguf: context length = 512\n"
    "WARNING:hf-to-gguf:Unknown RoPE type: default\n"
    "INFO:gguf.vocab:Setting special token type bos to 1\n"
    "INFO:gguf.gguf_writer:Writing the following files:\n"
    "INFO:gguf.gguf_writer:/tmp/prog/f16.gguf: n_tensors = 21, total_size = 3.7M\n"
    "\rWriting:   0%|          | 0.00/3.68M [00:00<?, ?byte/s]"
    "\rWriting:  98%|█████████▊| 3.61M/3.68M [00:00<00:00, 32.8Mbyte/s]"
    "\rWriting: 100%|██████████| 3.68M/3.68M [00:00<00:00, 33.1Mbyte/s]\n"
    "INFO:hf-to-gguf:Model successfully exported to /tmp/prog/f16.gguf\n"
)
# ... and from llama_model_quantize (Q4_K_M) on the F16 GGUF it wrote.
QUANTIZER_OUTPUT = (
    "llama_model_loader: loaded meta data with 30 key-value pairs and 21 tensors from /tmp/prog/f16.gguf "
    "(version GGUF V3 (latest))\n"
    "llama_model_loader: - kv   0:                       general.architecture str              = llama\n"
    "llama_model_loader: - type  f16:   16 tensors\n"
    "[   1/  21]                        output.weight - [   256,    512,      1,      1], type =    f16, "
    "converting to q6_K .. size =     0.25 MiB ->     0.10 MiB\n"
    "[   2/  21]                    output_norm.weight - [   256,      1,      1,      1], type =    f32, "
    "size =    0.001 MiB\n"
    "[  21/  21]                  blk.1.ffn_up.weight - [   256,    768,      1,      1], type =    f16, "
    "converting to q4_K .. size =     0.38 MiB ->     0.11 MiB\n"
    "llama_model_quantize_impl: model size  =     3.50 MiB (16.01 BPW)\n"
    "llama_model_quantize_impl: quant size  =     1.08 MiB (4.92 BPW)\n"
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lines_of(text: str) -> list[str]:
    return [part for line in text.split("\n") for part in line.split("\r") if part.strip()]


def messages(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == logging.INFO]


# --- parsing llama.cpp's output -------------------------------------------------------------------
def test_converter_lines_parse_into_tensors_then_bytes_written():
    events = [e for e in map(parse_llamacpp_line, lines_of(CONVERTER_OUTPUT)) if e]
    assert [e.phase for e in events] == ["tensor"] * 5 + ["files"] + ["writing"] * 3
    assert [e.name for e in events[:5]] == [
        "output.weight",
        "token_embd.weight",
        "blk.0.attn_norm.weight",
        "blk.0.ffn_down.weight",
        "output_norm.weight",
    ]
    assert events[5].total == 21 and events[5].name == "3.7M"
    assert [(e.done, e.total) for e in events[6:]] == [(0.0, 3.68e6), (3.61e6, 3.68e6), (3.68e6, 3.68e6)]


def test_quantizer_lines_parse_into_tensor_counts():
    events = [e for e in map(parse_llamacpp_line, lines_of(QUANTIZER_OUTPUT)) if e]
    assert [(e.phase, e.done, e.total, e.name) for e in events] == [
        ("quantize", 1, 21, "output.weight"),
        ("quantize", 2, 21, "output_norm.weight"),
        ("quantize", 21, 21, "blk.1.ffn_up.weight"),
    ]


@pytest.mark.parametrize(
    "line",
    [
        "llama_model_loader: - kv   4:                          llama.block_count u32              = 2",
        "INFO:hf-to-gguf:gguf: embedding length = 256",
        "INFO:hf-to-gguf:Set model tokenizer",
        "Loading weights: 100%|██████████| 21/21 [00:00<00:00, 91.92it/s]",
        "",
    ],
)
def test_other_lines_are_not_progress(line):
    assert parse_llamacpp_line(line) is None


def test_converter_progress_is_rate_limited_per_phase(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="loraship.test")
    reporter = LlamaCppProgress("convert", logging.getLogger("loraship.test"), every=10, clock=clock)
    for line in lines_of(CONVERTER_OUTPUT):
        reporter(line)
        clock.now += 1
    reporter.close()
    said = messages(caplog, "loraship.test")
    assert said == [
        "convert: preparing tensor 1 (output.weight)",
        "convert: preparing tensor 5 (output_norm.weight)",  # the phase's last, held back until it ended
        "convert: writing 21 tensors, 3.7MB",
        "convert: writing 0.00/3.68MB, 0%",
        "convert: writing 3.68M/3.68MB, 100%",
    ]


# --- live, from the real converter and quantizer --------------------------------------------------
def test_real_convert_and_quantize_report_progress_as_they_run(tiny_model, tmp_path, caplog, monkeypatch):
    from loraship.stages.convert import convert
    from loraship.llamacpp.quantizing import quantize

    monkeypatch.setenv("LORASHIP_PROGRESS_S", "3600")  # first and last of each phase only
    caplog.set_level(logging.INFO, logger="loraship")
    convert(tiny_model, tmp_path / "model-F16.gguf")
    quantize(tmp_path / "model-F16.gguf", tmp_path / "model-Q4_K_M.gguf", "Q4_K_M")
    converted, quantized = messages(caplog, "loraship.convert"), messages(caplog, "loraship.quantize")
    assert converted[0].startswith("convert: preparing tensor 1 ("), converted
    assert any(m.startswith("convert: writing 21 tensors") for m in converted), converted
    assert converted[-1].endswith(", 100%") and converted[-1].startswith("convert: writing "), converted
    assert quantized[0].startswith("quantize Q4_K_M: tensor 1/21 (") and quantized[-1].startswith(
        "quantize Q4_K_M: tensor 21/21 ("
    ), quantized
    assert quantized[-1].endswith("100%") and len(quantized) == 2, quantized  # not a line per tensor


# --- the child's pipes ------------------------------------------------------------------------------
def test_a_chatty_child_does_not_block_and_every_line_arrives_in_order(tmp_path):
    """More output on both pipes than a pipe holds (64 KiB on Linux), lines split by \\r and \\n."""
    script = (
        "import sys\n"
        "for i in range(20000):\n"
        "    sys.stderr.write(f'err {i}\\r' if i % 2 else f'err {i}\\n')\n"
        "    sys.stdout.write(f'out {i}\\n')\n"
    )
    seen: list[str] = []
    result = run_child([sys.executable, "-c", script], 60, "chatty child", on_line=seen.append)
    assert result.returncode == 0
    assert [s for s in seen if s.startswith("err")] == [f"err {i}" for i in range(20000)]
    assert [s for s in seen if s.startswith("out")] == [f"out {i}" for i in range(20000)]
    assert result.stderr.splitlines()[-1] == "err 19999" and result.stdout.splitlines()[0] == "out 0"


def test_streamed_child_is_still_killed_on_timeout():
    from loraship.errors import LorashipError

    seen: list[str] = []
    with pytest.raises(LorashipError, match="did not finish within 2 s"):
        run_child(
            [sys.executable, "-c", "import time\nprint('started', flush=True)\ntime.sleep(60)"],
            2,
            "sleeper",
            on_line=seen.append,
        )
    assert seen == ["started"]


# --- Progress itself --------------------------------------------------------------------------------
def test_progress_says_first_every_interval_and_last_with_eta(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="loraship.test")
    progress = Progress("train", 100, logging.getLogger("loraship.test"), every=30, clock=clock)
    for step in range(1, 101):
        clock.now += 2  # 2 s a step
        progress.update(step, f"step {step}/100")
    said = messages(caplog, "loraship.test")
    # step 1, then each 30 s (15 steps), and the last one: not a line per step.
    assert said[0] == "train: step 1/100, 1%"
    assert said[1] == "train: step 16/100, 16%, ETA 2m 48s"  # 84 steps left at 2 s
    assert said[-1] == "train: step 100/100, 100%"
    assert len(said) == 8


def test_progress_outside_prefect_creates_no_artifact(monkeypatch, caplog):
    import prefect.artifacts

    calls = []
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda **kw: calls.append(kw))
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact", lambda **kw: calls.append(kw))
    assert "prefect" in sys.modules and not in_prefect_run()
    caplog.set_level(logging.INFO, logger="loraship.test")
    with Progress("eval", 3, logging.getLogger("loraship.test"), every=0) as progress:
        for batch in (1, 2, 3):
            progress.update(batch, f"batch {batch}/3")
    assert calls == [] and len(messages(caplog, "loraship.test")) == 3


def test_progress_without_prefect_installed_does_not_import_it(tmp_path):
    """A stage image without Prefect (python -m loraship.stages.<stage>): progress neither needs nor imports it."""
    code = (
        "import sys, logging\n"
        "from loraship.runtime.progress import Progress, in_prefect_run\n"
        "assert not in_prefect_run()\n"
        "p = Progress('x', 2, logging.getLogger('loraship'), every=0)\n"
        "p.update(1); p.update(2)\n"
        "assert 'prefect' not in sys.modules\n"
        "print('ok')\n"
    )
    result = run_child([sys.executable, "-c", code], 60, "no prefect", extra_env={"PYTHONPATH": str(REPO)})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_progress_inside_a_flow_run_is_a_prefect_progress_artifact(tmp_path):
    """In a real (ephemeral) Prefect run: one artifact per Progress, at its last percentage."""
    code = """
import json, logging, sys
from prefect import flow
from prefect.client.orchestration import get_client
from loraship.runtime.progress import Progress

@flow
def f():
    p = Progress("train", 4, logging.getLogger("loraship"), key="progress-test", every=0)
    for step in range(1, 5):
        p.update(step, f"step {step}/4")

f()
with get_client(sync_client=True) as client:
    found = [(a.type, a.data, a.description) for a in client.read_artifacts() if a.key == "progress-test"]
print(json.dumps(found))
"""
    env = {
        "PYTHONPATH": str(REPO),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    }
    result = run_child([sys.executable, "-c", code], 300, "flow", extra_env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [["progress", 100, "train: step 4/4, 100%"]]


def test_training_ranks_progress_reaches_the_flow_runs_artifact(tmp_path):
    """Ranks under torchrun have no Prefect run: rank 0 relays its figures through a file and the launcher, inside
    the flow run, mirrors them into the artifact (rank 1 says the same figures and relays none)."""
    (tmp_path / "rank_progress.py").write_text(
        "import logging, os, time\n"
        "from loraship.runtime.progress import Progress\n"
        "p = Progress('train', 4, logging.getLogger('loraship'), key='relay-test', every=0)\n"
        "for step in range(1, 5):\n"
        "    p.update(step, f'step {step}/4 rank {os.environ[\"RANK\"]}')\n"
        "    time.sleep(0.5)\n"
    )
    code = """
import json, sys
from pathlib import Path
from prefect import flow
from prefect.client.orchestration import get_client
from loraship.training import distributed

@flow
def f():
    distributed.launch_ranks("rank_progress", [], 2, Path(sys.argv[1]), resume_hint="")
    return len((Path(sys.argv[1]) / distributed.PROGRESS_FILE).read_text().splitlines())

lines = f()
with get_client(sync_client=True) as client:
    found = [(a.type, a.data, a.description) for a in client.read_artifacts() if a.key == "relay-test"]
print(json.dumps([lines, found]))
"""
    env = {
        "PYTHONPATH": f"{REPO}:{tmp_path}",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "OMP_NUM_THREADS": "1",
    }
    result = run_child([sys.executable, "-c", code, str(tmp_path / "reports")], 300, "flow", extra_env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines, found = json.loads(result.stdout.strip().splitlines()[-1])
    assert lines == 4  # rank 0's four figures, none of rank 1's
    assert found == [["progress", 100, "train: step 4/4 rank 0, 100%"]]


# --- pictures ---------------------------------------------------------------------------------------
def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a well-formed PNG: signature, IHDR first, every chunk's CRC right, IEND last."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND" and pos == len(data)
    return struct.unpack(">II", chunks[0][1][:8])


def test_train_stage_writes_its_pictures_as_manifest_outputs(tiny_model, tmp_path, caplog):
    from PIL import Image

    from loraship.constants import LOSS_PLOT_FILE, MEMORY_PLOT_FILE

    caplog.set_level(logging.INFO, logger="loraship")
    config = parse_config(
        demo_config_dict(tiny_model, tmp_path, run_name="pictures", max_steps=3, save_steps=100, warmup_steps=0)
    )
    manifests = {s: importlib.import_module(f"loraship.stages.{s}").run(config) for s in ("plan", "train")}
    train = manifests["train"]
    folder = tmp_path / "work" / "pictures" / "train"
    assert train["metrics"]["figures"] == [LOSS_PLOT_FILE, MEMORY_PLOT_FILE]
    for name in (LOSS_PLOT_FILE, MEMORY_PLOT_FILE):
        assert name in train["outputs"], train["outputs"].keys()
        data = (folder / name).read_bytes()
        width, height = png_size(data)
        assert width >= 600 and height >= 300
        with Image.open(folder / name) as image:
            image.verify()
            assert image.format == "PNG"
        with Image.open(folder / name) as image:  # drawn on, not blank
            assert len(image.convert("L").getcolors(256)) > 10
    history = [json.loads(line) for line in (folder / "loss_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    said = messages(caplog, "loraship.train")
    steps = [m for m in said if m.startswith("train: step ")]
    assert steps[0].startswith("train: step 1/3, loss ") and " tokens/s" in steps[0]
    assert steps[-1].startswith("train: step 3/3, loss ") and steps[-1].endswith(", 100%")
    assert any(m.startswith("train: eval before (base model): batch 1/1") for m in said), said
    assert any(m.startswith("train: eval after: batch 1/1") for m in said), said

    # Merge reports its shards (the tiny model has one).
    from loraship.stages.merge import merge_shards

    (tmp_path / "merged").mkdir()
    merge_shards(tiny_model, folder / "adapter", tmp_path / "merged")
    assert messages(caplog, "loraship.merge") == ["merge: shard 1/1 (model.safetensors), 100%"]

    # Reference reports its eval texts, then its golden prompts, on the merged model.
    from transformers import AutoModelForCausalLM

    from loraship.runtime.progress import Progress
    from loraship.stages.reference import greedy_answers, log as reference_log, score_eval

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    texts = [{"input_ids": [1, 5, 6, 7, 8], "positions": [0, 1, 2, 3]}, {"input_ids": [1, 9, 10], "positions": [1]}]
    score_eval(model, texts, 4, Progress("reference: eval", len(texts), reference_log, every=0, clock=lambda: 0.0))
    greedy_answers(
        model,
        [{"prompt_ids": [1, 5, 6]}],
        2,
        [],
        Progress("reference: golden", 1, reference_log, every=0, clock=lambda: 0.0),
    )
    assert messages(caplog, "loraship.reference") == [
        "reference: eval: eval text 1/2, 0%",
        "reference: eval: eval text 2/2, 50%",
        "reference: eval: 2 eval texts scored, 100%",
        "reference: golden: golden prompt 1/1, 0%",
        "reference: golden: 1 golden prompts answered, 100%",
    ]

    # The flow attaches the same pictures to a Prefect markdown artifact, embedded as data: URIs.
    from loraship.flows.train_and_ship import _figures_markdown

    markdown = _figures_markdown("train", train)
    embedded = [base64.b64decode(uri) for uri in re.findall(r"\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)]
    assert embedded == [(folder / LOSS_PLOT_FILE).read_bytes(), (folder / MEMORY_PLOT_FILE).read_bytes()]
