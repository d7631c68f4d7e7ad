"""Reading dataset rows: local .jsonl/.json files (compressed too, loraship/dataset_files.py), URLs through fsspec,
.parquet/.csv files and Hub datasets through the `datasets` library, each row validated for its type with every
bad row named at once, and `fields` mapped onto the type's own names. loraship.data tokenizes what this reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from loraship.cache import cache_root
from loraship.config import DATASET_FIELDS, HUB_ID_PATTERN
from loraship.dataset_files import compressed_name_problem, data_suffix, decompressed
from loraship.errors import DataError

MAX_LISTED_PROBLEMS = 20
# No tool role: many templates (Llama 2/3 base, Mistral) cannot render one, and chat rows refuse it too.
ROLES = ("system", "user", "assistant")
# ShareGPT speaker names (as FastChat, Axolotl and the common dumps write them) -> chat roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
}
# Top-level columns each row type needs (the rest of DATASET_FIELDS are keys inside each message).
REQUIRED_COLUMNS = {
    "alpaca": ("instruction", "output"),
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "completion": ("text",),
}
LIST_COLUMN = {"chat": "messages", "sharegpt": "conversations"}
TABULAR_SUFFIXES = {".parquet": "parquet", ".csv": "csv"}
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _messages_problem(msgs: list[dict]) -> str | None:
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            return f"messages[{j}] must be {{'role': one of {list(ROLES)}, 'content': string}}"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no assistant message, so nothing to learn (loss is only on assistant turns)"
    if msgs[-1]["role"] != "assistant":
        # A trailing prompt teaches nothing and renders as an unanswered turn in the training text.
        return (
            f"the conversation ends with a {msgs[-1]['role']!r} turn; a training row must end with the "
            "assistant's answer (remove the trailing turn or add its answer)"
        )
    return None


def _row_problem(row, kind: str) -> str | None:
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if kind == "alpaca":
        missing = [k for k in ("instruction", "output") if not isinstance(row.get(k), str)]
        if missing:
            return f"missing or non-string field(s) {missing} (alpaca rows need instruction/output, optional input)"
        if "input" in row and not isinstance(row["input"], str):
            return "field 'input' must be a string"
    elif kind == "chat":
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "missing field 'messages' (chat rows need a non-empty list of {role, content})"
        return _messages_problem(msgs)
    elif kind == "sharegpt":
        turns = row.get("conversations")
        if not isinstance(turns, list) or not turns:
            return "missing field 'conversations' (ShareGPT rows need a non-empty list of {from, value})"
        for j, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                return f"conversations[{j}] must be {{'from': role, 'value': string}}"
            if turn.get("from") not in SHAREGPT_ROLES:
                return (
                    f"conversations[{j}]: unknown role from={turn.get('from')!r}; use one of "
                    f"{', '.join(SHAREGPT_ROLES)} (or rename it in the file)"
                )
        problem = _messages_problem(as_messages(row, kind))
        return problem.replace("messages[", "conversations[") if problem else None
    elif kind == "golden":  # verify's prompts: a conversation to answer, or a bare user prompt
        msgs = row.get("messages")
        if not isinstance(row.get("prompt"), str) and (
            not isinstance(msgs, list)
            or not msgs
            or any(
                not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            return "golden rows need 'prompt' (string) or 'messages' (list of {role, content})"
        if "expect_regex" in row:
            try:
                re.compile(row["expect_regex"])
            except (re.error, TypeError) as e:
                return f"expect_regex is not a valid regular expression ({e})"
    elif kind == "completion":
        if not isinstance(row.get("text"), str) or not row["text"]:
            return "missing or empty field 'text' (completion rows need {'text': ...})"
    else:
        return f"unknown dataset type {kind!r}; use alpaca, chat, sharegpt or completion"
    return None


def _problems_error(where: str, kind: str, problems: list[str], unit: str) -> DataError:
    shown = problems[:MAX_LISTED_PROBLEMS]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return DataError(f"dataset {where} ({kind}): {len(problems)} bad {unit}(s):\n  " + "\n  ".join(shown) + more)


URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(path: str | Path) -> str | None:
    """'s3' for 's3://bucket/x.jsonl'; None for a local path."""
    m = URL_SCHEME.match(str(path))
    return m.group(1).lower() if m else None


def filesystem_problem(url: str) -> str | None:
    """Why no installed fsspec implementation serves this URL's scheme, with the fix; None when one does."""
    import fsspec
    from fsspec.registry import known_implementations

    scheme = url_scheme(url)
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:  # fsspec knows the scheme, its package is not installed (s3 -> s3fs)
        package = known_implementations.get(scheme, {}).get("class", "").split(".")[0] or "the package fsspec names"
        return (
            f"no installed filesystem serves '{scheme}://' ({e}); pip install {package} into this environment "
            "(the image of every stage that reads it), or copy the file to a local path"
        )
    except ValueError:  # fsspec: "Protocol not known"
        return (
            f"'{scheme}://' is a URL scheme no fsspec filesystem knows; use a local path, "
            "hf://datasets/<org>/<name>, or an fsspec URL (s3://, gs://, az://, file://, ...)"
        )
    return None


def _read_bytes(path: str | Path) -> bytes:
    """The file's bytes: a local path, or a URL through fsspec."""
    if url_scheme(path) is None:
        path = Path(path)
        if not path.is_file():
            raise DataError(
                f"dataset {path}: file not found; check datasets[].path (relative paths start at the "
                "config file's folder)"
            )
        return path.read_bytes()
    problem = filesystem_problem(str(path))
    if problem:
        raise DataError(f"dataset {path}: {problem}")
    import fsspec

    try:
        fs, inner = fsspec.core.url_to_fs(str(path))
        if not fs.isfile(inner):
            raise DataError(
                f"dataset {path}: file not found; check datasets[].path and that these credentials can read it"
            )
        return fs.cat_file(inner)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - each filesystem raises its own types (credentials, network)
        raise DataError(
            f"dataset {path}: cannot read it ({type(e).__name__}: {e}); check the URL and the filesystem's credentials"
        ) from e


def _json_records(raw: bytes, where: str, suffix: str) -> list[tuple[int, object]]:
    """(line number, parsed value) per non-empty line; a .json file holding one array gives its items."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        compressed = compressed_name_problem(raw, where)
        if compressed:
            raise DataError(compressed) from e
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"dataset {where} line {line}: not UTF-8 (byte {e.start}); re-encode the file as UTF-8") from e
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"dataset {where} line {e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
        return list(enumerate(items, start=1))
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                records.append((number, e))
    return records


def map_fields(row, kind: str, fields: dict[str, str]):
    """The row under the type's own names: fields maps those names onto the file's (columns and message keys)."""
    if not fields or not isinstance(row, dict):
        return row
    names = DATASET_FIELDS.get(kind, ())
    out = dict(row)
    list_name = LIST_COLUMN.get(kind)
    if list_name is None:
        for name in names:
            if name in fields and fields[name] in row:
                out[name] = row[fields[name]]
    else:
        turns = row.get(fields.get(list_name, list_name))
        inner = {name: fields[name] for name in names[1:] if name in fields}
        if inner and isinstance(turns, list):
            turns = [
                {**{k: v for k, v in t.items() if k not in inner.values()}, **{n: t.get(c) for n, c in inner.items()}}
                if isinstance(t, dict)
                else t
                for t in turns
            ]
        out[list_name] = turns
    return out


def _missing_columns(where: str, kind: str, fields: dict[str, str], columns: list[str]) -> None:
    """One line naming a mapped or required column the data does not have, and the columns it does."""
    columns_read = (
        (LIST_COLUMN[kind],) if kind in LIST_COLUMN else DATASET_FIELDS[kind]
    )  # role/content are message keys
    for name in columns_read:
        if name in fields and fields[name] not in columns:
            raise DataError(
                f"dataset {where}: fields maps {name} to column {fields[name]!r}, which it does not have "
                f"(columns: {', '.join(map(str, columns))}); fix datasets[].fields"
            )
    for name in REQUIRED_COLUMNS[kind]:
        if name not in fields and name not in columns:
            raise DataError(
                f"dataset {where} ({kind}): no column {name!r} (columns: {', '.join(map(str, columns))}); "
                f"rename the column or map it with fields: {{{name}: <column>}}"
            )


def _check_rows(records, where: str, kind: str, fields: dict[str, str], unit: str) -> list[dict]:
    rows, problems = [], []
    for number, value in records:
        if isinstance(value, json.JSONDecodeError):
            problems.append(f"{unit} {number}: malformed JSON ({value.msg} at column {value.colno})")
            continue
        row = map_fields(value, kind, fields)
        problem = _row_problem(row, kind)
        if problem:
            problems.append(f"{unit} {number}: {problem}")
        else:
            rows.append(row)
    if problems:
        raise _problems_error(where, kind, problems, unit)
    if not rows:
        raise DataError(f"dataset {where}: empty (no rows); add at least one {kind} row")
    return rows


def read_rows(path: str | Path, kind: str, fields: dict[str, str] | None = None) -> list[dict]:
    """All rows of a JSONL (or JSON array) file, or a DataError listing every bad line (up to 20) with its number."""
    where = str(path) if url_scheme(path) else str(Path(path))
    records = _json_records(decompressed(_read_bytes(path), where), where, data_suffix(where))
    fields = fields or {}
    if fields and kind in DATASET_FIELDS and records:  # a mapping naming no column is one mistake, not one per line
        _missing_columns(where, kind, fields, sorted({k for _n, r in records if isinstance(r, dict) for k in r}))
    return _check_rows(records, where, kind, fields, "line")


def hub_dataset_id(path: str) -> str | None:
    """'org/name' for a Hub dataset path (hf://datasets/org/name or a bare id that is no local file), else None."""
    if path.startswith("hf://datasets/"):
        return path.removeprefix("hf://datasets/").strip("/")
    if url_scheme(path):
        return None  # another URL: a file read through fsspec
    if Path(path).expanduser().exists() or data_suffix(path) in (*JSON_SUFFIXES, *TABULAR_SUFFIXES):
        return None
    return path if HUB_ID_PATTERN.match(path) and not path.startswith((".", "/", "~")) else None


def _datasets_module(where: str):
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"dataset {where}: reading it needs the `datasets` package, which is not installed; "
            "pip install 'loraship[train]' (or datasets), or convert the data to JSONL"
        ) from e
    return datasets


def load_table(spec):
    """A `datasets.Dataset` for a .parquet/.csv file or a Hub dataset; a one-line DataError saying how to fix a
    failure."""
    repo = hub_dataset_id(spec.path)
    where = spec.path
    datasets = _datasets_module(where)
    try:
        if repo is None and url_scheme(spec.path):
            problem = filesystem_problem(spec.path)
            if problem:
                raise DataError(f"dataset {where}: {problem}")
            # datasets reads a URL through fsspec; the Arrow copy goes to loraship's cache as for local files.
            return datasets.load_dataset(
                TABULAR_SUFFIXES[data_suffix(spec.path)],
                data_files=spec.path,
                split="train",
                cache_dir=str(cache_root() / "datasets"),
            )
        if repo is None:
            path = Path(spec.path).expanduser()
            if not path.is_file():
                raise DataError(
                    f"dataset {path}: file not found; check datasets[].path (relative paths start at the "
                    "config file's folder)"
                )
            # Local files get their Arrow copy in loraship's cache, not the user's Hugging Face one.
            return datasets.load_dataset(
                TABULAR_SUFFIXES[data_suffix(path)],
                data_files=str(path),
                split="train",
                cache_dir=str(cache_root() / "datasets"),
            )
        if "/" in repo.split("/", 2)[-1] and Path(repo).suffix.lower() in TABULAR_SUFFIXES:  # one file in a Hub repo
            return datasets.load_dataset(
                TABULAR_SUFFIXES[Path(repo).suffix.lower()], data_files=f"hf://datasets/{repo}", split=spec.split
            )
        return datasets.load_dataset(repo, split=spec.split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (ConnectionError, DatasetNotFoundError, ValueError, ...)
        cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if repo and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise DataError(
                f"dataset {where}: not in the local Hugging Face cache and HF_HUB_OFFLINE=1 forbids downloading it "
                f"({cause}); download it once online (python -c \"import datasets; datasets.load_dataset('{repo}', "
                f"split='{spec.split}')\"), unset HF_HUB_OFFLINE, or point path at a local .jsonl/.parquet/.csv file"
            ) from e
        hint = (
            "check the id, the split and HF_TOKEN for a private dataset"
            if repo
            else "check that the file is valid " + Path(spec.path).suffix.lstrip(".").upper()
        )
        raise DataError(f"dataset {where}: cannot load it ({cause}); {hint}") from e


def _cell(value, name: str, kind: str):
    """CSV has no nested values: a messages/conversations cell holding JSON text is decoded."""
    if name == LIST_COLUMN.get(kind) and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def read_dataset(spec) -> list[dict]:
    """The rows of one datasets[] entry under the type's own field names; every bad row named at once."""
    if hub_dataset_id(spec.path) is None and data_suffix(spec.path) not in TABULAR_SUFFIXES:
        return read_rows(spec.path, spec.type, spec.fields)
    table = load_table(spec)
    _missing_columns(spec.path, spec.type, spec.fields, table.column_names)
    by_name = {v: k for k, v in spec.fields.items()}
    records = [
        (i, {c: _cell(v, by_name.get(c, c), spec.type) for c, v in row.items()})
        for i, row in enumerate(table.to_list(), start=1)
    ]
    return _check_rows(records, spec.path, spec.type, spec.fields, "row")


def dataset_identity(spec) -> str:
    """What the data is, for fingerprints: a local file's sha256, a Hub dataset's id, split and `datasets`
    fingerprint."""
    from loraship.runtime.manifest import sha256_file

    repo = hub_dataset_id(spec.path)
    if repo is None and url_scheme(spec.path):
        return hashlib.sha256(_read_bytes(spec.path)).hexdigest()
    if repo is None:
        path = Path(spec.path).expanduser()
        if not path.is_file():
            raise DataError(f"dataset {path}: file not found; check datasets[].path")
        return sha256_file(path)
    return f"hub:{repo}@{spec.split}:{load_table(spec)._fingerprint}"


def as_messages(row: dict, kind: str) -> list[dict]:
    if kind == "chat":
        return row["messages"]
    if kind == "sharegpt":
        return [
            {"role": SHAREGPT_ROLES.get(t["from"], t["from"]), "content": t["value"]} for t in row["conversations"]
        ]
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
