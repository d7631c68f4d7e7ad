"""A safetensors file checked from its header alone, before any tensor is loaded.

The format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian header
length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}} with offsets
relative to the byte after the header, then the data. A truncated download, or a header whose
offsets overlap or point past the data, is named here with the tensors concerned; whatever else
the safetensors library itself refuses (dtype, shape against byte count, gaps) comes from
`safe_open`, which reads the header and maps the file without reading tensor data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_FIX = "re-download or re-save it"


def read_header(path: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file; ValueError when it cannot be read."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise ValueError(f"header length {header_len} is longer than the file ({size} bytes)")
        header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    return header_len, header


def _offsets(name: str, info) -> tuple[int, int]:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
    ):
        raise ValueError(f"tensor {name!r} has data_offsets {offsets!r}, not two byte positions")
    return offsets[0], offsets[1]


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file, in one line with the fix, or None."""
    size = Path(path).stat().st_size
    try:
        header_len, header = read_header(path)
        spans = sorted((*_offsets(name, info), name) for name, info in header.items() if name != "__metadata__")
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        return f"{path}: not a readable safetensors file ({e}); {_FIX}"
    data_bytes = size - 8 - header_len
    for begin, end, name in spans:
        if begin > end:
            return f"{path}: tensor {name!r} has data_offsets [{begin}, {end}], which end before they begin; {_FIX}"
    if spans and max(end for _, end, _ in spans) > data_bytes:
        begin, end, name = max(spans, key=lambda s: s[1])
        return (
            f"{path}: truncated or its header is wrong: tensor {name!r} has data_offsets [{begin}, {end}] past the "
            f"end of the data ({data_bytes} bytes; the file has {size}, its header needs {8 + header_len + end}); "
            f"{_FIX}"
        )
    for (b1, e1, n1), (b2, e2, n2) in zip(spans, spans[1:]):
        if b2 < e1:
            return (
                f"{path}: tensors {n1!r} [{b1}, {e1}) and {n2!r} [{b2}, {e2}) overlap in its header's data_offsets; "
                f"the file is corrupt or crafted; {_FIX} from a trusted source"
            )
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError) as e:
        return f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); {_FIX}"
    return None
