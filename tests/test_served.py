"""The served check (loraship/llamacpp/served.py): llama.cpp's OpenAI-compatible server on the shipped GGUF,
asked by the official `openai` client; a taken port is retried, and the server never outlives the check."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from loraship.constants import REFERENCE_FILE, VERIFY_FILE
from loraship.runtime.stage import stage_dir


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
    # The server answers what the GGUF answers (next line); the merged model's answer where the quantized GGUF's is
    # too: where it parts from it, only at a near-tie, which golden_match judges and the served gate does not re-judge.
    chats = [a for a in verify["golden_answers"] if a["kind"] == "chat"]
    assert len(chats) == 12 and all(a["match"] or a["parted_at_near_tie"] for a in chats)
    assert served["equal_to_reference"] == sum(a["match"] for a in chats) >= 11
    assert served["equal_to_gguf_greedy"] == 12  # the server changed nothing the GGUF says outside it
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
    (proc, port), = started
    assert port != taken_port
    assert "address already in use" in (tmp_path / "server.log").read_text().lower()  # the first try hit the taken port
    assert proc.poll() is not None  # stopped although the check failed
