"""Issue 45's messages that pointed the wrong way, each now ONE message at plan naming the thing and the fix.
Every case starts from inputs that pass (the demo's) and breaks one thing; check_inputs is what `loraship plan`,
`loraship run` and the plan stage run."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.errors import ConfigError
from tests.conftest import REPO, demo_config_dict
from tests.test_bad_inputs import write


def _copy_model(source: Path, root: Path) -> Path:
    folder = root / "model"
    shutil.copytree(source, folder)
    return folder


def _gzip_named_jsonl(cfg, root, monkeypatch):
    path = root / "train.jsonl"
    path.write_bytes(gzip.compress((REPO / "data/demo/train.jsonl").read_bytes()))
    cfg["datasets"][0]["path"] = str(path)


def _corrupt_gzip(cfg, root, monkeypatch):
    cut = gzip.compress((REPO / "data/demo/train.jsonl").read_bytes())[:-40]  # a download cut short
    cfg["datasets"][0]["path"] = str(write(root / "train.jsonl.gz", cut))


def _zstd_without_its_package(cfg, root, monkeypatch):
    from fsspec import utils

    monkeypatch.delitem(utils.compressions, "zst", raising=False)  # as where zstandard is not installed
    cfg["datasets"][0]["path"] = str(write(root / "train.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"\0" * 16))


CASES = [
    (
        "gzip data named .jsonl",
        _gzip_named_jsonl,
        "train.jsonl: gzip-compressed, but its name does not say so; rename it to train.jsonl.gz",
    ),
    (
        "gzip data cut short",
        _corrupt_gzip,
        "train.jsonl.gz: named as gzip-compressed (.gz) but it does not decompress",
    ),
    (
        "zstd data where fsspec cannot read zstd",
        _zstd_without_its_package,
        "train.jsonl.zst: a zstd-compressed file, and this environment cannot read zstd (fsspec needs the "
        "zstandard package); pip install zstandard, or decompress it (zstd -d train.jsonl.zst)",
    ),
]


def test_the_inputs_before_breaking_them_pass(tiny_model, tmp_path):
    from loraship.planning.preflight import check_inputs

    assert check_inputs(parse_config(demo_config_dict(tiny_model, tmp_path))) == tiny_model


@pytest.mark.parametrize("name,breaker,expected", CASES, ids=[c[0] for c in CASES])
def test_one_message_at_plan(tiny_model, tmp_path, monkeypatch, name, breaker, expected):
    from loraship.planning.preflight import check_inputs

    cfg = demo_config_dict(tiny_model, tmp_path)
    breaker(cfg, tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as caught:
        check_inputs(parse_config(cfg))
    problems = caught.value.problems
    assert len(problems) == 1, problems
    assert expected in " ".join(problems[0].split()), problems[0]
