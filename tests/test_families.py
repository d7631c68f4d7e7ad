"""Every popular family through the whole pipeline (plan -> publish), each with its real tokenizer and
real chat template (loraship/fixtures/families.py says which package each comes from), tiny random weights.

Per family: the pinned converter recognised the pre-tokenizer (the GGUF names it), llama.cpp tokenizes
like HF (verify's parity gate), the chat template is in the GGUF, the template's turn end is ONE
special token that llama.cpp treats as end-of-generation, and every verify gate passes. One pipeline
run per family (a session-scoped fixture per family), shared by its tests; these are `slow`. In the
default run: what plan checks for every family before training, from its tokenizer and config alone.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from loraship.config import parse_config
from loraship.constants import STAGES
from loraship.errors import LorashipError
from loraship.fixtures.families import FAMILIES, Family
from loraship.runtime.stage import stage_dir
from tests.conftest import REPO, demo_config_dict

# Far shorter than the demo's 80 steps of 16: each family's model is pre-trained on the same world with
# its own template, and a 128k-256k output layer makes every CPU step costly. Enough to move the
# eval loss and exercise train -> merge -> convert on a real adapter.
FAMILY_OVERRIDES = dict(max_steps=8, save_steps=8, warmup_steps=2, micro_batch_size=8)
# Templates with a default system prompt (Qwen2.5's, SmolLM2's) add ~20-25 tokens to every row.
SEQUENCE_LEN = {"qwen2-base": 96, "smollm2": 96}


def run_family(model: Path, family: Family, root: Path, run_name: str | None = None, **more):
    overrides = dict(FAMILY_OVERRIDES, run_name=run_name or f"family-{family.name}", sequence_len=SEQUENCE_LEN.get(family.name, 64),
                     **more)
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


# A run costs minutes on 2 CPU cores (building the model, and the 128k-256k output layer in train, convert
# and quantize), past the default run's budget, so these are `slow`: `pytest -m slow tests/test_families.py`.
# The plan-time tests further down run by default.
PIPELINE_FAMILIES = [pytest.param(n, marks=pytest.mark.slow) for n in sorted(FAMILIES)]


@pytest.fixture(scope="session", params=PIPELINE_FAMILIES)
def family_run(request, tmp_path_factory):
    """One family's model (built once, cached under .loraship/models) and its whole pipeline run."""
    from loraship.fixtures.families import ensure_family

    family = FAMILIES[request.param]
    model = ensure_family(family.name, REPO / ".loraship" / "models" / f"family-{family.name}")
    config, manifests, verify = run_family(model, family, tmp_path_factory.mktemp(f"family-{family.name}"))
    return family, model, config, manifests, verify


# Failures found here, each a finding to fix in loraship or upstream, not a threshold to loosen. Strict:
# a test that starts passing fails until its entry goes.
KNOWN_FAILURES = {
    # Mistral 7B v0.3's sentencepiece (add_dummy_prefix) with transformers' legacy=False tokenizer: HF writes
    # "[INST] Do" as [INST] ▁Do, llama.cpp (llm_tokenizer_spm prefixes a space after every special token)
    # as [INST] ▁ ▁Do: 0 of 24 eval/golden texts tokenize alike, so the GGUF is served token sequences
    # the fine-tune never saw. verify refuses the artifact (tokenizer_parity), as it should.
    ("mistral-v03", "tokenizer_parity"): "llama.cpp adds a space after special tokens that HF (legacy=False) does not",
    ("mistral-v03", "every_gate"): "tokenizer_parity fails (above); golden answers then differ too",
    # Measured 2026-12-04: every other gate passes (parity 24/24, golden_match 0.83-0.92 >= 0.75, decisive
    # agreement 49/49-61/61), but `served` asks each of 12 answers to equal the reference while golden_match
    # lets 25% part at near-tied tokens: 11/12, 10/12, 10/12 served answers equal it.
    ("llama3-base", "every_gate"): "served requires 12/12 equal to reference; golden_match allows 0.75 (11/12 here)",
    ("smollm2", "every_gate"): "served requires 12/12 equal to reference; golden_match allows 0.75 (10/12 here)",
    ("mistral-nemo", "every_gate"): "served requires 12/12 equal to reference; golden_match allows 0.75 (10/12 here)",
    # Measured 2026-12-04: every other gate passes (parity 24/24, KL 0.00022, golden_match 12/12, decisive agreement
    # 56/56, served 12/12). The tiny fine-tuned Gemma 2 itself answers two golden prompts "Answer:pa." (margin 1.5
    # nats over " <name>"; the base answered "Answer: is Mivo." and "Answer:?" elsewhere), and the GGUF answers as
    # it does: the fixture model's format, not the pipeline's (its full-vocabulary loss is 1.86 nats against 0.18 on
    # the corpus's tokens, the most of any family: 255,800 untrained tied rows take most of the probability).
    ("gemma2", "every_gate"): "golden_format 10/12: the merged HF model answers 'Answer:pa.' twice; the GGUF equals it",
    # transformers 5.25 builds Phi-3's LlamaTokenizer from tokenizer_config's legacy: false (as Phi-3-mini's has it):
    # no "▁" after a special token, "<|user|>\nDo" -> <|user|> Do (the newline rstripped); llama.cpp's SPM
    # tokenizer prefixes a space after every special token (add_space_prefix; llama-vocab.cpp), <|user|> ▁Do, and
    # has no setting for "only at the start of the text": 0 of 24 eval/golden texts tokenize alike.
    ("phi3", "tokenizer_parity"): "llama.cpp adds a space after special tokens that HF (legacy=False) does not",
    # ...and Phi-3's generation_config stops on <|assistant|> (32001), which llama.cpp does not end generation on
    # (special_tokens), and served 10/12 equal to the GGUF's answer on HF's prompt ids: the server tokenizes itself.
    ("phi3", "every_gate"): "tokenizer_parity 0/24 (above), special_tokens (32001 not end-of-generation), served 10/12",
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
    expected = resolve_template(family.chat_template) if family.chat_template else template_of(AutoTokenizer.from_pretrained(model))
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
        assert llama_cpp.llama_vocab_is_eog(llm._model.vocab, end["id"]), f"{end} is not end-of-generation in llama.cpp"
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
    return run_family(real_smollm2, FAMILIES["smollm2"], root, "real-smollm2", golden_prompts=str(golden),
                      max_steps=4, save_steps=4, warmup_steps=1, micro_batch_size=4)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "measured 2026-12-04: 4 LoRA steps (all 2 cores afford) teach the format, not the capitals, so the "
    "names are near-tied guesses and free-running answers part at them: golden_match 1/12 and served 1/12 "
    "although golden_decisive_agreement is 45/45, KL 0.013, same top token 95%, parity 24/24"))
def test_real_pretrained_model_passes_every_gate(real_run):
    config, manifests, verify = real_run
    assert verify["passed"], {k: g for k, g in verify["gates"].items() if not g["passed"]}
    assert _gguf_fields(verify)["tokenizer.ggml.pre"] == "smollm"
    parity = verify["tokenizer_parity"]
    assert parity["equal"] == parity["checked"] > 0
    assert "publish" in manifests


# -- plan-time facts of every family, without weights -------------------------------------------------
@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    from loraship.fixtures.families import write_folder_without_weights

    root = tmp_path_factory.mktemp("family-tokenizers")
    folders = {}
    for name in sorted(FAMILIES):
        folders[name] = root / name
        folders[name].mkdir()
        write_folder_without_weights(name, folders[name])
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


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_planner_knows_every_family(family_folders, name):
    from loraship.planning.memory import parse_model_config

    parse_model_config(json.loads((family_folders[name] / "config.json").read_text()))
