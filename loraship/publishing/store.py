"""Publish to a local folder or any fsspec URL: every file read back, only what differs sent again, manifest last.

Only files loraship wrote at the destination are replaced or removed (loraship/publishing/destination.py): a
destination it did not write is refused, or with `force` moved aside first.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from loraship.constants import MANIFEST_NAME
from loraship.errors import OutputError
from loraship.publishing import destination as dest
from loraship.runtime.manifest import DigestCache, atomic_path, sha256_file

log = logging.getLogger("loraship")


def _remote_sha256(fs, path: str) -> str:
    """sha256 of a file as the store returns it (read back, not trusted from our side)."""
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _remote_matches(fs, path: str, info: dict, cache: DigestCache | None) -> bool:
    """Whether the destination holds exactly this file: size first (cheap), then its bytes. A
    local destination's digest comes from the run's digest cache while the file is unchanged."""
    try:
        size = fs.size(path)
    except FileNotFoundError:
        return False
    if size != info["size"]:
        return False
    if cache is not None:
        return cache.sha256(Path(path)) == info["sha256"]
    return _remote_sha256(fs, path) == info["sha256"]


def _put(fs, src: Path, dst: str, local: bool) -> None:
    fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
    if local:  # a local file appears whole, under its name, only once written and synced
        with atomic_path(Path(dst)) as tmp:
            fs.put_file(str(src), str(tmp))
    else:  # object stores make an object visible only once its upload completes
        fs.put_file(str(src), dst)


def clear_the_way(
    fs, base: str, destination: str, wanted: dict, force: bool, cache
) -> tuple[dest.Holdings, str | None]:
    """What the destination holds, once nothing of someone else's is in the way: refused, or with `force` moved
    aside (where to is returned and logged)."""
    holdings = dest.survey(fs, base, set(wanted))
    same = {rel for rel in set(wanted) & holdings.files if _remote_matches(fs, f"{base}/{rel}", wanted[rel], cache)}
    blocking = dest.in_the_way(holdings, set(wanted), same)
    if not blocking:
        return holdings, None
    if not force:
        raise OutputError(dest.refusal(destination, holdings, blocking, "publish"))
    aside = dest.move_aside(fs, base, holdings, blocking)
    log.warning(
        "publish: moved %d file(s) loraship did not write from %s to %s (nothing deleted)",
        len(blocking),
        destination,
        aside,
    )
    return dest.survey(fs, base, set(wanted)), aside


def sync(root: Path, files: dict, destination: str, cache: DigestCache | None = None, force: bool = False) -> dict:
    """Make `destination` hold the artifact in `root`, manifest.json last.

    The remote manifest is not trusted: every file is compared by size and sha256 read back from
    the store, and one that is missing or differs is uploaded again (then read back) even when the
    remote manifest lists it. Files an earlier publish there wrote that this artifact no longer ships
    (another quantization's GGUF, a file of an interrupted upload) are removed; files loraship did not
    write are never touched. Returns what was uploaded, removed and moved aside.
    """
    import fsspec

    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, base = fsspec.core.url_to_fs(destination)
        base = base.rstrip("/")
        manifest = root / MANIFEST_NAME
        wanted = {
            **files,
            MANIFEST_NAME: {
                "size": manifest.stat().st_size,
                "sha256": cache.sha256(manifest) if cache else sha256_file(manifest),
            },
        }
        local = isinstance(fs, LocalFileSystem)
        dest_cache = cache if local else None  # a remote store is always read back
        holdings, aside = clear_the_way(fs, base, destination, wanted, force, dest_cache)
        moved = {"moved_aside": aside} if aside else {}
        fs.makedirs(base, exist_ok=True)
        stale = [rel for rel, info in wanted.items() if not _remote_matches(fs, f"{base}/{rel}", info, dest_cache)]
        extra = sorted(holdings.ours - set(wanted) - {dest.JOURNAL})
        if not stale and not extra:
            if dest.JOURNAL in holdings.files:  # a publish killed after its manifest was in place
                fs.rm_file(f"{base}/{dest.JOURNAL}")
            return {"uploaded": [], "removed": [], **moved}
        # Before anything changes: every file this publish may leave here is named as loraship's.
        dest.write_journal(fs, base, set(holdings.listed) | set(wanted), local)
        # The old artifact stops being complete before anything in it changes.
        if fs.exists(f"{base}/{MANIFEST_NAME}"):
            fs.rm_file(f"{base}/{MANIFEST_NAME}")
            stale = [*[r for r in stale if r != MANIFEST_NAME], MANIFEST_NAME]
        for rel in extra:
            fs.rm_file(f"{base}/{rel}")
        for rel in sorted(stale, key=lambda r: r == MANIFEST_NAME):  # manifest last
            _put(fs, root / rel, f"{base}/{rel}", local)
            # Read back what the store now holds (not the local cache: these bytes are new).
            dst = f"{base}/{rel}"
            size, digest = fs.size(dst), _remote_sha256(fs, dst)
            if (size, digest) != (wanted[rel]["size"], wanted[rel]["sha256"]):
                raise OutputError(
                    f"publish: {dst} reads back as {size} bytes, sha256 {digest[:16]}..., not the "
                    f"{wanted[rel]['size']} bytes, sha256 {wanted[rel]['sha256'][:16]}... uploaded; the store "
                    "altered or lost it. Check the destination and run again (only differing files are re-sent)"
                )
            if dest_cache is not None:
                dest_cache.remember(Path(dst), digest, os.stat(dst))
        fs.rm_file(f"{base}/{dest.JOURNAL}")  # the manifest now names what is loraship's
    except OutputError:
        raise
    except Exception as e:  # noqa: BLE001 - stores raise their own types (botocore, gcsfs, adlfs ...)
        raise OutputError(
            f"publish: cannot write to {destination} ({type(e).__name__}: {e}); check output, its credentials "
            "and permissions, then run again: files already there and intact are not sent again"
        ) from e
    finally:
        if cache is not None:
            cache.save()
    return {"uploaded": stale, "removed": extra, **moved}
