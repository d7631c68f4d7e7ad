"""Compressed dataset files: `train.jsonl.gz`, `.json.bz2`, `.jsonl.xz`, `.jsonl.zst` are read as fsspec infers their
compression from the suffix (its `compression="infer"`), with the format suffix beneath it (`.jsonl`) deciding how
the rows are parsed. A compression fsspec cannot read here (zstd without the zstandard package), or a compressed
file whose name does not say so, is named with the fix instead of failing as text that is "not UTF-8"."""

from __future__ import annotations

import io
from pathlib import PurePosixPath

from loraship.errors import DataError

# Compressed suffixes fsspec knows (fsspec/compression.py), with the package that gives fsspec the codec where Python
# has none, and the shell command that decompresses the file. fsspec registers a codec only when it can import it.
SUFFIXES = {
    "gz": ("gzip", None, "gunzip"),
    "bz2": ("bz2", None, "bunzip2"),
    "xz": ("xz", None, "unxz"),
    "lzma": ("lzma", None, "unlzma"),
    "zip": ("zip", None, "unzip"),
    "zst": ("zstd", "zstandard", "zstd -d"),
    "lz4": ("lz4", "lz4", "lz4 -d"),
}
# The first bytes of each format, for a compressed file whose name ends in .jsonl or .json.
MAGIC = (
    (b"\x1f\x8b", "gz"),
    (b"BZh", "bz2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zst"),
    (b"PK\x03\x04", "zip"),
    (b"\x04\x22\x4d\x18", "lz4"),
)


def _name(path) -> str:
    return PurePosixPath(str(path)).name


def compression_suffix(path) -> str | None:
    """'gz' for 'train.jsonl.gz'; None for a file that is not named as compressed."""
    suffix = PurePosixPath(_name(path)).suffix.lstrip(".").lower()
    return suffix if suffix in SUFFIXES else None


def data_suffix(path) -> str:
    """The format suffix under any compression suffix: '.jsonl' for 'train.jsonl.gz', '.csv' for 'a.csv'."""
    name = PurePosixPath(_name(path))
    if compression_suffix(path):
        name = PurePosixPath(name.stem)
    return name.suffix.lower()


def _codec(path) -> str | None:
    """fsspec's codec for the file's compression suffix, None for a plain file; a DataError where fsspec has none."""
    suffix = compression_suffix(path)
    if suffix is None:
        return None
    from fsspec.utils import infer_compression

    kind, package, command = SUFFIXES[suffix]
    codec = infer_compression(_name(path))
    if codec is None:  # fsspec registers a codec only where its package imports
        raise DataError(
            f"dataset {path}: a {kind}-compressed file, and this environment cannot read {kind} (fsspec needs the "
            f"{package} package); pip install {package}, or decompress it ({command} {_name(path)}) and point path "
            "at the .jsonl it writes"
        )
    return codec


def open_text(path):
    """A local file as UTF-8 text, decompressed as it is read (for sampling its first rows)."""
    import fsspec

    return fsspec.open(str(path), "rt", compression=_codec(path), encoding="utf-8")


def decompressed(raw: bytes, path) -> bytes:
    """The file's content: raw as it is, or decompressed with the codec fsspec infers from the suffix."""
    codec = _codec(path)
    if codec is None:
        return raw
    from fsspec.compression import compr

    suffix = compression_suffix(path)
    kind = SUFFIXES[suffix][0]
    try:
        with compr[codec](io.BytesIO(raw), mode="rb") as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 - each codec raises its own type (OSError, EOFError, zlib.error, ...)
        raise DataError(
            f"dataset {path}: named as {kind}-compressed (.{suffix}) but it does not decompress ({type(e).__name__}: "
            f"{e}); the file is truncated or not {kind}: download or compress it again"
        ) from e


def compressed_name_problem(raw: bytes, path) -> str | None:
    """Why a file that is not UTF-8 text is compressed under a plain name, with the fix; None when it is not."""
    for magic, suffix in MAGIC:
        if raw.startswith(magic):
            kind = SUFFIXES[suffix][0]
            return (
                f"dataset {path}: {kind}-compressed, but its name does not say so; rename it to "
                f"{_name(path)}.{suffix} (loraship decompresses by the suffix), or decompress it"
            )
    return None
