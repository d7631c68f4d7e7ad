"""Publish to a Hugging Face Hub repository (`output: hf://...`), against a fake Hub.

FakeHub stands in for HfApi at the boundary (loraship.publishing.hub.hub_api): each repository is a folder of
committed files, a commit is all or nothing and must name the current head as its parent, files
are listed the way the Hub lists them (LFS files with their sha256, others with their git blob
id), and every call is recorded. upload_folder's patterns are matched with huggingface_hub's own
filter. The plan-time checks also run once through the real huggingface_hub HTTP client, against a
local server, in a `loraship run` subprocess.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml

from loraship.publishing import hub
from loraship.constants import MANIFEST_NAME
from loraship.errors import OutputError
from loraship.runtime.manifest import atomic_write_json, describe_files

REPO = Path(__file__).resolve().parents[1]


def http_error(cls_name: str, status: int, url: str = "https://huggingface.co/api"):
    import huggingface_hub.errors as errors

    response = httpx.Response(status, request=httpx.Request("GET", url))
    return getattr(errors, cls_name)(f"{status} Client Error for url: {url}", response=response)


class FakeHub:
    """What HfApi does with our calls, kept in a folder: repos/<type>/<id>/<branch>/<files>."""

    LFS_SUFFIXES = (".gguf", ".safetensors")  # the Hub's default .gitattributes sends these to LFS

    def __init__(self, root: Path, user: str = "alice", writable: tuple[str, ...] = ("alice",)):
        self.root, self.user, self.writable = root, user, set(writable)
        self.calls: list[tuple[str, dict]] = []
        self.tokens: list[str] = []
        self.heads: dict[tuple[str, str, str], int] = {}  # (type, repo, branch) -> commit number
        self.fail_next_commit: Exception | None = None
        self.alter_on_commit: str | None = None  # a path whose bytes the "Hub" changes as it stores them

    def __call__(self, token: str) -> FakeHub:  # replaces loraship.publishing.hub.hub_api
        self.tokens.append(token)
        return self

    def folder(self, repo_id: str, branch: str = "main", repo_type: str = "model") -> Path:
        return self.root / repo_type / repo_id / branch

    def _sha(self, repo_type, repo_id, branch) -> str:
        return f"{self.heads[(repo_type, repo_id, branch)]:040x}"

    # -- the HfApi methods loraship calls ------------------------------------------------
    def whoami(self):
        self.calls.append(("whoami", {}))
        return {"name": self.user, "auth": {"accessToken": {"role": "write"}}}

    def create_repo(self, repo_id, *, repo_type=None, private=None, exist_ok=False):
        self.calls.append(("create_repo", {"repo_id": repo_id, "private": private, "exist_ok": exist_ok}))
        repo_type = repo_type or "model"
        if (repo_type, repo_id, "main") in self.heads:
            return f"https://huggingface.co/{repo_id}"
        if repo_id.split("/")[0] not in self.writable:
            raise http_error("HfHubHTTPError", 403)
        self.folder(repo_id, "main", repo_type).mkdir(parents=True)
        (self.folder(repo_id, "main", repo_type) / ".gitattributes").write_text("*.gguf filter=lfs\n")
        self.heads[(repo_type, repo_id, "main")] = 1
        return f"https://huggingface.co/{repo_id}"

    def auth_check(self, repo_id, *, repo_type=None, write=False):
        self.calls.append(("auth_check", {"repo_id": repo_id, "write": write}))
        if ((repo_type or "model"), repo_id, "main") not in self.heads:
            raise http_error("RepositoryNotFoundError", 404)
        if write and repo_id.split("/")[0] not in self.writable:
            raise http_error("HfHubHTTPError", 403)

    def create_branch(self, repo_id, *, branch, repo_type=None, exist_ok=False):
        self.calls.append(("create_branch", {"repo_id": repo_id, "branch": branch}))
        repo_type = repo_type or "model"
        if (repo_type, repo_id, branch) not in self.heads:
            shutil.copytree(self.folder(repo_id, "main", repo_type), self.folder(repo_id, branch, repo_type))
            self.heads[(repo_type, repo_id, branch)] = self.heads[(repo_type, repo_id, "main")]

    def repo_info(self, repo_id, *, repo_type=None, revision=None):
        self.calls.append(("repo_info", {"repo_id": repo_id, "revision": revision}))
        return SimpleNamespace(sha=self._sha(repo_type or "model", repo_id, revision or "main"))

    def list_repo_tree(self, repo_id, path_in_repo=None, *, recursive=False, revision=None, repo_type=None):
        from huggingface_hub.hf_api import RepoFile, RepoFolder

        self.calls.append(("list_repo_tree", {"repo_id": repo_id, "path_in_repo": path_in_repo, "revision": revision}))
        repo_type = repo_type or "model"
        branch = next(
            b for (t, r, b) in self.heads if (t, r) == (repo_type, repo_id) and self._sha(t, r, b) == revision
        )  # listed at a commit, as loraship does
        base = self.folder(repo_id, branch, repo_type)
        start = base / path_in_repo if path_in_repo else base
        if not start.exists():
            raise http_error("RemoteEntryNotFoundError", 404)
        out = []
        for p in sorted(start.rglob("*")):
            rel = p.relative_to(base).as_posix()
            if p.is_dir():
                out.append(RepoFolder(path=rel, oid="0" * 40))
                continue
            data = p.read_bytes()
            lfs = None
            if p.suffix in self.LFS_SUFFIXES:
                lfs = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            out.append(RepoFile(path=rel, size=len(data), oid=blob, lfs=lfs))
        return out

    def hf_hub_download(self, repo_id, filename, *, repo_type=None, revision=None):
        self.calls.append(("hf_hub_download", {"repo_id": repo_id, "filename": filename, "revision": revision}))
        repo_type = repo_type or "model"
        branch = next(
            b for (t, r, b) in self.heads if (t, r) == (repo_type, repo_id) and self._sha(t, r, b) == revision
        )
        return str(self.folder(repo_id, branch, repo_type) / filename)

    def upload_folder(
        self,
        *,
        repo_id,
        folder_path,
        path_in_repo=None,
        commit_message=None,
        repo_type=None,
        revision=None,
        parent_commit=None,
        allow_patterns=None,
        delete_patterns=None,
    ):
        from huggingface_hub.utils import filter_repo_objects

        repo_type, branch = repo_type or "model", revision or "main"
        self.calls.append(
            (
                "upload_folder",
                {
                    "allow_patterns": allow_patterns,
                    "delete_patterns": delete_patterns,
                    "parent_commit": parent_commit,
                    "path_in_repo": path_in_repo,
                    "revision": revision,
                    "message": commit_message,
                },
            )
        )
        if parent_commit is not None and parent_commit != self._sha(repo_type, repo_id, branch):
            raise http_error("HfHubHTTPError", 412)
        local = sorted(p.relative_to(folder_path).as_posix() for p in Path(folder_path).rglob("*") if p.is_file())
        adds = list(filter_repo_objects(local, allow_patterns=allow_patterns))
        base = self.folder(repo_id, branch, repo_type)
        prefix = f"{path_in_repo.strip('/')}/" if path_in_repo else ""
        remote = (
            sorted(p.relative_to(base / prefix).as_posix() for p in (base / prefix).rglob("*") if p.is_file())
            if (base / prefix).exists()
            else []
        )
        deletes = (
            [
                r
                for r in filter_repo_objects(remote, allow_patterns=delete_patterns)
                if r not in adds and r != ".gitattributes"
            ]
            if delete_patterns
            else []
        )
        if self.fail_next_commit is not None:  # the commit fails as a whole: nothing changes
            error, self.fail_next_commit = self.fail_next_commit, None
            raise error
        for rel in deletes:
            (base / prefix / rel).unlink()
        for rel in adds:
            dst = base / prefix / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            data = (Path(folder_path) / rel).read_bytes()
            dst.write_bytes(data[::-1] if rel == self.alter_on_commit else data)
        self.heads[(repo_type, repo_id, branch)] += 1
        self.committed = {"added": adds, "deleted": deletes}
        return SimpleNamespace(oid=self._sha(repo_type, repo_id, branch))

    # -- for the tests -----------------------------------------------------------------
    def someone_elses_repo(self, repo_id: str) -> None:
        self.writable.add(repo_id.split("/")[0])
        self.create_repo(repo_id)
        self.writable.discard(repo_id.split("/")[0])
        self.calls.clear()

    def commits(self) -> list[dict]:
        return [kw for name, kw in self.calls if name == "upload_folder"]


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setattr(hub, "hub_api", fake)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_not_real")
    return fake


def artifact(root: Path, gguf: str = "model-Q4_K_M.gguf") -> dict:
    root.mkdir(parents=True, exist_ok=True)
    (root / gguf).write_bytes(b"GGUF" + bytes(range(256)) * 64)
    (root / "adapter").mkdir(exist_ok=True)
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"adapter" * 100)
    (root / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (root / "README.md").write_text("---\nlibrary_name: gguf\n---\n# card\n")
    files = describe_files(root)
    atomic_write_json(root / MANIFEST_NAME, {"gguf": gguf, "files": files})
    return files


def held(fake: FakeHub, repo="alice/tiny", branch="main", sub="") -> dict[str, bytes]:
    base = fake.folder(repo, branch) / sub
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in base.rglob("*") if p.is_file()}


def shipped(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_first_publish_is_one_commit_holding_the_whole_artifact(tmp_path, fake_hub):
    files = artifact(tmp_path / "a")
    sent = hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    assert sorted(sent["uploaded"]) == sorted([*files, MANIFEST_NAME]) and sent["removed"] == []
    assert len(fake_hub.commits()) == 1  # manifest in the same atomic commit as the files
    assert fake_hub.commits()[0]["parent_commit"] is not None
    assert {**held(fake_hub)} == {**shipped(tmp_path / "a"), ".gitattributes": b"*.gguf filter=lfs\n"}
    assert ("create_repo", {"repo_id": "alice/tiny", "private": True, "exist_ok": True}) in fake_hub.calls
    assert fake_hub.tokens == ["hf_test_token_not_real"]  # from HF_TOKEN
    # Published and read back: a second run compares and sends nothing.
    again = hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    assert again["uploaded"] == [] and again["removed"] == [] and len(fake_hub.commits()) == 1


def test_resume_after_a_partial_upload_sends_only_what_is_missing(tmp_path, fake_hub):
    files = artifact(tmp_path / "a")
    # An earlier commit holds part of the artifact (the adapter), and no manifest.
    fake_hub.create_repo("alice/tiny", exist_ok=True)
    for rel in ("adapter/adapter_model.safetensors", "adapter/adapter_config.json"):
        dst = fake_hub.folder("alice/tiny") / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "a" / rel, dst)
    # The first attempt's commit fails as a whole (connection reset): the repository is unchanged.
    fake_hub.fail_next_commit = ConnectionError("simulated: connection reset by peer")
    with pytest.raises(OutputError, match="ConnectionError: simulated.*run again"):
        hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    assert MANIFEST_NAME not in held(fake_hub)
    sent = hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    assert sorted(sent["uploaded"]) == sorted(["model-Q4_K_M.gguf", "README.md", MANIFEST_NAME])
    assert fake_hub.committed["added"] == sent["uploaded"]  # the intact adapter was not sent again
    assert {k: v for k, v in held(fake_hub).items() if k != ".gitattributes"} == shipped(tmp_path / "a")


@pytest.mark.parametrize("rel", ["model-Q4_K_M.gguf", "README.md"], ids=["lfs-file", "git-file"])
def test_a_differing_remote_file_is_uploaded_again(tmp_path, fake_hub, rel):
    files = artifact(tmp_path / "a")
    hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    remote = fake_hub.folder("alice/tiny") / rel
    data = bytearray(remote.read_bytes())
    data[5] ^= 0xFF  # same size, other bytes; the remote manifest still lists the file
    remote.write_bytes(bytes(data))
    sent = hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    assert sent["uploaded"] == [rel] and fake_hub.committed == {"added": [rel], "deleted": []}
    assert remote.read_bytes() == (tmp_path / "a" / rel).read_bytes()


def test_files_this_artifact_no_longer_ships_are_deleted_in_the_same_commit(tmp_path, fake_hub):
    hub.sync(tmp_path / "q4", artifact(tmp_path / "q4"), "hf://alice/tiny", "tiny")
    files = artifact(tmp_path / "q8", "model-Q8_0.gguf")
    sent = hub.sync(tmp_path / "q8", files, "hf://alice/tiny", "tiny")
    assert sent["removed"] == ["model-Q4_K_M.gguf"] and len(fake_hub.commits()) == 2
    assert "model-Q4_K_M.gguf" in fake_hub.committed["deleted"] and "model-Q8_0.gguf" in fake_hub.committed["added"]
    assert set(held(fake_hub)) == {*files, MANIFEST_NAME, ".gitattributes"}  # the Hub's own file kept


def test_a_file_added_on_the_hub_by_hand_is_left_alone(tmp_path, fake_hub):
    files = artifact(tmp_path / "a")
    hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    (fake_hub.folder("alice/tiny") / "adapter" / "optimizer.pt").write_bytes(b"left by hand")
    sent = hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    assert sent == {"uploaded": [], "removed": [], "commit": sent["commit"]}  # the manifest does not list it
    assert len(fake_hub.commits()) == 1 and held(fake_hub)["adapter/optimizer.pt"] == b"left by hand"


def test_a_repository_of_someone_elses_files_is_refused_then_committed_over_with_force(tmp_path, fake_hub):
    files = artifact(tmp_path / "a")
    fake_hub.create_repo("alice/tiny", exist_ok=True)
    theirs = {"README.md": b"# my model\n", "model.safetensors": b"weights"}
    for rel, data in theirs.items():
        (fake_hub.folder("alice/tiny") / rel).write_bytes(data)
    before = dict(held(fake_hub))
    [problem] = hub.output_problems("hf://alice/tiny")  # at plan, before any training
    assert "already holds 2 file(s) loraship did not write (README.md, model.safetensors)" in problem
    assert hub.output_problems("hf://alice/tiny", force=True) == []
    with pytest.raises(OutputError, match=r"already holds 2 file.*--force.*stay in the repository's history"):
        hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")
    assert held(fake_hub) == before and fake_hub.commits() == []
    parent = fake_hub._sha("model", "alice/tiny", "main")
    sent = hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny", force=True)
    assert sent["replaced_from_commit"] == parent and sent["removed"] == []
    assert fake_hub.committed["deleted"] == []  # nothing deleted: the card replaced README.md in a new commit
    assert held(fake_hub)["model.safetensors"] == theirs["model.safetensors"]


def test_revision_and_folder_of_the_url_are_honoured(tmp_path, fake_hub):
    files = artifact(tmp_path / "a")
    fake_hub.create_repo("alice/tiny", exist_ok=True)
    (fake_hub.folder("alice/tiny") / "notes.md").write_text("the user's own file, outside the artifact folder")
    hub.sync(tmp_path / "a", files, "hf://alice/tiny@experiments/runs/tiny", "tiny")
    assert held(fake_hub, branch="experiments", sub="runs/tiny") == shipped(tmp_path / "a")
    assert (fake_hub.folder("alice/tiny", "experiments") / "notes.md").exists()
    assert not (fake_hub.folder("alice/tiny", "main") / "runs").exists()
    assert fake_hub.commits()[0]["revision"] == "experiments" and fake_hub.commits()[0]["path_in_repo"] == "runs/tiny"


def test_a_hub_that_stores_other_bytes_is_refused(tmp_path, fake_hub):
    files = artifact(tmp_path / "a")
    fake_hub.alter_on_commit = "model-Q4_K_M.gguf"
    with pytest.raises(
        OutputError, match=r"does not hold what was uploaded: model-Q4_K_M.gguf \(holds \d+ bytes, sha256"
    ):
        hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")


def test_a_commit_pushed_by_someone_else_meanwhile_is_not_overwritten(tmp_path, fake_hub, monkeypatch):
    files = artifact(tmp_path / "a")
    real = fake_hub.list_repo_tree

    def someone_commits_after_the_listing(*args, **kwargs):
        out = real(*args, **kwargs)
        fake_hub.heads[("model", "alice/tiny", "main")] += 1
        return out

    monkeypatch.setattr(fake_hub, "list_repo_tree", someone_commits_after_the_listing)
    with pytest.raises(OutputError, match="HfHubHTTPError: 412"):
        hub.sync(tmp_path / "a", files, "hf://alice/tiny", "tiny")


# -- plan-time checks ------------------------------------------------------------------------


def test_no_token_is_a_plan_time_problem(fake_hub, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hub, "token", lambda: None)
    [problem] = hub.output_problems("hf://alice/tiny")
    assert "no Hugging Face token" in problem and "HF_TOKEN" in problem and "env_from_secrets" in problem
    assert fake_hub.calls == []  # nothing asked of the Hub
    with pytest.raises(OutputError, match="no Hugging Face token"):
        hub.sync(tmp_path, {}, "hf://alice/tiny")


def test_token_from_a_prefect_secret_block_through_env_from_secrets(fake_hub, monkeypatch):
    from loraship.runtime import prefect_env

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(prefect_env, "_load_secret", lambda block: {"hf-write": "hf_from_the_block"}[block])
    with prefect_env.secret_env({"HF_TOKEN": "hf-write"}):
        assert hub.output_problems("hf://alice/tiny") == []
    assert fake_hub.tokens == ["hf_from_the_block"] and "HF_TOKEN" not in os.environ


def test_token_that_cannot_write_to_the_repository(fake_hub):
    fake_hub.someone_elses_repo("bob/their-model")  # exists; alice is no member of bob
    [problem] = hub.output_problems("hf://bob/their-model")
    assert "the token of 'alice' cannot write to model repository 'bob/their-model' (HTTP 403)" in problem
    [problem] = hub.output_problems("hf://acme/new-model")  # a namespace it cannot create in
    assert "cannot create model repository 'acme/new-model'" in problem and "HTTP 403" in problem
    assert hub.output_problems("hf://alice/new-model") == []  # its own namespace: created, writable
    assert ("auth_check", {"repo_id": "alice/new-model", "write": True}) in fake_hub.calls


def test_token_the_hub_refuses(fake_hub, monkeypatch):
    def whoami():
        raise http_error("HfHubHTTPError", 401)

    monkeypatch.setattr(fake_hub, "whoami", whoami)
    [problem] = hub.output_problems("hf://alice/tiny")
    assert "invalid or expired (HTTP 401)" in problem


@pytest.mark.parametrize(
    "url,expected",
    [
        ("hf://spaces/alice/demo", "a space repository holds an app"),
        ("hf://datasets", "not a Hugging Face repository URL"),
    ],
)
def test_urls_that_name_no_model_repository(url, expected):
    [problem] = hub.output_problems(url)
    assert expected in problem


def test_urls_follow_huggingface_hub_syntax():
    t = hub.parse("hf://datasets/alice/runs@refs%2Fpr%2F3/sub/dir/")
    assert (t.repo_type, t.repo_id, t.revision, t.path) == ("dataset", "alice/runs", "refs/pr/3", "sub/dir")
    assert hub.is_hub_repo("hf://alice/tiny") and not hub.is_hub_repo("hf://buckets/alice/b")
    assert not hub.is_hub_repo("s3://bucket/hf://x")


# -- the real huggingface_hub client, in the CLI, against a local server --------------------


class FakeHubHTTP(http.server.BaseHTTPRequestHandler):
    """The Hub's answers for a token of 'alice' who may not write to bob's repository."""

    def _send(self, status: int, body: dict, headers: dict | None = None):
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/api/whoami-v2"):
            return self._send(
                200, {"name": "alice", "type": "user", "orgs": [], "auth": {"accessToken": {"role": "read"}}}
            )
        if self.path.startswith("/api/models/bob/their-model/auth-check/write"):
            return self._send(403, {"error": "You don't have write access"})
        return self._send(404, {"error": "not here"}, {"X-Error-Code": "RepoNotFound"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/api/repos/create"):
            # The Hub answers an existing repository with its URL too (create_repo reads it).
            return self._send(
                409,
                {
                    "error": "You already created this model repo",
                    "url": f"http://{self.headers['Host']}/bob/their-model",
                },
            )
        return self._send(404, {"error": "not here"})

    def log_message(self, *args):
        pass


def test_cli_refuses_before_any_training_a_token_that_cannot_write(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHubHTTP)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
        (model / "tokenizer.json").write_text("{}")
        data = tmp_path / "train.jsonl"
        data.write_text(
            json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
            + "\n"
        )
        cfg = {
            "run_name": "bad",
            "base_model": str(model),
            "datasets": [{"path": str(data), "type": "chat"}],
            "workdir": str(tmp_path / "work"),
            "output": "hf://bob/their-model",
        }
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
        env = {
            **os.environ,
            "HF_TOKEN": "hf_fake_read_token",
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        }
        result = subprocess.run(
            [sys.executable, "-m", "loraship.cli", "run", str(tmp_path / "config.yaml")],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
        )
    finally:
        server.shutdown()
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "the token of 'alice' cannot write to model repository 'bob/their-model' (HTTP 403)" in output, output
    assert "hf_fake_read_token" not in output and "Traceback" not in output
    assert not (tmp_path / "work" / "bad" / "train").exists()


# -- the publish stage of a real pipeline run ---------------------------------------------


def test_publish_stage_puts_the_artifact_at_the_repository_top_and_resumes(pipeline_run, fake_hub):
    import loraship.stages.publish as publish
    from loraship.config import parse_config

    config, _ = pipeline_run
    hub_config = parse_config({**config.model_dump(mode="json"), "output": "hf://alice/tiny"})
    assert publish.destination_of(hub_config) == "hf://alice/tiny"  # not under run_name: the card is the repo's
    manifest = publish.run(hub_config)
    files = held(fake_hub)
    assert files["README.md"].startswith(b"---\n") and b"library_name: gguf" in files["README.md"]
    assert "model-Q4_K_M.gguf" in files and "Modelfile" in files and MANIFEST_NAME in files
    assert manifest["metrics"]["hub_commit"] == fake_hub._sha("model", "alice/tiny", "main")
    assert len(fake_hub.commits()) == 1
    # The Hub lost the GGUF (deleted there): the finished stage puts back only that.
    (fake_hub.folder("alice/tiny") / "model-Q4_K_M.gguf").unlink()
    publish.run(hub_config)
    assert fake_hub.committed == {"added": ["model-Q4_K_M.gguf"], "deleted": []}
