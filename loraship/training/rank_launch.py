"""The parent side of training on several devices: start the ranks under torchrun, wait, and say what went wrong.

The train stage runs `launch_ranks`, which runs torchrun through this module's entry (below: it keeps torch's own
ChildFailedError record), relays rank 0's progress figures, and on a failure raises one error built from the ranks'
own reports (`failure_of`): the first rank's LorashipError, `RanksOutOfMemory` (which the stage's re-plan treats as
its own out-of-memory error) or `RankFailed` naming the rank. The ranks' side is loraship.training.distributed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from loraship.errors import LorashipError

REPORTS_ENV = "LORASHIP_RANK_REPORTS"  # the folder where ranks and the launcher leave what went wrong
FAILURES_FILE = "failures.json"
PROGRESS_FILE = "progress.jsonl"  # rank 0's progress figures, relayed to Prefect by the launcher
RELAY_POLL_S = 2.0


class RankFailed(LorashipError):
    """A rank died or failed; the message names it and how the run goes on."""


class RanksOutOfMemory(RuntimeError):
    """A rank ran out of device memory and every rank stopped. A RuntimeError whose message says "out of memory",
    so the train stage's is_out_of_memory re-plans exactly as after its own torch.OutOfMemoryError."""

    def __init__(self, rank: int, message: str, measured: dict | None):
        super().__init__(
            f"rank {rank}: {message}"
            if "out of memory" in message.lower()
            else f"rank {rank}: out of memory: {message}"
        )
        self.rank, self.measured = rank, measured or {}


def torchrun_command(module: str, args: list[str], world_size: int) -> list[str]:
    """torchrun's own command line for `python -m module args` on world_size local ranks, run through this module's
    entry (below) so that a failure comes back as torch's ChildFailedError record rather than log text."""
    return [
        sys.executable,
        "-m",
        __name__,
        "--standalone",
        f"--nproc-per-node={world_size}",
        "--max-restarts=0",
        "-m",
        module,
        *args,
    ]


def launch_ranks(
    module: str,
    args: list[str],
    world_size: int,
    reports: Path,
    *,
    resume_hint: str | Callable[[], str],
    env: dict[str, str] | None = None,
) -> None:
    """Run `module args` on world_size ranks under torchrun and wait; return when every rank succeeded.

    Raises the first rank's LorashipError as it reported it, RanksOutOfMemory when a rank ran out of memory, and
    RankFailed naming the rank, its exit code or signal, for anything else. resume_hint: what a rerun does (where it
    resumes), or a function that says it once the ranks stopped. The ranks lead their own session, killed with this
    process (interrupt or kill -9)."""
    import logging

    from loraship.runtime.progress import ProgressRelay
    from loraship.runtime.proc import child_setup, kill_group

    reports.mkdir(parents=True, exist_ok=True)
    earlier_attempt = [*reports.glob("rank-*.json"), reports / FAILURES_FILE, reports / PROGRESS_FILE]
    for old in earlier_attempt:
        old.unlink(missing_ok=True)
    # The ranks have no Prefect run: rank 0 relays its progress figures, mirrored here into the flow run's artifacts.
    relay = ProgressRelay(reports / PROGRESS_FILE, logging.getLogger("loraship.train"))
    # The ranks are this stage, in this container: they get its environment (the model is resolved already).
    child = {**os.environ, **(env or {}), **relay.env(), REPORTS_ENV: str(reports)}
    proc = subprocess.Popen(
        torchrun_command(module, args, world_size), env=child, start_new_session=True, preexec_fn=child_setup
    )
    try:
        while True:
            try:
                code = proc.wait(timeout=RELAY_POLL_S)
                break
            except subprocess.TimeoutExpired:
                relay.poll()
        relay.poll()
    except BaseException:
        kill_group(proc)
        raise
    kill_group(proc)  # nothing of the group may outlive it and write on
    if code != 0:
        raise failure_of(reports, world_size, code, resume_hint() if callable(resume_hint) else resume_hint)


def failure_of(reports: Path, world_size: int, code: int, resume_hint: str) -> Exception:
    """The error for a torchrun that exited with `code`: the ranks' own reports first (a LorashipError, an
    out-of-memory), then torchrun's failure record (the first rank that died, its exit code or signal)."""
    own = sorted(
        (json.loads(p.read_text(encoding="utf-8")) for p in reports.glob("rank-*.json")),
        key=lambda r: (r.get("kind") != "user_error", r["rank"]),
    )
    if own and own[0]["kind"] == "user_error":
        return LorashipError(own[0]["message"])
    if own and own[0]["kind"] == "out_of_memory":
        return RanksOutOfMemory(own[0]["rank"], own[0]["message"], own[0].get("measured"))
    record = reports / FAILURES_FILE
    failures = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else []
    # The root cause: torchrun stops the others by SIGTERM once one failed, and a rank killed by another signal
    # (SIGKILL: the OOM killer, a scheduler) leaves its peers failing on a closed connection (exit code 1).
    failures.sort(
        key=lambda f: (f.get("signal") == "SIGTERM", f.get("signal") is None, f.get("timestamp", 0), f["rank"])
    )
    if not failures:
        how = f"torchrun exited with code {code} before any rank reported"
        return RankFailed(f"distributed training failed: {how}; {resume_hint}; fix: read the log above for the cause")
    first = failures[0]
    how = f"was killed by {first['signal']}" if first.get("signal") else f"exited with code {first['exitcode']}"
    detail = (first.get("message") or "").strip().splitlines()
    cause = f" ({detail[-1]})" if detail and not first.get("signal") else ""
    return RankFailed(
        f"training rank {first['rank']} of {world_size} {how}{cause}; torchrun stopped the other ranks. "
        f"{resume_hint}; fix: find why rank {first['rank']} stopped (out of host memory? killed by the "
        "scheduler?) and run the same command again"
    )


def _run_torchrun(argv: list[str]) -> int:
    """torch.distributed.run's own parse and launch; its ChildFailedError recorded in REPORTS_ENV/failures.json."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        failures = [
            {
                "rank": rank,
                "local_rank": f.local_rank,
                "exitcode": f.exitcode,
                "pid": f.pid,
                "signal": f.signal_name() if f.exitcode < 0 else None,
                "timestamp": f.timestamp,
                "message": f.message if isinstance(f.message, str) else json.dumps(f.message),
            }
            for rank, f in e.failures.items()
        ]
        folder = os.environ.get(REPORTS_ENV)
        if folder:
            Path(folder, FAILURES_FILE).write_text(json.dumps(failures), encoding="utf-8")
        return 1
    return 0


if __name__ == "__main__":
    # The launcher's entry: torchrun (torch.distributed.run) exactly, with its failure record kept.
    sys.exit(_run_torchrun(sys.argv[1:]))
