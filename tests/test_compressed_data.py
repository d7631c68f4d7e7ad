"""Compressed datasets (train.jsonl.gz and its kin) read as users expect, everywhere a dataset is read: rows, the
tokenized cache's fingerprint, golden prompts and `loraship init`'s sniffing (loraship/dataset_files.py)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zipfile
from pathlib import Path

import pytest

from loraship.config import DatasetSpec
from tests.conftest import REPO

PLAIN = REPO / "data" / "demo" / "train.jsonl"


def _zip(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("train.jsonl", data)
    return buffer.getvalue()


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


COMPRESSORS = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress, "zip": _zip, "zst": _zstd}


@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_compressed_jsonl_reads_the_same_rows(tmp_path, suffix):
    from loraship.data import dataset_identity, read_dataset

    path = tmp_path / f"train.jsonl.{suffix}"
    path.write_bytes(COMPRESSORS[suffix](PLAIN.read_bytes()))
    rows = read_dataset(DatasetSpec(path=str(path), type="chat"))
    assert rows == read_dataset(DatasetSpec(path=str(PLAIN), type="chat")) and len(rows) > 1
    # The tokenized cache is keyed on the file as stored: another compression of the same rows is another file.
    assert dataset_identity(DatasetSpec(path=str(path), type="chat")) != dataset_identity(
        DatasetSpec(path=str(PLAIN), type="chat")
    )


def test_a_compressed_json_array_is_read_as_json(tmp_path):
    from loraship.data import read_rows

    path = tmp_path / "rows.json.gz"
    path.write_bytes(gzip.compress(b'[{"text": "one two"}, {"text": "three four"}]'))
    assert read_rows(path, "completion") == [{"text": "one two"}, {"text": "three four"}]


def test_a_compressed_file_that_does_not_exist_is_not_taken_for_a_hub_dataset():
    from loraship.data import hub_dataset_id

    assert hub_dataset_id("data/train.jsonl.gz") is None
    assert hub_dataset_id("org/name") == "org/name"


def test_golden_prompts_and_init_read_compressed_files(tmp_path):
    from loraship.data import read_rows
    from loraship.starter import detect_dataset_type

    golden = tmp_path / "golden.jsonl.gz"
    golden.write_bytes(gzip.compress((REPO / "data/demo/golden.jsonl").read_bytes()))
    assert read_rows(golden, "golden") == read_rows(REPO / "data/demo/golden.jsonl", "golden")
    train = tmp_path / "train.jsonl.bz2"
    train.write_bytes(bz2.compress(PLAIN.read_bytes()))
    assert detect_dataset_type(train) == "chat"


def test_init_names_a_compressed_file_under_a_plain_name(tmp_path):
    from loraship.errors import LorashipError
    from loraship.starter import detect_dataset_type

    path = tmp_path / "train.jsonl"
    path.write_bytes(gzip.compress(PLAIN.read_bytes()))
    with pytest.raises(LorashipError, match=r"gzip-compressed, but its name does not say so; rename it to "):
        detect_dataset_type(path)


def test_plain_names_are_unchanged():
    from loraship.dataset_files import data_suffix

    assert [data_suffix(p) for p in ("a.jsonl", "a.JSONL.GZ", "b.csv.bz2", "dir.v2/c.json", "d.parquet")] == [
        ".jsonl",
        ".jsonl",
        ".csv",
        ".json",
        ".parquet",
    ]
    assert data_suffix(Path("s3://bucket/x.jsonl.zst")) == ".jsonl"
