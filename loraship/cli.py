"""`loraship` command line: start a config, plan memory, run the flow (all of it or some stages),
see where a run stands, inspect, verify and chat with a GGUF, trigger GitOps runs."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, get_args, get_origin

import typer
from rich.console import Console
from rich.table import Table

from loraship.constants import STAGES
from loraship.errors import ConfigError, LorashipError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode="rich")
err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def _fail(e: LorashipError) -> None:
    err.print(f"error: {e}", markup=False, highlight=False)
    raise typer.Exit(e.exit_code)


@contextlib.contextmanager
def _user_errors():
    """A LorashipError becomes one message and its exit code, without a traceback."""
    try:
        yield
    except LorashipError as e:
        _fail(e)


def _example(*lines: str) -> str:
    return f"[bold]Example{'s' if len(lines) > 1 else ''}:[/]\n\n" + "\n\n".join(f"  $ {line}" for line in lines)


# -- --set KEY=VALUE, with dotted keys into nested mappings and lists ------------------------
def _model_of(annotation) -> type | None:
    """The pydantic model a field holds (itself, or the element of a list of them); None otherwise."""
    from pydantic import BaseModel

    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _set_path(data: dict, parts: list[str], value: Any, item: str) -> None:
    """data[parts[0]][parts[1]]... = value, refusing a key or index the config does not have."""
    from loraship.config import Config

    node: Any = data
    model: type | None = Config
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                have = f"indices 0..{len(node) - 1}" if node else "no entries"
                raise LorashipError(f"--set {item}: {where} is a list with {have}; use an existing index, or set the "
                                    f"whole list, e.g. --set '{where}=[...]'")
            key: Any = int(part)
        elif isinstance(node, dict):
            if model is not None and part not in model.model_fields:
                close = difflib.get_close_matches(part, list(model.model_fields), n=1, cutoff=0.6)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise LorashipError(f"--set {item}: {where} has no key {part!r}{hint}; the keys are described in "
                                    "loraship/config.py")
            if model is None and part not in node and depth < len(parts) - 1:
                raise LorashipError(f"--set {item}: {where} has no key {part!r}; set it whole, e.g. "
                                    f"--set '{where}.{part}=VALUE'")
            key = part
        else:
            raise LorashipError(f"--set {item}: {where} is {node!r}, not a mapping or a list; set it whole, e.g. "
                                f"--set {where}=VALUE")
        if depth == len(parts) - 1:
            node[key] = value
            return
        if isinstance(node, dict) and model is not None:
            field = model.model_fields[part]
            model = _model_of(field.annotation) if get_origin(field.annotation) is not dict else None
        node = node[key]


def _parse_sets(items: list[str]) -> list[tuple[list[str], Any, str]]:
    import yaml

    parsed = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LorashipError(f"--set {item!r}: expected KEY=VALUE, e.g. --set max_steps=10 or "
                                "--set datasets.0.path=train.jsonl")
        try:
            parsed.append((key.strip().split("."), yaml.safe_load(value), item))
        except yaml.YAMLError as e:
            raise LorashipError(f"--set {item}: the value is not valid YAML ({e}); quote it, e.g. --set 'key=\"...\"'") from e
    return parsed


def _load(config_path: Path, overrides: list[str]):
    """The config with --set overrides; dotted keys reach nested mappings and list entries."""
    from loraship.config import load_config, parse_config

    parsed = _parse_sets(overrides)
    for parts, _value, item in parsed:  # a misspelt key is named before anything else is read
        _set_path({}, parts[:1], None, item)
    top = {parts[0]: value for parts, value, _item in parsed if len(parts) == 1}
    config = load_config(config_path, top)
    nested = [p for p in parsed if len(p[0]) > 1]
    if not nested:
        return config
    data = config.model_dump(mode="json")  # defaults filled in, dataset paths already resolved
    for parts, value, item in nested:
        _set_path(data, parts, value, item)
    return parse_config(data, source=f"{config_path} with --set")


SET_HELP = "Override a config key, dotted for nested ones: --set max_steps=10, --set datasets.0.path=x.jsonl (repeatable)"


# -- run, plan ---------------------------------------------------------------------------------
def _stage_module(stage: str):
    return importlib.import_module(f"tasks.{stage}")


def _ancestors(stage: str) -> set[str]:
    found: set[str] = set()
    for up in _stage_module(stage).UPSTREAM:
        found |= {up} | _ancestors(up)
    return found


def select_stages(config, config_path: Path, only: str | None, start: str | None) -> list[str]:
    """Stages to run for --only/--from; refuses one whose upstream output is not there yet."""
    from loraship.manifest import read_manifest
    from loraship.stage import stage_dir

    if only and start:
        raise LorashipError("--only and --from together: use --only STAGE for one stage, or --from STAGE for it and "
                            "every stage after it")
    for flag, value in (("--only", only), ("--from", start)):
        if value is not None and value not in STAGES:
            raise LorashipError(f"{flag} {value!r}: not a stage; use one of {', '.join(STAGES)}")
    stages = [only] if only else list(STAGES[STAGES.index(start):]) if start else list(STAGES)
    first = stages[0]
    missing = sorted((s for s in set().union(*(_ancestors(s) for s in stages)) - set(stages)
                      if read_manifest(stage_dir(config, s)) is None), key=STAGES.index)
    direct = [s for s in _stage_module(first).UPSTREAM if s in missing] or missing
    if missing:
        flag = f"--only {only}" if only else f"--from {start}"
        raise LorashipError(
            f"{flag}: stage {first} reads the output of {direct[0]}, which has not run for run {config.run_name!r} "
            f"(no manifest in {stage_dir(config, direct[0])}); run {missing[0]} first: "
            f"loraship run {config_path} --from {missing[0]}"
        )
    return stages


@app.command(epilog=_example("loraship run configs/demo.yaml",
                             "loraship run configs/demo.yaml --from convert --set quantization=Q8_0",
                             "loraship run configs/demo.yaml --only verify"))
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="YAML config, e.g. configs/demo.yaml"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    only: str = typer.Option(None, "--only", metavar="STAGE", help=f"Run this stage alone: {', '.join(STAGES)}"),
    start: str = typer.Option(None, "--from", metavar="STAGE", help="Run this stage and every stage after it"),
) -> None:
    """Run train-and-ship (in-process Prefect, no server needed). Finished stages are skipped."""
    from loraship.prefect_env import configure_local_prefect

    configure_local_prefect()
    with _user_errors():
        config = _load(config_path, set_)
        stages = select_stages(config, config_path, only, start)
        if "plan" in stages:
            # Every input problem is reported here, before Prefect or a GPU is involved; with the
            # config's secrets in the environment (a gated hub model needs its token to be checked).
            from loraship.prefect_env import secret_env
            from loraship.preflight import check_inputs

            with secret_env(config.env_from_secrets):
                check_inputs(config)
    from flows.train_and_ship import train_and_ship

    state = train_and_ship(config, stages=None if stages == list(STAGES) else stages, return_state=True)
    if not state.is_completed():
        err.print(f"error: run {config.run_name!r} failed: {state.message}", markup=False, highlight=False)
        err.print("Finished stages are kept; fix the problem and run the same command again to resume.")
        raise typer.Exit(1)
    if "publish" in stages:
        from tasks.publish import destination_of

        out.print(f"[green]shipped[/] {config.run_name} -> {destination_of(config)}")
    else:
        out.print(f"[green]done[/] {config.run_name}: {', '.join(stages)}")


@app.command(epilog=_example("loraship plan configs/demo.yaml",
                             "loraship plan configs/qwen2-14b-lora.yaml --set gpu_memory_gib=24 --json"))
def plan(
    config_path: Path = typer.Argument(..., metavar="CONFIG"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON"),
) -> None:
    """Predict GPU memory, disk and the shipped model's footprint from config.json alone (no GPU, no weights)."""
    with _user_errors():
        config = _load(config_path, set_)
        from loraship import memory

        model_config = _model_config(config)
        try:
            training = memory.plan_training(model_config, config)
            footprint = memory.plan_disk_and_inference(model_config, config)
        except (ValueError, KeyError) as e:  # a config.json the planner cannot read
            raise LorashipError(f"{config.base_model}/config.json: {e}") from e
    if as_json:
        out.print_json(data={**training, **footprint})
    else:
        out.print(memory.render_plan(training, footprint))


def _model_config(config) -> dict:
    from loraship.models import resolve_base_model

    # config.json is all the planner reads: a 14B model need not be downloaded to plan it.
    config_file = resolve_base_model(config, weights=False) / "config.json"
    if not config_file.is_file():
        raise LorashipError(f"base_model {config.base_model!r}: no config.json at {config_file}; "
                            "point base_model at a folder holding the model's config.json")
    try:
        return json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LorashipError(f"{config_file}: not valid JSON ({e}); fix or replace the model's config.json") from e


# -- status ------------------------------------------------------------------------------------
def _extra_inputs(stage: str, config) -> dict | None:
    """The files outside the pipeline a stage is keyed on, computed as that stage computes them."""
    from loraship.manifest import sha256_file

    if stage == "plan":
        from loraship.models import resolve_base_model
        from tasks.plan import input_files

        return input_files(config, resolve_base_model(config, weights=False))
    if stage == "reference" and config.golden_prompts:  # as tasks/reference.py keys it
        return {"golden_prompts": sha256_file(config.golden_prompts)}
    return None


def _short(value: Any, width: int = 40) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def stage_status(config, stage: str, states: dict[str, dict]) -> dict:
    """done / stale / not run, with the reasons, from the stage's manifest and its upstream's."""
    from loraship.manifest import check_outputs, read_manifest
    from loraship.stage import stage_dir

    folder = stage_dir(config, stage)
    try:
        manifest = read_manifest(folder)
    except LorashipError as e:
        return {"stage": stage, "state": "stale", "reasons": [str(e)]}
    if manifest is None:
        return {"stage": stage, "state": "not run", "reasons": []}
    reasons = []
    recorded = manifest.get("config", {})
    current = config.model_dump(mode="json")
    for key, old in recorded.items():
        if key == "_inputs":
            continue
        if key not in current:
            reasons.append(f"config key {key} no longer exists")
        elif current[key] != old:
            reasons.append(f"{key} changed: {_short(old)} -> {_short(current[key])}")
    try:
        now = _extra_inputs(stage, config) or {}
    except (LorashipError, OSError) as e:
        reasons.append(f"its input files cannot be read: {e}")
        now = recorded.get("_inputs") or {}
    before = recorded.get("_inputs") or {}
    for name in sorted(set(before) | set(now)):
        if before.get(name) != now.get(name):
            reasons.append(f"{name} " + ("added" if name not in before else "removed" if name not in now else "changed"))
    keyed = getattr(_stage_module(stage), "DEPENDS_ON", {})
    for up, record in manifest.get("inputs", {}).items():
        if states.get(up, {}).get("state") != "done":
            reasons.append(f"upstream {up} is {states.get(up, {}).get('state', 'unknown')}")
            continue
        up_manifest = read_manifest(stage_dir(config, up)) or {}
        files = keyed.get(up)
        was = {k: v for k, v in record.get("outputs", {}).items() if files is None or k in files}
        is_ = {k: v for k, v in up_manifest.get("outputs", {}).items() if files is None or k in files}
        if was != is_:
            reasons.append(f"upstream {up} ran again since")
    if not reasons:
        reasons += check_outputs(manifest, folder)
    finished = manifest.get("timings", {}).get("finished")
    return {"stage": stage, "state": "stale" if reasons else "done", "reasons": reasons, "finished": finished,
            "seconds": manifest.get("timings", {}).get("seconds"), "dir": str(folder)}


@app.command(epilog=_example("loraship status configs/demo.yaml", "loraship status configs/demo.yaml --set lora_r=32"))
def status(
    config_path: Path = typer.Argument(..., metavar="CONFIG"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the states as JSON"),
) -> None:
    """Each stage of a config's run: done, stale (its inputs changed since it ran) or not run."""
    import datetime

    from loraship.stage import run_dir

    with _user_errors():
        config = _load(config_path, set_)
        states: dict[str, dict] = {}
        for stage in STAGES:
            states[stage] = stage_status(config, stage, states)
    if as_json:
        out.print_json(data={"run_name": config.run_name, "run_dir": str(run_dir(config)), "stages": list(states.values())})
        return
    table = Table(title=f"run {config.run_name} ({run_dir(config)})")
    for column in ("stage", "state", "details"):
        table.add_column(column)
    colour = {"done": "green", "stale": "yellow", "not run": "dim"}
    for s in states.values():
        if s["state"] == "done":
            when = datetime.datetime.fromtimestamp(s["finished"]).strftime("%Y-%m-%d %H:%M") if s.get("finished") else "?"
            details = f"finished {when} in {s.get('seconds')} s"
        else:
            details = "; ".join(s["reasons"])
        table.add_row(s["stage"], f"[{colour[s['state']]}]{s['state']}[/]", details)
    out.print(table)


# -- GGUF: inspect, verify, chat -------------------------------------------------------------
def gguf_file(path: Path) -> Path:
    """The GGUF to read: the file itself, or the one .gguf inside an artifact folder."""
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(p.name for p in found)})"
            raise LorashipError(f"{path}: folder with {what}; pass the .gguf file itself, e.g. "
                                "artifacts/<run>/model-Q4_K_M.gguf")
        path = found[0]
    if not path.is_file():
        raise LorashipError(f"{path}: file not found; pass the path of a .gguf file, e.g. artifacts/<run>/model-Q4_K_M.gguf")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LorashipError(f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with b'GGUF'); pass the "
                            ".gguf file a run shipped, e.g. artifacts/<run>/model-Q4_K_M.gguf")
    return path


def _file_type_name(value) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return f"unknown ({value})"


def _token_text(fields: dict, token_id) -> str | None:
    tokens = fields.get("tokenizer.ggml.tokens") or []
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def describe_gguf(path: Path) -> dict:
    """Metadata, tensor types and sizes, chat template and special tokens of a GGUF file."""
    from gguf import GGUFReader

    from loraship.gguf_info import read_gguf

    fields = read_gguf(path)["fields"]  # names a truncated or corrupt file
    reader = GGUFReader(str(path))
    types: dict[str, dict] = {}
    for tensor in reader.tensors:
        row = types.setdefault(tensor.tensor_type.name, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += int(tensor.n_elements)
        row["bytes"] += int(tensor.n_bytes)
    metadata = {k: (f"[{len(v)} items]" if isinstance(v, list) and len(v) > 16 else v)
                for k, v in fields.items() if k != "tokenizer.chat_template"}
    special = {}
    for key, value in fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            special[key.removeprefix("tokenizer.ggml.").removesuffix("_token_id")] = {
                "id": value, "text": _token_text(fields, value)}
    return {
        "file": str(path), "bytes": path.stat().st_size,
        "architecture": fields.get("general.architecture"), "name": fields.get("general.name"),
        "file_type": _file_type_name(fields.get("general.file_type")),
        "tensor_count": len(reader.tensors),
        "parameters": sum(t["parameters"] for t in types.values()),
        "tensor_types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])),
        "special_tokens": special,
        "add_bos_token": fields.get("tokenizer.ggml.add_bos_token"),
        "add_eos_token": fields.get("tokenizer.ggml.add_eos_token"),
        "chat_template": fields.get("tokenizer.chat_template"),
        "metadata": metadata,
    }


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@app.command(epilog=_example("loraship inspect artifacts/demo/model-Q4_K_M.gguf", "loraship inspect artifacts/demo --json"))
def inspect(
    gguf: Path = typer.Argument(..., metavar="GGUF", help="A .gguf file, or an artifact folder holding one"),
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON"),
) -> None:
    """Metadata, tensor types and sizes, chat template and special tokens of a GGUF file."""
    with _user_errors():
        info = describe_gguf(gguf_file(gguf))
    if as_json:
        out.print_json(data=info)
        return
    out.print(f"[bold]{info['file']}[/]  {_size(info['bytes'])}, {info['architecture']}, file type {info['file_type']}, "
              f"{info['tensor_count']} tensors, {info['parameters']:,} parameters, name {info['name']!r}")
    types = Table(title="tensor types")
    for column in ("type", "tensors", "parameters", "size"):
        types.add_column(column, justify="left" if column == "type" else "right")
    for name, row in info["tensor_types"].items():
        types.add_row(name, str(row["tensors"]), f"{row['parameters']:,}", _size(row["bytes"]))
    out.print(types)
    tokens = Table(title="special tokens")
    for column in ("token", "id", "text"):
        tokens.add_column(column)
    for name, row in info["special_tokens"].items():
        tokens.add_row(name, str(row["id"]), repr(row["text"]))
    out.print(tokens)
    out.print(f"add_bos_token {info['add_bos_token']}, add_eos_token {info['add_eos_token']}")
    meta = Table(title="metadata")
    meta.add_column("key")
    meta.add_column("value")
    for key, value in info["metadata"].items():
        meta.add_row(key, value if isinstance(value, str) else _short(value, 100))
    out.print(meta)
    out.print("[bold]chat template[/]")
    out.print(info["chat_template"] or "(none: a completion model; `loraship chat` needs a template)",
              markup=False, highlight=False)


def _load_llama(path: Path, n_ctx: int):
    from llama_cpp import Llama

    try:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_gpu_layers=0, verbose=False)
    except (ValueError, RuntimeError) as e:  # llama-cpp-python: "Failed to load model from file"
        raise LorashipError(f"{path}: llama.cpp cannot load it ({e}); the file is damaged or from a llama.cpp newer "
                            "than the pinned one; convert it again with `loraship run CONFIG --from convert`") from e


def _special_text(llm, token: int | None) -> str:
    return llm.detokenize([token], special=True).decode("utf-8", errors="replace") if token is not None and token >= 0 else ""


def _chat_formatter(llm, template: str):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    # What llama-cpp-python serves a GGUF's template with (Llama picks it from the metadata).
    return Jinja2ChatFormatter(template=template, eos_token=_special_text(llm, llm.token_eos()),
                               bos_token=_special_text(llm, llm.token_bos()), stop_token_ids=[llm.token_eos()])


def verify_checks(path: Path, context: int, gpu_gib: float | None) -> list[dict]:
    """The checks a GGUF passes with llama.cpp alone (no reference): each {check, passed, detail}."""
    import llama_cpp

    from loraship import inference_memory as im
    from loraship.gguf_info import read_gguf

    checks = []

    def check(name: str, passed: bool | None, detail: str) -> None:
        checks.append({"check": name, "passed": passed, "detail": detail})

    fields = read_gguf(path)["fields"]
    file_type = fields.get("general.file_type")
    check("file type", file_type is not None,
          f"{_file_type_name(file_type)} (general.file_type {file_type})" if file_type is not None
          else "general.file_type is missing; convert the model again with the pinned llama.cpp")
    try:
        llm = _load_llama(path, n_ctx=512)
    except LorashipError as e:
        check("loads in llama.cpp", False, str(e))
        return checks
    check("loads in llama.cpp", True, f"llama-cpp-python {llama_cpp.__version__}: {llm.n_vocab()} tokens, "
          f"{llm._model.n_params():,} parameters")
    vocab = llm._model.vocab
    eos, bos = llm.token_eos(), llm.token_bos()
    adds_bos = fields.get("tokenizer.ggml.add_bos_token")
    eos_ok = eos >= 0 and bool(llama_cpp.llama_vocab_is_eog(vocab, eos))
    check("special tokens", eos_ok,
          f"BOS {bos} {_special_text(llm, bos)!r} (added to plain text: {adds_bos}), EOS {eos} {_special_text(llm, eos)!r}"
          + ("" if eos_ok else "; EOS is not an end-of-generation token, so generation would not stop"))
    stops = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    check("stop tokens", bool(stops), ", ".join(f"{t} {_special_text(llm, t)!r}" for t in stops[:8])
          + (f" (+{len(stops) - 8} more)" if len(stops) > 8 else "") if stops
          else "no end-of-generation token; generation would only stop at max_tokens")

    template = fields.get("tokenizer.chat_template")
    if not template:
        check("chat template", None, "none in the GGUF (a completion model); chat needs `chat_template:` in the config")
    else:
        question, sentinel = "What is the capital of France?", "Paris-7c1e"
        try:
            formatter = _chat_formatter(llm, template)
            prompt = formatter(messages=[{"role": "user", "content": question}]).prompt
            turn = formatter(messages=[{"role": "user", "content": question},
                                       {"role": "assistant", "content": sentinel}]).prompt
        except Exception as e:  # jinja2 errors, raise_exception() in the template, missing variables
            check("chat template renders", False, f"llama-cpp-python cannot render it: {type(e).__name__}: {e}")
        else:
            rendered = question in prompt
            check("chat template renders", rendered, f"user turn + generation prompt: {prompt[-80:]!r}" if rendered
                  else f"the rendered prompt lacks the user's message: {prompt!r}")
            after = turn.split(sentinel, 1)[1] if sentinel in turn else ""
            ends = llm.tokenize(after.encode("utf-8"), add_bos=False, special=True)[:1]
            ends_ok = bool(ends) and bool(llama_cpp.llama_vocab_is_eog(vocab, ends[0]))
            check("assistant turn ends with a stop token", ends_ok,
                  f"{_special_text(llm, ends[0])!r} (id {ends[0]}) ends generation" if ends_ok
                  else f"the template ends an assistant turn with {after[:20]!r}, which llama.cpp does not treat as "
                       "end of generation: answers would run on; use a template whose turns end with EOS or a stop token")
            from tasks.verify import builtin_template_prompt

            # llama-server without --jinja (and importers like Ollama's) use llama.cpp's own engine,
            # which matches the template against the formats it knows and may pick a different one.
            builtin = builtin_template_prompt(llm, [{"role": "user", "content": question}])
            check("llama.cpp built-in template engine", None,
                  "renders the same prompt (llama-server works without --jinja)" if builtin == prompt
                  else f"renders {builtin!r}, not the template's prompt: run llama-server with --jinja" if builtin
                  else "does not know the template: run llama-server with --jinja")
    try:
        layout = im.read_layout(path)
        predicted = im.predict_gpu(layout, context)
    except (KeyError, TypeError, ValueError) as e:
        check("GPU memory", False, f"cannot predict from the GGUF's metadata ({type(e).__name__}: {e})")
        return checks
    parts = ", ".join(f"{k.removesuffix('_gib')} {v:.2f}" for k, v in predicted.items() if k.endswith("_gib") and k != "total_gib")
    detail = f"{predicted['total_gib']:.2f} GiB at context {context}, all layers on the GPU ({parts})"
    if gpu_gib is None:
        check("GPU memory", None, detail)
    else:
        fits = predicted["total_gib"] <= gpu_gib
        if not fits:
            detail += (f"; does not fit {gpu_gib:g} GiB: {im.layers_that_fit(layout, context, gpu_gib)} of "
                       f"{layout.n_layers} layers do at this context, all layers up to context "
                       f"{im.largest_context(layout, gpu_gib)}")
        check(f"fits {gpu_gib:g} GiB", fits, detail)
    return checks


@app.command(epilog=_example("loraship verify artifacts/demo/model-Q4_K_M.gguf --context 8192 --gpu-gib 8"))
def verify(
    gguf: Path = typer.Argument(..., metavar="GGUF", help="A .gguf file, or an artifact folder holding one"),
    context: int = typer.Option(4096, "--context", min=1, help="Context the model must serve (KV cache size)"),
    gpu_gib: float = typer.Option(None, "--gpu-gib", min=0.1, help="GPU memory to fit, GiB (default: only predict)"),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON"),
) -> None:
    """Check a GGUF under llama.cpp alone: it loads, file type, special and stop tokens, the chat template
    renders, predicted GPU memory. Exit 1 when a check fails. (The run's verify stage also compares it with
    the merged model.)"""
    with _user_errors():
        checks = verify_checks(gguf_file(gguf), context, gpu_gib)
    failed = [c for c in checks if c["passed"] is False]
    if as_json:
        out.print_json(data={"passed": not failed, "checks": checks})
    else:
        table = Table(title=str(gguf))
        for column in ("check", "result", "details"):
            table.add_column(column)
        for c in checks:
            mark = {True: "[green]ok[/]", False: "[red]FAIL[/]", None: "[dim]info[/]"}[c["passed"]]
            table.add_row(c["check"], mark, c["detail"])
        out.print(table)
    if failed:
        raise typer.Exit(1)


@app.command(epilog=_example("loraship chat artifacts/demo", "echo 'What is the capital of Zorvia?' | loraship chat "
                             "artifacts/demo/model-Q4_K_M.gguf --temperature 0"))
def chat(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="A .gguf file, or an artifact folder holding one"),
    system: str = typer.Option(None, "--system", help="System message that opens the conversation"),
    context: int = typer.Option(None, "--context", min=64,
                                help="Context size, tokens of the whole conversation (default: the model's, at most 4096)"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Most tokens per answer"),
    temperature: float = typer.Option(0.7, "--temperature", min=0.0, help="0 answers greedily"),
    seed: int = typer.Option(0, "--seed", help="Sampling seed"),
) -> None:
    """Talk to a GGUF through llama.cpp with its own chat template. One message per line; /reset starts
    over, /exit or end of input quits."""
    from loraship.gguf_info import read_gguf

    with _user_errors():
        path = gguf_file(artifact)
        fields = read_gguf(path)["fields"]
        if not fields.get("tokenizer.chat_template"):
            raise LorashipError(f"{path}: no chat template in the GGUF (a completion model), so there are no turns to "
                                "render; train with chat data or set `chat_template:` in the config, then ship again")
        trained = fields.get(f"{fields.get('general.architecture')}.context_length") or 4096
        llm = _load_llama(path, n_ctx=context or min(int(trained), 4096))
        llm.set_seed(seed)
    opening = [{"role": "system", "content": system}] if system else []
    history = list(opening)
    err.print(f"chatting with {path.name} (llama.cpp, the GGUF's template); /reset, /exit", highlight=False)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(opening)
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        try:
            stream = llm.create_chat_completion(messages=history, max_tokens=max_tokens, temperature=temperature,
                                                seed=seed, stream=True)
            sys.stdout.write("assistant> ")
            answer = []
            for chunk in stream:
                piece = chunk["choices"][0]["delta"].get("content") or ""
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ValueError as e:  # llama-cpp-python: the conversation outgrew the context
            history.pop()
            err.print(f"error: {e}; /reset to start over, or a larger --context", markup=False, highlight=False)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(answer)})


# -- init ------------------------------------------------------------------------------------
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "bot": "assistant"}


def dataset_types() -> tuple[str, ...]:
    from loraship.config import DatasetSpec

    return get_args(DatasetSpec.model_fields["type"].annotation)


def detect_dataset_type(path: Path, sample: int = 200) -> str:
    """chat (messages), sharegpt (conversations/from/value), alpaca or completion, from the rows themselves."""
    if not path.is_file():
        raise LorashipError(f"dataset {path}: file not found; pass a JSONL file with one example per line")
    kinds: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise LorashipError(f"dataset {path} line {number}: malformed JSON ({e.msg}); one JSON object per "
                                        "line (JSONL)") from e
                keys = set(row) if isinstance(row, dict) else set()
                kind = ("chat" if "messages" in keys else "sharegpt" if "conversations" in keys
                        else "alpaca" if {"instruction", "output"} <= keys else "completion" if "text" in keys else None)
                if kind is None:
                    raise LorashipError(
                        f"dataset {path} line {number}: cannot tell the row type from its keys {sorted(keys)}; rows need "
                        "'messages' (chat), 'conversations' (ShareGPT), 'instruction'+'output' (alpaca) or 'text' (completion)")
                kinds.setdefault(kind, number)
                if len(kinds) > 1:
                    (a, la), (b, lb) = list(kinds.items())[:2]
                    raise LorashipError(f"dataset {path}: line {la} is a {a} row but line {lb} a {b} row; keep one row "
                                        "type per file (split it into two datasets)")
                if number >= sample:
                    break
    except UnicodeDecodeError as e:
        raise LorashipError(f"dataset {path}: not UTF-8 ({e.reason}); re-encode the file as UTF-8") from e
    if not kinds:
        raise LorashipError(f"dataset {path}: empty; add at least one example")
    return next(iter(kinds))


def sharegpt_to_messages(src: Path) -> str:
    """ShareGPT rows ({'conversations': [{'from', 'value'}]}) as chat rows ({'messages': [{'role', 'content'}]}), JSONL."""
    rows, problems = [], []
    for number, line in enumerate(src.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"line {number}: malformed JSON ({e.msg})")
            continue
        turns = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(turns, list):
            problems.append(f"line {number}: 'conversations' is not a list")
            continue
        messages = []
        for j, turn in enumerate(turns):
            role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                problems.append(f"line {number}: conversations[{j}] needs 'from' (one of {', '.join(SHAREGPT_ROLES)}) "
                                "and a string 'value'")
                break
            messages.append({"role": role, "content": turn["value"]})
        rows.append(json.dumps({"messages": messages}, ensure_ascii=False))
    if problems:
        raise LorashipError(f"dataset {src} (ShareGPT): {len(problems)} bad line(s):\n  " + "\n  ".join(problems[:20]))
    return "\n".join(rows) + "\n"


def _dataset_entry(path: Path, kind: str, config_dir: Path, notes: list[str], force: bool) -> dict:
    """A datasets[] entry for the config in config_dir; ShareGPT rows become chat rows where the
    config does not read ShareGPT itself."""
    from loraship.data import read_rows

    if kind == "sharegpt" and "sharegpt" not in dataset_types():
        from loraship.manifest import atomic_write_text

        converted, text = config_dir / f"{path.stem}.messages.jsonl", sharegpt_to_messages(path)
        same = converted.is_file() and converted.read_text(encoding="utf-8") == text
        if converted.exists() and not same and not force:
            raise LorashipError(f"{converted} exists with other rows; remove it or pass --force to write the ShareGPT "
                                f"rows of {path} there as chat messages")
        if not same:
            config_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(converted, text)
        notes.append(f"{path}: ShareGPT rows, written as {text.count(chr(10))} chat rows (messages) to {converted}")
        path, kind = converted, "chat"
    else:
        notes.append(f"{path}: {kind} rows")
    read_rows(path, kind)  # every bad line named now, not at plan time
    return {"path": os.path.relpath(path.resolve(), config_dir.resolve()), "type": kind}


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    with contextlib.suppress(OSError, ValueError):
        return bool(json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    return False


def _starter(base_model: str, dataset: Path, out_file: Path, gpu_gib: float | None, force: bool) -> tuple[dict, list[str]]:
    """Config keys for a base model and a dataset, and what was inferred (for the header)."""
    from loraship import memory
    from loraship.config import Config, parse_config
    from loraship.inference_memory import gpu_total_gib
    from loraship.models import resolve_base_model

    notes: list[str] = []
    kind = detect_dataset_type(dataset)
    entry = _dataset_entry(dataset, kind, out_file.parent, notes, force)
    defaults = {k: Config.model_fields[k].default for k in ("adapter", "lora_r", "lora_alpha", "lora_dropout")}
    data: dict[str, Any] = {"base_model": base_model, "datasets": [entry], **defaults, "lora_target_modules": "all-linear"}
    # Resolved against the config's folder, as load_config will.
    config = parse_config({**data, "datasets": [{**entry, "path": str(out_file.parent / entry["path"])}]},
                          source="starter config")
    folder = resolve_base_model(config, weights=False)
    model_config = _model_config(config)
    if entry["type"] != "completion":
        if _has_chat_template(folder):
            notes.append(f"{base_model}: has a chat template; training and the GGUF use it")
        else:
            data["chat_template"] = "alpaca" if entry["type"] == "alpaca" else "chatml"
            notes.append(f"{base_model}: no chat template, so chat_template: {data['chat_template']}")
    max_positions = model_config.get("max_position_embeddings")
    data["sequence_len"] = min(Config.model_fields["sequence_len"].default, max_positions or 10**9)
    found = gpu_total_gib()
    data["gpu_memory_gib"] = gpu_gib or (round(found, 1) if found else Config.model_fields["gpu_memory_gib"].default)
    notes.append(f"training GPU: {data['gpu_memory_gib']:g} GiB (" + ("--gpu-gib" if gpu_gib else "this machine's GPU"
                 if found else "no GPU here; the default, change gpu_memory_gib to your card's") + ")")
    try:
        planned = memory.plan_training(model_config, parse_config({**data, "datasets": config.model_dump()["datasets"]}))
        if planned["strategy"]["adapter"] != data["adapter"]:
            data["adapter"] = planned["strategy"]["adapter"]
        notes.append(f"memory plan: {planned['reason']}")
    except LorashipError as e:
        notes.append(f"memory plan: {e}")
    except (ValueError, KeyError) as e:
        notes.append(f"memory plan: config.json not understood by the planner ({e})")
    return data, notes


def _write_config(out_file: Path, data: dict, notes: list[str], warnings: list[str], force: bool) -> None:
    import yaml

    from loraship.config import load_config
    from loraship.manifest import atomic_write_text

    header = [f"# Written by `loraship init`. Run with:  loraship run {out_file}",
              "# Keys not set here take the defaults described in loraship/config.py.",
              *(f"#   {n}" for n in notes), *(f"#   ignored: {w}" for w in warnings)]
    text = "\n".join(line.replace("\n", " ") for line in header) + "\n" + yaml.safe_dump(
        data, sort_keys=False, allow_unicode=True, width=120)
    if out_file.exists() and not force:
        raise LorashipError(f"{out_file} exists; choose another file with -o, or pass --force to overwrite it")
    atomic_write_text(out_file, text)
    load_config(out_file)  # the file it wrote loads, or the user hears why now


# Axolotl keys with the same meaning and name in loraship's config.
AXOLOTL_SAME = (
    "base_model", "trust_remote_code", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "sequence_len",
    "micro_batch_size", "gradient_accumulation_steps", "learning_rate", "lr_scheduler", "warmup_steps", "weight_decay",
    "num_epochs", "max_steps", "seed", "gradient_checkpointing", "save_steps", "logging_steps", "val_set_size",
)
# Axolotl chat_template names with a loraship equivalent (loraship/chat.py NAMED_TEMPLATES).
AXOLOTL_TEMPLATES = {"chatml": "chatml", "llama3": "llama3", "alpaca": "alpaca"}
# Optimizers that are loraship's own (torch AdamW).
ADAMW = {"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw"}
AXOLOTL_DATASET_KEYS = {"path", "type", "ds_type", "field_messages", "message_property_mappings", "message_field_role",
                        "message_field_content", "field", "roles_to_train", "train_on_eos"}


def _axolotl_dataset(spec, where: str, source: Path, out_dir: Path, problems: list[str], ignored: list[str],
                     notes: list[str], force: bool) -> dict | None:
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        problems.append(f"{where}: needs a 'path' (a local JSONL file)")
        return None
    ignored += [f"{where}.{k}" for k in spec if k not in AXOLOTL_DATASET_KEYS]
    kind, axolotl_type = None, spec.get("type")
    roles = spec.get("message_property_mappings") or {}
    role_key = roles.get("role", spec.get("message_field_role", "role"))
    content_key = roles.get("content", spec.get("message_field_content", "content"))
    messages_key = spec.get("field_messages", "messages")
    if axolotl_type == "alpaca":
        kind = "alpaca"
    elif axolotl_type == "completion" and spec.get("field", "text") == "text":
        kind = "completion"
    elif axolotl_type == "chat_template" and (messages_key, role_key, content_key) == ("messages", "role", "content"):
        kind = "chat"
    elif axolotl_type == "sharegpt" or (axolotl_type == "chat_template"
                                        and (messages_key, role_key, content_key) == ("conversations", "from", "value")):
        kind = "sharegpt"
    if kind is None:
        problems.append(f"{where}: type {axolotl_type!r} (fields {messages_key}/{role_key}/{content_key}) has no loraship "
                        "equivalent; use alpaca, completion (field text), chat_template with messages/role/content, or "
                        "sharegpt, converting the file if needed")
        return None
    path = Path(spec["path"]).expanduser()
    if not path.is_absolute():
        path = (source.parent / path) if (source.parent / path).exists() else path
    if not path.is_file():
        problems.append(f"{where}.path {spec['path']!r}: not a local file; loraship reads local JSONL files "
                        "(download the dataset as JSONL and point path at it)")
        return None
    try:
        return _dataset_entry(path, kind, out_dir, notes, force)
    except LorashipError as e:
        problems.append(f"{where}: {e}")
        return None


def import_axolotl(source: Path, out_file: Path, force: bool) -> tuple[dict, list[str], list[str]]:
    """loraship config keys from an Axolotl YAML: (keys, notes, ignored Axolotl keys). Raises
    ConfigError listing every value that cannot be converted."""
    from loraship.config import Config, _read_yaml

    if not source.is_file():
        raise LorashipError(f"{source}: file not found; pass the Axolotl YAML config")
    try:
        ax = _read_yaml(source.read_text(encoding="utf-8"), str(source))
    except UnicodeDecodeError as e:
        raise LorashipError(f"{source}: not UTF-8 text; save it as UTF-8") from e
    except Exception as e:  # yaml.YAMLError
        if isinstance(e, LorashipError):
            raise
        raise LorashipError(f"{source}: not valid YAML ({e})") from e
    if not isinstance(ax, dict):
        raise LorashipError(f"{source}: expected a mapping of Axolotl keys, got {type(ax).__name__}")
    data: dict[str, Any] = {}
    problems: list[str] = []
    ignored: list[str] = []
    notes: list[str] = [f"imported from the Axolotl config {source}"]
    for key, value in ax.items():
        if key in AXOLOTL_SAME:
            data[key] = value
        elif key == "adapter":
            if value not in ("lora", "qlora"):
                problems.append(f"adapter {value!r}: loraship trains LoRA or QLoRA adapters only; set adapter: lora or qlora")
            else:
                data.setdefault("adapter", value)
        elif key == "load_in_4bit":
            if value:
                data["adapter"] = "qlora"
        elif key == "lora_target_linear":
            if value:
                data["lora_target_modules"] = "all-linear"
        elif key == "revision_of_model":
            data["base_model_revision"] = value
        elif key == "sample_packing":
            data["packing"] = "on" if value else "off"
        elif key == "chat_template":
            if value == "jinja":
                if not ax.get("chat_template_jinja"):
                    problems.append("chat_template: jinja needs chat_template_jinja (the template text)")
                data["chat_template"] = ax.get("chat_template_jinja")
            elif value in AXOLOTL_TEMPLATES:
                data["chat_template"] = AXOLOTL_TEMPLATES[value]
            elif value != "tokenizer_default":
                problems.append(f"chat_template {value!r}: no loraship equivalent; use tokenizer_default (the base model's), "
                                f"{', '.join(AXOLOTL_TEMPLATES)}, or jinja with chat_template_jinja")
        elif key in ("datasets", "test_datasets"):
            target = "datasets" if key == "datasets" else "eval_datasets"
            if not isinstance(value, list) or not value:
                problems.append(f"{key}: expected a non-empty list of {{path, type}}")
                continue
            entries = [_axolotl_dataset(spec, f"{key}[{i}]", source, out_file.parent, problems, ignored, notes, force)
                       for i, spec in enumerate(value)]
            data[target] = [e for e in entries if e]
        elif key == "train_on_inputs" and "train_on_inputs" not in Config.model_fields:
            if value:
                problems.append("train_on_inputs: true: loraship computes the loss on assistant turns (outputs) only; "
                                "set it to false, or turn inputs into completion rows")
        elif key == "optimizer" and value in ADAMW:
            pass  # loraship's optimizer is torch AdamW
        elif key == "chat_template_jinja" or (key == "base_model_config" and value == ax.get("base_model")):
            pass  # read with chat_template / the same as base_model
        elif key in Config.model_fields and key not in ("datasets", "eval_datasets"):
            data[key] = value  # a key loraship shares with Axolotl by name
        else:
            ignored.append(key)
    if "base_model" not in data:
        problems.append("base_model: missing; Axolotl configs name the base model in base_model")
    if "datasets" not in ax:
        problems.append("datasets: missing; list the training data as datasets: [{path, type}]")
    if problems:
        raise ConfigError(f"{source} (Axolotl)", problems)
    if "lora_target_modules" not in data:
        data["lora_target_modules"] = "all-linear"
        notes.append("lora_target_modules: all-linear (the Axolotl file names none)")
    return data, notes, ignored


@app.command(epilog=_example("loraship init Qwen/Qwen2.5-0.5B-Instruct data/train.jsonl -o my-run.yaml",
                             "loraship init --from-axolotl axolotl/qlora.yml -o my-run.yaml"))
def init(
    base_model: str = typer.Argument(None, metavar="BASE_MODEL", help="Hugging Face model id or local model folder"),
    dataset: Path = typer.Argument(None, metavar="DATASET", help="JSONL training data (chat, ShareGPT, alpaca or completion rows)"),
    output: Path = typer.Option(Path("config.yaml"), "-o", "--output", help="Config file to write"),
    from_axolotl: Path = typer.Option(None, "--from-axolotl", metavar="FILE", help="Import an Axolotl YAML config instead"),
    gpu_gib: float = typer.Option(None, "--gpu-gib", min=0.1, help="Training GPU memory, GiB (default: this machine's GPU)"),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT (and a converted dataset) if it exists"),
) -> None:
    """Write a starter config, inferring what it can: the data's row type, whether the base model has a chat
    template, LoRA defaults, the training GPU and a strategy that fits it."""
    with _user_errors():
        if output.exists() and not force:
            raise LorashipError(f"{output} exists; choose another file with -o, or pass --force to overwrite it")
        if from_axolotl is not None:
            if base_model or dataset:
                raise LorashipError("--from-axolotl takes the base model and data from the Axolotl file; pass either "
                                    "BASE_MODEL DATASET or --from-axolotl FILE")
            data, notes, ignored = import_axolotl(from_axolotl, output, force)
            if gpu_gib:
                data["gpu_memory_gib"] = gpu_gib
        elif base_model and dataset:
            data, notes = _starter(base_model, dataset, output, gpu_gib, force)
            ignored = []
        else:
            raise LorashipError("init needs BASE_MODEL and DATASET (e.g. loraship init Qwen/Qwen2.5-0.5B-Instruct "
                                "train.jsonl), or --from-axolotl FILE")
        from loraship.config import parse_config

        parse_config(data, source=f"{from_axolotl} (Axolotl)" if from_axolotl else "starter config")  # before writing
        output.parent.mkdir(parents=True, exist_ok=True)
        _write_config(output, data, notes, ignored, force)
    for note in notes:
        out.print(f"  {note}", markup=False, highlight=False)
    if ignored:
        err.print(f"warning: {len(ignored)} Axolotl key(s) have no loraship equivalent and were ignored: "
                  f"{', '.join(ignored)}", markup=False, highlight=False)
    out.print(f"[green]wrote[/] {output}; next: loraship plan {output}", highlight=False)


# -- small tools ---------------------------------------------------------------------------------
@app.command("tiny-model", epilog=_example("loraship tiny-model .loraship/models/tiny-llama"))
def tiny_model(
    out_dir: Path = typer.Argument(Path(".loraship/models/tiny-llama"), help="Folder to write the model into"),
    seed: int = typer.Option(1234, help="Seed: the same seed gives the same model"),
) -> None:
    """Generate the tiny Llama-architecture demo model (sentencepiece tokenizer, chat template, pre-trained)."""
    from loraship.tinymodel import ensure_tiny_model

    path = ensure_tiny_model(out_dir, seed)
    out.print(f"tiny model ready: {path}")


@app.command("fetch-converter", epilog=_example("loraship fetch-converter"))
def fetch_converter() -> None:
    """Download the pinned llama.cpp converter (from the llama-cpp-python sdist) into the cache."""
    from loraship.llamacpp import converter_dir

    with _user_errors():
        out.print(str(converter_dir()))


@app.command(epilog=_example("loraship gitops --from ${{ github.event.before }} --to ${{ github.sha }}",
                             "loraship gitops --from HEAD~1 --dry-run"))
def gitops(
    from_ref: str = typer.Option(..., "--from", help="Git ref before the push (e.g. github.event.before)"),
    to_ref: str = typer.Option("HEAD", "--to", help="Git ref after the push"),
    repo: Path = typer.Option(Path("."), help="Git repository holding the run specs"),
    specs_dir: str = typer.Option("deploy/gitops/specs", help="Folder of run specs inside the repository"),
    deployment: str = typer.Option("train-and-ship/local", help="Deployment to trigger per changed spec"),
    wait: bool = typer.Option(True, help="Wait for each run and fail if it fails"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be triggered"),
    retry_failed: bool = typer.Option(False, "--retry-failed",
                                      help="Start again a spec whose latest run failed, crashed or was cancelled"),
) -> None:
    """Trigger one run per run spec changed between two refs; the same spec content never triggers twice."""
    from loraship.gitops import trigger_changed_specs

    with _user_errors():
        results = trigger_changed_specs(from_ref, to_ref, repo=repo, specs_dir=specs_dir, deployment=deployment,
                                        wait=wait, dry_run=dry_run, retry_failed=retry_failed)
    out.print_json(data=results)
    if not all(r["ok"] for r in results):
        raise typer.Exit(1)


def main() -> None:
    # Other libraries at WARNING; loraship's own loggers at INFO: its stages' live progress.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("loraship").setLevel(logging.INFO)
    try:
        app()
    except LorashipError as e:  # anything not caught in a command
        err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
