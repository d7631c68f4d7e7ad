"""Ctrl-C and SIGTERM for a long command (`loraship run`): the run ends promptly, in one line, and leaves the next
run free to resume.

SIGTERM is what `docker stop`, a Kubernetes eviction and `timeout` send; the container runtime kills about 10-30 s
later, so the run must be gone well before. On the first SIGINT or SIGTERM the main thread raises Interrupted (a
KeyboardInterrupt, so Prefect's engines record the runs as Crashed, "aborted by an interrupt signal") and unwinds:
stage locks and GPU slots are given back, checkpoints stay where they are (each lands whole, by rename). Inside a
flow run Prefect's own SIGTERM handler raises its TerminationSignal first and passes the signal on to ours after.
Should the unwinding hang (a blocking call, an API that does not answer), a watchdog ends the process after
GRACE_S, as a second Ctrl-C does at once; what it leaves behind is what a kill -9 leaves, which the next run
takes over (loraship/runtime/locks.py).

Console log lines stop at the signal: Prefect's crash reports ("Crash detected! ... aborted by an interrupt
signal", "Finished in state Crashed(...)") and tracebacks would bury the one line that says what happened.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable, Iterator

# The unwinding normally takes a second or two (the Prefect API is told the runs crashed); this bound keeps
# the whole exit inside a container runtime's 10 s grace period with room for the process's own teardown.
GRACE_S = 8.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What Prefect's state messages say of an interrupted run (prefect.states.exception_to_crashed_state).
_CRASH_WORDS = ("aborted by an interrupt signal", "aborted by a termination signal")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the process; exit_code is the shell's 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code_of(exc: BaseException) -> int:
    """130 for Ctrl-C, 143 for SIGTERM (Prefect's TerminationSignal carries the signal too)."""
    signum = getattr(exc, "signum", None) or getattr(exc, "signal", None) or signal.SIGINT
    return 128 + int(signum)


class _QuietAfterInterrupt(logging.Filter):
    def __init__(self, guard: "Guard"):
        super().__init__()
        self.guard = guard

    def filter(self, record: logging.LogRecord) -> bool:
        if self.guard.signum is not None:
            return False
        with contextlib.suppress(Exception):
            if any(words in record.getMessage() for words in _CRASH_WORDS):
                return False
        return True


def _console_handlers() -> list[logging.Handler]:
    """Handlers writing to a terminal stream, on every logger: not Prefect's API handler, which keeps the
    crash in the run's logs."""
    loggers = [
        logging.getLogger(),
        *(x for x in list(logging.root.manager.loggerDict.values()) if isinstance(x, logging.Logger)),
    ]
    found = []
    for logger in loggers:
        for handler in getattr(logger, "handlers", ()):
            if (
                isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging.FileHandler)
                and handler not in found
            ):
                found.append(handler)
    return found


class Guard:
    """What interruptible() hands its block. stopping(signum): the process is on its way out (the console goes
    quiet, and a watchdog ends it after grace_s); finish(signum) prints the one line, once, however it ends;
    cover_console() filters the console handlers that exist now (call it again once Prefect is imported: it adds
    its own on import)."""

    def __init__(self, say: Callable[[int], str], teardown: Callable[[], None], grace_s: float):
        self.say, self.teardown, self.grace_s = say, teardown, grace_s
        self.signum: int | None = None
        self.said = False
        self.lock = threading.RLock()  # the signal handler may run while the main thread holds it
        self.quiet = _QuietAfterInterrupt(self)
        self.filtered: list[logging.Handler] = []

    def stopping(self, signum: int) -> bool:
        """True the first time: the watchdog is started."""
        with self.lock:
            if self.signum is not None:
                return False
            self.signum = signum
        threading.Thread(target=self._watchdog, name="loraship-interrupt-watchdog", daemon=True).start()
        return True

    def finish(self, signum: int) -> None:
        with self.lock:
            if self.said:
                return
            self.said = True
        print(self.say(signum), file=sys.stderr, flush=True)

    def force_exit(self) -> None:
        signum = self.signum or signal.SIGINT
        self.finish(signum)
        with contextlib.suppress(BaseException):
            self.teardown()
        os._exit(128 + signum)

    def _watchdog(self) -> None:
        threading.Event().wait(self.grace_s)
        self.force_exit()

    def cover_console(self) -> None:
        for h in _console_handlers():
            if self.quiet not in h.filters:
                h.addFilter(self.quiet)
                self.filtered.append(h)

    def uncover_console(self) -> None:
        for h in self.filtered:
            h.removeFilter(self.quiet)
        self.filtered.clear()


@contextlib.contextmanager
def interruptible(
    say: Callable[[int], str], teardown: Callable[[], None], grace_s: float = GRACE_S
) -> Iterator[Guard]:
    """SIGINT and SIGTERM raise Interrupted in the main thread while the block runs; the caller catches it (or
    Prefect's TerminationSignal: is_interrupt), calls guard.stopping, cleans up, calls guard.finish and exits
    with exit_code_of(it).

    say(signum): the one line to print. teardown(): what must not outlive the process (the temporary Prefect
    server), called before a forced exit (the watchdog after grace_s, or a second signal)."""
    guard = Guard(say, teardown, grace_s)

    def handler(signum: int, frame) -> None:
        if not guard.stopping(signum):  # a second Ctrl-C: the user does not want to wait for the unwinding
            guard.force_exit()
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    guard.cover_console()
    try:
        yield guard
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        guard.uncover_console()


def is_interrupt(exc: BaseException) -> bool:
    """Ctrl-C (ours or a bare KeyboardInterrupt) or Prefect's TerminationSignal (SIGTERM inside a flow run)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    terminated = getattr(sys.modules.get("prefect.exceptions"), "TerminationSignal", None)
    return terminated is not None and isinstance(exc, terminated)
