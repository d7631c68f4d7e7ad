"""The artifact people expect: a GGUF named after the run, an Ollama Modelfile whose template
renders what the model was trained on, and a model card with the commands and the figures."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from loraship.llamacpp import ollama
from loraship.chat import NAMED_TEMPLATES
from loraship.constants import (
    GENERATION_CONFIG_FILE,
    LOSS_PLOT_FILE,
    MANIFEST_NAME,
    MEMORY_PLOT_FILE,
    MODEL_CARD,
    MODELFILE,
    PLAN_FILE,
    VERIFY_FILE,
    quantized_gguf_name,
)
from loraship.runtime.stage import stage_dir
from loraship.sampling import GREEDY

# Real checkpoints' templates (tokenizer_config.json), written out so the tests need no download.
QWEN2_INSTRUCT = (  # Qwen/Qwen2-7B-Instruct: a default system prompt when none is given
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_INSTRUCT = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA31_DATED = (  # Llama 3.1's shape: a dated system header in front of any system prompt
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\\n\\n"
    "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n"
    "{{ system }}<|eot_id|>{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\\n\\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\\n\\n{% endif %}"
)
MISTRAL_V03 = (  # mistralai/Mistral-7B-Instruct-v0.3 without its tool branches
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
MISTRAL_V01 = (  # mistralai/Mistral-7B-Instruct-v0.1: no system role at all
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# (case, tokenizer, template or None for the tokenizer's own, family, default system prompt)
CASES = [
    ("qwen2.5", "qwen", None, "chatml", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    ("qwen2", "qwen", QWEN2_INSTRUCT, "chatml", "You are a helpful assistant."),
    ("named chatml", "qwen", NAMED_TEMPLATES["chatml"], "chatml", None),
    ("llama3", "llama", LLAMA3_INSTRUCT, "llama3", None),
    ("named llama3", "llama", NAMED_TEMPLATES["llama3"], "llama3", None),
    ("mistral v0.3", "llama", MISTRAL_V03, "mistral", None),
    ("mistral v0.1", "llama", MISTRAL_V01, "mistral-legacy", None),
    ("named mistral", "llama", NAMED_TEMPLATES["mistral"], "mistral-legacy", None),
    ("llama 3.1 dated system header", "llama", LLAMA31_DATED, None, None),
    ("alpaca", "llama", NAMED_TEMPLATES["alpaca"], None, None),
    ("tiny-llama's own", "llama", None, None, None),
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Zorvia?"}],
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Answer: 1."},
        {"role": "user", "content": "Two"},
        {"role": "assistant", "content": "Answer: 2."},
        {"role": "user", "content": "Three"},
    ],
    [
        {"role": "system", "content": "Be brief.\nVery brief."},
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Answer: 1."},
        {"role": "user", "content": "Two"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers(tiny_model, tmp_path_factory):
    from transformers import AutoTokenizer

    from loraship.fixtures.tinyqwen import write_tokenizer

    qwen = tmp_path_factory.mktemp("qwen-tokenizer")
    write_tokenizer(qwen)  # Qwen's real vocabulary and Qwen2.5-Instruct's tokenizer files and template
    return {"qwen": qwen, "llama": tiny_model}, AutoTokenizer


def tokenizer_for(tokenizers, kind: str, template: str | None):
    paths, auto = tokenizers
    tokenizer = auto.from_pretrained(paths[kind])
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("case,kind,template,family,system", CASES, ids=[c[0] for c in CASES])
def test_template_family_is_recognised_by_rendering(tokenizers, case, kind, template, family, system):
    facts = ollama.recognise(tokenizer_for(tokenizers, kind, template))
    assert facts["family"] == family, facts
    if family is None:
        assert facts["reason"]
    else:
        assert facts["system"] == system


def _hf_prompt(tokenizer, messages) -> str | None:
    """transformers' rendering with the generation prompt, BOS text removed (a runtime adds it as a token)."""
    return ollama._rendered(tokenizer, messages)


def _go_binary(tmp: Path) -> Path:
    """A Go program that executes a template as Ollama's template.Execute does for `.Messages`
    templates: System = the system messages joined, Messages = every message, system ones included."""
    (tmp / "main.go").write_text(
        """package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type Message struct {
	Role    string
	Content string
}

func main() {
	var in struct {
		Template string
		Cases    [][]Message
	}
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	t := template.Must(template.New("").Option("missingkey=zero").Parse(in.Template))
	out := []string{}
	for _, messages := range in.Cases {
		var system []string
		for _, m := range messages {
			if m.Role == "system" {
				system = append(system, m.Content)
			}
		}
		var b strings.Builder
		values := map[string]any{"System": strings.Join(system, "\\n\\n"), "Messages": messages, "Response": ""}
		if err := t.Execute(&b, values); err != nil {
			panic(err)
		}
		out = append(out, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
""",
        encoding="utf-8",
    )
    (tmp / "go.mod").write_text("module gotmpl\n\ngo 1.18\n", encoding="utf-8")
    subprocess.run(["go", "build", "-o", "gotmpl", "."], cwd=tmp, check=True, capture_output=True, timeout=300)
    return tmp / "gotmpl"


def _go_render(binary: Path, template: str, conversations: list[list[dict]]) -> list[str]:
    cases = [[{"Role": m["role"], "Content": m["content"]} for m in c] for c in conversations]
    done = subprocess.run(
        [str(binary)],
        input=json.dumps({"Template": template, "Cases": cases}),
        text=True,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return json.loads(done.stdout)


def test_go_templates_render_what_the_model_was_trained_on(tokenizers, tmp_path):
    """Every recognised template, run through Go's text/template as Ollama runs it (the Modelfile's
    SYSTEM arriving as a system message when the conversation has none), renders exactly what
    transformers renders with the model's own template. CI installs Go (.ci/run), so there it never skips."""
    if shutil.which("go") is None:
        if os.environ.get("CI"):
            pytest.fail("no Go toolchain in CI: .ci/run installs Debian's golang-go; this check must not skip there")
        pytest.skip("needs a Go toolchain to run Ollama's text/template (apt-get install golang-go)")
    binary = _go_binary(tmp_path)
    for case, kind, template, family, _system in CASES:
        if family is None:
            continue
        tokenizer = tokenizer_for(tokenizers, kind, template)
        facts = ollama.recognise(tokenizer)
        conversations = [c for c in CONVERSATIONS if _hf_prompt(tokenizer, c) is not None]
        as_ollama = [
            c
            if c[0]["role"] == "system" or not facts["system"]
            else [{"role": "system", "content": facts["system"]}, *c]
            for c in conversations
        ]
        go = _go_render(binary, facts["template"], as_ollama)
        for conversation, rendered in zip(conversations, go):
            assert rendered == _hf_prompt(tokenizer, conversation), (case, conversation)
        assert len(conversations) >= 2, case


def test_modelfile_of_a_recognised_family(tokenizers):
    facts = ollama.recognise(tokenizer_for(tokenizers, "qwen", None))
    text = ollama.modelfile("model-Q4_K_M.gguf", facts, ["<|im_end|>", "<|endoftext|>"], 4096)
    lines = text.splitlines()
    assert lines[0] == "FROM ./model-Q4_K_M.gguf"
    assert "PARAMETER num_ctx 4096" in lines
    stops = [line for line in lines if line.startswith("PARAMETER stop ")]
    assert stops == ['PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|endoftext|>"', 'PARAMETER stop "<|im_start|>"']
    # The settings verify served it with: Ollama's own defaults (temperature 0.8, repeat_penalty 1.1) answer otherwise.
    settings = [
        line
        for line in lines
        if line.startswith("PARAMETER ") and not line.startswith(("PARAMETER stop ", "PARAMETER num_ctx "))
    ]
    assert settings == [
        "PARAMETER temperature 0",
        "PARAMETER top_k 0",
        "PARAMETER top_p 1",
        "PARAMETER min_p 0",
        "PARAMETER repeat_penalty 1",
        "PARAMETER presence_penalty 0",
        "PARAMETER frequency_penalty 0",
    ]
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    assert template == facts["template"]
    assert 'SYSTEM """You are Qwen, created by Alibaba Cloud. You are a helpful assistant."""' in lines


def test_gguf_is_named_after_the_run_and_its_base(pipeline_run):
    from gguf import Keys

    from loraship.llamacpp.gguf_info import open_gguf

    config, _ = pipeline_run
    shipped = Path(config.output) / config.run_name / quantized_gguf_name(config.primary_quantization)
    fields = open_gguf(shipped).fields
    value = {key: fields[key].contents() for key in fields if key.startswith("general.")}
    base = Path(config.base_model).name
    assert value[Keys.General.NAME] == f"{base}-{config.run_name}" != "merged"
    assert value[Keys.General.BASENAME] == base
    assert value[Keys.General.FINETUNE] == config.run_name
    assert value[Keys.General.BASE_MODEL_NAME.format(id=0)] == base


def test_published_modelfile_and_card(pipeline_run):
    from huggingface_hub import ModelCard

    config, manifests = pipeline_run
    root = Path(config.output) / config.run_name
    gguf = quantized_gguf_name(config.primary_quantization)
    modelfile = (root / MODELFILE).read_text(encoding="utf-8").splitlines()
    assert modelfile[0] == f"FROM ./{gguf}" and (root / gguf).is_file()
    assert 'PARAMETER stop "</s>"' in modelfile  # the tiny Llama's EOS, the stop id verify checked
    assert f"PARAMETER num_ctx {config.target_context}" in modelfile
    # The tiny model's template is its own (<|user|> ...): no TEMPLATE, and the card says why.
    assert not any(line.startswith(("TEMPLATE", "SYSTEM")) for line in modelfile)

    card = ModelCard.load(root / MODEL_CARD)
    assert {"gguf", *config.quantizations}.issubset(card.data.tags)
    assert card.data.pipeline_tag == "text-generation" and card.data.library_name == "gguf"
    assert card.data.base_model is None  # a local folder is no Hub id
    assert (
        f"llama-server -m {gguf} --jinja -c {config.target_context} -ngl 999 --temp 0 --top-k 0 --top-p 1 --min-p 0 "
        "--repeat-penalty 1 --presence-penalty 0 --frequency-penalty 0"
    ) in card.text
    assert "PARAMETER repeat_penalty 1" in modelfile and "PARAMETER temperature 0" in modelfile
    assert "`repeat_penalty` 1.1" in card.text and '`extra_body={"repeat_penalty": 1.0}`' in card.text
    assert f"ollama create {config.run_name} -f {MODELFILE}" in card.text
    assert "Ollama will use the GGUF's template" in card.text
    assert manifests["train"]["metrics"]["trained_as"] in card.text
    verify = json.loads((root / VERIFY_FILE).read_text(encoding="utf-8"))
    for name, gate in verify["gates"].items():
        assert f"| {name} | {'pass' if gate['passed'] else 'FAIL'} |" in card.text
    manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    published = manifest["files"]
    assert {MODELFILE, MODEL_CARD, GENERATION_CONFIG_FILE}.issubset(published)
    # The decoding verify served the GGUF with, recorded in verify.json and the manifest, in every shipped form.
    assert manifest["sampling"] == verify["sampling"] == verify["served"]["sampling"] == GREEDY.record()
    defaults = verify["served"]["server_defaults"]
    assert f"{defaults['differ_from_gguf_greedy']} of {defaults['requests']} answers differed" in card.text
    generation = json.loads((root / GENERATION_CONFIG_FILE).read_text(encoding="utf-8"))
    assert generation["do_sample"] is False and generation["repetition_penalty"] == 1.0
    merged = json.loads((stage_dir(config, "merge") / "merged" / GENERATION_CONFIG_FILE).read_text(encoding="utf-8"))
    assert generation == merged and generation["eos_token_id"]  # the merged model's stop tokens, the same settings
    # The train stage's pictures ship beside the GGUF and the card shows them.
    for picture in (LOSS_PLOT_FILE, MEMORY_PLOT_FILE):
        assert picture in published and (root / picture).read_bytes().startswith(b"\x89PNG")
        assert f"]({picture})" in card.text


def test_card_of_a_hub_base_that_fell_back_to_qlora_and_does_not_fit_whole(pipeline_run):
    """From the run's real manifests, changed as a GPU run that re-planned would have them."""
    from huggingface_hub import ModelCard

    from loraship.stages.publish import model_card

    config, manifests = pipeline_run
    config = config.model_copy(update={"base_model": "Qwen/Qwen2-7B-Instruct"})
    manifests = copy.deepcopy(manifests)
    train = manifests["train"]["metrics"]
    train["strategy"] = {**train["strategy"], "adapter": "qlora"}
    train["trained_as"] = "QLoRA (NF4 base), micro-batch 2 x 8 accumulation, fused loss, gradient checkpointing on"
    train["strategy_reason"] = "bf16 LoRA needs 41.2 GiB of 32 GiB; QLoRA fits: 24.7 GiB"
    train["measured_memory"] = {"peak_reserved_gib": 25.12, "peak_allocated_gib": 21.3}
    verify = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text(encoding="utf-8"))
    verify["memory"] = {**verify["memory"], "fits": False, "gpu_layers_at_target_context": 21}
    plan = json.loads((stage_dir(config, "plan") / PLAN_FILE).read_text(encoding="utf-8"))
    facts = {
        "family": "chatml",
        "template": ollama.FAMILIES[0].go_template,
        "system": "You are a helpful assistant.",
        "stop_tokens": ["<|im_end|>", "<|endoftext|>"],
    }
    metadata = {"general.name": "Qwen2-7B-Instruct-pipeline", "general.license": "apache-2.0"}
    card = ModelCard(model_card(config, manifests, verify, plan, facts, metadata))
    assert card.data.base_model == "Qwen/Qwen2-7B-Instruct" and card.data.license == "apache-2.0"
    assert "qlora" in card.data.tags and "QLoRA adapter" in card.text
    assert train["trained_as"] in card.text and train["strategy_reason"] in card.text
    assert "peak reserved 25.12 GiB" in card.text
    assert f"-c {config.target_context} -ngl 21" in card.text
    assert "chatml family" in card.text and "`<|im_end|>`" in card.text


def test_license_comes_from_the_base_models_card(tmp_path):
    from loraship.config import parse_config
    from loraship.stages.convert import gguf_metadata

    base = tmp_path / "my-base"
    base.mkdir()
    config = parse_config(
        {"base_model": str(base), "run_name": "support-bot", "datasets": [{"path": "x", "type": "chat"}]}
    )
    assert "general.license" not in gguf_metadata(config, None)  # no card: no license claimed
    (base / "README.md").write_text("---\nlicense: apache-2.0\ntags: [text]\n---\n\n# My base\n", encoding="utf-8")
    metadata = gguf_metadata(config, None)
    assert metadata["general.license"] == "apache-2.0"
    assert metadata["general.name"] == "my-base-support-bot" and metadata["general.finetune"] == "support-bot"


def test_a_run_trained_before_its_pictures_publishes_without_them():
    from loraship.stages.publish import shipped_pictures

    assert shipped_pictures({"outputs": {"adapter/adapter_model.safetensors": {}}}) == []
    assert shipped_pictures({"outputs": {LOSS_PLOT_FILE: {}, MEMORY_PLOT_FILE: {}}}) == [
        LOSS_PLOT_FILE,
        MEMORY_PLOT_FILE,
    ]
