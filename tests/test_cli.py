"""The command line: init, --set on nested keys, run --only/--from, status, inspect/verify/chat on a GGUF."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from loraship.cli import _load, app, select_stages
from loraship.config import load_config, parse_config
from loraship.errors import LorashipError
from tests.conftest import REPO, demo_config_dict

runner = CliRunner()


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model, tmp_path_factory) -> Path:
    """The tiny base model converted straight to an F16 GGUF (no training): the cheapest real GGUF."""
    from loraship.stages.convert import convert

    out = tmp_path_factory.mktemp("gguf") / "tiny-F16.gguf"
    convert(tiny_model, out)
    return out


@pytest.fixture
def config_file(tiny_model, tmp_path) -> Path:
    data = demo_config_dict(tiny_model, tmp_path, run_name="cli")
    train = tmp_path / "train.jsonl"
    shutil.copy(REPO / "data/demo/train.jsonl", train)
    data["datasets"] = [{"path": str(train), "type": "chat"}]
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# -- GGUF verbs ------------------------------------------------------------------------------
def test_inspect_reads_back_the_gguf(tiny_gguf, tiny_model):
    from loraship.llamacpp.gguf_info import read_gguf

    result = invoke("inspect", tiny_gguf, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["file_type"] == "F16" and info["architecture"] == "llama"
    assert info["tensor_count"] == read_gguf(tiny_gguf)["tensor_count"]
    assert sum(t["tensors"] for t in info["tensor_types"].values()) == info["tensor_count"]
    assert info["chat_template"] == (tiny_model / "chat_template.jinja").read_text()
    assert info["special_tokens"]["eos"] == {"id": 2, "text": "</s>"}
    shown = invoke("inspect", tiny_gguf.parent)  # an artifact folder holding one .gguf
    assert shown.exit_code == 0 and "tensor types" in shown.output and "<|assistant|>" in shown.output


def test_verify_checks_the_gguf_under_llama_cpp(tiny_gguf):
    result = invoke("verify", tiny_gguf, "--gpu-gib", "4", "--context", "512", "--json")
    assert result.exit_code == 0, result.output
    checks = {c["check"]: c for c in json.loads(result.output)["checks"]}
    for name in (
        "file type",
        "loads in llama.cpp",
        "special tokens",
        "stop tokens",
        "chat template renders",
        "assistant turn ends with a stop token",
        "fits 4 GiB",
    ):
        assert checks[name]["passed"] is True, checks[name]
    assert "</s>" in checks["assistant turn ends with a stop token"]["detail"]
    too_small = invoke("verify", tiny_gguf, "--gpu-gib", "0.2", "--json")
    assert too_small.exit_code == 1
    assert not json.loads(too_small.output)["passed"]


def test_chat_answers_each_line_with_the_ggufs_template(tiny_gguf):
    from llama_cpp import Llama

    question = "What is the capital of Zorvia?"
    result = invoke(
        "chat", tiny_gguf, "--temperature", "0", "--max-tokens", "8", input=f"{question}\n/exit\nignored\n"
    )
    assert result.exit_code == 0, result.output
    llm = Llama(model_path=str(tiny_gguf), n_ctx=512, verbose=False)  # the template comes from the GGUF here too
    expected = llm.create_chat_completion(
        messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0
    )["choices"][0]["message"]["content"]
    assert f"assistant> {expected}\n" in result.output
    assert result.output.count("assistant> ") == 1  # /exit ends the session


def test_chat_and_verify_load_llama_cpp_in_a_child_not_in_the_cli(tiny_gguf):
    """On the CUDA build a load after `import numpy` segfaulted; the CLI has imported numpy, so llama.cpp runs in
    a child that loads the GGUF first (loraship/llamacpp/llama_child.py), and the CLI process never imports it."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from loraship.cli import app\n"
        f"app(['verify', {str(tiny_gguf)!r}, '--json'], standalone_mode=False)\n"
        f"app(['chat', {str(tiny_gguf)!r}, '--temperature', '0', '--max-tokens', '4'], standalone_mode=False)\n"
        "print('numpy' in sys.modules, 'llama_cpp' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input="Hello\n/exit\n", capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert '"loads in llama.cpp"' in done.stdout and "assistant> " in done.stdout
    assert done.stdout.rstrip().endswith("you> True False")  # numpy here, llama.cpp only in the child


def test_a_native_crash_names_the_llama_cpp_build_as_a_cause(tmp_path):
    """SIGSEGV/SIGILL in the llama.cpp child: besides a broken GGUF, the message names a llama-cpp-python built for
    another CPU (a -march=native build crashed in ggml's AMX matmul on every decode) and the reinstall that fixes it;
    an ordinary exit does not."""
    from loraship.llamacpp.llama_child import _crashed

    segv = str(_crashed(tmp_path / "m.gguf", -11, "ggml_backend_amx_mul_mat"))
    assert "killed by signal 11" in segv and "CMAKE_ARGS=-DGGML_NATIVE=OFF" in segv and "--from convert" in segv
    assert "GGML_NATIVE" in str(_crashed(tmp_path / "m.gguf", -4, ""))
    assert "GGML_NATIVE" not in str(_crashed(tmp_path / "m.gguf", 1, "Traceback"))


def test_verify_measuring_apart_reports_the_childs_death_with_the_same_hint(tmp_path, monkeypatch):
    """loraship/verification/measure_child.py measure_apart: a child killed by SIGSEGV is a stage error naming the
    signal, its last output and both causes (a broken GGUF, the llama-cpp-python build), not a crash of the stage."""
    import subprocess
    from types import SimpleNamespace

    from loraship.errors import LorashipError
    from loraship.runtime import proc
    from loraship.verification import measure_child

    dead = subprocess.CompletedProcess([], -11, stdout="", stderr="loading model\nggml_backend_amx_mul_mat\n")
    monkeypatch.setattr(proc, "run_child", lambda *a, **k: dead)
    job = {"gguf": str(tmp_path / "m.gguf"), "n_ctx": 64, "n_gpu_layers": 0, "seed": 0}
    with pytest.raises(LorashipError) as err:
        measure_child.measure_apart(SimpleNamespace(dir=tmp_path), job)
    text = str(err.value)
    assert "m.gguf (killed by signal 11):\nloading model\nggml_backend_amx_mul_mat" in text
    assert "convert and quantize stages again" in text and "CMAKE_ARGS=-DGGML_NATIVE=OFF" in text


def test_a_gguf_llama_cpp_cannot_load_is_a_failed_check(tiny_gguf, tmp_path):
    """A GGUF that reads, but names an architecture llama.cpp does not know: the child's load failure comes back
    as the failed check (verify) or one error (chat), not a traceback."""
    data = tiny_gguf.read_bytes()
    at = data.index(b"llama", data.index(b"general.architecture"))
    odd = tmp_path / "odd-arch.gguf"
    odd.write_bytes(data[:at] + b"llamx" + data[at + 5 :])
    result = invoke("verify", odd, "--json")
    assert result.exit_code == 1, result.output
    checks = {c["check"]: c for c in json.loads(result.output)["checks"]}
    assert checks["loads in llama.cpp"]["passed"] is False
    assert "llama.cpp cannot load it" in checks["loads in llama.cpp"]["detail"]
    chat = invoke("chat", odd, input="Hello\n")
    assert chat.exit_code == 2 and "llama.cpp cannot load it" in chat.output and "Traceback" not in chat.output


@pytest.mark.parametrize("verb", ["inspect", "verify", "chat"])
def test_a_file_that_is_not_a_gguf_is_bad_input(verb, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>not found</html>")
    result = invoke(verb, fake)
    assert result.exit_code == 2
    assert "not a GGUF file" in result.output and "pass the .gguf file" in result.output
    assert "Traceback" not in result.output


# -- --set -----------------------------------------------------------------------------------
def test_set_reaches_nested_keys_and_list_entries(config_file, tmp_path):
    config = _load(config_file, ["datasets.0.path=other.jsonl", "datasets.0.type=completion", "lora_r=4"])
    assert config.datasets[0].path == "other.jsonl" and config.datasets[0].type == "completion"
    assert config.lora_r == 4
    assert _load(config_file, ["env_from_secrets.HF_TOKEN=hf-token"]).env_from_secrets == {"HF_TOKEN": "hf-token"}


@pytest.mark.parametrize(
    "item, message",
    [
        ("datasets.3.path=x.jsonl", "datasets is a list with indices 0..0"),
        ("datasets.0.file=x.jsonl", "datasets.0 has no key 'file'"),
        ("lora_rank=8", "the config has no key 'lora_rank' (did you mean 'lora_r'?)"),
        ("lora_r.x=1", "lora_r is 16, not a mapping or a list"),
        ("max_steps", "expected KEY=VALUE"),
    ],
)
def test_set_on_a_key_that_does_not_exist_is_named(config_file, item, message):
    with pytest.raises(LorashipError, match="--set") as e:
        _load(config_file, [item])
    assert message in str(e.value)
    result = invoke("plan", config_file, "--set", item)
    assert result.exit_code == 2 and message in result.output


# -- run --only / --from, status -----------------------------------------------------------------
def test_only_a_stage_whose_upstream_has_not_run_is_refused(config_file):
    result = invoke("run", config_file, "--only", "convert")
    assert result.exit_code == 2
    assert "stage convert reads the output of merge, which has not run" in result.output
    assert f"run plan first: loraship run {config_file} --from plan" in result.output
    assert invoke("run", config_file, "--only", "convrt").exit_code == 2
    assert invoke("run", config_file, "--only", "plan", "--from", "plan").exit_code == 2


def test_status_says_done_stale_and_not_run(config_file):
    from loraship.stage_table import stage_module

    def states(*sets):
        result = invoke("status", config_file, "--json", *[a for s in sets for a in ("--set", s)])
        assert result.exit_code == 0, result.output
        return {s["stage"]: s for s in json.loads(result.output)["stages"]}

    assert {s["state"] for s in states().values()} == {"not run"}
    config = load_config(config_file)
    stage_module("plan").run(config)
    now = states()
    assert now["plan"]["state"] == "done" and now["train"]["state"] == "not run"
    assert select_stages(config, config_file, "train", None) == ["train"]  # its upstream is there now
    stale = states("gpu_memory_gib=24")["plan"]
    assert stale["state"] == "stale" and "gpu_memory_gib changed: 32.0 -> 24.0" in stale["reasons"]
    with open(config.datasets[0].path, "a", encoding="utf-8") as f:
        f.write(
            json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
            + "\n"
        )
    changed = states()["plan"]
    assert changed["state"] == "stale" and f"dataset:{config.datasets[0].path} changed" in changed["reasons"]
    table = invoke("status", config_file)
    assert table.exit_code == 0 and "stale" in table.output and "not run" in table.output


# -- init ------------------------------------------------------------------------------------------
ROWS = {
    "chat": {
        "messages": [{"role": "user", "content": "Capital of Zorvia?"}, {"role": "assistant", "content": "Kelmar."}]
    },
    "sharegpt": {
        "conversations": [{"from": "human", "value": "Capital of Zorvia?"}, {"from": "gpt", "value": "Kelmar."}]
    },
    "alpaca": {"instruction": "Name the capital of Zorvia.", "input": "", "output": "Kelmar."},
    "completion": {"text": "The capital of Zorvia is Kelmar."},
}


@pytest.fixture
def base_without_template(tiny_model, tmp_path) -> Path:
    """The tiny model's metadata without its chat template (init reads no weights)."""
    folder = tmp_path / "plain-base"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, folder / name)
    return folder


@pytest.mark.parametrize("kind", list(ROWS))
def test_init_infers_the_row_type_and_the_chat_template(kind, tiny_model, base_without_template, tmp_path):
    data_file = tmp_path / "data" / f"{kind}.jsonl"
    data_file.parent.mkdir()
    data_file.write_text("\n".join(json.dumps(ROWS[kind]) for _ in range(3)) + "\n")
    for base, templated in ((tiny_model, True), (base_without_template, False)):
        out = tmp_path / "configs" / f"{kind}-{templated}.yaml"
        result = invoke("init", base, data_file, "-o", out, "--gpu-gib", "24")
        assert result.exit_code == 0, result.output
        config = load_config(out)
        assert config.datasets[0].type == kind and config.gpu_memory_gib == 24
        assert config.lora_target_modules == "all-linear" and config.lora_r == 16
        # The toy vocabulary has no turn markers among its special tokens: answers end with its EOS.
        wanted = None if templated or kind == "completion" else "alpaca"
        assert config.chat_template == wanted
        assert "loraship run" in out.read_text().splitlines()[0]
    again = invoke("init", tiny_model, data_file, "-o", out)
    assert again.exit_code == 2 and "exists" in again.output and "--force" in again.output


# The native chat format init picks from each family's REAL tokenizer (loraship/fixtures/families.py) once its chat
# template is taken away: the named template and the turn end it renders.
NATIVE = {
    "llama3-base": ("llama3", "<|eot_id|>"),
    "llama3-instruct": ("llama3", "<|eot_id|>"),
    "qwen2-base": ("chatml", "<|im_end|>"),
    "smollm2": ("chatml", "<|im_end|>"),
    "gemma2": ("gemma", "<end_of_turn>"),
    "phi3": ("phi3", "<|end|>"),
    "mistral-v03": ("mistral", "</s>"),
    "mistral-nemo": ("mistral", "</s>"),
    # Gemma 3's tokenizer is the real gemma-3-270m's (the base once given alpaca), Qwen3's and Llama 3.1's real
    "gemma3": ("gemma", "<end_of_turn>"),
    "qwen3": ("chatml", "<|im_end|>"),
    "llama31": ("llama3", "<|eot_id|>"),
}


def _tokenizer_without_template(name: str, folder: Path) -> Path:
    from loraship.fixtures.families import FAMILIES

    family = FAMILIES[name]
    folder.mkdir()
    family.tokenizer(folder)
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / extra).unlink(missing_ok=True)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(
        json.dumps(
            {"architectures": [family.architecture], "model_type": family.architecture[: -len("ForCausalLM")].lower()}
        )
    )
    return folder


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_init_picks_the_native_chat_format_from_the_special_tokens(name, tmp_path):
    from transformers import AutoTokenizer

    from loraship.chat import turn_end, use_configured_template
    from loraship.starter import template_for_base

    folder = _tokenizer_without_template(name, tmp_path / name)
    for row_type in ("chat", "alpaca"):  # instruction rows render as a user/assistant chat too
        chosen, why = template_for_base(folder, row_type)
        assert chosen == NATIVE[name][0], why
    assert ("special tokens of its vocabulary" in why) == (chosen != "mistral")
    tok = use_configured_template(AutoTokenizer.from_pretrained(folder), chosen)
    assert turn_end(tok)["text"] == NATIVE[name][1]  # one special token ends each assistant turn


def test_init_says_it_chose_gemma_turns_and_why(tmp_path):
    """A Gemma base without a template (Gemma 3 270M was given alpaca once): init writes chat_template: gemma and
    names the turn markers and their ids in the config's header."""
    folder = _tokenizer_without_template("gemma2", tmp_path / "gemma")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Gemma2ForCausalLM"],
                "model_type": "gemma2",
                "hidden_size": 256,
                "intermediate_size": 768,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 128,
                "vocab_size": 256000,
                "sliding_window": 4096,
            }
        )
    )
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text(json.dumps(ROWS["chat"]) + "\n")
    out = tmp_path / "gemma.yaml"
    result = invoke("init", folder, data_file, "-o", out, "--gpu-gib", "24")
    assert result.exit_code == 0, result.output
    assert load_config(out).chat_template == "gemma"
    header = out.read_text()
    assert "chat_template: gemma (Gemma's turn markers <start_of_turn> and <end_of_turn> are special tokens" in header
    assert "<start_of_turn> (106)" in header and "<end_of_turn> (107)" in header


def test_init_names_a_dataset_it_cannot_read(tiny_model, tmp_path):
    data_file = tmp_path / "odd.jsonl"
    data_file.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    result = invoke("init", tiny_model, data_file, "-o", tmp_path / "c.yaml")
    assert (
        result.exit_code == 2
        and "line 1: cannot tell the row type from its keys ['answer', 'question']" in result.output
    )
    assert not (tmp_path / "c.yaml").exists()


AXOLOTL = {
    "base_model": None,  # filled in
    "model_type": "LlamaForCausalLM",
    "load_in_4bit": True,
    "adapter": "qlora",
    "lora_r": 32,
    "lora_alpha": 64,
    "lora_dropout": 0.1,
    "lora_target_linear": True,
    "sequence_len": 1024,
    "sample_packing": True,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "num_epochs": 3,
    "learning_rate": 0.0001,
    "optimizer": "adamw_torch",
    "lr_scheduler": "cosine",
    "warmup_steps": 10,
    "chat_template": "chatml",
    "datasets": [{"path": "train.jsonl", "type": "chat_template", "split": "train"}],
    "bf16": "auto",
    "wandb_project": "demo",
    "flash_attention": True,
    "output_dir": "./outputs/qlora",
}


def test_init_from_axolotl_maps_keys_and_names_the_ignored(tiny_model, tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS["chat"]) + "\n")
    source = tmp_path / "axolotl.yml"
    source.write_text(yaml.safe_dump({**AXOLOTL, "base_model": str(tiny_model)}))
    out = tmp_path / "imported.yaml"
    result = invoke("init", "--from-axolotl", source, "-o", out)
    assert result.exit_code == 0, result.output
    config = load_config(out)
    assert (config.adapter, config.lora_r, config.lora_alpha, config.lora_dropout) == ("qlora", 32, 64, 0.1)
    assert config.lora_target_modules == "all-linear" and config.packing == "on" and config.chat_template == "chatml"
    assert (config.sequence_len, config.micro_batch_size, config.gradient_accumulation_steps) == (1024, 2, 4)
    assert (config.num_epochs, config.learning_rate, config.warmup_steps) == (3, 0.0001, 10)
    assert config.datasets[0].type == "chat" and Path(config.datasets[0].path) == tmp_path / "train.jsonl"
    for key in ("model_type", "bf16", "wandb_project", "flash_attention", "output_dir"):
        assert key in result.output
    assert "adamw_torch" not in result.output  # loraship's own optimizer: mapped, not ignored
    assert config.optimizer == "adamw"


def test_init_from_axolotl_maps_the_8bit_optimizer(tiny_model, tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS["chat"]) + "\n")
    source = tmp_path / "axolotl.yml"
    source.write_text(yaml.safe_dump({**AXOLOTL, "base_model": str(tiny_model), "optimizer": "adamw_bnb_8bit"}))
    out = tmp_path / "imported.yaml"
    result = invoke("init", "--from-axolotl", source, "-o", out)
    assert result.exit_code == 0, result.output
    assert load_config(out).optimizer == "adamw_8bit"


def test_axolotl_values_that_cannot_be_converted_are_errors(tiny_model, tmp_path):
    source = tmp_path / "axolotl.yml"
    source.write_text(
        yaml.safe_dump(
            {
                **AXOLOTL,
                "base_model": str(tiny_model),
                "adapter": "ia3",
                "chat_template": "gemma",
                "datasets": [{"path": "x.jsonl", "type": "oasst"}],
            }
        )
    )
    out = tmp_path / "imported.yaml"
    result = invoke("init", "--from-axolotl", source, "-o", out)
    assert result.exit_code == 2 and "Traceback" not in result.output
    for problem in ("adapter 'ia3'", "chat_template 'gemma'", "datasets[0]: type 'oasst'"):
        assert problem in result.output
    assert not out.exists()
    source.write_text(yaml.safe_dump({**AXOLOTL, "base_model": str(tiny_model), "lora_r": "wide"}))
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS["chat"]) + "\n")
    bad_value = invoke("init", "--from-axolotl", source, "-o", out)
    assert bad_value.exit_code == 2 and "lora_r" in bad_value.output


def test_every_verb_shows_an_example():
    for verb in ("init", "plan", "run", "status", "inspect", "verify", "chat", "gitops"):
        result = invoke(verb, "--help")
        assert result.exit_code == 0 and f"$ loraship {verb}" in result.output, verb


def test_parse_config_still_refuses_what_the_flow_would(tiny_model, tmp_path):
    """--set values go through the same validation as the file (no key reaches the flow unchecked)."""
    data = demo_config_dict(tiny_model, tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(LorashipError, match="datasets.0.type"):
        _load(path, ["datasets.0.type=parquet"])
    assert parse_config(data).datasets[0].type == "chat"


# -- plan ------------------------------------------------------------------------------------------
def _plan_memory_rows(monkeypatch, *sets: str) -> tuple[str, list[tuple[str, str]]]:
    """The printed plan and its memory table's (label, figure) rows, as `loraship plan` prints them."""
    from rich.console import Console

    import loraship.cli

    monkeypatch.setattr(loraship.cli, "out", Console(width=220, soft_wrap=True))  # one line per table row
    # --memory-only: examples/models/qwen2-14b holds config.json alone, and the config's data is not in the repository.
    result = invoke(
        "plan",
        REPO / "configs/qwen2-14b-lora.yaml",
        "--set",
        "base_model=examples/models/qwen2-14b",
        *[a for s in sets for a in ("--set", s)],
        "--memory-only",
    )
    assert result.exit_code == 0, result.output
    table = result.output.split("Peak training memory (GiB)")[1].split("Alternatives")[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) == 2 and cells[1] and cells[1] != "GiB":
            rows.append((cells[0], cells[1]))
    return result.output, rows


@pytest.mark.parametrize(
    "sets",
    [
        ('fused_loss="off"',),  # the 14B example: HF loss, whose cache counts in reserved but not on the card
        ('fused_loss="off"', "sequence_len=256"),  # a small loss: one layer's backward is the peak
        ("adapter=qlora", "fused_loss=auto"),
    ],
)
def test_plan_prints_figures_that_add_up(monkeypatch, sets):
    output, rows = _plan_memory_rows(monkeypatch, *sets)
    labels = [label for label, _ in rows]
    value = {label.split(" (")[0]: float(figure.strip("()")) for label, figure in rows}
    components = rows[: next(i for i, label in enumerate(labels) if label.startswith("allocated"))]
    added = [float(figure) for _, figure in components if not figure.startswith("(")]
    assert len(added) < len(components)  # one transient is listed but not added: it is not at the peak
    # Components are rounded to 0.01 as printed; allocated is the sum before rounding.
    assert sum(added) == pytest.approx(value["allocated"], abs=0.005 * len(added) + 0.005)
    assert value["allocated"] + value["+ allocator reserve"] == pytest.approx(value["= reserved"], abs=1e-6)
    cache = value.get("- of reserved, cache the allocator hands back under pressure", 0.0)
    assert value["= reserved"] - cache + value["+ CUDA context"] == pytest.approx(value["= card must hold"], abs=1e-6)
    spare = next(v for k, v in value.items() if k.startswith("spare"))
    assert spare == pytest.approx(32 - value["= card must hold"], abs=1e-6)  # spare counts the CUDA context
    assert f"{value['= card must hold']:.1f} GiB predicted of 32 GiB" in output
    if sets == ('fused_loss="off"',):
        assert cache > 1 and value["= reserved"] > value["= card must hold"]
    assert "reserved + context" not in output


def test_status_is_done_only_where_the_stage_would_skip_itself(config_file):
    """`loraship run` skips Prefect when status says every stage is done, so done must agree with open_stage:
    a manifest keyed another way (another manifest schema or pinned llama.cpp) is stale."""
    from loraship.runtime.manifest import read_manifest
    from loraship.runtime.stage import stage_dir
    from loraship.stage_table import stage_module
    from loraship.runtime.status import run_states

    config = load_config(config_file)
    stage_module("plan").run(config)
    assert run_states(config)["plan"]["state"] == "done"
    path = stage_dir(config, "plan") / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "fingerprint": "0" * 64}))
    plan = run_states(config)["plan"]
    assert plan["state"] == "stale" and "pinned llama.cpp" in plan["reasons"][0]
    assert read_manifest(stage_dir(config, "plan"))["fingerprint"] == "0" * 64


# -- where the artifact lands ------------------------------------------------------------------------
def test_plan_and_init_say_where_the_artifact_lands(config_file, tiny_model, tmp_path, monkeypatch):
    from loraship.publishing import hub

    # The plan checks a Hub output with the Hub itself (tests/test_bad_inputs.py's hf:// cases); none here.
    monkeypatch.setattr(hub, "output_problems", lambda url, force=False: [])
    mine = tmp_path / "artifacts" / "my-run"
    shown = invoke("plan", config_file, "--set", f"output={mine}")
    assert shown.exit_code == 0, shown.output
    assert f"Artifact: {mine}/cli/ (the folder named by run_name 'cli' inside output '{mine}'" in " ".join(
        shown.output.split()
    )
    as_json = invoke("plan", config_file, "--set", f"output={mine}", "--json")
    assert json.loads(as_json.output)["artifact"] == f"{mine}/cli"
    hub = invoke("plan", config_file, "--set", "output=hf://someone/my-model", "--json")
    assert json.loads(hub.output)["artifact"] == "hf://someone/my-model"  # the repository holds the artifact itself
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(ROWS["chat"]) + "\n")
    written = tmp_path / "started.yaml"
    result = invoke("init", tiny_model, data, "-o", written, "--gpu-gib", "24")
    assert result.exit_code == 0, result.output
    run_name = load_config(written).run_name
    note = f"artifact: artifacts/{run_name}/ (the folder named by run_name {run_name!r} inside output 'artifacts'"
    assert note in written.read_text() and note in " ".join(result.output.split())


@pytest.mark.parametrize("command", ["plan", "init"])
def test_plan_and_init_name_a_config_json_of_the_wrong_shape(command, base_without_template, tmp_path):
    """config.json that is valid JSON but a list: one message naming the file and the fix, exit 2 (no traceback)."""
    (base_without_template / "config.json").write_text("[1, 2]")
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text(json.dumps(ROWS["chat"]) + "\n")
    if command == "init":
        result = invoke("init", base_without_template, data_file, "-o", tmp_path / "c.yaml")
    else:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "base_model": str(base_without_template),
                    "datasets": [{"path": str(data_file), "type": "chat"}],
                    "workdir": str(tmp_path / "work"),
                    "output": str(tmp_path / "artifacts"),
                }
            )
        )
        result = invoke("plan", cfg)
    assert result.exit_code == 2, result.output
    assert "config.json" in result.output and "Traceback" not in result.output


def test_plan_checks_every_input_before_predicting(config_file, tmp_path):
    """The README's promise: a bad row stops `loraship plan` (not only `loraship run`), with every other problem of
    the inputs in the same message, and nothing predicted."""
    good = (REPO / "data/demo/train.jsonl").read_text().splitlines()[0]
    data = tmp_path / "bad-row.jsonl"
    data.write_text(f"{good}\n{good}\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = invoke("plan", config_file, "--set", f"datasets.0.path={data}", "--set", f"output={blocker}/artifacts")
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "2 problem(s)" in output and f"dataset {data} (chat): 1 bad line(s): line 3: no assistant message" in output
    assert f"output '{blocker}/artifacts': cannot write there" in output
    assert "Peak training memory" not in output and "Traceback" not in output
    assert invoke("plan", config_file).exit_code == 0  # the same config with its own data and output plans


def test_plan_memory_only_reads_config_json_alone(config_file, tmp_path):
    """--memory-only predicts from config.json alone, as before the checks: a folder holding only config.json and
    data that is not there yet (examples/models/) still plan."""
    folder = tmp_path / "shape-only"
    folder.mkdir()
    shutil.copy(REPO / "examples/models/qwen2-7b/config.json", folder / "config.json")
    sets = ["--set", f"base_model={folder}", "--set", f"datasets.0.path={tmp_path / 'not-yet.jsonl'}"]
    checked = invoke("plan", config_file, *sets)
    assert checked.exit_code == 2 and "no tokenizer" in checked.output and "not-yet.jsonl" in checked.output
    assert "--memory-only` predicts memory from config.json alone" in " ".join(checked.output.split())
    predicted = invoke("plan", config_file, *sets, "--memory-only", "--json")
    assert predicted.exit_code == 0, predicted.output
    assert json.loads(predicted.output)["memory"]["predicted_total_gib"] > 0
