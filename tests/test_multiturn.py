"""Multi-turn chat rows: every assistant turn is learned as a served model sees it, located in the one rendering
of the whole conversation by the model's own template. Qwen3's real template (loraship/fixtures/families.py) drops
the think block of every turn before the last user message, so its conversations are not prefixes of each other;
the learned text per turn and the token ids are checked against the template's own rendering."""

from __future__ import annotations

import json

import pytest

from loraship.errors import DataError

SYSTEM = {"role": "system", "content": "You are a terse geography assistant."}
U1 = {"role": "user", "content": "What is the capital of Zorvia?"}
A1 = {"role": "assistant", "content": "Answer: Kelmar."}
U2 = {"role": "user", "content": "And the capital of Tesmonne?"}
A2 = {"role": "assistant", "content": "Answer: Mivo."}
U3 = {"role": "user", "content": "Name the capital of Teskates."}
A3 = {"role": "assistant", "content": "Answer: Mika."}
REASONING = "The atlas lists Kelmar for Zorvia."
END = "<|im_end|>\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


def with_reasoning(message: dict, how: str, reasoning: str = REASONING) -> dict:
    if how == "content":
        return {**message, "content": f"<think>\n{reasoning}\n</think>\n\n{message['content']}"}
    return {**message, "reasoning_content": reasoning}


@pytest.fixture(scope="module")
def qwen3_tokenizers(tmp_path_factory) -> dict:
    """Qwen3's real tokenizer and template, per `thinking`, as train loads them (enable_thinking set)."""
    from transformers import AutoTokenizer

    from loraship.chat import set_template_kwargs, template_kwargs, template_of
    from loraship.fixtures.families import write_folder_without_weights

    folder = tmp_path_factory.mktemp("qwen3")
    write_folder_without_weights("qwen3", folder)
    tokenizers = {}
    for thinking in (False, True):
        tok = tokenizers[thinking] = AutoTokenizer.from_pretrained(folder)
        set_template_kwargs(tok, template_kwargs(template_of(tok), thinking))
    return tokenizers


def learned_runs(tok, messages: list[dict]) -> list[str]:
    """The learned text, one string per run of learned tokens; the ids must be the template's own rendering."""
    from loraship.chat import template_kwargs_of, tokenize_conversation

    ids, learn = tokenize_conversation(tok, messages)
    rendered = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **template_kwargs_of(tok))
    assert ids == list(rendered["input_ids"])
    runs, run = [], []
    for token, keep in zip(ids, learn):
        if keep:
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize(
    "messages, earlier",
    [
        pytest.param([SYSTEM, U1, A1, U2, A2], ["Answer: Kelmar."], id="system-2-exchanges"),
        pytest.param([SYSTEM, U1, A1, U2, A2, U3, A3], ["Answer: Kelmar.", "Answer: Mivo."], id="system-3-exchanges"),
        pytest.param([U1, A1, U2, A2], ["Answer: Kelmar."], id="no-system"),
        pytest.param(
            [SYSTEM, U1, with_reasoning(A1, "content"), U2, A2], ["Answer: Kelmar."], id="earlier-think-in-content"
        ),
        pytest.param(
            [SYSTEM, U1, with_reasoning(A1, "reasoning_content"), U2, A2],
            ["Answer: Kelmar."],
            id="earlier-reasoning_content",
        ),
        pytest.param(
            [SYSTEM, U1, with_reasoning(A1, "content"), U2, with_reasoning(A2, "reasoning_content"), U3, A3],
            ["Answer: Kelmar.", "Answer: Mivo."],
            id="both-earlier-turns-reasoning",
        ),
    ],
)
def test_qwen3_learns_every_turn_as_served(qwen3_tokenizers, thinking, messages, earlier):
    """Earlier turns are learned as the template renders them as history (content and turn end, never their
    reasoning); the last as the model writes it after the generation prompt: with thinking the empty think block is
    its own output and learned, without it the block ends the prompt and is not."""
    tok = qwen3_tokenizers[thinking]
    last = messages[-1]["content"] + END
    assert learned_runs(tok, messages) == [text + END for text in earlier] + [(EMPTY_THINK if thinking else "") + last]
    assert REASONING not in tok.apply_chat_template(messages, tokenize=False)  # history without reasoning


@pytest.mark.parametrize("how", ["content", "reasoning_content"])
def test_qwen3_with_thinking_learns_the_last_turns_reasoning(qwen3_tokenizers, how):
    tok = qwen3_tokenizers[True]
    messages = [SYSTEM, U1, with_reasoning(A1, how, "Earlier thoughts."), U2, with_reasoning(A2, how)]
    assert learned_runs(tok, messages) == [
        "Answer: Kelmar." + END,
        f"<think>\n{REASONING}\n</think>\n\nAnswer: Mivo." + END,
    ]


def test_the_prefix_method_still_learns_single_turn_rows(qwen3_tokenizers):
    # One exchange renders as prefixes: the fast path, learned as before.
    assert learned_runs(qwen3_tokenizers[False], [SYSTEM, U1, A1]) == ["Answer: Kelmar." + END]


# ChatML variants that rewrite earlier turns in ways no span can be located in, or the last turn unlike the generation
# prompt (on Qwen3's vocabulary, where <|im_end|> is one special token).
def _chatml(earlier_assistant: str, last_header: str = "assistant") -> str:
    return (
        "{% for m in messages %}"
        "{% if m.role == 'assistant' and not loop.last %}" + earlier_assistant + "{% elif m.role == 'assistant' %}"
        "<|im_start|>" + last_header + "\n{{ m.content }}<|im_end|>\n"
        "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


@pytest.mark.parametrize(
    "template, messages, match",
    [
        pytest.param(  # drops earlier assistant turns: nothing to learn them from
            _chatml(""),
            [U1, A1, U2, A2],
            r"does not render assistant message 1 \(messages\[1\]\) once .*rendered 0 times\); set `chat_template:` "
            r"to a named template \(alpaca, chatml, .*\{% generation %\}",
            id="drops-earlier-turns",
        ),
        pytest.param(  # writes an earlier turn twice: which copy is the turn is ambiguous
            _chatml("<|im_start|>assistant\n{{ m.content }}\n{{ m.content }}<|im_end|>\n"),
            [U1, A1, U2, A2],
            r"does not render assistant message 1 \(messages\[1\]\) once .*rendered 2 times",
            id="writes-earlier-turn-twice",
        ),
        # Text between an earlier turn and its end marker (the turn-end probe, without a system prompt, has none).
        pytest.param(
            _chatml(
                "<|im_start|>assistant\n{{ m.content }}{% if messages[0].role == 'system' %} (earlier){% endif %}"
                "<|im_end|>\n"
            ),
            [SYSTEM, U1, A1, U2, A2],
            r"assistant message 2 \(messages\[2\], 'Answer: Kelmar\.'\) is not followed by the turn end "
            r"'<\|im_end\|>' .*\(' \(earlier\)<\|im_end\|>",
            id="text-before-turn-end",
        ),
        pytest.param(  # the last turn under another header than the generation prompt's
            _chatml("<|im_start|>assistant\n{{ m.content }}<|im_end|>\n", last_header="model"),
            [U1, A1],
            r"otherwise than the prompt a served model answers with its last turn: at character \d+ the conversation "
            r"has 'model\\nAnswer: Kelmar\..*' where that prompt has 'assistant\\n'",
            id="last-turn-other-header",
        ),
        pytest.param(  # Qwen3's own template: reasoning the non-thinking form never writes
            None,
            [SYSTEM, U1, A1, U2, with_reasoning(A2, "content")],
            r"last assistant turn \(.<think>\\nThe atlas.*\) carries reasoning .*set `thinking: true` to train the "
            r"reasoning, or remove it",
            id="last-turn-think-in-content",
        ),
        pytest.param(
            None,
            [U1, with_reasoning(A1, "reasoning_content")],
            r"last assistant turn \(.Answer: Kelmar\..\) carries reasoning",
            id="last-turn-reasoning_content",
        ),
    ],
)
def test_turns_that_cannot_be_located_are_refused(qwen3_tokenizers, template, messages, match):
    from loraship.chat import tokenize_conversation

    tok = qwen3_tokenizers[False]  # thinking off, the default
    qwen3_template = tok.chat_template
    tok.chat_template = template or qwen3_template
    try:
        with pytest.raises(DataError, match=match):
            tokenize_conversation(tok, messages)
    finally:
        tok.chat_template = qwen3_template


def multi_turn_rows(src, n: int) -> list[dict]:
    """n rows of a system prompt and two exchanges, from the demo's single-exchange rows."""
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    return [{"messages": [SYSTEM, *rows[2 * k]["messages"], *rows[2 * k + 1]["messages"]]} for k in range(n)]


def test_a_qwen3_model_trains_on_multi_turn_rows(tmp_path):
    """The issue's data through plan and train on the tiny Qwen3 (its real template, thinking off): every row keeps
    both of its turns in the loss, and the adapter trains."""
    import loraship.stages.plan as plan
    import loraship.stages.train as train
    from loraship.config import parse_config
    from loraship.data import encoded_splits
    from loraship.runtime.stage import stage_dir
    from loraship.training.model_loading import load_tokenizer
    from tests.conftest import REPO, demo_config_dict, family_model

    model = family_model("qwen3")
    for split, n in (("train", 24), ("eval", 4)):
        rows = multi_turn_rows(REPO / "data" / "demo" / f"{split}.jsonl", n)
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config(
        demo_config_dict(
            model,
            tmp_path,
            run_name="qwen3-multiturn",
            datasets=[{"path": str(tmp_path / "train.jsonl"), "type": "chat"}],
            eval_datasets=[{"path": str(tmp_path / "eval.jsonl"), "type": "chat"}],
            sequence_len=96,
            max_steps=2,
            save_steps=2,
            warmup_steps=1,
            micro_batch_size=8,
        )
    )
    assert config.thinking is False
    plan.run(config)
    train.run(config)
    metrics = json.loads((stage_dir(config, "train") / "train_metrics.json").read_text())
    assert metrics["train_examples"] == 24 and metrics["truncated_examples"] == 0 and metrics["steps"] == 2
    assert 0 < metrics["eval_loss_after"] < 50
    tok = load_tokenizer(model, config)
    train_items, _eval_items = encoded_splits(config, tok)
    assert len(train_items) == 24
    for _kind, record in train_items:
        learned = tok.decode([t for t, k in zip(record["input_ids"], record["learn"]) if k])
        assert learned.count("<|im_end|>") == 2 and "<think>" not in learned and SYSTEM["content"] not in learned


def test_a_row_the_template_cannot_split_stops_the_plan_naming_it(tmp_path):
    """Every row is tokenized at plan as train will (Qwen3's enable_thinking set from `thinking`): a fifth row whose
    last turn carries reasoning under `thinking: false` stops `loraship plan`, naming the dataset and the row."""
    from loraship.config import parse_config
    from loraship.errors import ConfigError
    from loraship.planning.preflight import check_inputs
    from tests.conftest import REPO, demo_config_dict, family_model

    model = family_model("qwen3")
    rows = multi_turn_rows(REPO / "data" / "demo" / "train.jsonl", 24)
    rows[4]["messages"][-1] = with_reasoning(rows[4]["messages"][-1], "content")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config(
        demo_config_dict(
            model,
            tmp_path,
            run_name="qwen3-bad-row",
            datasets=[{"path": str(tmp_path / "train.jsonl"), "type": "chat"}],
        )
    )
    with pytest.raises(ConfigError) as caught:
        check_inputs(config)
    message = str(caught.value)
    assert "datasets[0]" in message and "row 5:" in message and "set `thinking: true`" in message, message
    rows[4]["messages"][-1] = A2
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_inputs(config)  # the same rows without the reasoning plan
