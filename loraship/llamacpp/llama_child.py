"""llama.cpp for `loraship chat` and `loraship verify GGUF`, in a child process that loads the GGUF
before it imports anything of loraship, the way the verify stage runs it (loraship/verification/measure_child.py
_MEASURE).

The CLI has imported numpy (gguf reads the metadata with it) by the time it needs llama.cpp, and on an
H200 a CUDA load of a GGUF after `import numpy` segfaulted while the same load as a process's first work
did not (bench/results/verify_gpu_bisect.json). In the child the load comes first; a crash there ends
the child and is reported, not fatal to the CLI. The child answers on its stdout in lines tagged with
MARK, so anything llama.cpp itself prints there is not taken for an answer.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from loraship.errors import LorashipError

MARK = "<loraship-child> "
# Loading a 14B Q4_K_M GGUF (8.4 GiB) from a cold network disk takes minutes; the checks take seconds.
CHECKS_TIMEOUT_S = 1800

_CHILD = """
import json, sys
with open(sys.argv[1], encoding="utf-8") as f:
    spec = json.load(f)
try:
    from llama_cpp import Llama
    llm = Llama(**spec["llama"])
except (ValueError, RuntimeError) as e:  # llama-cpp-python: "Failed to load model from file"
    sys.stdout.write("%s%s\\n" % (spec["mark"], json.dumps({"load_error": str(e)})))
    sys.exit(0)
import importlib
module, _, entry = spec["entry"].partition(":")
getattr(importlib.import_module(module), entry)(llm, spec["job"])
"""


def send(message: dict) -> None:
    """In the child: one answer to the parent."""
    sys.stdout.write(MARK + json.dumps(message, default=str) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def _command(path: Path, n_ctx: int, entry: str, job: dict) -> Iterator[list[str]]:
    """The child's command line; what it loads and runs in a file (a GGUF's metadata can outgrow an argument)."""
    # n_gpu_layers=0 as the CLI always loaded it: these checks and chats need no GPU.
    from loraship.planning.resources import llama_threads

    spec = {
        "llama": {"model_path": str(path), "n_ctx": n_ctx, "n_gpu_layers": 0, "verbose": False, **llama_threads()},
        "entry": entry,
        "job": job,
        "mark": MARK,
    }
    with tempfile.TemporaryDirectory(prefix="loraship-llama-") as folder:
        spec_file = Path(folder) / "spec.json"
        spec_file.write_text(json.dumps(spec), encoding="utf-8")
        yield [sys.executable, "-c", _CHILD, str(spec_file)]


def _message(line: str) -> dict | None:
    return json.loads(line[len(MARK) :]) if line.startswith(MARK) else None


def _load_failed(path: Path, reason: str) -> LorashipError:
    return LorashipError(
        f"{path}: llama.cpp cannot load it ({reason}); the file is damaged or from a llama.cpp newer "
        "than the pinned one; convert it again with `loraship run CONFIG --from convert`"
    )


def native_crash_hint(returncode: int) -> str:
    """For a child killed by SIGSEGV or SIGILL: the llama-cpp-python build itself may be at fault."""
    if returncode not in (-4, -11):
        return ""
    return (
        "; a crash in every file points at the llama-cpp-python build instead: one compiled for its build machine's "
        "CPU (-march=native) crashed in ggml's AMX matmul on an AMX CPU; reinstall it with "
        "CMAKE_ARGS=-DGGML_NATIVE=OFF pip install --force-reinstall --no-cache-dir llama-cpp-python"
    )


def child_death(returncode: int, stderr: str) -> str:
    """How a llama.cpp child ended and the last lines it wrote: "(killed by signal 11):\n<tail>"."""
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"
    tail = "\n".join(stderr.strip().splitlines()[-8:])
    return f"({how}):\n{tail}"


def _crashed(path: Path, returncode: int, stderr: str) -> LorashipError:
    return LorashipError(
        f"{path}: the llama.cpp process ended {child_death(returncode, stderr)}\nA GGUF that "
        "llama-cpp-python cannot load is a llama.cpp version mismatch or a broken file: convert it again with "
        f"`loraship run CONFIG --from convert`{native_crash_hint(returncode)}"
    )


def run_loaded(path: Path, n_ctx: int, entry: str, job: dict, what: str) -> dict:
    """entry(llm, job) ("module:function") in a child that loaded path first; its one send()ed message."""
    from loraship.runtime.proc import run_child

    with _command(path, n_ctx, entry, job) as cmd:
        done = run_child(cmd, CHECKS_TIMEOUT_S, what)
    messages = [m for m in map(_message, done.stdout.splitlines()) if m is not None]
    if messages and "load_error" in messages[0]:
        raise _load_failed(path, messages[0]["load_error"])
    if done.returncode != 0 or not messages:
        raise _crashed(path, done.returncode, done.stderr)
    return messages[0]


class ChatChild:
    """A chat with a GGUF held by a child process: ask() sends the conversation, yields the answer's pieces."""

    def __init__(self, path: Path, n_ctx: int, seed: int):
        from loraship.runtime.proc import start_child

        self.path = path
        # A file, not a pipe nobody reads while chatting: what llama.cpp logs must not fill it and block the child.
        self.stderr = tempfile.TemporaryFile(mode="w+")
        with _command(path, n_ctx, "loraship.llamacpp.llama_child:serve_chat", {"seed": seed}) as cmd:
            self.proc = start_child(cmd, self.stderr)
            first = self._next()  # the child has read its spec once it answers
        if "load_error" in first:
            self.close()
            raise _load_failed(path, first["load_error"])

    def _next(self) -> dict:
        for line in self.proc.stdout:
            message = _message(line.rstrip("\n"))
            if message is not None:
                return message
        self.proc.wait()
        self.stderr.seek(0)
        raise _crashed(self.path, self.proc.returncode, self.stderr.read())

    def ask(self, messages: list[dict], **sampling) -> Iterator[str]:
        """The answer's pieces as llama.cpp streams them; ValueError when the conversation outgrew the context."""
        self.proc.stdin.write(json.dumps({"messages": messages, **sampling}) + "\n")
        self.proc.stdin.flush()
        while True:
            message = self._next()
            if "piece" in message:
                yield message["piece"]
            elif "error" in message:
                raise ValueError(message["error"])
            else:
                return

    def close(self) -> None:
        from loraship.runtime.proc import stop_child

        stop_child(self.proc)
        self.stderr.close()

    def __enter__(self) -> "ChatChild":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_chat(llm, job: dict) -> None:
    """In the child: answer each conversation read from stdin (one JSON line each) until stdin closes."""
    llm.set_seed(job["seed"])
    send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        messages = request.pop("messages")
        try:
            for chunk in llm.create_chat_completion(messages=messages, stream=True, **request):
                piece = chunk["choices"][0]["delta"].get("content") or ""
                if piece:
                    send({"piece": piece})
        except ValueError as e:  # llama-cpp-python: the conversation outgrew the context
            send({"error": str(e)})
            continue
        send({"done": True})
