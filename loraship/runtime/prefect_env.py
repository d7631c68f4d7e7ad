"""Prefect settings for the embedded default: ephemeral API, state under the project, not $HOME."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


def configure_local_prefect(project_root: Path | None = None) -> None:
    """Must run before `import prefect`. Respects anything the user set explicitly."""
    root = Path(project_root or os.getcwd())
    os.environ.setdefault("PREFECT_HOME", str(root / ".prefect"))
    # First start of the ephemeral server took ~24 s here; CI machines can be slower.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_UI_ENABLED", "false")
    # The stages' own progress and findings (loraship.* loggers) in the flow run's logs too.
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "loraship")


def stop_local_prefect(timeout_s: float = 30) -> None:
    """Send the logs and events Prefect still holds, then stop its ephemeral API server: what Prefect's own
    atexit hooks do, for a caller that must do it while its streams are still open. Under pytest the server's
    atexit hook logged "Stopping temporary server" to the stream pytest had captured and already closed
    ("--- Logging error --- ... I/O operation on closed file" after the summary). Nothing if Prefect was not
    imported."""
    import logging
    import sys

    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    # Workers first, as prefect.testing.utilities.prefect_test_harness does: they send to the server.
    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)
    # The server logs "Stopping temporary server" at INFO on the "prefect" logger: noise at a process's end.
    prefect_logger = logging.getLogger("prefect")
    level = prefect_logger.level
    prefect_logger.setLevel(logging.WARNING)
    try:
        SubprocessASGIServer().stop()  # the ephemeral server is the one under the default (None) key
    finally:
        prefect_logger.setLevel(level)


# The temporary server's own log (uvicorn, its database) goes to a file, not the console: on its shutdown after a
# SIGTERM it logged a cancelled SQLite rollback's traceback under the run's one "interrupted" line.
SERVER_LOG = "server.log"
_SERVER_LOG_MAX_BYTES = 8 << 20  # started afresh past this: a log of many runs, kept to a few MB


def server_log_path() -> Path:
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / SERVER_LOG


def start_local_prefect() -> None:
    """Start the temporary API server now, where no server is configured, in its own session and killed with this
    process, its log in PREFECT_HOME/server.log. Prefect starts it in this process's group: a terminal's Ctrl-C
    reached it too, it stopped at once, and the interrupted run could not report its end (httpx ConnectError
    tracebacks, over 120 s of retries); a kill -9 of this process alone left it running. Nothing where
    PREFECT_API_URL (or the profile) names a server."""
    import subprocess

    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    from loraship.errors import LorashipError
    from loraship.runtime.proc import child_setup

    if get_current_settings().api.url:
        return
    existing = SubprocessASGIServer._instances.get(None)
    if existing is not None and existing.running:
        return
    log_path = server_log_path()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if log_path.exists() and log_path.stat().st_size > _SERVER_LOG_MAX_BYTES:
        log_path.unlink()

    class OwnSessionServer(SubprocessASGIServer):
        # get_client() asks SubprocessASGIServer() for the server under the default (None) key: this one.
        def _run_uvicorn_command(self) -> subprocess.Popen:
            popen = subprocess.Popen

            def own_session(*args, **kwargs):
                with open(log_path, "ab") as log:  # the child keeps its own descriptor
                    log.write(f"--- temporary server on port {self.port}, for pid {os.getpid()}\n".encode())
                    log.flush()
                    return popen(
                        *args,
                        **{
                            **kwargs,
                            "start_new_session": True,
                            "preexec_fn": child_setup,
                            "stdout": log,
                            "stderr": subprocess.STDOUT,
                        },
                    )

            subprocess.Popen = own_session  # Prefect's own command line and environment, one call only
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen

    try:
        OwnSessionServer().start()
    except RuntimeError as e:  # "Timed out while attempting to connect to ephemeral Prefect API server."
        raise LorashipError(
            f"the temporary Prefect server did not start ({e}); its log, {log_path}, ends with:\n"
            f"{_tail(log_path)}\nRaise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS on a slow machine, or point "
            "PREFECT_API_URL at a running server (`prefect server start`)"
        ) from e


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(unreadable)"


def kill_local_prefect() -> None:
    """Kill the temporary API server at once (a forced exit: nothing is drained); nothing if none runs."""
    import sys

    module = sys.modules.get("prefect.server.api.server")
    server = module.SubprocessASGIServer._instances.get(None) if module else None
    process = getattr(server, "server_process", None)
    if process is not None:
        process.kill()


def _load_secret(block: str) -> str:
    from prefect.blocks.system import Secret

    return str(Secret.load(block).get())


@contextlib.contextmanager
def secret_env(env_from_secrets: dict[str, str]) -> Iterator[None]:
    """The config's credentials in this process's environment for one stage, and gone after it.

    A variable already set in the environment wins (a Kubernetes secret mounted as env, a CI
    variable), so a stage run outside Prefect needs no Prefect. Child processes of convert and
    quantize get an explicit environment without them (loraship/runtime/proc.py).
    """
    from loraship.errors import LorashipError

    before = {name: os.environ.get(name) for name in env_from_secrets}
    try:
        for name, block in env_from_secrets.items():
            if os.environ.get(name):
                continue
            try:
                os.environ[name] = _load_secret(block)
            except ImportError as e:
                raise LorashipError(
                    f"env_from_secrets: {name} comes from the Prefect Secret block {block!r}, but Prefect "
                    f"is not installed here; install loraship[orchestrate] or set {name} in the "
                    "environment"
                ) from e
            except ValueError as e:
                raise LorashipError(
                    f"env_from_secrets: Prefect Secret block {block!r} for {name} not found; create it "
                    "with `prefect block create secret` or remove the entry"
                ) from e
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
