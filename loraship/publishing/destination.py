"""Where publish may write, and what it may remove there: only what loraship wrote itself.

The artifact folder must lie apart from everything the run reads or writes (workdir, base model, datasets,
golden prompts): publish makes its folder hold the artifact, so on the base model's folder it would replace the
weights. At a destination of its own, publish removes only files listed by the manifest.json it
wrote there last (or by its journal, which a publish writes before it changes anything and removes once the
manifest is in place, so an interrupted publish is still known as its own). A non-empty destination without
either was written by someone else: publish refuses it, or with `replace_output` (`loraship run --force`) moves
its contents aside to `<destination>.replaced-<UTC time>/` first; at one it wrote, a file it does not list that
the artifact would overwrite is treated so too, and others are left in place. Nothing loraship did not write is
ever deleted. Both checks run at plan and again in publish (the destination can change in between).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from loraship.constants import MANIFEST_NAME
from loraship.publishing import hub

# Written at the destination before publish changes anything there, removed once manifest.json is in place:
# the files an interrupted publish may have left, which the next publish may replace or remove.
JOURNAL = ".loraship-publishing.json"
# What a loraship process killed while writing leaves: a temporary of runtime/manifest.py's atomic_path
# (".tmp-<name>.<host>.<pid>.<hex>") beside a file it was publishing, and the plan's write probe.
TEMPORARY_SUFFIX = re.compile(r"^[^/]+\.\d+\.[0-9a-f]+$")
WRITE_PROBE = re.compile(r"^\.loraship-write-test-[0-9a-f]+$")
FORCE_HINT = "--force (or `replace_output: true` in the config)"


def destination_of(config) -> str:
    """`output/<run_name>`; a Hub repository is the destination itself, so its top-level README.md is
    the model card the Hub renders (loraship/publishing/hub.py)."""
    if hub.is_hub_repo(config.output):
        return config.output.rstrip("/")
    return f"{config.output.rstrip('/')}/{config.run_name}"


def local_path(url: str) -> Path | None:
    """The local folder a destination names (a path, or a file:// URL); None for any other store."""
    from loraship.data import url_scheme

    scheme = url_scheme(url)
    if scheme is None:
        return Path(url).expanduser().resolve()
    if scheme in ("file", "local"):
        return Path(re.sub(r"^[A-Za-z]+://", "", url)).expanduser().resolve()
    return None


def _relation(dest: Path, other: Path) -> str | None:
    if dest == other:
        return "is"
    if other.is_relative_to(dest):
        return "contains"
    if dest.is_relative_to(other):
        return "lies inside"
    return None


def protected_paths(config, model_dir: Path | None) -> list[tuple[str, Path]]:
    """What the run reads or writes locally, each with its name in a message: the workdir, the base model folder,
    every local dataset, the golden prompts file."""
    from loraship.data import url_scheme

    found = [("workdir", Path(config.workdir).expanduser().resolve())]
    # The folder the plan resolved (a Hub id's cache snapshot) and the one the config names, where they differ.
    models = {Path(model_dir).resolve()} if model_dir is not None else set()
    if config.base_model_is_local():
        models.add(Path(config.base_model).expanduser().resolve())
    found += [("base model folder", m) for m in sorted(models)]
    for group in ("datasets", "eval_datasets"):
        for i, spec in enumerate(getattr(config, group)):
            path = Path(spec.path).expanduser()
            if url_scheme(spec.path) is None and path.exists():  # not a Hub dataset id
                found.append((f"dataset {group}[{i}]", path.resolve()))
    if config.golden_prompts and url_scheme(config.golden_prompts) is None:
        found.append(("golden_prompts file", Path(config.golden_prompts).expanduser().resolve()))
    return found


def overlap_problems(config, model_dir: Path | None = None) -> list[str]:
    """An artifact folder that is, contains or lies inside a folder or file the run reads or writes: publishing
    there would overwrite or remove it. Only local destinations can overlap local inputs."""
    from loraship.runtime.stage import run_dir

    dest = local_path(destination_of(config))
    if dest is None:
        return []
    problems = []
    for what, path in protected_paths(config, model_dir):
        relation = _relation(dest, path)
        run = run_dir(config).resolve()
        if what == "workdir" and dest.is_relative_to(run):  # the more precise of the two
            what, path, relation = "run folder", run, _relation(dest, run)
        if relation is None:
            continue
        problems.append(
            f"output {config.output!r}: the artifact folder {dest} (output/run_name) {relation} the {what} {path}; "
            "publishing there would overwrite or remove what the run needs; fix: set output to a folder of its own, "
            "outside the workdir and the inputs (e.g. output: artifacts)"
        )
    return problems


def is_artifact_manifest(data) -> bool:
    """A manifest.json publish wrote: its files, each with size and sha256."""
    files = data.get("files") if isinstance(data, dict) else None
    return (
        isinstance(files, dict)
        and bool(files)
        and all(isinstance(v, dict) and "sha256" in v and "size" in v for v in files.values())
    )


@dataclass(frozen=True)
class Holdings:
    """What a destination holds (paths relative to it) and which of those loraship wrote."""

    files: frozenset[str]
    listed: frozenset[str]  # named by loraship's manifest.json or journal there
    ours: frozenset[str]  # listed, the manifest and journal themselves, and loraship's temporaries
    by_loraship: bool  # a loraship manifest.json or journal is there

    @property
    def foreign(self) -> list[str]:
        return sorted(self.files - self.ours)


def _is_temporary_of(rel: str, names: set[str]) -> bool:
    """A temporary sibling atomic_path wrote for one of `names` (".tmp-<name>.<host>.<pid>.<hex>")."""
    folder, _, base = rel.rpartition("/")
    if not base.startswith(".tmp-"):
        return False
    for name in names:
        name_folder, _, name_base = name.rpartition("/")
        prefix = f".tmp-{name_base}."
        if name_folder == folder and base.startswith(prefix) and TEMPORARY_SUFFIX.match(base[len(prefix) :]):
            return True
    return False


def held(files: set[str], manifest: object, journal: object, wanted: set[str] = frozenset()) -> Holdings:
    """Holdings from the files listed at a destination and its manifest.json and journal (parsed JSON, or None)."""
    listed: set[str] = set()
    own: set[str] = set()
    if is_artifact_manifest(manifest):
        listed |= set(manifest["files"])
        own.add(MANIFEST_NAME)
    if isinstance(journal, dict) and isinstance(journal.get("files"), list):
        listed |= {f for f in journal["files"] if isinstance(f, str)}
        own.add(JOURNAL)
    by_loraship = bool(own)
    names = listed | set(wanted)
    own |= {rel for rel in files if WRITE_PROBE.match(rel.rpartition("/")[2]) or _is_temporary_of(rel, names)}
    ours = (listed | own) & files
    return Holdings(frozenset(files), frozenset(listed), frozenset(ours), by_loraship)


def _read_json(fs, path: str):
    try:
        return json.loads(fs.cat_file(path))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None


def survey(fs, base: str, wanted: set[str] = frozenset()) -> Holdings:
    """What the fsspec destination `base` holds, and whose. `wanted`: the files about to be published, whose
    temporaries a killed publish may have left."""
    if not fs.exists(base):
        return held(set(), None, None)
    if not fs.isdir(base):
        return held({""}, None, None)  # a file where the folder should be
    files = {p[len(base) + 1 :] for p in fs.find(base) if p.startswith(base + "/")}
    manifest = _read_json(fs, f"{base}/{MANIFEST_NAME}") if MANIFEST_NAME in files else None
    journal = _read_json(fs, f"{base}/{JOURNAL}") if JOURNAL in files else None
    return held(files, manifest, journal, wanted)


def in_the_way(holdings: Holdings, wanted: set[str], same: set[str] = frozenset()) -> list[str]:
    """The files that stop a publish: every file of a destination loraship did not write; at one it did, the
    files it does not list that the artifact would overwrite. A file that already holds the artifact's bytes
    (`same`) loses nothing; other files there are left alone."""
    foreign = set(holdings.foreign) - set(same)
    return sorted(foreign if not holdings.by_loraship else foreign & wanted)


def _shown(files: list[str]) -> str:
    names = ", ".join(f or "(a file, not a folder)" for f in files[:4])
    return names + (f" and {len(files) - 4} more" if len(files) > 4 else "")


def refusal(destination: str, holdings: Holdings, blocking: list[str], where: str, aside: str = "") -> str:
    """Why publish will not write at `destination`, and the two ways on (`aside`: what --force does there)."""
    aside = aside or f"move them aside to {destination}.replaced-<UTC time>/ first (nothing is deleted)"
    if not holdings.by_loraship:
        what = (
            f"already holds {len(blocking)} file(s) loraship did not write ({_shown(blocking)}) and no loraship "
            "manifest.json, so publishing would overwrite or remove them"
        )
    else:
        what = (
            f"holds {_shown(blocking)}, which the artifact would overwrite, but loraship's manifest.json there does "
            "not list them (someone else wrote them)"
        )
    return (
        f"{where}: the artifact folder {destination} {what}; fix: choose another run_name (or output), or run "
        f"again with {FORCE_HINT} to {aside}"
    )


def aside_name(destination: str, exists) -> str:
    """`<destination>.replaced-<UTC time>`, with a counter where that is taken."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name, n = f"{destination}.replaced-{stamp}", 1
    while exists(name):
        name, n = f"{destination}.replaced-{stamp}-{n}", n + 1
    return name


def move_aside(fs, base: str, holdings: Holdings, blocking: list[str]) -> str:
    """Move what is in the way to a sibling folder: the whole folder when loraship wrote none of it, else only the
    blocking files (their paths kept). Returns where they went."""
    aside = aside_name(base, fs.exists)
    if not holdings.by_loraship:
        fs.mv(base, aside, recursive=True)
        return aside
    for rel in blocking:
        fs.makedirs(f"{aside}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.mv(f"{base}/{rel}", f"{aside}/{rel}")
    return aside


def write_journal(fs, base: str, files: set[str], local: bool) -> None:
    """Name every file this publish may leave at the destination before it changes anything there."""
    record = {"files": sorted(files - {MANIFEST_NAME, JOURNAL})}
    if local:
        from loraship.runtime.manifest import atomic_write_json

        atomic_write_json(Path(f"{base}/{JOURNAL}"), record)  # a torn journal would make our files foreign
    else:
        fs.pipe_file(f"{base}/{JOURNAL}", json.dumps(record).encode())


def foreign_problems(config) -> list[str]:
    """At plan: a destination (fsspec or local) that holds files loraship did not write, unless replace_output."""
    import fsspec

    destination = destination_of(config)
    if config.replace_output or hub.is_hub_repo(destination):
        return []
    try:
        fs, base = fsspec.core.url_to_fs(destination)
        holdings = survey(fs, base.rstrip("/"))
    except Exception:  # noqa: BLE001 - a store that cannot be listed: the write probe and publish say why
        return []
    blocking = in_the_way(holdings, set())
    if not blocking:
        return []
    return [refusal(destination, holdings, blocking, f"output {config.output!r}")]
