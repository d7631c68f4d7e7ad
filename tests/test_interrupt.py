"""An interrupted run never blocks the next one: GPU slots of dead holders are taken over, the wait for a live one
is said, and `loraship run` ends on Ctrl-C or SIGTERM in one line (exit 130 / 143), keeping its checkpoints."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from loraship.runtime import gpu_slot, locks
from tests.conftest import REPO

HOLD_SLOT = """
import sys, time
from pathlib import Path
from loraship.runtime.gpu_slot import file_slot
with file_slot(Path(sys.argv[1]), "other", "train", count=1):
    print("held", flush=True)
    time.sleep(600)
"""


def hold_slot(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_SLOT, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_gpu_slot_of_a_killed_holder_is_taken_over(tmp_path, caplog):
    proc = hold_slot(tmp_path)
    kill9(proc)
    assert (tmp_path / "slot-0.lock").exists()  # kill -9 leaves the file behind
    with caplog.at_level(logging.WARNING, logger="loraship"):
        with gpu_slot.file_slot(tmp_path, "next", "train", count=1, timeout=30) as path:
            assert json.loads(path.read_text())["run"] == "next"
    assert f"pid {proc.pid} on host" in caplog.text and "no longer running" in caplog.text
    assert not (tmp_path / "slot-0.lock").exists()


def test_gpu_slot_wait_names_the_holder_and_since_when_and_repeats(tmp_path, caplog):
    proc = hold_slot(tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="loraship"):
            with pytest.raises(locks.LockTimeout, match=r"run 'other' \(train, pid \d+") as e:
                with gpu_slot.file_slot(tmp_path, "next", "train", count=1, timeout=4, wait_log_s=1):
                    pass
    finally:
        kill9(proc)
    waits = [r.getMessage() for r in caplog.records if "waiting for the GPU slot held by" in r.getMessage()]
    assert len(waits) >= 2, caplog.text  # said again while the wait goes on
    assert all(f"run 'other' (train, pid {proc.pid} on host {locks.host()!r}) since 20" in w for w in waits), waits
    assert gpu_slot.SLOTS_ENV in str(e.value)


def test_a_second_slot_is_free_while_the_first_is_held(tmp_path):
    proc = hold_slot(tmp_path)
    try:
        with gpu_slot.file_slot(tmp_path, "next", "verify", count=2, timeout=30) as path:
            assert path.name == "slot-1.lock"
    finally:
        kill9(proc)


def test_no_prefect_limit_without_a_configured_server(tiny_model, tmp_path, monkeypatch):
    """Under `loraship run`'s temporary server a Prefect slot would outlive a killed run (its lease dies with the
    server, the count stays in PREFECT_HOME's database): only the slot files are used there."""
    import prefect.concurrency.sync

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv(gpu_slot.DIR_ENV, str(tmp_path / "gpu"))
    monkeypatch.setattr(prefect.concurrency.sync, "concurrency", lambda *a, **k: pytest.fail("Prefect limit taken"))
    from loraship.flows.train_and_ship import gpu_slot as flow_gpu_slot
    from loraship.config import parse_config
    from tests.conftest import demo_config_dict

    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="slot"))
    with flow_gpu_slot("train", config):
        assert (tmp_path / "gpu" / "slot-0.lock").exists()
    assert not (tmp_path / "gpu" / "slot-0.lock").exists()


def test_prefect_slot_wait_is_said_and_ends_when_the_holder_lets_go(monkeypatch, caplog):
    """Where a long-lived server is configured, Prefect's limit is taken too, under a renewed lease; the wait for
    it is said (taken slots and the server), and it ends when the holding lease is released."""
    import uuid

    from prefect.testing.utilities import prefect_test_harness

    name = f"loraship-gpu-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(gpu_slot, "GPU_LIMIT", name)
    # A server and database of its own: the ephemeral server of PREFECT_HOME is shared with the flow runs other
    # tests start in subprocesses, and under xdist one of them migrating the same SQLite file failed this server's
    # startup ("Application startup failed"). 120 s: the start is slow on 2 busy cores.
    with prefect_test_harness(server_startup_timeout=120):
        _slot_wait_is_said_and_ends(name, caplog)


def _slot_wait_is_said_and_ends(name, caplog):
    from prefect.client.orchestration import get_client

    client = get_client(sync_client=True)
    with client:
        gpu_slot.ensure_gpu_limit(client, 1)
        lease = client.increment_concurrency_slots_with_lease(
            names=[name], slots=1, mode="concurrency", lease_duration=300
        ).json()["lease_id"]

    class LetGoOnceWaiting(logging.Handler):  # the holder finishes once the wait was said: no timing involved
        def emit(self, record):
            if "waiting for Prefect's concurrency limit" in record.getMessage():
                with get_client(sync_client=True) as other:
                    other.release_concurrency_slots_with_lease(lease)

    let_go = LetGoOnceWaiting()
    logging.getLogger("loraship").addHandler(let_go)
    try:
        with caplog.at_level(logging.INFO, logger="loraship"):
            with gpu_slot.prefect_slot("next", "train", 1, wait_log_s=1):
                with get_client(sync_client=True) as c:
                    assert c.read_global_concurrency_limit_by_name(name).active_slots == 1
        with get_client(sync_client=True) as c:
            assert c.read_global_concurrency_limit_by_name(name).active_slots == 0
    finally:
        logging.getLogger("loraship").removeHandler(let_go)
        with get_client(sync_client=True) as c:
            c.delete_global_concurrency_limit_by_name(name)
    assert f"waiting for Prefect's concurrency limit '{name}' (1 of 1 slots taken" in caplog.text
    assert "failed to process item" not in caplog.text  # Prefect's ERROR for each timed-out attempt, not shown


GUARDED = """
import logging, sys, time
from loraship.runtime import interrupt
logging.basicConfig(level=logging.INFO)
mode = sys.argv[1]
with interrupt.interruptible(lambda s: f"interrupted ({interrupt.signal_name(s)})", teardown=lambda: None,
                             grace_s=float(sys.argv[2])) as guard:
    try:
        print("ready", flush=True)
        time.sleep(600)
    except KeyboardInterrupt as e:
        guard.stopping(e.signum)
        logging.getLogger("loraship").error("Crash detected! noise")
        if mode == "hang":
            time.sleep(600)  # a teardown that never returns: the watchdog ends the process
        guard.finish(e.signum)
        sys.exit(interrupt.exit_code_of(e))
"""


@pytest.mark.parametrize(
    "sig, mode, code", [(signal.SIGINT, "clean", 130), (signal.SIGTERM, "clean", 143), (signal.SIGTERM, "hang", 143)]
)
def test_interrupt_ends_in_one_line_with_the_shells_code(sig, mode, code):
    proc = subprocess.Popen(
        [sys.executable, "-c", GUARDED, mode, "1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code
    assert stderr.splitlines() == [f"interrupted ({sig.name})"]


# -- through the flow: `loraship run` interrupted during train, three ways, then the same command ships ----------


def _start_run(cfg: Path, env: dict) -> tuple[subprocess.Popen, list[str]]:
    """`loraship run` in its own process group, as a shell runs a foreground job; its output lines, as they come."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraship.cli", "run", str(cfg)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    return proc, lines


def _wait_for(what: str, ready, proc: subprocess.Popen, lines: list[str], limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}:\n{''.join(lines)}"
        assert time.monotonic() < deadline, f"no {what} after {limit_s} s:\n{''.join(lines)}"
        time.sleep(0.05)


def _prefect_servers(prefect_home: Path) -> list[int]:
    """Processes of this user whose environment names this PREFECT_HOME (a temporary server left behind)."""
    found = []
    for proc_dir in Path("/proc").iterdir():
        if proc_dir.name.isdigit() and int(proc_dir.name) != os.getpid():
            try:
                environ = (proc_dir / "environ").read_bytes()
            except OSError:
                continue
            if f"PREFECT_HOME={prefect_home}".encode() in environ.split(b"\0"):
                found.append(int(proc_dir.name))
    return found


def test_interrupted_runs_resume_and_ship(tiny_model, tmp_path):
    from loraship.config import parse_config
    from loraship.constants import MANIFEST_NAME
    from loraship.runtime.stage import stage_dir
    from tests.conftest import demo_config_dict

    # Trains as the demo does (80 steps, a checkpoint every 20), so verify's gates pass and it ships.
    config = parse_config(demo_config_dict(tiny_model, tmp_path, run_name="interrupted"))
    cfg = tmp_path / "interrupted.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    prefect_home = tmp_path / "prefect"  # one PREFECT_HOME for every run: where a leaked slot used to stay
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    env.pop("PREFECT_API_URL", None)
    train = stage_dir(config, "train")
    state = train / "checkpoints" / "last" / "trainer_state.pt"

    def next_checkpoint(proc, lines):
        before = state.stat().st_mtime_ns if state.exists() else None
        _wait_for("new checkpoint", lambda: state.exists() and state.stat().st_mtime_ns != before, proc, lines)

    # Ctrl-C in a terminal reaches the whole foreground group; SIGTERM (docker stop, timeout) the process alone;
    # kill -9 the whole group.
    for sig, to_group, code in (
        (signal.SIGINT, True, 130),
        (signal.SIGTERM, False, 143),
        (signal.SIGKILL, True, -signal.SIGKILL),
    ):
        proc, lines = _start_run(cfg, env)
        next_checkpoint(proc, lines)
        os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
        sent = time.monotonic()
        try:
            proc.wait(timeout=120)
            print(f"{sig.name}: exit {proc.returncode} after {time.monotonic() - sent:.1f} s")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"`loraship run` still running 120 s after {sig.name}:\n{''.join(lines)}")
        time.sleep(0.2)  # the reader thread takes the last lines
        output = "".join(lines)
        assert proc.returncode == code, output
        assert not (train / MANIFEST_NAME).exists(), f"train finished before {sig.name} landed:\n{output}"
        assert state.exists()  # the checkpoint is kept
        if sig != signal.SIGKILL:
            assert lines[-1].startswith(f"interrupted ({sig.name}): run 'interrupted' stopped;"), output
            for noise in ("Traceback", "Crash detected", "ConnectError", "Aborted"):
                assert noise not in output, output
        servers = []
        deadline = time.monotonic() + 60
        while (servers := _prefect_servers(prefect_home)) and time.monotonic() < deadline:
            time.sleep(0.2)  # a killed server's parent-death signal is on its way
        assert not servers, f"a temporary Prefect server outlived the run after {sig.name}: pids {servers}"

    proc, lines = _start_run(cfg, env)
    try:
        proc.wait(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(
            "the run after the interrupts did not finish within 1200 s (waiting on a slot?):\n" + "".join(lines)
        )
    time.sleep(0.2)
    output = "".join(lines)
    assert proc.returncode == 0, output
    assert "shipped interrupted ->" in output
    manifest = json.loads((train / MANIFEST_NAME).read_text())
    assert manifest["metrics"]["resumed_from_step"] >= 60, manifest["metrics"]  # three checkpoints, none lost
    assert "took over the lock of" in output  # kill -9 left the train locks behind; taken over, not waited on


SERVER = """
import sys
from loraship.errors import LorashipError
from loraship.runtime import prefect_env
prefect_env.configure_local_prefect()
try:
    prefect_env.start_local_prefect()
except LorashipError as e:
    print("refused:", e)
else:
    from prefect.server.api.server import SubprocessASGIServer
    import httpx
    print("health", httpx.get(SubprocessASGIServer().api_url + "/health").status_code, flush=True)
    prefect_env.stop_local_prefect()
print("log", prefect_env.server_log_path(), flush=True)
"""


def _server(tmp_path: Path, **env) -> tuple[str, str, Path]:
    run_env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), **env}
    run_env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-c", SERVER], cwd=REPO, env=run_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    log = Path(done.stdout.splitlines()[-1].removeprefix("log "))
    return done.stdout, done.stderr, log


def test_the_temporary_server_logs_to_a_file_not_the_console(tmp_path):
    # Its shutdown after a SIGTERM once logged a cancelled SQLite rollback's traceback under the run's last line.
    stdout, stderr, log = _server(tmp_path)
    assert "health 200" in stdout, stdout + stderr
    assert log == tmp_path / "prefect" / "server.log"
    assert log.read_text().startswith("--- temporary server on port ")
    assert "Traceback" not in stderr and "uvicorn" not in stderr.lower(), stderr


def test_a_server_that_does_not_start_is_refused_with_its_log(tmp_path):
    stdout, stderr, log = _server(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="0")
    assert "refused: the temporary Prefect server did not start (Timed out" in stdout, stdout + stderr
    assert f"its log, {log}, ends with:" in stdout and "--- temporary server on port" in stdout
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in stdout
