"""Reading GGUF files back: metadata and tensor counts, with a clear error for broken files."""

from __future__ import annotations

from pathlib import Path

from loraship.constants import GGUF_FILE_TYPES, GGUF_KEY_FILE_TYPE
from loraship.errors import IntegrityError, LorashipError


def read_gguf(path: Path) -> dict:
    """{'fields': {key: value}, 'tensor_count': n} of a GGUF file, or IntegrityError naming it."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on truncated files
        raise IntegrityError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); it is truncated or corrupt") from e
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            fields[key] = field.contents()
        except Exception:  # arrays of unusual types: keep the key, skip the value
            fields[key] = None
    return {"fields": fields, "tensor_count": len(reader.tensors)}


def read_gguf_of_type(path: Path, file_type: str) -> dict:
    """read_gguf, insisting that general.file_type is the one asked for (F16, Q4_K_M, ...)."""
    info = read_gguf(path)
    found, expected = info["fields"].get(GGUF_KEY_FILE_TYPE), GGUF_FILE_TYPES[file_type]
    if found != expected:
        raise LorashipError(f"{path}: general.file_type is {found}, expected {expected} ({file_type})")
    return info
