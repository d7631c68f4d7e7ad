"""One error path for a failed flow run: the stage's error printed once by `loraship run`, exit 2 for input the user
must fix and 1 for a stage that failed or crashed (loraship/errors.py exit_code_of).

The flow's failed states carry the stage's exception as their data. Prefect's run loggers report a failure three
more times on the console (the task's "Task run failed with state" with an empty traceback, printed as
"NoneType: None", and "Finished in state Failed" for the task and for the flow): ConsoleFailureFilter drops those,
and the stage task's own error line, from console handlers only. Prefect's API handler keeps every record, so the
flow run's log in Prefect still holds them.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

# `extra=` of the stage task's error record: the flow run's log keeps it, the console leaves it to the CLI.
FAILURE = {"loraship_failure": True}
# What Prefect's task and flow engines log about a failure they are told of (prefect/task_engine.py, flow_engine.py).
PREFECT_FAILURE_LINES = (
    "Task run failed with",
    "Finished in state Failed",
    "Finished in state Crashed",
    "Encountered exception during execution",
)
RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")


class ConsoleFailureFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "loraship_failure", False):
            return False
        if record.name.startswith(RUN_LOGGERS) and isinstance(record.msg, str):
            return not record.msg.startswith(PREFECT_FAILURE_LINES)
        return True


def quiet_failures_on_console() -> None:
    """Put the filter on every handler that writes to a stream (the root's, Prefect's console handler), on every
    logger, after Prefect's import has added its own; not on file or API handlers."""
    loggers = [logging.getLogger(), *logging.root.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if console and not any(isinstance(f, ConsoleFailureFilter) for f in handler.filters):
                handler.addFilter(ConsoleFailureFilter())


def keep_traceback(config, stage: str) -> Path:
    """The traceback of the exception being handled, in <run folder>/.logs/<stage>-traceback.txt; returns where."""
    from loraship.runtime.stage import run_dir

    path = run_dir(config) / ".logs" / f"{stage}-traceback.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc(), encoding="utf-8")
    except OSError:
        pass  # the flow run's log in Prefect keeps it too
    return path


def failure_of(state) -> BaseException | None:
    """The exception a failed Prefect state carries (the flow's and the stage task's do); None without one (a
    child deployment's run reports only its message)."""
    try:
        data = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 - a state without data, or whose result cannot be read back
        return None
    return data if isinstance(data, BaseException) else None
