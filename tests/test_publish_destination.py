"""Publish never deletes or overwrites what loraship did not write: an artifact folder on the base model, on the
workdir or over a user's own files is refused at plan and again at publish; --force moves the user's files aside;
a rerun removes only what loraship's previous manifest there lists. Each case compares the sha256 of every file of
the other folders before and after, on the demo pipeline's real artifact."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from loraship.constants import MANIFEST_NAME
from loraship.errors import ConfigError, OutputError


def digests(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path (folders named in `skip` left out)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not set(p.relative_to(folder).parts) & set(skip)
    }


def user_files(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes, not loraship's\n")
    (folder / "experiments").mkdir(exist_ok=True)
    (folder / "experiments" / "results.csv").write_text("run,loss\na,1.25\n")
    return digests(folder)


@pytest.fixture(scope="module")
def shipped(pipeline_run):
    """The demo pipeline's config; afterwards its publish stage is made again for its own output, for the other
    test files that read it (a publish elsewhere replaces the stage's folder)."""
    import loraship.stages.publish as publish

    config, _ = pipeline_run
    yield config
    publish.run(config)


def elsewhere(config, **changes):
    return config.model_copy(update=changes)


def check_plan(config) -> str:
    """The checks `loraship plan` and `loraship run` make before anything runs; their message."""
    from loraship.planning.preflight import check_inputs

    with pytest.raises(ConfigError) as refused:
        check_inputs(config)
    return " ".join(str(refused.value).split())


def test_the_base_model_folder_as_destination_is_refused_and_untouched(shipped, tmp_path):
    import loraship.stages.publish as publish

    model = tmp_path / "models" / shipped.run_name  # output/run_name is this base model's folder
    shutil.copytree(shipped.base_model, model)
    before = digests(model)
    config = elsewhere(shipped, base_model=str(model), output=str(tmp_path / "models"))
    assert f"the artifact folder {model} (output/run_name) is the base model folder {model}" in check_plan(config)
    with pytest.raises(OutputError, match="is the base model folder"):
        publish.run(config)
    assert digests(model) == before
    assert sorted(p.name for p in model.parent.iterdir()) == [shipped.run_name]  # nothing moved aside or added


def test_output_equal_to_workdir_is_refused_and_every_stage_is_kept(shipped):
    import loraship.stages.publish as publish
    from loraship.runtime.stage import run_dir

    run = run_dir(shipped)
    before = digests(run, skip=(".locks",))
    config = elsewhere(shipped, output=shipped.workdir)
    message = check_plan(config)
    assert f"the artifact folder {run.resolve()} (output/run_name) is the run folder {run.resolve()}" in message
    with pytest.raises(OutputError, match="is the run folder"):
        publish.run(config)
    assert digests(run, skip=(".locks",)) == before  # every stage's manifest, checkpoint, model and GGUF


def test_an_artifact_folder_inside_the_workdir_or_holding_a_dataset_is_refused(shipped, tmp_path):
    from loraship.publishing.destination import overlap_problems

    inside = elsewhere(shipped, output=str(Path(shipped.workdir) / "published"))
    [problem] = overlap_problems(inside)
    assert "lies inside the workdir" in problem
    data = Path(shipped.datasets[0].path)
    over_data = elsewhere(shipped, output=str(data.parent.parent), run_name=data.parent.name)
    assert any(f"contains the dataset datasets[0] {data}" in p for p in overlap_problems(over_data))
    assert overlap_problems(elsewhere(shipped, output="memory://bucket")) == []  # a store holds no local input


def test_a_folder_of_the_users_own_files_is_refused_then_moved_aside_with_force(shipped, tmp_path):
    import loraship.stages.publish as publish

    dest = tmp_path / "out" / shipped.run_name
    before = user_files(dest)
    config = elsewhere(shipped, output=str(tmp_path / "out"))
    message = check_plan(config)
    assert (
        f"the artifact folder {dest} already holds 2 file(s) loraship did not write (experiments/results.csv, "
        "notes.txt) and no loraship manifest.json" in message
    )
    assert "choose another run_name (or output), or run again with --force" in message
    with pytest.raises(OutputError, match="already holds 2 file"):
        publish.run(config)
    assert digests(dest) == before

    manifest = publish.run(elsewhere(config, replace_output=True))
    aside = Path(manifest["metrics"]["moved_aside"])
    assert aside.parent == dest.parent and aside.name.startswith(f"{shipped.run_name}.replaced-")
    assert digests(aside) == before  # moved whole, nothing deleted
    published = json.loads((dest / MANIFEST_NAME).read_text())
    assert set(digests(dest)) == {*published["files"], MANIFEST_NAME}


def test_a_rerun_removes_only_what_its_previous_manifest_listed(shipped, tmp_path):
    import loraship.stages.publish as publish

    config = elsewhere(shipped, output=str(tmp_path / "out"))
    publish.run(config)
    dest = tmp_path / "out" / shipped.run_name
    # An earlier publish there shipped another quantization: its manifest listed that GGUF.
    old = dest / "model-Q8_0.gguf"
    old.write_bytes(b"GGUF an earlier quantization")
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    manifest["files"]["model-Q8_0.gguf"] = {"size": old.stat().st_size, "sha256": "0" * 64}
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest))
    mine = user_files(dest / "mine")  # the user's own files beside the artifact
    publish.run(config)
    assert not old.exists()
    assert digests(dest / "mine") == mine
    published = json.loads((dest / MANIFEST_NAME).read_text())
    assert set(digests(dest)) == {*published["files"], MANIFEST_NAME, "mine/notes.txt", "mine/experiments/results.csv"}


def test_force_on_the_command_line_reaches_the_config(shipped, tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    import loraship.cli as cli

    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(shipped.model_dump(mode="json")))
    seen = []
    monkeypatch.setattr(cli, "_run", lambda path, sets, *rest: seen.append(cli._load(path, sets).replace_output))
    for argv, replace in ((["--force"], True), ([], False)):
        result = CliRunner().invoke(cli.app, ["run", str(config_file), *argv])
        assert result.exit_code == 0, result.output
        assert seen.pop() is replace
