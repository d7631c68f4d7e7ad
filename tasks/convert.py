"""Convert: merged HF folder -> F16 GGUF with the pinned llama.cpp's convert_hf_to_gguf.py.

The converter runs in a subprocess with a timeout: a blocking native call cannot be
interrupted by a Prefect task timeout (shared/PITFALLS.md), and a crash there must not take
the flow with it. Output is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

from loraship.constants import F16_GGUF, GGUF_KEY_CHAT_TEMPLATE, GGUF_KEY_FILE_TYPE, MERGED_DIR
from loraship.gguf_info import read_gguf_of_type
from loraship.llamacpp import converter_dir
from loraship.proc import write_with_tool
from loraship.preflight import check_free_disk
from loraship.stage import exclusive, main, open_stage, reset_dir

STAGE = "convert"
UPSTREAM = ("merge",)
FIELDS: tuple[str, ...] = ()
TIMEOUT_S = 4 * 3600


def convert(merged_dir: Path, out_file: Path, outtype: str = "f16") -> None:
    script = converter_dir() / "convert_hf_to_gguf.py"
    write_with_tool(
        lambda tmp: [sys.executable, str(script), str(merged_dir), "--outfile", str(tmp), "--outtype", outtype],
        out_file, f"convert_hf_to_gguf.py on {merged_dir}", TIMEOUT_S,
    )


@exclusive
def run(config) -> dict:
    ctx = open_stage(config, STAGE, UPSTREAM, FIELDS)
    if ctx.done:
        return ctx.done
    reset_dir(ctx)
    merged = ctx.upstream_dir("merge") / MERGED_DIR
    merged_bytes = sum(p.stat().st_size for p in merged.glob("*.safetensors"))
    check_free_disk(ctx.dir, merged_bytes * 1.05, "convert (F16 GGUF)")
    out = ctx.dir / F16_GGUF
    convert(merged, out)
    info = read_gguf_of_type(out, "F16")
    return ctx.finish(
        {
            "tensor_count": info["tensor_count"],
            "file_type": info["fields"][GGUF_KEY_FILE_TYPE],
            "has_chat_template": bool(info["fields"].get(GGUF_KEY_CHAT_TEMPLATE)),
            "bytes": out.stat().st_size,
        }
    )


if __name__ == "__main__":
    main(run)
