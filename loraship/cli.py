"""`loraship` command line: start a config, plan memory, run the flow (all of it or some stages),
see where a run stands, inspect, verify and chat with a GGUF, trigger GitOps runs."""

from __future__ import annotations

# Each command's options and help are here (the docstring above is `loraship --help`); the work is in the library:
# --set in loraship.config_overrides, --only/--from in loraship.stage_selection, what `plan` prints in
# loraship.plan_report, `init` in loraship.starter.

import contextlib
import logging
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from loraship.config_overrides import SET_HELP, load_with_overrides
from loraship.constants import GGUF_KEY_CHAT_TEMPLATE, STAGES
from loraship.errors import LorashipError
from loraship.llamacpp.gguf_tools import describe_gguf, gguf_file, human_size, verify_checks
from loraship.plan_report import artifact_place, artifact_words, render_plan
from loraship.runtime.status import run_states, short
from loraship.stage_selection import select_stages
from loraship.stage_table import stage_module
from loraship.starter import init_config, model_config_of

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


# The config with --set overrides (tests call it by this name too).
_load = load_with_overrides


# -- run, plan ---------------------------------------------------------------------------------
@app.command(
    epilog=_example(
        "loraship run configs/demo.yaml",
        "loraship run configs/demo.yaml --from convert --set quantization=Q8_0",
        "loraship run configs/demo.yaml --only verify",
    )
)
def run(
    config_path: Path = typer.Argument(..., metavar="CONFIG", help="YAML config, e.g. configs/demo.yaml"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    only: str = typer.Option(None, "--only", metavar="STAGE", help=f"Run this stage alone: {', '.join(STAGES)}"),
    start: str = typer.Option(None, "--from", metavar="STAGE", help="Run this stage and every stage after it"),
    force: bool = typer.Option(
        False,
        "--force",
        help="Publish into an artifact folder holding files loraship did not write, moving them aside first "
        "(to <folder>.replaced-<UTC time>/; nothing is deleted)",
    ),
) -> None:
    """Run train-and-ship (in-process Prefect, no server needed). Finished stages are skipped. Ctrl-C or SIGTERM
    stops it in one line (exit 130 or 143), keeping finished stages and checkpoints: run it again to resume."""
    from loraship.runtime import interrupt
    from loraship.runtime.prefect_env import configure_local_prefect, kill_local_prefect

    configure_local_prefect()
    named = {"run": str(config_path)}

    def say(signum: int) -> str:
        return (
            f"interrupted ({interrupt.signal_name(signum)}): run {named['run']} stopped; finished stages and "
            "checkpoints are kept; run the same command again to resume"
        )

    with interrupt.interruptible(say, teardown=kill_local_prefect) as guard:
        try:
            _run(config_path, [*set_, "replace_output=true"] if force else set_, only, start, named, guard)
        except BaseException as e:
            if not interrupt.is_interrupt(e):
                raise
            code = interrupt.exit_code_of(e)
            guard.stopping(code - 128)
            _stop_prefect_quietly()
            guard.finish(code - 128)
            # Locks, slots and the server are already seen to; the interpreter's own teardown (garbage collecting
            # torch and transformers) took 4.4 s more after the line here, of a container's 10 s grace.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def _stop_prefect_quietly() -> None:
    """The temporary server down and its logs sent, after an interrupt; a failure here changes nothing for the
    user (the watchdog in loraship/runtime/interrupt.py bounds the time)."""
    from loraship.runtime.prefect_env import stop_local_prefect

    with contextlib.suppress(Exception):
        stop_local_prefect(timeout_s=3)


def _run(config_path: Path, set_: list[str], only: str | None, start: str | None, named: dict, guard) -> None:
    with _user_errors():
        config = _load(config_path, set_)
        named["run"] = repr(config.run_name)
        stages = select_stages(config, config_path, only, start)
        if _nothing_to_run(config, stages):
            return
        if "plan" in stages:
            # Every input problem is reported here, before Prefect or a GPU is involved; with the
            # config's secrets in the environment (a gated hub model needs its token to be checked).
            from loraship.runtime.prefect_env import secret_env
            from loraship.planning.preflight import check_inputs

            with secret_env(config.env_from_secrets):
                check_inputs(config)
    from loraship.flows.train_and_ship import train_and_ship  # Prefect: imported only to run
    from loraship.runtime.prefect_env import start_local_prefect

    from loraship.errors import exit_code_of
    from loraship.runtime.failures import failure_of, quiet_failures_on_console

    guard.cover_console()  # Prefect's console handler, added on its import
    quiet_failures_on_console()  # the failure is said once, below
    with _user_errors():
        start_local_prefect()
    state = train_and_ship(config, stages=None if stages == list(STAGES) else stages, return_state=True)
    if not state.is_completed():
        err.print(f"error: run {config.run_name!r} failed: {state.message}", markup=False, highlight=False)
        err.print("Finished stages are kept; fix the problem and run the same command again to resume.")
        raise typer.Exit(exit_code_of(failure_of(state)))
    _finished(config, stages)


def _finished(config, stages: list[str]) -> None:
    if "publish" in stages:
        destination = stage_module("publish").destination_of(config)
        out.print(f"[green]shipped[/] {config.run_name} -> {destination}")
    else:
        out.print(f"[green]done[/] {config.run_name}: {', '.join(stages)}")


def _nothing_to_run(config, stages: list[str]) -> bool:
    """Finish the run here when every stage asked for is up to date, as `loraship status` sees it: no
    Prefect server to start, no torch or transformers to import (bench/results/noop_rerun.json). Publish
    still runs its skip, which puts back whatever differs at the destination. False: the flow has work to do."""
    from loraship.runtime.stage import WouldRun, skip_only

    states = run_states(config)
    if any(states[stage]["state"] != "done" for stage in stages):
        return False
    if "publish" in stages:
        try:
            with skip_only():
                stage_module("publish").run(config)
        except (WouldRun, LorashipError):  # the flow runs it, or fails it with its message, as always
            return False
    for stage in stages:
        out.print(f"{stage}: up to date (same inputs, outputs intact), skipped", highlight=False)
    _finished(config, stages)
    return True


@app.command(
    epilog=_example(
        "loraship plan configs/demo.yaml",
        "loraship plan configs/qwen2-14b-lora.yaml --set gpu_memory_gib=24 --json",
        "loraship plan configs/qwen2-14b-lora.yaml --set base_model=examples/models/qwen2-14b --memory-only",
    )
)
def plan(
    config_path: Path = typer.Argument(..., metavar="CONFIG"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON"),
    memory_only: bool = typer.Option(
        False,
        "--memory-only",
        help="Predict from config.json alone: skip the input checks (tokenizer, data, "
        "output), e.g. for a folder holding only config.json",
    ),
) -> None:
    """Check every input as `loraship run` does before training (base model folder, tokenizer, every dataset row,
    golden prompts, workdir, output), then predict GPU memory, disk and the shipped model's footprint (no GPU, no
    weights loaded)."""
    with _user_errors():
        config = _load(config_path, set_)
        from loraship.planning.shape import shape_from_config
        from loraship.planning.shipping import plan_disk_and_inference

        if memory_only:
            model_config = model_config_of(config)
        else:
            # The same checks as `loraship run` and the plan stage, so a fault stops here and not at train.
            from loraship.models import read_model_config
            from loraship.planning.preflight import check_inputs
            from loraship.runtime.prefect_env import configure_local_prefect, secret_env

            configure_local_prefect()  # a Prefect Secret of env_from_secrets is read as `loraship run` reads it
            try:
                with secret_env(config.env_from_secrets):
                    model_config = read_model_config(check_inputs(config))
            except LorashipError as e:
                told = LorashipError(
                    f"{e}\n(`loraship plan {config_path} --memory-only` predicts memory from "
                    "config.json alone, without these checks)"
                )
                told.exit_code = e.exit_code
                raise told from e
        try:
            from loraship.planning.multi_gpu import plan_on_gpus

            shape = shape_from_config(model_config)
            training = plan_on_gpus(shape, config)
            footprint = plan_disk_and_inference(shape, config)
        except (ValueError, KeyError) as e:  # a config.json the planner cannot read
            raise LorashipError(f"{config.base_model}/config.json: {e}") from e
    artifact = artifact_place(config)
    if as_json:
        out.print_json(data={**training, **footprint, "artifact": artifact})
    else:
        out.print(render_plan(training, footprint))
        out.print(f"[bold]Artifact[/]: {artifact_words(config)}", highlight=False)


# -- status ------------------------------------------------------------------------------------
@app.command(epilog=_example("loraship status configs/demo.yaml", "loraship status configs/demo.yaml --set lora_r=32"))
def status(
    config_path: Path = typer.Argument(..., metavar="CONFIG"),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the states as JSON"),
) -> None:
    """Each stage of a config's run: done, stale (its inputs changed since it ran) or not run."""
    import datetime

    from loraship.runtime.stage import run_dir

    with _user_errors():
        config = _load(config_path, set_)
        states = run_states(config)
    if as_json:
        out.print_json(
            data={"run_name": config.run_name, "run_dir": str(run_dir(config)), "stages": list(states.values())}
        )
        return
    table = Table(title=f"run {config.run_name} ({run_dir(config)})")
    for column in ("stage", "state", "details"):
        table.add_column(column)
    colour = {"done": "green", "stale": "yellow", "not run": "dim"}
    for s in states.values():
        if s["state"] == "done":
            when = (
                datetime.datetime.fromtimestamp(s["finished"]).strftime("%Y-%m-%d %H:%M") if s.get("finished") else "?"
            )
            details = f"finished {when} in {s.get('seconds')} s"
        else:
            details = "; ".join(s["reasons"])
        table.add_row(s["stage"], f"[{colour[s['state']]}]{s['state']}[/]", details)
    out.print(table)


# -- GGUF: inspect, verify, chat -------------------------------------------------------------
@app.command(
    epilog=_example("loraship inspect artifacts/demo/model-Q4_K_M.gguf", "loraship inspect artifacts/demo --json")
)
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
    out.print(
        f"[bold]{info['file']}[/]  {human_size(info['bytes'])}, {info['architecture']}, file type "
        f"{info['file_type']}, {info['tensor_count']} tensors, {info['parameters']:,} parameters, name "
        f"{info['name']!r}"
    )
    types = Table(title="tensor types")
    for column in ("type", "tensors", "parameters", "size"):
        types.add_column(column, justify="left" if column == "type" else "right")
    for name, row in info["tensor_types"].items():
        types.add_row(name, str(row["tensors"]), f"{row['parameters']:,}", human_size(row["bytes"]))
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
        meta.add_row(key, value if isinstance(value, str) else short(value, 100))
    out.print(meta)
    out.print("[bold]chat template[/]")
    out.print(
        info["chat_template"] or "(none: a completion model; `loraship chat` needs a template)",
        markup=False,
        highlight=False,
    )


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


@app.command(
    epilog=_example(
        "loraship chat artifacts/demo",
        "echo 'What is the capital of Zorvia?' | loraship chat artifacts/demo/model-Q4_K_M.gguf --temperature 0",
    )
)
def chat(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="A .gguf file, or an artifact folder holding one"),
    system: str = typer.Option(None, "--system", help="System message that opens the conversation"),
    context: int = typer.Option(
        None,
        "--context",
        min=64,
        help="Context size, tokens of the whole conversation (default: the model's, at most 4096)",
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Most tokens per answer"),
    temperature: float = typer.Option(0.7, "--temperature", min=0.0, help="0 answers greedily"),
    seed: int = typer.Option(0, "--seed", help="Sampling seed"),
) -> None:
    """Talk to a GGUF through llama.cpp with its own chat template. One message per line; /reset starts
    over, /exit or end of input quits."""
    from loraship.llamacpp.gguf_info import read_gguf_apart
    from loraship.llamacpp.llama_child import ChatChild

    with _user_errors():
        path = gguf_file(artifact)
        fields = read_gguf_apart(path)["fields"]
        if not fields.get(GGUF_KEY_CHAT_TEMPLATE):
            raise LorashipError(
                f"{path}: no chat template in the GGUF (a completion model), so there are no turns to "
                "render; train with chat data or set `chat_template:` in the config, then ship again"
            )
        trained = fields.get(f"{fields.get('general.architecture')}.context_length") or 4096
        # llama.cpp in a child that loads the GGUF first: this process has imported numpy
        # (loraship/llamacpp/llama_child.py).
        llm = ChatChild(path, n_ctx=context or min(int(trained), 4096), seed=seed)
    with llm, _user_errors():
        _chat_loop(llm, path, system, max_tokens=max_tokens, temperature=temperature, seed=seed)


def _chat_loop(llm, path: Path, system: str | None, **sampling) -> None:
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
            sys.stdout.write("assistant> ")
            answer = []
            for piece in llm.ask(history, **sampling):
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
@app.command(
    epilog=_example(
        "loraship init Qwen/Qwen2.5-0.5B-Instruct data/train.jsonl -o my-run.yaml",
        "loraship init --from-axolotl axolotl/qlora.yml -o my-run.yaml",
    )
)
def init(
    base_model: str = typer.Argument(None, metavar="BASE_MODEL", help="Hugging Face model id or local model folder"),
    dataset: Path = typer.Argument(
        None, metavar="DATASET", help="JSONL training data (chat, ShareGPT, alpaca or completion rows)"
    ),
    output: Path = typer.Option(Path("config.yaml"), "-o", "--output", help="Config file to write"),
    from_axolotl: Path = typer.Option(
        None, "--from-axolotl", metavar="FILE", help="Import an Axolotl YAML config instead"
    ),
    gpu_gib: float = typer.Option(
        None, "--gpu-gib", min=0.1, help="Training GPU memory, GiB (default: this machine's GPU)"
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT (and a converted dataset) if it exists"),
) -> None:
    """Write a starter config, inferring what it can: the data's row type, whether the base model has a chat
    template, LoRA defaults, the training GPU and a strategy that fits it."""
    with _user_errors():
        notes, ignored = init_config(base_model, dataset, output, from_axolotl, gpu_gib, force)
    for note in notes:
        out.print(f"  {note}", markup=False, highlight=False)
    if ignored:
        err.print(
            f"warning: {len(ignored)} Axolotl key(s) have no loraship equivalent and were ignored: "
            f"{', '.join(ignored)}",
            markup=False,
            highlight=False,
        )
    out.print(f"[green]wrote[/] {output}; next: loraship plan {output}", highlight=False)


# -- small tools ---------------------------------------------------------------------------------
@app.command("tiny-model", epilog=_example("loraship tiny-model .loraship/models/tiny-llama"))
def tiny_model(
    out_dir: Path = typer.Argument(Path(".loraship/models/tiny-llama"), help="Folder to write the model into"),
    seed: int = typer.Option(1234, help="Seed: the same seed gives the same model"),
) -> None:
    """Generate the tiny Llama-architecture demo model (sentencepiece tokenizer, chat template, pre-trained)."""
    from loraship.fixtures.tinymodel import ensure_tiny_model

    path = ensure_tiny_model(out_dir, seed)
    out.print(f"tiny model ready: {path}")


@app.command("fetch-converter", epilog=_example("loraship fetch-converter"))
def fetch_converter() -> None:
    """Download the pinned llama.cpp converter (from the llama-cpp-python sdist) into the cache."""
    from loraship.llamacpp.llamacpp import converter_dir

    with _user_errors():
        out.print(str(converter_dir()))


@app.command("build-tools", epilog=_example("loraship build-tools"))
def build_tools() -> None:
    """Build llama.cpp's llama-imatrix, llama-quantize and llama-perplexity from the pinned source into the cache."""
    from loraship.llamacpp.tools import tools_dir

    with _user_errors():
        out.print(str(tools_dir()))


@app.command(
    epilog=_example(
        "loraship gitops --from ${{ github.event.before }} --to ${{ github.sha }}",
        "loraship gitops --from HEAD~1 --dry-run",
    )
)
def gitops(
    from_ref: str = typer.Option(..., "--from", help="Git ref before the push (e.g. github.event.before)"),
    to_ref: str = typer.Option("HEAD", "--to", help="Git ref after the push"),
    repo: Path = typer.Option(Path("."), help="Git repository holding the run specs"),
    specs_dir: str = typer.Option("deploy/gitops/specs", help="Folder of run specs inside the repository"),
    deployment: str = typer.Option("train-and-ship/local", help="Deployment to trigger per changed spec"),
    wait: bool = typer.Option(True, help="Wait for each run and fail if it fails"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be triggered"),
    retry_failed: bool = typer.Option(
        False, "--retry-failed", help="Start again a spec whose latest run failed, crashed or was cancelled"
    ),
) -> None:
    """Trigger one run per run spec changed between two refs; the same spec content never triggers twice."""
    from loraship.runtime.gitops import trigger_changed_specs

    with _user_errors():
        results = trigger_changed_specs(
            from_ref,
            to_ref,
            repo=repo,
            specs_dir=specs_dir,
            deployment=deployment,
            wait=wait,
            dry_run=dry_run,
            retry_failed=retry_failed,
        )
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
