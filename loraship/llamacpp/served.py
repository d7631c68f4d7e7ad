"""The served check: the GGUF behind llama.cpp's OpenAI-compatible server, asked by the official client.

Users consume a GGUF through an OpenAI-style server (llama-server, Ollama), not through a Python
binding, and the threads users open about shipped models are about what happens there: answers that
never stop, stop early, leak template markers, or differ when streamed. This starts llama-cpp-python's
server (the pinned llama.cpp, with the GGUF's own chat template) on 127.0.0.1 in its own process,
sends every golden chat prompt through the `openai` client with the sampling settings the artifact
ships (loraship/sampling.py: greedy, repeat_penalty 1.0 and every other sampler off), once whole and
once streamed, and stops the server in every case. It asks each prompt once more as a plain OpenAI
request at temperature 0, every llama.cpp setting left to the server (repeat_penalty 1.1 there), and
reports, without gating, how many answers that changes: what a user who does not send the shipped
settings gets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

from loraship.errors import LorashipError
from loraship.runtime.proc import child_setup, kill_group, child_env
from loraship.sampling import GREEDY, Sampling

log = logging.getLogger("loraship.llamacpp.served")

START_TIMEOUT_S = 300  # loading a 14B GGUF onto a GPU
REQUEST_TIMEOUT_S = 600
PORT_TRIES = 3
MODEL_ALIAS = "loraship"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def server_command(
    gguf: Path,
    port: int,
    n_ctx: int,
    n_gpu_layers: int,
    threads: int,
    template_kwargs: dict | None = None,
    n_cpu_moe: int = 0,
) -> list[str]:
    """The server's command line. With n_cpu_moe, llama-cpp-python's server started through
    loraship/llamacpp/cpu_moe.py, which takes llama-server's --n-cpu-moe N and keeps those experts in CPU memory."""
    cmd = [
        sys.executable,
        "-m",
        "loraship.llamacpp.cpu_moe" if n_cpu_moe else "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        MODEL_ALIAS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_gpu_layers",
        str(n_gpu_layers),
        "--n_threads",
        str(threads),
        "--n_threads_batch",  # else every core of the host, as in the measuring child
        str(threads),
        "--verbose",
        "False",
    ]
    if template_kwargs:  # the variables training rendered the template with (Qwen3's enable_thinking)
        cmd += ["--chat_template_kwargs", json.dumps(template_kwargs)]
    if n_cpu_moe:
        cmd += ["--n-cpu-moe", str(n_cpu_moe)]
    return cmd


def start_server(
    gguf: Path,
    n_ctx: int,
    n_gpu_layers: int,
    threads: int,
    log_file: Path,
    template_kwargs: dict | None = None,
    n_cpu_moe: int = 0,
) -> tuple[subprocess.Popen, int, list[str]]:
    """llama-cpp-python's server on a free loopback port; (process, port, command). A port taken between
    choosing and binding it (another process, another verify) is retried on a fresh one."""
    last_tail = ""
    for _ in range(PORT_TRIES):
        port = free_port()
        cmd = server_command(gguf, port, n_ctx, n_gpu_layers, threads, template_kwargs, n_cpu_moe)
        with open(log_file, "ab") as sink:
            proc = subprocess.Popen(
                cmd,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=child_env(),
                start_new_session=True,
                preexec_fn=child_setup,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None and not _ready(port):
            time.sleep(0.2)
        if proc.poll() is None and _ready(port):
            return proc, port, cmd
        kill_group(proc)
        last_tail = "\n".join(log_file.read_text(errors="replace").strip().splitlines()[-6:])
        if "address already in use" not in last_tail.lower():
            break
    raise LorashipError(
        f"llama.cpp's OpenAI-compatible server did not start on {gguf.name} within {START_TIMEOUT_S} s:\n{last_tail}\n"
        "Install the server extra of the pinned llama-cpp-python (pip install 'llama-cpp-python[server]'), or see "
        f"{log_file}"
    )


def stop_server(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    kill_group(proc)


def ask(client, messages: list[dict], max_tokens: int, stream: bool, sampling: Sampling | None = GREEDY) -> dict:
    """One chat completion: its text, finish reason and prompt token count. sampling: the settings
    sent, every one of them; None sends a plain OpenAI request at temperature 0 and leaves the rest
    (repeat_penalty, top_k, min_p, ...) to the server's defaults."""
    args = dict(
        model=MODEL_ALIAS,
        messages=messages,
        max_tokens=max_tokens,
        seed=0,
        **(sampling.openai_request() if sampling is not None else {"temperature": 0}),
    )
    if not stream:
        response = client.chat.completions.create(**args)
        choice = response.choices[0]
        return {
            "content": choice.message.content or "",
            "finish_reason": choice.finish_reason,
            "prompt_tokens": response.usage.prompt_tokens if response.usage else None,
        }
    parts, finish = [], None
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta is not None and delta.content:
            parts.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    return {"content": "".join(parts), "finish_reason": finish}


def server_defaults() -> dict:
    """What llama-cpp-python's server decodes a chat request with when the request leaves a setting
    out (its request model's defaults), for the settings the shipped record names."""
    from llama_cpp.server.types import CreateChatCompletionRequest

    defaults = CreateChatCompletionRequest.model_fields
    return {name: defaults[name].default for name in GREEDY.record() if name in defaults}


def parting_from(text: str, own: dict) -> tuple[int | None, float | None]:
    """Where `text` first leaves the GGUF's own greedy answer (own: its full text, the byte length of
    each token prefix, and each step's lead in nats): the index of the greedy step there and llama.cpp's
    lead at it (None past its steps), or (None, None) when the stripped texts are equal."""
    served, greedy = text.strip(), own["text"].strip()
    # A token that ends inside a UTF-8 character decodes to U+FFFD in the greedy text; the server holds
    # such bytes back or drops them. The same tokens then differ only there.
    if served == greedy or served.replace("\ufffd", "") == greedy.replace("\ufffd", ""):
        return None, None
    at_char = next((i for i, (x, y) in enumerate(zip(served, greedy)) if x != y), min(len(served), len(greedy)))
    skipped = len(own["text"]) - len(own["text"].lstrip())
    at_byte = len(own["text"][: skipped + at_char].encode("utf-8"))
    step = next((k for k, end in enumerate(own["prefix_bytes"]) if end > at_byte), len(own["prefix_bytes"]))
    return step, (own["leads"][step] if step < len(own["leads"]) else None)


def merged_lead(record: dict, step: int | None) -> float | None:
    """The merged model's lead (the reference's teacher-forced margin) at the GGUF's greedy step `step`,
    where the GGUF's greedy answer is the merged model's token for token, so both ran on the same
    tokens up to it; None elsewhere (another prefix, or past the merged model's answer and stop)."""
    margins = record.get("margins") or []
    if step is None or not record.get("gguf_match") or step >= len(margins):
        return None
    return margins[step]


def served_check(
    gguf: Path,
    chats: list[dict],
    max_new_tokens: int,
    n_ctx: int,
    n_gpu_layers: int,
    threads: int,
    markers: list[str],
    log_file: Path,
    sampling: Sampling = GREEDY,
    template_kwargs: dict | None = None,
    n_cpu_moe: int = 0,
) -> dict:
    """Every golden chat prompt through the server, whole and streamed, with `sampling` (the shipped
    settings), against the reference's greedy answer and the same GGUF's own greedy answer outside the
    server; then each once more with the server's defaults, reported as server_defaults. chats: reference
    golden records of kind chat (messages, answer_text, prompt_ids, margins), each with gguf_answer_text,
    gguf_match (the GGUF's greedy answer is the merged model's token for token) and gguf_own (parting_from)."""
    from openai import OpenAI

    proc, port, command = start_server(gguf, n_ctx, n_gpu_layers, threads, log_file, template_kwargs, n_cpu_moe)
    answers = []
    try:
        client = OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="loraship", timeout=REQUEST_TIMEOUT_S, max_retries=0
        )
        for record in chats:
            whole = ask(client, record["messages"], max_new_tokens, stream=False, sampling=sampling)
            streamed = ask(client, record["messages"], max_new_tokens, stream=True, sampling=sampling)
            default = ask(client, record["messages"], max_new_tokens, stream=False, sampling=None)
            content, streamed_content = whole["content"].strip(), streamed["content"].strip()
            whole_at, whole_lead = parting_from(content, record["gguf_own"])
            streamed_at, streamed_lead = parting_from(streamed_content, record["gguf_own"])
            default_at, default_lead = parting_from(default["content"], record["gguf_own"])
            answers.append(
                {
                    "prompt": record["messages"][-1]["content"],
                    "reference": record["answer_text"],
                    "served": content,
                    "streamed": streamed_content,
                    "gguf_greedy": record["gguf_answer_text"],
                    "finish_reason": whole["finish_reason"],
                    "streamed_finish_reason": streamed["finish_reason"],
                    "equal_to_reference": content == record["answer_text"],
                    "equal_to_gguf_greedy": content == record["gguf_answer_text"],
                    "streamed_equal": streamed_content == content,
                    "whole_equal_to_gguf": whole_at is None,
                    "whole_gguf_parted_at": whole_at,
                    "whole_gguf_lead_there": whole_lead,
                    "whole_merged_lead_there": merged_lead(record, whole_at),
                    "streamed_equal_to_gguf": streamed_at is None,
                    "streamed_gguf_parted_at": streamed_at,
                    "streamed_gguf_lead_there": streamed_lead,
                    "streamed_merged_lead_there": merged_lead(record, streamed_at),
                    "markers_leaked": [m for m in markers if m and m in whole["content"] + streamed["content"]],
                    "prompt_tokens": whole["prompt_tokens"],
                    "reference_prompt_tokens": len(record["prompt_ids"]),
                    # Reported, not gated: the same prompt with every llama.cpp setting left to the server.
                    "server_defaults": {
                        "served": default["content"].strip(),
                        "equal_to_gguf": default_at is None,
                        "gguf_parted_at": default_at,
                        "gguf_lead_there": default_lead,
                    },
                }
            )
    finally:
        stop_server(proc)
    differing = [a for a in answers if not a["server_defaults"]["equal_to_gguf"]]
    return {
        "api": "openai",
        "server": "llama_cpp.server (llama-cpp-python, the GGUF's chat template)",
        "command": command[1:],  # after the Python interpreter: what verify ran, --n-cpu-moe included
        "n_cpu_moe": n_cpu_moe,
        "sampling": sampling.record(),
        "requests": len(answers),
        "finished_by_stop": sum(
            a["finish_reason"] == "stop" and a["streamed_finish_reason"] == "stop" for a in answers
        ),
        "equal_to_reference": sum(a["equal_to_reference"] for a in answers),
        "equal_to_gguf_greedy": sum(a["equal_to_gguf_greedy"] for a in answers),
        "streamed_equal": sum(a["streamed_equal"] for a in answers),
        "without_markers": sum(not a["markers_leaked"] for a in answers),
        "prompt_tokens_equal": sum(a["prompt_tokens"] == a["reference_prompt_tokens"] for a in answers),
        "server_defaults": {
            "settings": server_defaults(),
            "requests": len(answers),
            "differ_from_gguf_greedy": len(differing),
            "note": (
                "reported, not gated: each prompt once more as a plain OpenAI request at temperature 0, every "
                "other setting the server's default; answers that differ are what a client gets that does not "
                "send the shipped settings"
            ),
        },
        "answers": answers,
    }
