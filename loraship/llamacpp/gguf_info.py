"""Reading GGUF files back: metadata and tensor counts, with a clear error for broken files.

Every stage that reads a GGUF goes through read_gguf first, so a truncated file, or one whose
header declares tensor data past its end or two tensors on the same bytes, is refused with its
name before any work (quantizing, loading it into llama.cpp).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from loraship.constants import GGUF_FILE_TYPES, GGUF_KEY_FILE_TYPE
from loraship.errors import IntegrityError, LorashipError

_FIX = "the file is truncated or its header is corrupt; run the stage that wrote it again, or copy the file again"


class _TensorExtentError(ValueError):
    """A tensor's declared bytes run past the file's end, or overlap another tensor's."""


def _open(path: Path):
    """gguf.GGUFReader whose tensor infos are checked against the file size before it maps them.

    GGUFReader computes each tensor's data offset and size (GGML_QUANT_SIZES) in _build_tensors
    and only then slices its memory map, which on a short file fails with a bare numpy reshape
    error; checking the same extents first turns that into a message naming the tensor.
    """
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            # GGUFReader._get, slicing a plain ndarray view of the memory map: every slice of a
            # np.memmap runs memmap.__array_finalize__ in Python, which made reading a 128k-256k
            # vocabulary (one slice per token and per merge) take 8-15 s; this takes 2.
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            # An array as few parts: a scalar array one view of all its items, a string array one memoryview per
            # string. GGUFReader makes numpy views per item (and two per string): a 151k-token vocabulary's tokens,
            # scores and merges took 5-10 s a read, and a pipeline reads its GGUFs 7 times (tests/test_tinyqwen.py
            # compares every field with GGUFReader's). contents() gives the same values; the field's data then
            # indexes one part per array, so contents(i) of a scalar array is not the i-th item.
            from gguf import GGUFValueType

            if GGUFValueType(int(raw_type)) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            item_type, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(item_type)
            if nptype is not None:
                items = self._get(offs, nptype, count)
                return 12 + int(items.nbytes), [raw_itype, alen, items], [2], [GGUFValueType.ARRAY, item_type]
            if item_type != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            self._get(offs, np.uint8)  # makes the plain view
            buffer, length_at = memoryview(self.__dict__["_plain_data"]), struct.Struct("<Q").unpack_from
            parts, data = [raw_itype, alen], []
            for _ in range(count):
                (length,) = length_at(buffer, offs)
                parts += (buffer[offs : offs + 8], buffer[offs + 8 : offs + 8 + length])
                data.append(len(parts) - 1)
                offs += 8 + length
            if offs > len(buffer):
                raise ValueError(f"a string array's items run past the end of the file (byte {offs})")
            return offs - orig_offs, parts, data, [GGUFValueType.ARRAY, item_type]

        def _build_tensors(self, start_offs, fields):
            file_size = len(self.data)
            extents = []
            for field in fields:
                _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
                name = bytes(name_data).decode("utf-8", errors="replace")
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                n_bytes = math.prod(int(d) for d in dims) * type_size // block_size  # ints: no int64 overflow
                begin = int(start_offs) + int(offset_tensor[0])
                if begin + n_bytes > file_size:
                    raise _TensorExtentError(
                        f"tensor {name!r} declares {n_bytes} bytes at offset {begin}, up to byte {begin + n_bytes}, "
                        f"but the file has {file_size} bytes: its tensor data runs past the end of the file"
                    )
                extents.append((begin, begin + n_bytes, name))
            extents.sort()
            for (b1, e1, n1), (b2, e2, n2) in zip(extents, extents[1:]):
                if b2 < e1:
                    raise _TensorExtentError(f"tensors {n1!r} (bytes {b1}-{e1}) and {n2!r} (bytes {b2}-{e2}) overlap")
            super()._build_tensors(start_offs, fields)

    return CheckedReader(str(path))


_READ: dict[tuple, dict] = {}


def open_gguf(path: Path):
    """A GGUF's reader (gguf.GGUFReader, its tensor extents checked first), or IntegrityError naming the file."""
    try:
        return _open(path)
    except _TensorExtentError as e:
        raise IntegrityError(f"{path}: {e}; {_FIX}") from e
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on truncated files
        raise IntegrityError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); {_FIX}") from e


def read_gguf(path: Path, reader=None) -> dict:
    """{'fields': {key: value}, 'tensor_count': n} of a GGUF file (of `reader`, open_gguf's, where one is open), or
    IntegrityError naming it."""
    if reader is None:
        # A stage reads one file more than once (convert its output, quantize its input): the same file, unchanged,
        # is read once. Its identity: path, inode, size and modification time.
        try:
            stat = Path(path).stat()
        except OSError:
            return read_gguf(path, open_gguf(path))  # open_gguf names the problem
        key = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if key not in _READ:
            _READ.clear()  # the last file only: a vocabulary's fields are tens of MB of Python strings
            _READ[key] = read_gguf(path, open_gguf(path))
        return {"fields": dict(_READ[key]["fields"]), "tensor_count": _READ[key]["tensor_count"]}
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


_READ_APART = """
import dataclasses, json, sys
from pathlib import Path
from loraship.errors import LorashipError
from loraship.llamacpp.gguf_info import open_gguf, read_gguf
from loraship.planning.inference_memory import read_layout
path = Path(sys.argv[1])
try:
    reader = open_gguf(path)
    info = read_gguf(path, reader)
except LorashipError as e:
    sys.exit(str(e))
try:
    info["layout"] = dataclasses.asdict(read_layout(path, reader))
except (KeyError, TypeError, ValueError) as e:  # metadata a prediction needs is missing or odd
    info["layout"], info["layout_error"] = None, f"{type(e).__name__}: {e}"
print(json.dumps(info, default=str))
"""


def read_gguf_apart(path: Path) -> dict:
    """read_gguf plus the tensor layout (loraship/planning/inference_memory.py), read in a child process, for
    a process about to load the same GGUF in llama.cpp.

    gguf's reader memory-maps the file with numpy; in a process that had done so (or had allocated
    large numpy arrays), llama.cpp's CUDA load of the file segfaulted on an H200, while the same load
    as a process's first work did not (bench/verify_gpu.py). Values come back as JSON types; layout
    is None (layout_error says why) where the metadata cannot give one.
    """
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _READ_APART, str(path)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise IntegrityError(tail if str(path) in tail else f"{path}: reading its metadata failed ({tail}); {_FIX}")
    return json.loads(done.stdout)
