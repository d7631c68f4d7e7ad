"""Stage manifests: the contract between stages, and what makes a run resumable.

A stage writes its outputs first (each under a temporary name, then renamed) and its
manifest.json last, so a manifest that exists vouches for complete outputs. A stage whose
manifest records the same input fingerprint, and whose outputs still hash to what it says,
is skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import secrets
import shutil
import socket
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from loraship import __version__
from loraship.constants import LLAMA_CPP_PYTHON_VERSION, MANIFEST_NAME, MANIFEST_SCHEMA_VERSION
from loraship.errors import IntegrityError

_TRACKED_LIBRARIES = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "liger-kernel",
    "llama-cpp-python",
    "gguf",
    "safetensors",
    "tokenizers",
    "prefect",
)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


DIGESTS_FILE = ".digests.json"  # in the run folder, next to the stage folders
FULL_VERIFY_ENV = "LORASHIP_FULL_VERIFY"


class DigestCache:
    """sha256 of files keyed by (device, inode, size, mtime_ns), kept in a JSON file.

    Resuming a finished 7B run used to hash every upstream output again in every stage (about
    100 GB of sha256); a file whose inode, size and modification time are unchanged is not read
    again. Rewriting a file (a new inode through rename, or a write in place, which moves mtime)
    misses the cache. LORASHIP_FULL_VERIFY=1 ignores it and reads every file a stage verifies.
    Concurrent processes may each save; an entry lost that way is only hashed again.
    """

    def __init__(self, file: Path | None):
        self.file = Path(file) if file else None
        self.entries: dict[str, dict] = {}
        self.dirty = False
        self.trusted = os.environ.get(FULL_VERIFY_ENV, "") not in ("1", "true", "yes")
        if self.file and self.file.is_file():
            with contextlib.suppress(OSError, ValueError):
                loaded = json.loads(self.file.read_text(encoding="utf-8"))
                self.entries = loaded if isinstance(loaded, dict) else {}

    @classmethod
    def of_run(cls, stage_dir: Path) -> "DigestCache":
        return cls(Path(stage_dir).parent / DIGESTS_FILE)

    @staticmethod
    def _key(st: os.stat_result) -> str:
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def sha256(self, path: Path, st: os.stat_result | None = None) -> str:
        st = st or os.stat(path)
        key = self._key(st)
        hit = self.entries.get(key)
        if self.trusted and hit:
            return hit["sha256"]
        digest = sha256_file(path)
        self.remember(path, digest, os.stat(path))
        return digest

    def remember(self, path: Path, digest: str, st: os.stat_result) -> None:
        self.entries[self._key(st)] = {"path": str(Path(path).resolve()), "sha256": digest}
        self.dirty = True

    def save(self) -> None:
        if not (self.file and self.dirty):
            return
        merged = DigestCache(self.file).entries
        merged.update(self.entries)
        live = {}
        for key, entry in merged.items():  # forget files that are gone or changed
            with contextlib.suppress(OSError, KeyError, TypeError):
                if self._key(os.stat(entry["path"])) == key:
                    live[key] = entry
        with contextlib.suppress(OSError):  # a cache that cannot be saved costs time, not correctness
            atomic_write_json(self.file, live)
        self.dirty = False


def describe_files(
    root: Path, paths: list[Path] | None = None, cache: DigestCache | None = None
) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under root (or of the given files), keyed by relative path."""
    root = Path(root)
    files = paths if paths is not None else sorted(p for p in root.rglob("*") if p.is_file())
    out = {}
    for p in files:
        rel = Path(p).relative_to(root).as_posix()
        if rel == MANIFEST_NAME or rel.endswith(".tmp") or "/.tmp-" in f"/{rel}":
            continue
        st = os.stat(p)
        out[rel] = {"sha256": cache.sha256(Path(p), st) if cache else sha256_file(Path(p)), "size": st.st_size}
    if cache:
        cache.save()
    return out


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "loraship": __version__}
    for name in _TRACKED_LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    versions["llama.cpp (via llama-cpp-python, pinned)"] = LLAMA_CPP_PYTHON_VERSION
    return versions


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, data: Any, sort_keys: bool = False) -> None:
    """`data` as indented JSON, replacing `path` at once; `sort_keys` for a record read back by name (plan.json),
    whose bytes then depend on its content only, not on the order it was built in."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=sort_keys, default=str) + "\n")


def temp_suffix() -> str:
    """Unique per process across containers: the pid alone is 1 in every container sharing a volume."""
    return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable (POSIX leaves it in the page cache)."""
    with contextlib.suppress(OSError):  # some filesystems (and Windows) cannot open a folder
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """Data of a file, or of every file and folder under a folder, on disk before it is renamed
    into view: after a power loss a visible output must not be empty or half there."""
    path = Path(path)
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if p.is_file() and not p.is_symlink():
                fsync_tree(p)
            elif p.is_dir():
                fsync_dir(p)
        fsync_dir(path)
    elif path.is_file():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling path; it becomes `final` only if the block finishes."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}.{temp_suffix()}")
    _remove(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        if (final.exists() or final.is_symlink()) and (tmp.is_dir() or (final.is_dir() and not final.is_symlink())):
            # No rename replaces a non-empty folder (nor a file by a folder): move the old one aside
            # first (one rename), so a kill between the two renames leaves it whole under its aside
            # name (aside_of finds it), never half deleted.
            os.replace(final, final.with_name(f".old-{final.name}.{temp_suffix()}"))
        os.replace(tmp, final)  # a file over a file is replaced in this one step
        fsync_dir(final.parent)
        for old in final.parent.glob(f".old-{final.name}.*"):
            _remove(old)
    finally:
        _remove(tmp)


def aside_of(final: Path) -> Path | None:
    """The folder atomic_path moved aside for `final` when a kill came before its replacement
    took its place (the newest, if several); None when there is none."""
    final = Path(final)
    found = sorted(final.parent.glob(f".old-{final.name}.*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def input_fingerprint(stage: str, config_subset: dict, upstream: dict[str, dict]) -> str:
    """What decides whether a stage must run again: its config fields and its inputs' hashes."""
    return sha256_json(
        {
            "schema": MANIFEST_SCHEMA_VERSION,
            "stage": stage,
            "config": config_subset,
            "inputs": {name: m.get("outputs", {}) for name, m in sorted(upstream.items())},
            "llama_cpp": LLAMA_CPP_PYTHON_VERSION,
        }
    )


def write_manifest(
    stage_dir: Path,
    *,
    stage: str,
    run_name: str,
    fingerprint: str,
    config: dict,
    upstream: dict[str, dict],
    metrics: dict,
    started: float,
    outputs: dict[str, dict] | None = None,
) -> dict:
    stage_dir = Path(stage_dir)
    manifest = {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "stage": stage,
        "run_name": run_name,
        "fingerprint": fingerprint,
        "config": config,
        "inputs": {
            name: {
                "stage_dir": m.get("_dir"),
                "manifest_sha256": sha256_json(_public(m)),
                "outputs": m.get("outputs", {}),
            }
            for name, m in sorted(upstream.items())
        },
        "outputs": outputs if outputs is not None else describe_files(stage_dir, cache=DigestCache.of_run(stage_dir)),
        "metrics": metrics,
        "versions": library_versions(),
        "timings": {"started": started, "finished": time.time(), "seconds": round(time.time() - started, 3)},
    }
    atomic_write_json(stage_dir / MANIFEST_NAME, manifest)
    return with_dir(manifest, stage_dir)


def _public(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith("_")}


def with_dir(manifest: dict, stage_dir: Path) -> dict:
    return {**manifest, "_dir": str(Path(stage_dir).resolve())}


def read_manifest(stage_dir: Path) -> dict | None:
    path = Path(stage_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return with_dir(json.loads(path.read_text(encoding="utf-8")), stage_dir)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IntegrityError(
            f"{path}: manifest is not valid JSON ({e}); delete {Path(stage_dir)} to redo that stage"
        ) from e


def _selected(rel: str, only: tuple[str, ...] | None) -> bool:
    """Whether rel is one of `only` (a file, or a folder covering everything under it)."""
    return only is None or any(rel == o or rel.startswith(o.rstrip("/") + "/") for o in only)


def check_outputs(manifest: dict, stage_dir: Path, only: tuple[str, ...] | None = None) -> list[str]:
    """Problems with the files a manifest vouches for (all, or those in `only`): missing, wrong
    size, wrong sha256."""
    problems = []
    cache = DigestCache.of_run(stage_dir)
    if not cache.trusted:
        only = None  # full verification reads every output
    for rel, info in manifest.get("outputs", {}).items():
        if not _selected(rel, only):
            continue
        p = Path(stage_dir) / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        st = p.stat()
        if st.st_size != info["size"]:
            problems.append(f"{p}: size {st.st_size} != {info['size']} in its manifest (truncated or replaced)")
        elif cache.sha256(p, st) != info["sha256"]:
            problems.append(f"{p}: sha256 does not match its manifest (corrupted or replaced)")
    cache.save()
    return problems


def load_verified(stage_dir: Path, stage: str, only: tuple[str, ...] | None = None) -> dict:
    """An upstream stage's manifest, refusing it unless every output this stage reads (`only`;
    all by default) matches its checksum."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise IntegrityError(
            f"stage '{stage}' has no manifest in {stage_dir}; run it first (the flow does this in order)"
        )
    problems = check_outputs(manifest, stage_dir, only)
    if problems:
        raise IntegrityError(
            f"stage '{stage}' outputs do not match {Path(stage_dir) / MANIFEST_NAME}:\n  - "
            + "\n  - ".join(problems)
            + f"\nDelete {stage_dir} and run again to redo that stage."
        )
    return manifest


def up_to_date(stage_dir: Path, fingerprint: str) -> dict | None:
    """The existing manifest when the stage already ran on the same inputs and its outputs are intact."""
    try:
        manifest = read_manifest(stage_dir)
    except IntegrityError:
        return None
    if manifest is None or manifest.get("fingerprint") != fingerprint:
        return None
    if check_outputs(manifest, stage_dir):
        return None
    return manifest
