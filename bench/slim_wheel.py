"""Copy a wheel without some of its files, with a RECORD that matches what is left.

    python bench/slim_wheel.py IN.whl OUT_DIR studio/                       # Unsloth without its web UI
    python bench/slim_wheel.py IN.whl OUT_DIR bitsandbytes/libbitsandbytes_cuda1{18,21,24,26,28}.so

Every argument after OUT_DIR drops the archive members that start with it. The copy keeps the
wheel's file name (pip checks name and tags, not size) and passes `pip install`'s RECORD check.
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, out_dir: Path, drop: list[str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename == record or any(info.filename.startswith(d) for d in drop):
                    continue
                data = src.read(info)
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                if not info.is_dir():
                    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                    rows.append(f"{info.filename},sha256={digest},{len(data)}")
            rows.append(f"{record},,")
            dst.writestr(record, "\n".join(rows) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    print(slim(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]))
