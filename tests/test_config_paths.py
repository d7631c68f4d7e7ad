"""Relative data paths in a config start at the config file's folder (a pod's working directory
is the image's, not the folder the config was written in)."""

from __future__ import annotations

import yaml

from loraship.config import load_config


def test_relative_dataset_paths_resolve_beside_the_config(tmp_path, monkeypatch):
    specs = tmp_path / "specs"
    (specs / "data").mkdir(parents=True)
    for name in ("b.jsonl", "a.jsonl", "eval.jsonl", "golden.jsonl"):
        (specs / "data" / name).write_text("{}\n")
    (specs / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "base_model": "org/model",
                "datasets": [{"path": "data/b.jsonl", "type": "chat"}, {"path": "data/a.jsonl", "type": "chat"}],
                "eval_datasets": [{"path": "data/eval.jsonl", "type": "chat"}],
                "golden_prompts": "data/golden.jsonl",
            }
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(specs / "run.yaml")
    assert [d.path for d in config.datasets] == [str(specs / "data" / "b.jsonl"), str(specs / "data" / "a.jsonl")]
    assert config.eval_datasets[0].path == str(specs / "data" / "eval.jsonl")
    assert config.golden_prompts == str(specs / "data" / "golden.jsonl")


def test_a_path_found_only_from_the_current_folder_still_works(tmp_path, monkeypatch):
    # configs/demo.yaml names data/demo/train.jsonl from the repository root, where make runs it.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "c.yaml").write_text(
        yaml.safe_dump({"base_model": "org/model", "datasets": [{"path": "data/train.jsonl", "type": "chat"}]})
    )
    monkeypatch.chdir(tmp_path)
    assert load_config("configs/c.yaml").datasets[0].path == "data/train.jsonl"


def test_a_dataset_url_is_kept_as_written_and_read_through_fsspec(tmp_path, monkeypatch):
    """A URL is no path beside the config; its rows and its identity come through fsspec (file:// here, the same
    code path as s3:// or gs:// with their packages installed)."""
    import hashlib
    import json

    from loraship.data import dataset_identity, read_dataset

    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = tmp_path / "remote" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    (tmp_path / "specs").mkdir()
    url = f"file://{data}"
    (tmp_path / "specs" / "run.yaml").write_text(
        yaml.safe_dump({"base_model": "org/model", "datasets": [{"path": url, "type": "chat"}]})
    )
    monkeypatch.chdir(tmp_path)
    spec = load_config(tmp_path / "specs" / "run.yaml").datasets[0]
    assert spec.path == url
    assert read_dataset(spec) == [row, row]
    assert dataset_identity(spec) == hashlib.sha256(data.read_bytes()).hexdigest()
