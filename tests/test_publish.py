"""Publish to a store that can fail half-way, lose or alter files, hold an earlier artifact or someone else's
files: every file read back, only what differs sent again, nothing stale left, the manifest last, and nothing
loraship did not write removed or overwritten."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import fsspec
import pytest

from loraship.constants import MANIFEST_NAME
from loraship.errors import OutputError
from loraship.runtime.manifest import atomic_write_json, describe_files
from loraship.publishing.destination import JOURNAL
from loraship.publishing.store import sync


def artifact(root: Path, gguf: str = "model-Q4_K_M.gguf") -> dict:
    root.mkdir(parents=True, exist_ok=True)
    (root / gguf).write_bytes(b"GGUF" + bytes(range(256)) * 64)
    (root / "adapter").mkdir(exist_ok=True)
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"adapter" * 100)
    (root / "README.md").write_text("card")
    files = describe_files(root)
    atomic_write_json(root / MANIFEST_NAME, {"gguf": gguf, "files": files})
    return files


def remote() -> tuple[object, str, str]:
    url = f"memory://loraship-test/{uuid.uuid4().hex}/run"
    fs, base = fsspec.core.url_to_fs(url)
    return fs, base, url


class FlakyStore:
    """Wraps put_file to fail (with a non-OSError, as botocore does) after n uploads."""

    def __init__(self, fs, fail_after: int | None):
        self.fs, self.fail_after, self.calls = fs, fail_after, []
        self.real = type(fs).put_file.__get__(fs)

    def __call__(self, src, dst, *args, **kwargs):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("simulated store error: connection reset")
        self.calls.append(dst)
        return self.real(src, dst, *args, **kwargs)


def test_interrupted_publish_resumes_sending_only_what_is_missing(tmp_path, monkeypatch):
    files = artifact(tmp_path / "a")
    fs, base, url = remote()
    flaky = FlakyStore(fs, fail_after=2)
    monkeypatch.setattr(fs, "put_file", flaky)
    with pytest.raises(OutputError, match="RuntimeError: simulated store error.*run again"):
        sync(tmp_path / "a", files, url)
    assert not fs.exists(f"{base}/{MANIFEST_NAME}")  # an interrupted publish is visibly incomplete
    assert fs.exists(f"{base}/{JOURNAL}")  # and known as loraship's: the rerun may replace what it left
    done_before = list(flaky.calls)

    resumed = FlakyStore(fs, fail_after=None)
    monkeypatch.setattr(fs, "put_file", resumed)
    sent = sync(tmp_path / "a", files, url)
    assert not set(done_before) & set(resumed.calls)  # intact files are not sent again
    assert resumed.calls[-1] == f"{base}/{MANIFEST_NAME}"  # manifest last
    assert len(resumed.calls) == len(files) + 1 - len(done_before)
    assert sent["removed"] == []
    published = json.loads(fs.cat_file(f"{base}/{MANIFEST_NAME}"))
    assert published["files"] == files and not fs.exists(f"{base}/{JOURNAL}")
    assert sync(tmp_path / "a", files, url) == {"uploaded": [], "removed": []}  # nothing left to do


def test_a_file_altered_in_the_store_is_sent_again_though_the_manifest_lists_it(tmp_path):
    files = artifact(tmp_path / "a")
    fs, base, url = remote()
    sync(tmp_path / "a", files, url)
    gguf = f"{base}/model-Q4_K_M.gguf"
    data = bytearray(fs.cat_file(gguf))
    data[100] ^= 0xFF  # same size, other bytes
    fs.pipe_file(gguf, bytes(data))
    fs.rm_file(f"{base}/README.md")
    sent = sync(tmp_path / "a", files, url)
    assert sorted(sent["uploaded"]) == sorted(["model-Q4_K_M.gguf", "README.md", MANIFEST_NAME])
    assert fs.cat_file(gguf) == (tmp_path / "a" / "model-Q4_K_M.gguf").read_bytes()


def test_files_of_an_earlier_quantization_are_removed(tmp_path):
    fs, base, url = remote()
    sync(tmp_path / "q4", artifact(tmp_path / "q4"), url)
    assert fs.exists(f"{base}/model-Q4_K_M.gguf")
    files = artifact(tmp_path / "q8", "model-Q8_0.gguf")
    sent = sync(tmp_path / "q8", files, url)
    assert sent["removed"] == ["model-Q4_K_M.gguf"]
    assert not fs.exists(f"{base}/model-Q4_K_M.gguf") and fs.exists(f"{base}/model-Q8_0.gguf")


def test_store_that_alters_what_it_receives_is_refused(tmp_path, monkeypatch):
    files = artifact(tmp_path / "a")
    fs, base, url = remote()
    real = fs.put_file

    def truncating(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        fs.pipe_file(dst, fs.cat_file(dst)[:-1])

    monkeypatch.setattr(fs, "put_file", truncating)
    with pytest.raises(OutputError, match="reads back as .* bytes"):
        sync(tmp_path / "a", files, url)
    assert not fs.exists(f"{base}/{MANIFEST_NAME}")


def test_local_destination_gets_whole_files_and_no_temporaries(tmp_path):
    files = artifact(tmp_path / "a")
    dest = tmp_path / "out" / "run"
    dest.mkdir(parents=True)
    (dest / ".tmp-model-Q4_K_M.gguf.pod-1.1.abcd").write_bytes(b"half")  # left by a killed publish
    sync(tmp_path / "a", files, str(dest))
    shipped = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert shipped == sorted([*files, MANIFEST_NAME])


def test_the_artifact_ships_the_sampling_settings_verify_served_it_with(tmp_path):
    from loraship.config import parse_config
    from loraship.sampling import GREEDY, Sampling
    from loraship.publishing.model_card import serve_commands, shipped_sampling
    from loraship.stages.publish import write_generation_config

    config = parse_config(
        {"base_model": str(tmp_path), "run_name": "support-bot", "datasets": [{"path": "x", "type": "chat"}]}
    )
    assert shipped_sampling({}) == GREEDY  # a verify.json from before the record checked argmax answers
    commands = serve_commands(config, {"sampling": GREEDY.record()})
    assert commands["llama_server"].endswith(
        "--temp 0 --top-k 0 --top-p 1 --min-p 0 --repeat-penalty 1 --presence-penalty 0 --frequency-penalty 0"
    )
    other = Sampling(repeat_penalty=1.1)
    assert "--repeat-penalty 1.1 " in serve_commands(config, {"sampling": other.record()})["llama_server"]
    # A merge made before merge wrote greedy settings: the artifact's generation_config.json is greedy anyway.
    merged = tmp_path / "generation_config.json"
    merged.write_text(
        json.dumps({"eos_token_id": [2, 7], "do_sample": True, "temperature": 0.7, "repetition_penalty": 1.05})
    )
    write_generation_config(merged, tmp_path / "out.json", GREEDY)
    assert json.loads((tmp_path / "out.json").read_text()) == {
        "eos_token_id": [2, 7],
        "do_sample": False,
        "repetition_penalty": 1.0,
    }


def remote_digests(fs, base: str) -> dict[str, str]:
    return {p[len(base) + 1 :]: hashlib.sha256(fs.cat_file(p)).hexdigest() for p in sorted(fs.find(base))}


def test_a_store_folder_of_someone_elses_files_is_refused_then_moved_aside_with_force(tmp_path):
    files = artifact(tmp_path / "a")
    fs, base, url = remote()
    fs.pipe_file(f"{base}/notes.txt", b"mine")
    fs.pipe_file(f"{base}/experiments/results.csv", b"run,loss\n")
    before = remote_digests(fs, base)
    with pytest.raises(OutputError, match=r"already holds 2 file\(s\) loraship did not write .* --force"):
        sync(tmp_path / "a", files, url)
    assert remote_digests(fs, base) == before
    sent = sync(tmp_path / "a", files, url, force=True)
    aside = sent["moved_aside"]
    assert aside.startswith(f"{base}.replaced-") and remote_digests(fs, aside) == before
    assert set(remote_digests(fs, base)) == {*files, MANIFEST_NAME}


def test_a_rerun_removes_what_its_manifest_listed_and_keeps_the_rest(tmp_path):
    fs, base, url = remote()
    sync(tmp_path / "q4", artifact(tmp_path / "q4"), url)
    fs.pipe_file(f"{base}/notes.txt", b"added by hand beside the artifact")
    mine = remote_digests(fs, base)["notes.txt"]
    files = artifact(tmp_path / "q8", "model-Q8_0.gguf")
    sent = sync(tmp_path / "q8", files, url)
    assert sent["removed"] == ["model-Q4_K_M.gguf"]
    assert remote_digests(fs, base)["notes.txt"] == mine
    assert set(remote_digests(fs, base)) == {*files, MANIFEST_NAME, "notes.txt"}


def test_a_file_of_someone_elses_the_artifact_would_overwrite_is_refused_then_moved_aside(tmp_path):
    dest = tmp_path / "out" / "run"
    sync(tmp_path / "q4", artifact(tmp_path / "q4"), str(dest))
    (dest / "model-Q8_0.gguf").write_bytes(b"the user's own GGUF, not listed by loraship's manifest")
    theirs = hashlib.sha256((dest / "model-Q8_0.gguf").read_bytes()).hexdigest()
    files = artifact(tmp_path / "q8", "model-Q8_0.gguf")
    with pytest.raises(OutputError, match="holds model-Q8_0.gguf, which the artifact would overwrite"):
        sync(tmp_path / "q8", files, str(dest))
    assert (dest / "model-Q4_K_M.gguf").exists()  # refused before anything changed
    sent = sync(tmp_path / "q8", files, str(dest), force=True)
    moved = Path(sent["moved_aside"]) / "model-Q8_0.gguf"
    assert hashlib.sha256(moved.read_bytes()).hexdigest() == theirs
    assert sent["removed"] == ["model-Q4_K_M.gguf"]


def test_a_foreign_manifest_json_does_not_make_a_folder_loraships(tmp_path):
    dest = tmp_path / "out" / "run"
    dest.mkdir(parents=True)
    (dest / MANIFEST_NAME).write_text('{"name": "my web app"}')
    with pytest.raises(OutputError, match="already holds 1 file"):
        sync(tmp_path / "a", artifact(tmp_path / "a"), str(dest))
    assert (dest / MANIFEST_NAME).read_text() == '{"name": "my web app"}'
