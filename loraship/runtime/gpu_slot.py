"""The GPU slot: a stage that holds an accelerator (train, reference, verify; loraship/stage_table.py) first takes
one of LORASHIP_GPU_SLOTS slots (default 1), so two such stages never share one card.

A slot is a lock file, `<workdir>/.locks/gpu/slot-<i>.lock` (LORASHIP_GPU_LOCKS names another folder), held
as loraship/runtime/locks.py holds its locks: the holder's pid, process start time and host, and a heartbeat. A
holder that died (Ctrl-C, kill -9, an evicted pod) is seen as dead at once on its host, and on other hosts
sharing the folder once it stops touching its file (locks.STALE_S), and its slot is taken over. Waiting is said
in the log, naming the run holding the slot and since when, every WAIT_LOG_S.

A Prefect global concurrency limit alone cannot do this under `loraship run`: the run's temporary Prefect server
keeps its slot leases in memory and dies with the run, while the taken slot is counted in the database under
PREFECT_HOME, so after one interrupted run every later run waited forever. Prefect's limit `loraship-gpu` is
therefore taken only where a long-lived server is configured (PREFECT_API_URL: the Docker and Kubernetes pools'
workers, where runs talking to one server need not share a workdir), on top of the slot files, and under a lease
of LEASE_S that this process renews: the server's lease reaper frees the slot of a holder that died within about
LEASE_S. Such a server keeps its leases in memory unless told otherwise: one restarted while a slot was held
keeps it taken; PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=prefect.server.concurrency.lease_storage.filesystem
(or Redis, with prefect-redis) keeps them across restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Iterator

from loraship.errors import LorashipError
from loraship.runtime import locks

log = logging.getLogger("loraship")

SLOTS_ENV = "LORASHIP_GPU_SLOTS"
DIR_ENV = "LORASHIP_GPU_LOCKS"
GPU_LIMIT = "loraship-gpu"
# "Still waiting" is said again this often, so a wait of hours shows it is alive, without flooding the log.
WAIT_LOG_S = 30.0
# Prefect's lease on the limit's slot: renewed every 3/4 of it by Prefect's renewal thread; a holder that died
# stops renewing, and the server frees its slot once the lease ran out (Prefect's default is 300 s).
LEASE_S = 60.0


def slots() -> int:
    raw = os.environ.get(SLOTS_ENV, "1")
    try:
        count = int(raw)
    except ValueError as e:
        raise LorashipError(
            f"{SLOTS_ENV}={raw!r} is not a whole number; fix: set it to the number of GPU stages "
            "that may run at once on the GPUs these runs share (default 1)"
        ) from e
    if count < 1:
        raise LorashipError(
            f"{SLOTS_ENV}={raw!r}: at least one slot is needed, or no GPU stage could ever run; "
            "fix: set it to 1 or more"
        )
    return count


def slots_dir(workdir: str | Path) -> Path:
    configured = os.environ.get(DIR_ENV)
    return Path(configured).expanduser() if configured else Path(workdir).expanduser() / ".locks" / "gpu"


def describe_holder(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return (
        f"run {holder.get('run', '?')!r} ({holder.get('stage', '?')}, pid {holder.get('pid')} on host "
        f"{holder.get('host')!r}) since {since}"
    )


@contextlib.contextmanager
def file_slot(
    folder: Path,
    run_name: str,
    stage: str,
    count: int | None = None,
    timeout: float | None = None,
    wait_log_s: float = WAIT_LOG_S,
) -> Iterator[Path]:
    """Hold one of `count` slot files in `folder` for the block, taking over those of dead holders."""
    folder = Path(folder)
    count = slots() if count is None else count
    timeout = locks.timeout_s() if timeout is None else timeout
    paths = [folder / f"slot-{i}.lock" for i in range(count)]
    me = locks.identity(run=run_name, stage=stage)
    what = f"GPU slot for {stage} of run {run_name!r}"
    started, said = time.monotonic(), None
    while True:
        holders, changed = [], False
        for path in paths:
            taken, holder = locks.try_take(path, me, what)
            if taken:
                with locks.holding(path, me):
                    yield path
                return
            if holder is None:
                changed = True
            else:
                holders.append(holder)
        if changed or not holders:
            continue  # a slot changed hands meanwhile: look again at once
        now = time.monotonic()
        if now - started >= timeout:
            raise locks.LockTimeout(
                f"{what}: every slot still held after waiting {now - started:.0f} s, by "
                f"{'; '.join(describe_holder(h) for h in holders)} ({folder}). Wait for that run to finish; to let "
                f"GPU stages share the card set {SLOTS_ENV} (now {count}); to wait longer set {locks.TIMEOUT_ENV}"
            )
        if said is None or now - said >= wait_log_s:
            log.info("%s: waiting for the GPU slot held by %s", what, "; ".join(describe_holder(h) for h in holders))
            said = now
        time.sleep(locks.POLL_S)


def configured_api_url() -> str | None:
    """The Prefect API a user or a worker configured (env or profile); None under the temporary server."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def ensure_gpu_limit(client, count: int) -> None:
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(GPU_LIMIT)
    except ObjectNotFound:
        with contextlib.suppress(ObjectAlreadyExists):  # another run created it first
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=count))


@contextlib.contextmanager
def prefect_slot(run_name: str, stage: str, count: int, wait_log_s: float = WAIT_LOG_S) -> Iterator[None]:
    """A slot of Prefect's limit `loraship-gpu` on the configured server, under a renewed lease; the wait is said
    every wait_log_s with how many slots are taken (the server does not tell who holds them)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        ensure_gpu_limit(client, count)
    quiet = _QuietAcquisitionTimeouts()
    service_logger = logging.getLogger("prefect._internal.concurrency")
    service_logger.addFilter(quiet)
    try:
        yield from _prefect_slot_loop(run_name, stage, wait_log_s)
    finally:
        service_logger.removeFilter(quiet)


class _QuietAcquisitionTimeouts(logging.Filter):
    """Prefect's slot service logs each acquisition that timed out as an ERROR ("Service ... failed to process
    item ... raised TimeoutError"): here a timeout is only the moment to say the wait goes on."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("ConcurrencySlotAcquisition" in message and "TimeoutError" in message)


def _prefect_slot_loop(run_name: str, stage: str, wait_log_s: float) -> Iterator[None]:
    from prefect.client.orchestration import get_client
    from prefect.concurrency.asyncio import AcquireConcurrencySlotTimeoutError
    from prefect.concurrency.sync import concurrency

    while True:
        acquired = False
        try:
            with concurrency(GPU_LIMIT, occupy=1, strict=True, lease_duration=LEASE_S, timeout_seconds=wait_log_s):
                acquired = True
                yield
            return
        except AcquireConcurrencySlotTimeoutError:
            if acquired:  # not the wait's: the stage's own
                raise
            with get_client(sync_client=True) as client:
                limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
            log.info(
                "GPU slot for %s of run %r: waiting for Prefect's concurrency limit %r (%d of %d slots taken "
                "at %s; a holder that died frees its slot within %.0f s)",
                stage,
                run_name,
                GPU_LIMIT,
                limit.active_slots,
                limit.limit,
                configured_api_url() or "the temporary server",
                LEASE_S,
            )


@contextlib.contextmanager
def gpu_slot(run_name: str, stage: str, workdir: str | Path) -> Iterator[None]:
    """The slot files always (they name the holder, and cover every run sharing the folder); Prefect's limit
    as well where a long-lived server is configured."""
    count = slots()
    with file_slot(slots_dir(workdir), run_name, stage, count):
        if configured_api_url():
            with prefect_slot(run_name, stage, count):
                yield
        else:
            yield
