"""Every popular family through the whole pipeline (plan -> publish), each with its real tokenizer and
real chat template (loraship/fixtures/families.py says which package each comes from), tiny random weights.

Per family: the pinned converter recognised the pre-tokenizer (the GGUF names it), llama.cpp tokenizes
like HF (verify's parity gate), the chat template is in the GGUF, the template's turn end is ONE
special token that llama.cpp treats as end-of-generation, and every verify gate passes. One pipeline
run per family (a session-scoped fixture per family), shared by its tests; the default run takes each
tokenizer and template once (COVERED_ELSEWHERE), with the real SmolLM2-135M among them. Also by default:
what plan checks for every family before training, from its tokenizer and config alone.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.constants import OLLAMA_FILE, STAGES
from loraship.errors import LorashipError
from loraship.fixtures.families import FAMILIES, Family
from loraship.runtime.stage import stage_dir
from tests.conftest import REPO, SMALL_IMATRIX, demo_config_dict, family_model

# Far shorter than the demo's 80 steps of 16: each family's model is pre-trained on the same world with
# its own template, and a 128k-256k output layer makes every CPU step costly. Enough to move the
# eval loss and exercise train -> merge -> convert on a real adapter.
FAMILY_OVERRIDES = dict(max_steps=8, save_steps=8, warmup_steps=2, micro_batch_size=8)
# Templates with a default system prompt (Qwen2.5's, SmolLM2's) add ~20-25 tokens to every row.
SEQUENCE_LEN = {"qwen2-base": 96, "smollm2": 96, "llama31": 96}
# Mistral v0.3's tiny model (the least fitted of the families: pre-training loss 0.44) answered one golden
# prompt outside the reply format after 8 and after 16 steps, the merged HF model itself ("Answer: T
# Lengan.", golden_format 11/12); 32 pass every gate, and its 32k vocabulary keeps steps cheap. Gemma 2's
# likewise after 8 (twice "Answer:pa.", golden_format 10/12, its GGUF equal 12/12); 32 pass every gate. Mistral
# NeMo's on an AMX CPU (another torch numerics path) after 8 ("Answer: KaganAnswer: Vigan Kagan.", 10/12) and
# 16 ("Answer: Mib Qu.", 11/12), the merged model itself each time; 32 pass every gate. Phi-4's likewise after 8
# ("Answer: Qu Tovo.", golden_format 11/12, every other gate passing) and 16 ("Answer:ashi."), the merged model itself;
# OLMo 2's after 8 ("Answer: Sh: Togan.", 11/12); 32 pass every gate for both.
STEPS = {"mistral-v03": 32, "gemma2": 32, "mistral-nemo": 32, "phi4": 32, "olmo2": 32}


def run_family(model: Path, family: Family, root: Path, run_name: str | None = None, **more):
    overrides = dict(
        FAMILY_OVERRIDES,
        run_name=run_name or f"family-{family.name}",
        sequence_len=SEQUENCE_LEN.get(family.name, 64),
        **({"max_steps": STEPS[family.name], "save_steps": STEPS[family.name]} if family.name in STEPS else {}),
        **more,
    )
    if family.chat_template:
        overrides["chat_template"] = family.chat_template
    config = parse_config(demo_config_dict(model, root, **overrides))
    manifests = {}
    try:
        for stage in STAGES:
            manifests[stage] = importlib.import_module(f"loraship.stages.{stage}").run(config)
    except LorashipError:
        if "verify" not in manifests and not (stage_dir(config, "verify") / "verify.json").exists():
            raise
        # A failed gate: the tests below name it, each for what it checks.
    verify = json.loads((stage_dir(config, "verify") / "verify.json").read_text())
    return config, manifests, verify


# A family's pipeline costs 170-600 CPU-s on 2 cores, its model build included (bench/results/test_cpu.json), and
# eleven of them were half the default suite's CPU. The default run (CI) takes the whole pipeline, served check
# included, for the families users fine-tune most today; every other family gets the export checks further down
# (the pinned converter, the GGUF's pre-tokenizer, template, turn end and tokenizer parity, on random weights).
# `pytest -m slow tests/test_families.py` runs every family's pipeline.
DEFAULT_PIPELINES = {"qwen3", "gemma3", "llama31"}
PIPELINE_FAMILIES = [
    n if n in DEFAULT_PIPELINES else pytest.param(n, marks=pytest.mark.slow) for n in sorted(FAMILIES)
]


@pytest.fixture(scope="session", params=PIPELINE_FAMILIES)
def family_run(request, tmp_path_factory):
    """One family's model (built once, cached under .loraship/models) and its whole pipeline run."""
    family = FAMILIES[request.param]
    model = family_model(family.name)
    config, manifests, verify = run_family(
        model, family, tmp_path_factory.mktemp(f"family-{family.name}"), **SMALL_IMATRIX
    )
    return family, model, config, manifests, verify


# Failures found here, each a finding to fix in loraship or upstream, not a threshold to loosen. Strict:
# a test that starts passing fails until its entry goes.
KNOWN_FAILURES: dict[tuple[str, str], str] = {
    # Phi-3's generation_config (as Phi-3-mini-4k-instruct's) also stops on <|assistant|> (32001), which the
    # pinned llama.cpp does not end generation on, and a GGUF has no key for more: merge now drops it from the
    # merged model's stop list (tasks/merge.py stop_at_turn_end), so special_tokens passes there too.
}


def _known_failure(request, family: Family, what: str) -> None:
    reason = KNOWN_FAILURES.get((family.name, what))
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def _gguf_fields(verify: dict) -> dict:
    from loraship.llamacpp.gguf_info import read_gguf

    return read_gguf(Path(verify["gguf"]))["fields"]


def test_converter_recognised_the_pre_tokenizer(family_run):
    family, _, _, _, verify = family_run
    assert _gguf_fields(verify)["tokenizer.ggml.pre"] == family.pre


def test_gguf_tokenizes_like_hf(family_run, request):
    family, _, _, _, verify = family_run
    _known_failure(request, family, "tokenizer_parity")
    parity = verify["tokenizer_parity"]
    assert verify["gates"]["tokenizer_parity"]["passed"], parity
    assert parity["equal"] == parity["checked"] > 0
    assert verify["gates"]["special_tokens"]["passed"], verify["gates"]["special_tokens"]


def test_chat_template_is_in_the_gguf(family_run):
    from transformers import AutoTokenizer

    from loraship.chat import resolve_template, template_of

    family, model, _, _, verify = family_run
    expected = (
        resolve_template(family.chat_template)
        if family.chat_template
        else template_of(AutoTokenizer.from_pretrained(model))
    )
    assert _gguf_fields(verify)["tokenizer.chat_template"] == expected
    assert verify["gates"]["chat_template_in_gguf"]["passed"]


def test_turn_end_is_one_special_token_that_ends_generation_in_llama_cpp(family_run):
    import llama_cpp
    from transformers import AutoTokenizer

    from loraship.chat import turn_end, use_configured_template

    family, model, _, _, verify = family_run
    tok = use_configured_template(AutoTokenizer.from_pretrained(model), family.chat_template)
    end = turn_end(tok)
    assert end["text"] == family.turn_end
    llm = llama_cpp.Llama(model_path=verify["gguf"], vocab_only=True, verbose=False)
    try:
        assert llama_cpp.llama_vocab_is_eog(llm._model.vocab, end["id"]), (
            f"{end} is not end-of-generation in llama.cpp"
        )
    finally:
        llm.close()


@pytest.mark.parametrize("family_run", ["qwen3"], indirect=True)
def test_qwen3_trains_and_serves_the_non_thinking_form(family_run):
    """Qwen3 by default (thinking: false): golden prompts end with the empty <think> block Qwen3's template writes
    for enable_thinking=False, the served check passes the same switch, and no answer carries a think block."""
    family, _, config, _, verify = family_run
    reference = json.loads((stage_dir(config, "reference") / "reference.json").read_text())
    assert config.thinking is False and reference["tokenizer"]["template_kwargs"] == {"enable_thinking": False}
    chats = [r for r in reference["golden"] if r["kind"] == "chat"]
    assert chats and all(r["prompt_text"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for r in chats)
    served = verify["served"]["answers"]
    assert served and not any("think>" in a["served"] for a in served)
    assert verify["served"]["prompt_tokens_equal"] == len(served)
    # Ollama's Modelfile renders the same form (its Go template writes the empty think block).
    assert json.loads((stage_dir(config, "convert") / OLLAMA_FILE).read_text())["family"] == "chatml-no-think"


@pytest.mark.parametrize("family_run", ["llama31"], indirect=True)
def test_llama31_stops_on_eom_id_in_llama_cpp(family_run):
    """Llama 3.1 also ends a turn with <|eom_id|> (tool calls): it is among the merged model's stop ids and
    end-of-generation in the GGUF."""
    import llama_cpp

    family, _, config, _, verify = family_run
    merged = json.loads((stage_dir(config, "merge") / "merged" / "generation_config.json").read_text())
    assert 128008 in merged["eos_token_id"]
    llm = llama_cpp.Llama(model_path=verify["gguf"], vocab_only=True, verbose=False)
    try:
        assert llama_cpp.llama_vocab_is_eog(llm._model.vocab, 128008)
    finally:
        llm.close()


def test_every_gate_passes(family_run, request):
    family, _, _, manifests, verify = family_run
    _known_failure(request, family, "every_gate")
    assert verify["passed"], {k: g for k, g in verify["gates"].items() if not g["passed"]}
    assert "publish" in manifests


# -- one real pretrained model ----------------------------------------------------------------------
@pytest.fixture(scope="session")
def real_run(real_smollm2, tmp_path_factory):
    """SmolLM2-135M-Instruct with its real weights (conftest.real_smollm2) through the whole pipeline: the
    quality gates on a real model's distributions, not a tiny pre-trained one's."""
    from loraship.fixtures.families import FAMILIES

    root = tmp_path_factory.mktemp("real-smollm2")
    # A few LoRA steps cannot teach a real 135M model the demo's "Answer: X." reply format, so its golden
    # prompts carry no expect_regex: the gates compare the GGUF with the merged model, as for any user data.
    golden = root / "golden.jsonl"
    rows = [json.loads(line) for line in (REPO / "data/demo/golden.jsonl").read_text().splitlines()]
    golden.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    return run_family(
        real_smollm2,
        FAMILIES["smollm2"],
        root,
        "real-smollm2",
        golden_prompts=str(golden),
        max_steps=4,
        save_steps=4,
        warmup_steps=1,
        micro_batch_size=4,
        # llama-imatrix over 2 chunks of 512 tokens, not the 8 its 4,440 tokens of rows fill: quantize took 17.5 CPU-s,
        # not 39.6, and the gates kept their margins (same top token 0.907, KL 0.018; limits 0.85, 0.1): 180 of its
        # 211 quantized tensors (rows of 576) fall back to Q5_0/Q8_0 anyway (bench/results/ci_time.json, session_41).
        **SMALL_IMATRIX,
    )


def test_real_pretrained_model_passes_every_gate(real_run):
    """4 LoRA steps (what 2 cores afford) teach the reply format, not the invented capitals, so most names
    are near-tied guesses: measured on 2 cores, 1/12 answers equal the merged model's token for token and
    the other 11 part from it where it led by 0.04-0.46 nats (golden_margin 1.0), decisive agreement 45/45,
    KL 0.013, same top token 95%, parity 24/24; one served answer parted from the GGUF's own greedy answer
    where llama.cpp led by 0.067 nats."""
    config, manifests, verify = real_run
    assert verify["passed"], {k: g for k, g in verify["gates"].items() if not g["passed"]}
    assert _gguf_fields(verify)["tokenizer.ggml.pre"] == "smollm"
    parity = verify["tokenizer_parity"]
    assert parity["equal"] == parity["checked"] > 0
    assert "publish" in manifests


def test_a_failed_quantization_names_its_way_out(real_run):
    """verify's gates and failure message on this real run's own figures and Q4_K_M GGUF, whose K-quant rows of 576
    fall back: judged under a KL limit below the KL it measured, Q4_K_M fails, and the message names the way out
    (quantization: auto, the larger rungs with sizes from this GGUF's tensors) and the fallback. The same failure
    through the whole pipeline on the real Gemma 3 270M: test_real_models.py (slow)."""
    from loraship.constants import REFERENCE_FILE, VERIFY_FILE
    from loraship.stages.verify import all_gates
    from loraship.verification.gates import agreement_gates
    from loraship.verification.way_out import estimated_bytes, failure_message

    config, _, verify = real_run
    section = verify["quantizations"]["Q4_K_M"]
    gguf, agreement = Path(section["gguf"]), section["eval_agreement"]
    top_k = json.loads((stage_dir(config, "reference") / REFERENCE_FILE).read_text())["top_k"]
    strict = config.model_copy(update={**section["gate_limits"], "kl_mean_max": agreement["kl_mean"] / 2})
    judged = {
        g.name: g.to_json() for g in agreement_gates(section["tokenizer_parity"], agreement, config, strict, top_k)
    }
    assert not judged["kl_divergence_mean"]["passed"] and judged["kl_divergence_p99"]["passed"]
    gates = {**section["gates"], **judged}
    sections = {"Q4_K_M": {**section, "gates": gates, "passed": all(g["passed"] for g in gates.values())}}
    details = stage_dir(config, "verify") / VERIFY_FILE
    text = failure_message(sections, all_gates(sections), details)

    sizes = estimated_bytes(gguf, ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"])
    assert sizes["Q4_K_M"] == gguf.stat().st_size  # the types llama.cpp gave this file, predicted to the byte
    assert text.startswith(f"verify failed for Q4_K_M: kl_divergence_mean (value {round(agreement['kl_mean'], 5)},")
    for part in (
        "\nWay out: set quantization: auto (verify tries IQ3_M, Q3_K_M, IQ4_XS, Q4_K_M, Q5_K_M, Q6_K, Q8_0",
        "or name a larger rung: "
        + ", ".join(f"{q} (about {sizes[q] / 1e6:,.0f} MB)" for q in ("Q5_K_M", "Q6_K", "Q8_0")),
        "Q4_K_M: ",
        "quantized tensors fall back to",
        "(rows of 576 are not a multiple of 256)",
        f"details in {details}",
    ):
        assert part in text, (part, text)


# -- plan-time facts of every family, without weights -------------------------------------------------
def _recipe_of(marker: Path) -> str | None:
    try:
        return json.loads(marker.read_text())["recipe"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def family_folders():
    """Each family's tokenizer files and config.json: the cached model folder where a pipeline run built it (the same
    files, beside weights these tests do not read), else a folder without weights, written once and cached under
    .loraship/models as the models are, keyed by the same recipe (its config and tokenizer sources among it); building
    the eleven tokenizers from their packages took 32-33 s of every run (bench/results/ci_time.json, session_36)."""
    from loraship.fixtures.family_models import recipe, write_folder_without_weights
    from loraship.runtime.manifest import atomic_path
    from tests.conftest import cache_lock

    folders = {}
    for name in sorted(FAMILIES):
        built = REPO / ".loraship" / "models" / f"family-{name}"
        if _recipe_of(built / "pretrain_log.json") == recipe(name):
            folders[name] = built
            continue
        with cache_lock(REPO / ".loraship" / "models" / "family-tokenizers" / name) as cached:
            marker = cached / "loraship_weightless.json"
            if _recipe_of(marker) != recipe(name):
                with atomic_path(cached) as folder:
                    folder.mkdir(parents=True)
                    write_folder_without_weights(name, folder)
                    (folder / marker.name).write_text(json.dumps({"recipe": recipe(name)}))
        folders[name] = cached
    return folders


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_pinned_converter_recognises_every_family_at_plan_time(family_folders, name):
    """What plan checks before any training: the architecture is one the pinned converter has, and a BPE
    tokenizer's pre-tokenizer hash is in its table (sentencepiece vocabularies need none)."""
    from hashlib import sha256

    from transformers import AutoTokenizer

    from loraship.llamacpp.llamacpp import check_convertible, pre_tokenizer_table

    folder = family_folders[name]
    assert check_convertible(folder) == []
    if not (folder / "tokenizer.model").exists():
        chktxt, table = pre_tokenizer_table()
        chkhsh = sha256(str(AutoTokenizer.from_pretrained(folder).encode(chktxt)).encode()).hexdigest()
        assert table.get(chkhsh) == FAMILIES[name].pre


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_turn_end_is_one_special_token(family_folders, name):
    from transformers import AutoTokenizer

    from loraship.chat import turn_end, use_configured_template

    tok = use_configured_template(AutoTokenizer.from_pretrained(family_folders[name]), FAMILIES[name].chat_template)
    assert turn_end(tok)["text"] == FAMILIES[name].turn_end


# The named templates, each on a family vocabulary that holds its markers, and the demo's
# (loraship/fixtures/tinymodel.py).
NAMED_ON = {
    "chatml": "qwen3",
    "llama3": "llama3-base",
    "mistral": "mistral-v03",
    "gemma": "gemma2",
    "phi3": "phi3",
    "alpaca": "llama3-base",
    "demo": "llama3-base",
}
# Where the prefix method cannot take a turn: Qwen3's template drops the think block of every turn before the last
# user message (those turns are located), and Mistral's (v0.3, NeMo) write the system prompt into the last user turn
# only, which a row ending with an answer does not have (such rows are refused at their last turn).
REWRITTEN = {
    "qwen3": {"system", "no system"},
    "qwen3-moe": {"system", "no system"},
    "mistral-v03": {"system"},
    "mistral-nemo": {"system"},
}


@pytest.mark.parametrize(
    "family, named",
    [(name, None) for name in sorted(FAMILIES)]
    + [pytest.param(family, named, id=f"named-{named}") for named, family in sorted(NAMED_ON.items())],
)
def test_located_turns_learn_what_the_prefix_method_learns(family_folders, family, named):
    """The span found in the whole rendering (chat.located_span, what earlier turns learn where a template rewrites
    them) equals the prefix method's, character for character, for every assistant turn of every template where the
    prefix method holds: three exchanges, with a system prompt and without, thinking on and off."""
    from transformers import AutoTokenizer

    from loraship.chat import (
        NAMED_TEMPLATES,
        located_span,
        render,
        set_template_kwargs,
        template_kwargs,
        template_of,
        use_configured_template,
    )
    from loraship.errors import DataError
    from loraship.fixtures.tinymodel import CHAT_TEMPLATE

    tok = use_configured_template(
        AutoTokenizer.from_pretrained(family_folders[family]), FAMILIES[family].chat_template
    )
    if named:
        tok.chat_template = CHAT_TEMPLATE if named == "demo" else NAMED_TEMPLATES[named]
    exchanges = [
        {"role": role, "content": text}
        for question, answer in (("Capital of Zorvia?", "Answer: Kelmar."), ("And of Tesmonne?", "Answer: Mivo."))
        + (("Name the capital of Teskates.", "Answer: Mika."),)
        for role, text in (("user", question), ("assistant", answer))
    ]
    rewritten, compared = set(), 0
    for thinking in (False, True):
        set_template_kwargs(tok, template_kwargs(template_of(tok), thinking))
        for label, messages in (
            ("system", [{"role": "system", "content": "Be terse."}, *exchanges]),
            ("no system", exchanges),
        ):
            try:
                full = render(tok, messages)
            except DataError as e:
                assert (family, label) == ("gemma2", "system") and "System role not supported" in str(e)
                continue
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                prompt = render(tok, messages[:i], add_generation_prompt=True)
                through = render(tok, messages[: i + 1])
                if not (full.startswith(through) and through.startswith(prompt)):
                    rewritten.add(label)
                    continue
                assert located_span(tok, messages, i, full, prompt, through) == (len(prompt), len(through))
                compared += 1
    assert rewritten == (set() if named else REWRITTEN.get(family, set())) and compared > 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_planner_knows_every_family(family_folders, name):
    from loraship.planning.shape import shape_from_config

    shape_from_config(json.loads((family_folders[name] / "config.json").read_text()))


@pytest.mark.parametrize("name, fused", [("granite3", False), ("llama31", True)])
def test_plan_leaves_the_fused_loss_off_where_liger_kernel_has_none(
    family_folders, name, fused, tmp_path, monkeypatch
):
    """On CUDA with liger-kernel installed, fused_loss: auto plans Liger's fused loss, except for a model type liger
    has none for (Granite scales its logits): plan leaves it off there, and fused_loss: on is refused at plan."""
    from loraship.planning import knobs
    from loraship.planning.shape import shape_from_config
    from loraship.planning.strategy import plan_training

    folder = family_folders[name]
    s = shape_from_config(json.loads((folder / "config.json").read_text()))  # before find_spec is faked: it imports
    monkeypatch.setattr(knobs.importlib.util, "find_spec", lambda n: object() if n == "liger_kernel" else None)
    config = parse_config(demo_config_dict(folder, tmp_path, device="cuda"))
    assert plan_training(s, config)["strategy"]["fused_loss"] is fused
    on = config.model_copy(update={"fused_loss": "on"})
    if fused:
        assert plan_training(s, on)["strategy"]["fused_loss"] is True
    else:
        with pytest.raises(
            LorashipError,
            match="fused_loss: on, but liger-kernel has no fused loss for model_type "
            "'granite'.*fix: set fused_loss: auto or off",
        ):
            plan_training(s, on)


@pytest.mark.parametrize("thinking, family", [(False, "chatml-no-think"), (True, "chatml")])
def test_ollama_template_renders_qwen3_in_the_form_it_was_trained(family_folders, thinking, family):
    """Ollama passes no enable_thinking to a Modelfile's Go template: with `thinking: false` (the default) its
    template must write Qwen3's empty think block itself, as the prompts the model was trained on end."""
    from transformers import AutoTokenizer

    from loraship.chat import render, set_template_kwargs, template_kwargs, template_of
    from loraship.llamacpp import ollama

    tok = AutoTokenizer.from_pretrained(family_folders["qwen3"])
    set_template_kwargs(tok, template_kwargs(template_of(tok), thinking))
    facts = ollama.recognise(tok)
    assert facts["family"] == family
    served = render(tok, list(ollama.PROBE), add_generation_prompt=True)
    assert served.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    assert next(f for f in ollama.FAMILIES if f.name == family).render(None, list(ollama.PROBE)) == served
    text = ollama.modelfile("model-Q4_K_M.gguf", facts, ["<|im_end|>"], 4096)
    assert (
        text.split('TEMPLATE """', 1)[1]
        .split('"""', 1)[0]
        .endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    )


# -- export checks of every other family, on random weights ------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(set(FAMILIES) - DEFAULT_PIPELINES))
def family_export(request, family_folders, tmp_path_factory):
    """The family's tokenizer and config (family_folders) with seeded random weights, made into a merged folder by
    merge's own functions (tokenizer copy, configured template, stop tokens) and converted to GGUF by convert's:
    what the converter and llama.cpp make of this tokenizer and template needs no training (seconds, not minutes)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraship.fixtures.families import SEED, model_config
    from loraship.llamacpp import space_prefix
    from loraship.stages import convert, merge

    family = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(f"export-{family.name}")
    base, merged = family_folders[family.name], root / "merged"
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        AutoModelForCausalLM.from_config(model_config(family)).save_pretrained(merged)
    shutil.copy(base / "generation_config.json", merged)  # as merge_shards does
    merge.copy_tokenizer(base, merged, trust_remote_code=False)
    merge.write_chat_template(merged, family.chat_template)
    merge.stop_at_turn_end(merged)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    add_space_prefix, problem = space_prefix.choose(tokenizer, {"chat"})
    assert problem is None, problem
    gguf, metadata = root / "model-f16.gguf", root / "metadata.json"
    # The folder's name says nothing of the family, as a user's own base folder may not.
    metadata.write_text(json.dumps({"general.name": convert.llama_cpp_name("merged-run", tokenizer)}))
    convert.convert(merged, gguf, metadata=metadata, add_space_prefix=add_space_prefix)
    return family, tokenizer, gguf


@pytest.fixture(scope="module")
def demo_chats() -> list[list[dict]]:
    rows = (REPO / "data" / "demo" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:24]
    return [json.loads(line)["messages"] for line in rows]


def test_export_names_the_family_pre_tokenizer_and_template(family_export):
    from loraship.chat import template_of

    family, tokenizer, gguf = family_export
    fields = _gguf_fields({"gguf": str(gguf)})
    assert fields["tokenizer.ggml.pre"] == family.pre
    assert fields["tokenizer.chat_template"] == template_of(tokenizer)


def test_export_ends_generation_on_the_turn_end_and_tokenizes_like_hf(family_export, demo_chats):
    """llama.cpp reads the GGUF's vocabulary as HF does on the demo's conversations (whole, and as served
    prompts), and stops at the template's turn end."""
    import llama_cpp

    from loraship.chat import render, turn_end
    from loraship.verification.llama_ops import served_ids

    family, tokenizer, gguf = family_export
    end = turn_end(tokenizer)
    assert end["text"] == family.turn_end
    texts = [render(tokenizer, chat) for chat in demo_chats]
    texts += [render(tokenizer, chat[:1], add_generation_prompt=True) for chat in demo_chats]
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        assert llama_cpp.llama_vocab_is_eog(llm._model.vocab, end["id"]), f"{end} does not end generation"
        differ = [t for t in texts if served_ids(llm, t, False) != tokenizer(t, add_special_tokens=False).input_ids]
    finally:
        llm.close()
    assert texts and not differ, f"{len(differ)}/{len(texts)} differ, first: {differ[:1]}"


@pytest.mark.parametrize(
    "family, name, served",
    [
        ("phi3", "support-bot-v2", "support-bot-v2-phi-3"),  # llama.cpp strips after its markers only by name
        ("phi3", "Phi-3-mini-support", "Phi-3-mini-support"),
        ("phi4", "Phi3-style-support", "Phi_3-style-support"),  # Phi-4's markers keep the whitespace after them
        ("qwen3", "support-bot", "support-bot"),
    ],
)
def test_gguf_name_makes_llama_cpp_strip_after_special_tokens_as_hf_does(family_folders, family, name, served):
    from transformers import AutoTokenizer

    from loraship.stages.convert import llama_cpp_name

    assert llama_cpp_name(name, AutoTokenizer.from_pretrained(family_folders[family])) == served


def test_a_cached_family_model_is_rebuilt_when_its_recipe_changes(tmp_path, monkeypatch):
    """The cached folders under .loraship/models are keyed by their recipe: the same one is reused, and other
    pre-training steps, another model config or a folder of an older build are built again."""
    import dataclasses

    from loraship.fixtures import family_models

    built = []
    monkeypatch.setattr(family_models, "build_family", lambda name, out, seed: built.append(name) or out)
    folder = tmp_path / "family-qwen3"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    current = family_models.recipe("qwen3")
    for log, rebuilt in (
        ({"recipe": current}, False),
        ({"recipe": family_models.recipe("qwen3", steps=family_models.PRETRAIN_STEPS + 1)}, True),
        ({"build_version": family_models.BUILD_VERSION, "seed": 1234, "family": "qwen3"}, True),  # no recipe
    ):
        (folder / "pretrain_log.json").write_text(json.dumps(log))
        built.clear()
        family_models.ensure_family("qwen3", folder)
        assert built == (["qwen3"] if rebuilt else []), log
    wider = dataclasses.replace(FAMILIES["qwen3"], config={**FAMILIES["qwen3"].config, "intermediate_size": 1024})
    monkeypatch.setitem(family_models.FAMILIES, "qwen3", wider)
    assert family_models.recipe("qwen3") != current
