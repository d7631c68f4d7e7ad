"""The served check (loraship/llamacpp/served.py): llama.cpp's OpenAI-compatible server on the shipped GGUF,
asked by the official `openai` client; a taken port is retried, and the server never outlives the check."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from loraship.config import Config
from loraship.constants import REFERENCE_FILE, VERIFY_FILE
from loraship.runtime.stage import stage_dir

# The gates' defaults, with one golden chat enough evidence for the one prompt served below.
_CONFIG = Config.model_construct(**{name: f.default for name, f in Config.model_fields.items()}).model_copy(
    update={"min_golden_prompts": 1}
)


@pytest.fixture(scope="module")
def shipped(pipeline_run):
    config, _ = pipeline_run
    verify = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text())
    reference = json.loads((stage_dir(config, "reference") / REFERENCE_FILE).read_text())
    chats = [r for r in reference["golden"] if r["kind"] == "chat"]
    return Path(verify["gguf"]), chats, reference["tokenizer"]["markers"], config


def test_demo_verify_serves_every_golden_chat(pipeline_run):
    config, _ = pipeline_run
    verify = json.loads((stage_dir(config, "verify") / VERIFY_FILE).read_text())
    served = verify["served"]
    assert verify["gates"]["served"]["passed"] and served["requests"] == 12
    assert served["finished_by_stop"] == served["streamed_equal"] == 12
    assert served["equal_to_gguf_greedy"] == 12  # the server changed nothing the GGUF says outside it
    # Asked with the shipped settings; the server's defaults asked once more and reported beside them, not gated.
    assert served["sampling"] == verify["sampling"] and served["server_defaults"]["requests"] == 12
    assert served["server_defaults"]["settings"]["repeat_penalty"] == 1.1
    assert all("server_defaults" in a for a in served["answers"])
    # The server answers what the GGUF answers (above); the merged model's answer where the quantized GGUF's is
    # too: where it parts from it, only at a near-tie, which golden_match judges and the served gate does not re-judge.
    chats = [a for a in verify["golden_answers"] if a["kind"] == "chat"]
    assert len(chats) == 12 and all(a["match"] or a["parted_at_near_tie"] for a in chats)
    # Most answers are the merged model's token for token; which near-ties fall the other way moves with the
    # platform's float rounding (10 or 12 of 12 seen with different torch/transformers builds).
    assert served["equal_to_reference"] == sum(a["match"] for a in chats) >= 10
    assert served["prompt_tokens_equal"] == 12  # the server rendered the GGUF's template into HF's prompt


def test_a_taken_port_is_retried_and_the_server_is_stopped_on_failure(shipped, tmp_path, monkeypatch):
    from loraship.llamacpp import served

    gguf, chats, markers, _config = shipped
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    first = iter([taken_port])
    real_free_port = served.free_port
    monkeypatch.setattr(served, "free_port", lambda: next(first, None) or real_free_port())
    started = []
    real_start = served.start_server

    def remember(*args):
        started.append(real_start(*args))
        return started[-1]

    def broken_client(*args, **kwargs):
        raise RuntimeError("client broke")

    monkeypatch.setattr(served, "start_server", remember)
    monkeypatch.setattr(served, "ask", broken_client)
    try:
        with pytest.raises(RuntimeError, match="client broke"):
            served.served_check(gguf, chats[:1], 8, 256, 0, 1, markers, tmp_path / "server.log")
    finally:
        taken.close()
    ((proc, port, _command),) = started
    assert port != taken_port
    assert (
        "address already in use" in (tmp_path / "server.log").read_text().lower()
    )  # the first try hit the taken port
    assert proc.poll() is not None  # stopped although the check failed


# -- the sampling settings a request carries (no server: the openai client's request body, intercepted) ---------
def _intercepting_client(bodies: list[dict]):
    import httpx
    from openai import OpenAI

    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "loraship",
        "choices": [{"index": 0, "delta": {"content": "Answer"}, "finish_reason": "stop"}],
    }
    whole = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "loraship",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Answer"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }

    def handler(request):
        body = json.loads(request.content)
        bodies.append(body)
        if body.get("stream"):
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
            )
        return httpx.Response(200, json=whole)

    return OpenAI(
        base_url="http://127.0.0.1:9/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )


def test_every_request_carries_the_shipped_settings_and_the_server_reads_them():
    from llama_cpp.server.types import CreateChatCompletionRequest

    from loraship.llamacpp.served import ask, server_defaults
    from loraship.sampling import GREEDY

    bodies: list[dict] = []
    client = _intercepting_client(bodies)
    messages = [{"role": "user", "content": "Capital of Czechia, as JSON?"}]
    assert ask(client, messages, 8, stream=False)["content"] == "Answer"
    assert ask(client, messages, 8, stream=True) == {"content": "Answer", "finish_reason": "stop"}
    assert ask(client, messages, 8, stream=False, sampling=None)["finish_reason"] == "stop"
    shipped, streamed, default = bodies
    for body in (shipped, streamed):
        assert {k: body[k] for k in GREEDY.record()} == GREEDY.record()  # every setting, extra_body's in the body
        # llama-cpp-python's server parses them as its own fields (an unknown key would be dropped silently).
        parsed = CreateChatCompletionRequest(**body)
        assert {k: getattr(parsed, k) for k in GREEDY.record()} == GREEDY.record()
    # The plain OpenAI request sends none of llama.cpp's settings: the server's defaults decide them.
    assert default["temperature"] == 0 and not {"repeat_penalty", "top_k", "min_p"} & set(default)
    assert CreateChatCompletionRequest(**default).repeat_penalty == server_defaults()["repeat_penalty"] == 1.1


def test_the_merged_models_lead_is_named_only_where_the_gguf_answered_as_it():
    from loraship.llamacpp.served import merged_lead

    record = {"margins": [3.0, 1.71, 0.4], "gguf_match": True}
    assert merged_lead(record, 1) == 1.71 and merged_lead(record, None) is None and merged_lead(record, 3) is None
    assert merged_lead({**record, "gguf_match": False}, 1) is None  # another prefix: the margins are not its


# -- a real instruct model whose right answer repeats the question: SmolLM2-135M-Instruct's own GGUF ---------------
# Asked for JSON that echoes the country, its greedy answer names Czechia twice; llama-cpp-python's server with its
# default repeat_penalty 1.1 answers "Kyiv" for the capital (issue #34's case, on the model the tests already ship).
REPEATING_PROMPT = 'Reply with only JSON: {"country": <the country>, "capital": <its capital>}. Country: Czechia'


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """The GGUF's own greedy answer (verify's argmax decoding, outside the server) to REPEATING_PROMPT, and the
    served check's report on it."""
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from loraship.fixtures.families import smollm2_gguf
    from loraship.llamacpp.served import served_check
    from loraship.verification.llama_ops import greedy, is_eog

    gguf = smollm2_gguf()
    llm = Llama(model_path=str(gguf), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    # The prompt as the server renders it: the GGUF's Jinja template, BOS and markers as text.
    formatter = Jinja2ChatFormatter(
        template=llm.metadata["tokenizer.chat_template"],
        eos_token=llm.detokenize([llm.token_eos()]).decode(),
        bos_token=llm.detokenize([llm.token_bos()]).decode(),
    )
    messages = [{"role": "user", "content": REPEATING_PROMPT}]
    prompt_ids = llm.tokenize(formatter(messages=messages).prompt.encode(), add_bos=False, special=True)
    leads: list[float] = []
    answer, stop, _ = greedy(llm, prompt_ids, 24, {t for t in range(llm.n_vocab()) if is_eog(llm, t)}, leads)
    text = llm.detokenize(answer).decode("utf-8", errors="replace")
    own = {
        "text": text,
        "leads": leads,
        "prefix_bytes": [len(llm.detokenize(answer[: k + 1])) for k in range(len(answer))],
    }
    del llm
    record = {
        "messages": messages,
        "answer_text": text.strip(),
        "prompt_ids": prompt_ids,
        "gguf_answer_text": text.strip(),
        "gguf_match": False,
        "gguf_own": own,
    }
    report = served_check(
        gguf, [record], 24, 512, 0, 2, ["<|im_end|>", "<|im_start|>"], tmp_path_factory.mktemp("served") / "server.log"
    )
    return text.strip(), stop, report


def test_the_shipped_settings_serve_the_greedy_answer_that_repeats_the_question(repeating):
    from loraship.verification.gates import served_gate

    greedy_text, stop, report = repeating
    assert stop is not None and greedy_text.count("Czechia") == 2  # the answer repeats the question's country
    (answer,) = report["answers"]
    assert answer["served"] == answer["streamed"] == greedy_text and answer["finish_reason"] == "stop"
    assert report["equal_to_gguf_greedy"] == report["streamed_equal"] == 1
    # The server's defaults, asked once more, answer otherwise: reported, and the gate still passes.
    defaults = answer["server_defaults"]
    assert not defaults["equal_to_gguf"] and defaults["served"] != greedy_text and "Czechia" in defaults["served"]
    assert report["server_defaults"]["differ_from_gguf_greedy"] == 1
    assert report["server_defaults"]["settings"]["repeat_penalty"] == 1.1
    verdict = served_gate(report, _CONFIG)
    assert verdict.passed and verdict.note.startswith("1 of 1 answers differ under the server's default settings")


def test_a_default_server_answer_is_called_decided_where_llama_cpp_was(repeating):
    from loraship.verification.gates import served_gate

    _text, _stop, report = repeating
    (answer,) = report["answers"]
    defaults = answer["server_defaults"]
    # Had the check sent no settings (what it did before), the default server's answer would have been served.
    served = {
        **report,
        "equal_to_gguf_greedy": 0,
        "answers": [
            {
                **answer,
                "served": defaults["served"],
                "equal_to_gguf_greedy": False,
                "whole_equal_to_gguf": False,
                "whole_gguf_parted_at": defaults["gguf_parted_at"],
                "whole_gguf_lead_there": defaults["gguf_lead_there"],
            }
        ],
    }
    lead = defaults["gguf_lead_there"]
    assert lead >= _CONFIG.golden_margin  # llama.cpp's own greedy token was decided where the penalty changed it
    verdict = served_gate(served, _CONFIG)
    assert not verdict.passed and "near-tie" not in verdict.note
    assert f"where it was decided: llama.cpp's own top token led by {lead:.2f} nats" in verdict.note


def test_llama_cpp_scores_prompts_on_the_capped_thread_count(tmp_path, monkeypatch):
    """verify's measuring child and the served check's server take cpu_count() for prompt batches too:
    llama-cpp-python's own default for n_threads_batch is every core of the host."""
    import subprocess
    from types import SimpleNamespace

    import loraship.runtime.proc as proc
    from loraship.llamacpp import served
    from loraship.planning.resources import cpu_count
    from loraship.verification.measure_child import measure_apart

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = {}

    def child(cmd, timeout, what, extra_env=None):
        seen["job"] = json.loads(Path(cmd[-3]).read_text())
        Path(cmd[-2]).write_text("{}")
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(proc, "run_child", child)
    measure_apart(SimpleNamespace(dir=tmp_path), {"gguf": "m.gguf", "n_ctx": 64, "n_gpu_layers": 0, "seed": 0})
    assert seen["job"]["llama"]["n_threads"] == seen["job"]["llama"]["n_threads_batch"] == cpu_count() == 1

    class Started(Exception):
        pass

    def popen(cmd, **kwargs):
        seen["server"] = cmd
        raise Started

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Started):
        served.start_server(tmp_path / "m.gguf", 64, 0, cpu_count(), tmp_path / "server.log")
    args = seen["server"]
    assert args[args.index("--n_threads_batch") + 1] == args[args.index("--n_threads") + 1] == "1"
