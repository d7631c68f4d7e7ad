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
                raise LorashipError(f"env_from_secrets: {name} comes from the Prefect Secret block {block!r}, but Prefect "
                                    f"is not installed here; install loraship[orchestrate] or set {name} in the "
                                    "environment") from e
            except ValueError as e:
                raise LorashipError(f"env_from_secrets: Prefect Secret block {block!r} for {name} not found; create it "
                                    "with `prefect block create secret` or remove the entry") from e
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
