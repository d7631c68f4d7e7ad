"""Publish to a Hugging Face Hub repository: `output: hf://<namespace>/<name>[@<revision>][/<path>]`.

The URL is huggingface_hub's own syntax (`parse_hf_uri`, what its HfFileSystem reads):
`hf://org/name` is a model repository, `hf://datasets/org/name` a dataset repository, `@revision`
a branch (created from the default branch if missing) or a pull request ref `refs/pr/N`, and a
path a folder inside the repository. The artifact goes exactly there, not under `run_name`: the
Hub renders the model card, and reads its front matter, only from the repository's top-level
README.md. Buckets (`hf://buckets/...`) are plain storage, published like any other fsspec URL.

The token is huggingface_hub's (`get_token`): HF_TOKEN in the environment, which a stage fills from
a Prefect Secret block through the config's `env_from_secrets`, else the `hf auth login` token.

Publish replaces or deletes only files that the manifest.json it committed there lists; a repository folder
holding other files and no loraship manifest is refused (at plan and at publish), and with `force` the artifact
is committed over it: the files it replaces stay in the repository's history, the others where they are.

One publish is one commit (`HfApi.upload_folder`). A Hub commit is atomic: a reader of the
revision sees the tree before it or after it, never part of it, so manifest.json goes into the
same commit as the files instead of after them, and an interrupted upload leaves the repository
as it was. The comparison is made against one commit of the revision and the upload names it as
`parent_commit`, so a commit someone else pushes in between makes ours fail instead of being
overwritten unchecked.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from loraship.constants import MANIFEST_NAME
from loraship.errors import OutputError
from loraship.runtime.manifest import sha256_file

log = logging.getLogger("loraship")

PROTOCOL = "hf://"
# The Hub writes .gitattributes (which files go to LFS) into every new repository; it is the
# repository's, not the artifact's, so publish neither compares nor removes it.
HUB_OWN_FILES = {".gitattributes"}
# A repository publish creates starts private: a fine-tune of private data must not become public
# by default. Making it public is one click in its settings; an existing repository keeps its own.
CREATE_PRIVATE = True
TOKEN_FIX = (
    "set HF_TOKEN to a token with write access (https://huggingface.co/settings/tokens), or add "
    "`env_from_secrets: {HF_TOKEN: <Prefect Secret block>}` to the config"
)


@dataclass(frozen=True)
class HubTarget:
    url: str
    repo_id: str
    repo_type: str
    revision: str | None
    path: str  # folder inside the repository, "" for its top level

    def __str__(self) -> str:
        return self.url


def is_hub_repo(url: str) -> bool:
    """An `hf://` URL naming a repository (buckets are plain fsspec storage)."""
    return url.startswith(PROTOCOL) and not url.startswith(f"{PROTOCOL}buckets/")


def parse(url: str) -> HubTarget:
    from huggingface_hub import parse_hf_uri
    from huggingface_hub.errors import HfUriError

    try:
        uri = parse_hf_uri(url.rstrip("/"))
    except HfUriError as e:
        raise OutputError(
            f"output {url!r}: not a Hugging Face repository URL ({e}); write it as "
            "hf://<namespace>/<repo>[@<branch>][/<folder>]"
        ) from e
    if uri.type not in ("model", "dataset"):
        raise OutputError(
            f"output {url!r}: a {uri.type} repository holds an app or code, not a model artifact; "
            "publish to a model repository, hf://<namespace>/<repo>"
        )
    return HubTarget(url.rstrip("/"), uri.id, uri.type, uri.revision, uri.path_in_repo.strip("/"))


def hub_api(token: str):
    """The Hub client; tests replace this one function with a fake that keeps files in a folder."""
    from huggingface_hub import HfApi

    return HfApi(token=token)


def token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _status(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def output_problems(url: str, force: bool = False) -> list[str]:
    """Plan-time check of an `hf://` output: a token, valid, that can write to the repository, and (unless
    `force`) nothing there that loraship did not write.

    The repository is created here (private, `exist_ok`) as a folder output is created by the
    plan: then the Hub itself answers whether this token can write to it (`auth_check(write=True)`)
    instead of loraship guessing from the token's scopes.
    """
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        target = parse(url)
    except OutputError as e:
        return [str(e)]
    tok = token()
    if not tok:
        return [f"output {url!r}: no Hugging Face token to publish with; {TOKEN_FIX}"]
    api = hub_api(tok)
    try:
        user = api.whoami().get("name", "?")
    except OfflineModeIsEnabled:
        return [
            f"output {url!r}: HF_HUB_OFFLINE is set, so the token cannot be checked and nothing can be published; "
            "unset HF_HUB_OFFLINE for this run or choose a local output folder"
        ]
    except Exception as e:  # noqa: BLE001 - HTTP and connection errors of several libraries
        if _status(e) == 401:
            return [f"output {url!r}: the Hub refuses the token as invalid or expired (HTTP 401); {TOKEN_FIX}"]
        return [
            f"output {url!r}: cannot reach the Hub to check the token ({type(e).__name__}: {e}); check the "
            "network (or HF_ENDPOINT), then run again"
        ]
    try:
        api.create_repo(target.repo_id, repo_type=target.repo_type, private=CREATE_PRIVATE, exist_ok=True)
    except Exception as e:  # noqa: BLE001
        return [
            f"output {url!r}: the token of {user!r} cannot create {target.repo_type} repository {target.repo_id!r} "
            f"({type(e).__name__}, HTTP {_status(e)}); create it on the Hub first, or use a token with write "
            f"access to the namespace {target.repo_id.split('/')[0]!r}"
        ]
    try:
        api.auth_check(target.repo_id, repo_type=target.repo_type, write=True)
    except Exception as e:  # noqa: BLE001
        if _status(e) in (401, 403, 404):
            return [
                f"output {url!r}: the token of {user!r} cannot write to {target.repo_type} repository "
                f"{target.repo_id!r} (HTTP {_status(e)}); use a token with write access to it (a write token of a "
                "member, or a fine-grained token with repo write permission on it), or publish to a repository "
                "you own"
            ]
        return [
            f"output {url!r}: cannot check write access to {target.repo_id!r} ({type(e).__name__}: {e}); run again"
        ]
    return [] if force else foreign_problems(api, target)


def foreign_problems(api, target: HubTarget) -> list[str]:
    """Files at the target that loraship did not write, as publish would refuse them. Where they cannot be listed
    now (a branch publish will create) nothing is said: publish checks again before its commit."""
    from loraship.publishing import destination

    try:
        head = api.repo_info(target.repo_id, repo_type=target.repo_type, revision=target.revision).sha
        holdings = _holdings(api, target, head, _remote_files(api, target, head), set())
    except Exception:  # noqa: BLE001 - HTTP and Hub errors
        return []
    blocking = destination.in_the_way(holdings, set())
    return [_refusal(target, holdings, blocking, f"output {target.url!r}", head)] if blocking else []


def _holdings(api, target: HubTarget, revision: str, remote: dict, wanted: set[str]):
    """What the target folder holds at one commit and which files loraship's manifest.json there lists."""
    from loraship.publishing import destination

    manifest = None
    if MANIFEST_NAME in remote:
        path = f"{target.path}/{MANIFEST_NAME}" if target.path else MANIFEST_NAME
        local = api.hf_hub_download(target.repo_id, path, repo_type=target.repo_type, revision=revision)
        try:
            manifest = json.loads(Path(local).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            manifest = None
    return destination.held(set(remote), manifest, None, wanted)


def _refusal(target: HubTarget, holdings, blocking: list[str], where: str, head: str) -> str:
    from loraship.publishing import destination

    return destination.refusal(
        target.url,
        holdings,
        blocking,
        where,
        aside=(
            f"commit the artifact over them: the files it replaces stay in the repository's history (commit "
            f"{head[:12]}), the others where they are"
        ),
    )


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file, which the Hub reports for files it keeps in git, not LFS."""
    data = Path(path).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _remote_files(api, target: HubTarget, revision: str) -> dict:
    """The files under the target folder at one commit, keyed by path relative to that folder."""
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.hf_api import RepoFile

    try:
        entries = api.list_repo_tree(
            target.repo_id,
            path_in_repo=target.path or None,
            recursive=True,
            revision=revision,
            repo_type=target.repo_type,
        )
        entries = list(entries)
    except EntryNotFoundError:  # the folder does not exist yet
        return {}
    prefix = f"{target.path}/" if target.path else ""
    return {
        e.path[len(prefix) :]: e
        for e in entries
        if isinstance(e, RepoFile) and e.path.startswith(prefix) and e.path[len(prefix) :] not in HUB_OWN_FILES
    }


def _matches(remote, info: dict, local: Path) -> bool:
    """Whether the Hub holds exactly this file: size, then sha256 (LFS) or the git blob id."""
    if remote is None or remote.size != info["size"]:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == info["sha256"]
    return remote.blob_id == git_blob_sha1(local)


def _pattern(rel: str) -> str:
    """An exact path as an upload_folder pattern (they are fnmatch globs)."""
    return glob.escape(rel)


def _head(api, target: HubTarget) -> str:
    """The commit the revision points at, creating the branch when the URL names a new one."""
    if target.revision and not target.revision.startswith("refs/"):
        api.create_branch(target.repo_id, branch=target.revision, repo_type=target.repo_type, exist_ok=True)
    return api.repo_info(target.repo_id, repo_type=target.repo_type, revision=target.revision).sha


def sync(root: Path, files: dict, url: str, run_name: str = "", force: bool = False) -> dict:
    """Make the Hub location hold the artifact in `root` (manifest.json included), in one commit.

    Every file is compared with what the Hub holds, by size and sha256 (the LFS pointer's) or the
    git blob id, never with the remote manifest; what is missing or differs is uploaded, what the
    manifest committed there before lists and this artifact no longer ships is deleted in the same
    commit, and the commit is read back the same way. Files loraship did not write are refused, or
    with `force` left in place (those the artifact replaces stay in the history). Returns what was
    uploaded and removed, and the commit.
    """
    from loraship.publishing import destination

    target = parse(url)
    tok = token()
    if not tok:
        raise OutputError(f"publish: no Hugging Face token to publish to {url}; {TOKEN_FIX}, then run again")
    manifest = root / MANIFEST_NAME
    wanted = {**files, MANIFEST_NAME: {"size": manifest.stat().st_size, "sha256": sha256_file(manifest)}}
    try:
        api = hub_api(tok)
        api.create_repo(target.repo_id, repo_type=target.repo_type, private=CREATE_PRIVATE, exist_ok=True)
        parent = _head(api, target)
        remote = _remote_files(api, target, parent)
        holdings = _holdings(api, target, parent, remote, set(wanted))
        stale = sorted(rel for rel, info in wanted.items() if not _matches(remote.get(rel), info, root / rel))
        blocking = destination.in_the_way(holdings, set(wanted), set(wanted) - set(stale))
        if blocking and not force:
            raise OutputError(_refusal(target, holdings, blocking, "publish", parent))
        extra = sorted(holdings.ours - set(wanted))
        replaced = sorted(set(blocking) & set(stale))
        if replaced:
            log.warning(
                "publish: %d file(s) loraship did not write at %s replaced by the artifact (%s); their earlier "
                "versions stay in the repository's history at commit %s",
                len(replaced),
                url,
                ", ".join(replaced[:4]),
                parent,
            )
        if not stale and not extra:
            return {"uploaded": [], "removed": [], "commit": parent}
        commit = api.upload_folder(
            repo_id=target.repo_id,
            repo_type=target.repo_type,
            revision=target.revision,
            folder_path=str(root),
            # An empty list sends nothing (None would send the whole folder).
            path_in_repo=target.path or None,
            allow_patterns=[_pattern(r) for r in stale],
            delete_patterns=[_pattern(r) for r in extra] or None,
            parent_commit=parent,
            commit_message=(
                f"loraship: publish {run_name or 'artifact'} ({len(stale)} file(s) sent, {len(extra)} removed)"
            ),
        )
        held = _remote_files(api, target, commit.oid)
    except OutputError:
        raise
    except Exception as e:  # noqa: BLE001 - HTTP, connection and Hub errors
        raise OutputError(
            f"publish: cannot write to {url} ({type(e).__name__}: {e}); check the token's write access to "
            f"{target.repo_id!r} and the network, then run again: files already on the Hub and intact are not sent "
            "again"
        ) from e
    wrong = [rel for rel, info in wanted.items() if not _matches(held.get(rel), info, root / rel)]
    left = sorted(rel for rel in extra if rel in held)
    if wrong or left:
        shown = ", ".join(
            f"{rel} ({_describe(held.get(rel))}, sent {wanted[rel]['size']} bytes sha256 "
            f"{wanted[rel]['sha256'][:16]}...)"
            for rel in wrong[:3]
        )
        raise OutputError(
            f"publish: {url} at commit {str(commit.oid)[:12]} does not hold what was uploaded: "
            f"{shown or 'no file differs'}{'; left over: ' + ', '.join(left) if left else ''}; check the repository "
            "and run again (only differing files are sent)"
        )
    kept = {"replaced_from_commit": parent} if replaced else {}
    return {"uploaded": stale, "removed": extra, "commit": commit.oid, **kept}


def _describe(remote) -> str:
    if remote is None:
        return "missing"
    digest = f"sha256 {remote.lfs.sha256[:16]}..." if remote.lfs is not None else f"git blob {remote.blob_id[:12]}"
    return f"holds {remote.size} bytes, {digest}"
