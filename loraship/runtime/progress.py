"""Live progress of long steps: rate-limited INFO log lines, mirrored as a Prefect progress artifact.

A stage reports `Progress.update(done, detail)`; this module adds the percentage and an ETA and
decides when to say it: the first update, then at most every LORASHIP_PROGRESS_S seconds
(default 15), and the last one, never a line per token or tensor. Inside a Prefect flow or task
run the same figure goes into a progress artifact (created on the first update, updated on the
same cadence); outside one (`python -m loraship.stages.<stage>`, tests) that part is skipped without
importing Prefect, which the stage images need not have.

`LlamaCppProgress` reads llama.cpp's converter and quantizer output, line by line as it streams
(loraship/runtime/proc.py), into Progress updates.

A child process has no Prefect run (training ranks under torchrun): where its parent set LORASHIP_PROGRESS_RELAY,
the child's rank 0 appends each figure it says to that file, and the parent's `ProgressRelay` mirrors them into the
same artifacts from the flow run's own process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass

PROGRESS_S_ENV = "LORASHIP_PROGRESS_S"
DEFAULT_EVERY_S = 15.0
PROGRESS_RELAY_ENV = "LORASHIP_PROGRESS_RELAY"


def every_s() -> float:
    value = os.environ.get(PROGRESS_S_ENV)
    try:
        return max(0.0, float(value)) if value else DEFAULT_EVERY_S
    except ValueError:
        return DEFAULT_EVERY_S


def in_prefect_run() -> bool:
    """True inside a Prefect flow or task run. Prefect not imported means no run: a flow imports it."""
    if "prefect" not in sys.modules:
        return False
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """Progress of one long step (training, an evaluation, a merge, a conversion, a quantization).

    what: the step's name, first in every line ("train", "convert: writing").
    total: units of work when known (steps, batches, shards, tensors, bytes); None shows no percentage.
    key: Prefect artifact key; each step gets its own so that train and eval do not overwrite each other.
    """

    def __init__(
        self,
        what: str,
        total: float | None,
        logger: logging.Logger,
        *,
        key: str | None = None,
        every: float | None = None,
        clock=time.monotonic,
    ):
        self.what, self.total, self.log, self.key = what, total, logger, key
        self.every = every_s() if every is None else every
        self.clock = clock
        self.first: tuple[float, float] | None = None  # (time, done) at the first update: the ETA's base
        self.last_said = -float("inf")
        self.last: tuple[float, str] | None = None  # the latest update, said or not
        self.said_last = False
        self.artifact = None  # Prefect artifact id, or None
        self.mirror = in_prefect_run()
        # Outside a run, a parent's relay file (rank 0 only: the other ranks say the same figures).
        relay = os.environ.get(PROGRESS_RELAY_ENV)
        self.relay = relay if relay and key and not self.mirror and os.environ.get("RANK", "0") == "0" else None

    def update(self, done: float, detail: str = "", total: float | None = None) -> None:
        if total is not None:
            self.total = total
        now = self.clock()
        if self.first is None:
            self.first = (now, done)
        self.last, self.said_last = (done, detail), False
        finished = self.total is not None and done >= self.total
        if now - self.last_said >= self.every or finished:
            self._say(now, done, detail)

    def close(self) -> None:
        """Say the latest update if the rate limit held it back (a step may end short of its total)."""
        if self.last is not None and not self.said_last:
            self._say(self.clock(), *self.last)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()

    def percent(self, done: float) -> float | None:
        if not self.total:
            return None
        return max(0.0, min(100.0, 100.0 * done / self.total))

    def eta_s(self, now: float, done: float) -> float | None:
        if not self.total or self.first is None:
            return None
        t0, done0 = self.first
        if done <= done0 or now <= t0:
            return None
        return (now - t0) / (done - done0) * max(0.0, self.total - done)

    def message(self, now: float, done: float, detail: str) -> str:
        parts = [detail] if detail else []
        pct = self.percent(done)
        if pct is not None:
            parts.append(f"{pct:.0f}%")
        eta = self.eta_s(now, done)
        if eta is not None and done < (self.total or 0):
            parts.append(f"ETA {format_duration(eta)}")
        return f"{self.what}: " + ", ".join(parts)

    def _say(self, now: float, done: float, detail: str) -> None:
        self.last_said, self.said_last = now, True
        text = self.message(now, done, detail)
        self.log.info("%s", text)
        pct = self.percent(done)
        if self.mirror and pct is not None:
            self._mirror(pct, text)
        elif self.relay and pct is not None:
            self._relay(pct, text)

    def _relay(self, pct: float, text: str) -> None:
        # One short line per write: the reader (ProgressRelay.poll) takes whole lines only.
        try:
            with open(self.relay, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": self.key, "what": self.what, "pct": pct, "text": text}) + "\n")
        except OSError as e:
            self.relay = None
            self.log.warning("%s: progress no longer relayed to the parent (%s)", self.what, e)

    def _mirror(self, pct: float, text: str) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        try:
            if self.artifact is None:
                self.artifact = create_progress_artifact(progress=pct, key=self.key, description=text)
            else:
                update_progress_artifact(artifact_id=self.artifact, progress=pct, description=text)
        except Exception as e:  # noqa: BLE001 - an unreachable or refusing API must not stop a training run
            self.mirror = False
            self.log.warning("%s: progress no longer mirrored to Prefect (%s: %s)", self.what, type(e).__name__, e)


class ProgressRelay:
    """The parent's side of LORASHIP_PROGRESS_RELAY: `poll()` mirrors the figures a child appended since the last
    poll into Prefect progress artifacts, one per key, from this process (inside the flow run). Logs nothing: the
    child's own lines reach the stage log already. Outside a Prefect run it reads nothing."""

    def __init__(self, path, logger: logging.Logger):
        self.path, self.log, self.offset = path, logger, 0
        self.active = in_prefect_run()
        self.mirrors: dict[str, Progress] = {}

    def env(self) -> dict[str, str]:
        """What the child's environment needs (nothing outside a Prefect run)."""
        return {PROGRESS_RELAY_ENV: str(self.path)} if self.active else {}

    def poll(self) -> int:
        """Mirror every complete new line; returns how many."""
        if not self.active:
            return 0
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        lines = [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]
        for line in lines:
            mirror = self.mirrors.get(line["key"])
            if mirror is None:
                mirror = self.mirrors[line["key"]] = Progress(line["what"], 100.0, self.log, key=line["key"])
            if mirror.mirror:
                mirror._mirror(line["pct"], line["text"])
        return len(lines)


# -- llama.cpp's converter (convert_hf_to_gguf.py) and quantizer (llama_model_quantize) output ------------
# Lines as llama-cpp-python 0.3.36's llama.cpp prints them (captured from the tiny model in tests/test_progress.py):
#   INFO:hf-to-gguf:blk.0.attn_q.weight,        torch.bfloat16 --> F16, shape = {256, 256}
#   INFO:gguf.gguf_writer:/tmp/x.gguf: n_tensors = 21, total_size = 3.7M
#   Writing:  98%|█████████▊| 3.61M/3.68M [00:00<00:00, 32.8Mbyte/s]      (tqdm, parts split by \r)
#   [   3/  21] token_embd.weight - [   256,    512,      1,      1], type =    f16, converting to q4_K .. size = ...
_CONVERT_TENSOR = re.compile(r"^INFO:hf-to-gguf:(?P<name>[^\s,]+),\s+\S+ --> (?P<type>\w+), shape = ")
_CONVERT_FILES = re.compile(r"^INFO:gguf\.gguf_writer:.*: n_tensors = (?P<n>\d+), total_size = (?P<size>\S+)")
_WRITING = re.compile(r"^Writing:\s+(?P<pct>\d+)%\|.*?\|\s*(?P<done>[\d.]+[kMGTP]?)/(?P<total>[\d.]+[kMGTP]?)")
_QUANT_TENSOR = re.compile(r"^\[\s*(?P<i>\d+)/\s*(?P<n>\d+)\]\s+(?P<name>\S+)")
_SI = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}  # tqdm's unit_scale divides by 1000


@dataclass(frozen=True)
class ToolLine:
    """What one line of llama.cpp output says about progress."""

    phase: str  # "tensor" (converter prepares one), "files" (about to write), "writing", "quantize"
    done: float | None = None
    total: float | None = None
    name: str = ""  # a tensor's name, or the written sizes as tqdm shows them


def si_number(text: str) -> float:
    unit = text[-1] if text[-1] in "kMGTP" else ""
    return float(text[: len(text) - len(unit)]) * _SI[unit]


def parse_llamacpp_line(line: str) -> ToolLine | None:
    """The progress a converter or quantizer output line reports, or None for any other line."""
    line = line.strip()
    if m := _QUANT_TENSOR.match(line):
        return ToolLine("quantize", int(m["i"]), int(m["n"]), m["name"])
    if m := _CONVERT_TENSOR.match(line):
        return ToolLine("tensor", name=m["name"])
    if m := _CONVERT_FILES.match(line):
        return ToolLine("files", total=int(m["n"]), name=m["size"])
    if m := _WRITING.match(line):
        return ToolLine("writing", si_number(m["done"]), si_number(m["total"]), f"{m['done']}/{m['total']}")
    return None


class LlamaCppProgress:
    """on_line callback for loraship.runtime.proc.run_child: converter/quantizer lines into Progress updates,
    one Progress per phase (preparing tensors, writing, quantizing), so each phase has its own ETA."""

    def __init__(
        self,
        what: str,
        logger: logging.Logger,
        key: str | None = None,
        every: float | None = None,
        clock=time.monotonic,
    ):
        self.what, self.log, self.key, self.every, self.clock = what, logger, key, every, clock
        self.phase: str | None = None
        self.progress: Progress | None = None
        self.tensors = 0

    def _phase(self, phase: str, total: float | None = None) -> Progress:
        if self.phase != phase:
            self.close()
            self.phase = phase
            self.progress = Progress(self.what, total, self.log, key=self.key, every=self.every, clock=self.clock)
        return self.progress

    def __call__(self, line: str) -> None:
        event = parse_llamacpp_line(line)
        if event is None:
            return
        if event.phase == "tensor":
            self.tensors += 1
            self._phase("tensor").update(self.tensors, f"preparing tensor {self.tensors} ({event.name})")
        elif event.phase == "files":
            self.close()
            self.log.info("%s: writing %d tensors, %sB", self.what, event.total, event.name)
        elif event.phase == "writing":
            self._phase("writing", event.total).update(event.done, f"writing {event.name}B", total=event.total)
        elif event.phase == "quantize":
            self._phase("quantize", event.total).update(
                event.done, f"tensor {event.done}/{event.total} ({event.name})", total=event.total
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.progress, self.phase = None, None
