"""`loraship` command line: run the flow, plan memory, make the tiny demo model, trigger GitOps runs."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
import typer
from rich.console import Console

from loraship.errors import LorashipError

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
err = Console(stderr=True, soft_wrap=True)
out = Console()


def _fail(e: LorashipError) -> None:
    err.print(f"error: {e}", markup=False, highlight=False)
    raise typer.Exit(e.exit_code)


def _load(config_path: Path, overrides: list[str]):
    import yaml

    from loraship.config import load_config

    parsed = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise LorashipError(f"--set {item!r}: expected KEY=VALUE, e.g. --set max_steps=10")
        parsed[key] = yaml.safe_load(value)
    return load_config(config_path, parsed)


@app.command()
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="YAML config, e.g. configs/demo.yaml"),
    set_: list[str] = typer.Option([], "--set", help="Override a config key: --set max_steps=10 (repeatable)"),
) -> None:
    """Run train-and-ship end to end (in-process Prefect, no server needed). Finished stages are skipped."""
    from loraship.prefect_env import configure_local_prefect

    configure_local_prefect()
    try:
        config = _load(config_path, set_)
        # Every input problem is reported here, before Prefect or a GPU is involved.
        from loraship.preflight import check_inputs

        check_inputs(config)
    except LorashipError as e:
        _fail(e)
    from flows.train_and_ship import train_and_ship

    state = train_and_ship(config, return_state=True)
    if not state.is_completed():
        err.print(f"error: run {config.run_name!r} failed: {state.message}", markup=False, highlight=False)
        err.print("Finished stages are kept; fix the problem and run the same command again to resume.")
        raise typer.Exit(1)
    from tasks.publish import destination_of

    out.print(f"[green]shipped[/] {config.run_name} -> {destination_of(config)}")


@app.command()
def plan(
    config_path: Path = typer.Argument(..., metavar="CONFIG"),
    set_: list[str] = typer.Option([], "--set", help="Override a config key (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON"),
) -> None:
    """Predict GPU memory, disk and the shipped model's footprint from config.json alone (no GPU, no weights)."""
    try:
        config = _load(config_path, set_)
        from loraship import memory
        from loraship.models import resolve_base_model

        # config.json is all the planner reads: a 14B model need not be downloaded to plan it.
        config_file = resolve_base_model(config, weights=False) / "config.json"
        if not config_file.is_file():
            raise LorashipError(f"base_model {config.base_model!r}: no config.json at {config_file}; "
                                "point base_model at a folder holding the model's config.json")
        model_config = json.loads(config_file.read_text(encoding="utf-8"))
        training = memory.plan_training(model_config, config)
        footprint = memory.plan_disk_and_inference(model_config, config)
    except LorashipError as e:
        _fail(e)
    except (ValueError, KeyError) as e:  # a config.json the planner cannot read
        _fail(LorashipError(f"{config.base_model}/config.json: {e}"))
    if as_json:
        out.print_json(data={**training, **footprint})
    else:
        out.print(memory.render_plan(training, footprint))


@app.command("tiny-model")
def tiny_model(
    out_dir: Path = typer.Argument(Path(".loraship/models/tiny-llama"), help="Folder to write the model into"),
    seed: int = typer.Option(1234, help="Seed: the same seed gives the same model"),
) -> None:
    """Generate the tiny Llama-architecture demo model (sentencepiece tokenizer, chat template, pre-trained)."""
    from loraship.tinymodel import ensure_tiny_model

    path = ensure_tiny_model(out_dir, seed)
    out.print(f"tiny model ready: {path}")


@app.command("fetch-converter")
def fetch_converter() -> None:
    """Download the pinned llama.cpp converter (from the llama-cpp-python sdist) into the cache."""
    from loraship.llamacpp import converter_dir

    try:
        out.print(str(converter_dir()))
    except LorashipError as e:
        _fail(e)


@app.command()
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

    try:
        results = trigger_changed_specs(from_ref, to_ref, repo=repo, specs_dir=specs_dir, deployment=deployment,
                                        wait=wait, dry_run=dry_run, retry_failed=retry_failed)
    except LorashipError as e:
        _fail(e)
    out.print_json(data=results)
    if not all(r["ok"] for r in results):
        raise typer.Exit(1)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        app()
    except LorashipError as e:  # anything not caught in a command
        err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
