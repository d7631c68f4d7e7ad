"""What verify asks of a GGUF loaded in llama-cpp-python (`llm`, a llama_cpp.Llama with logits_all): argmax
decoding, log-probs at positions, the token ids it serves, and its end-of-generation tokens."""

from __future__ import annotations

import time


def vocab_of(llm):
    return llm._model.vocab


def is_eog(llm, token: int) -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(vocab_of(llm), token))


def adds_bos(llm) -> bool:
    sample = b"Hello world"
    with_bos = llm.tokenize(sample, add_bos=True, special=False)
    return len(with_bos) > len(llm.tokenize(sample, add_bos=False, special=False))


def served_ids(llm, text: str, add_bos: bool) -> list[int]:
    """Token ids llama.cpp feeds the model for text: a rendered chat prompt carries its own BOS text
    (llama-cpp-python's chat handlers tokenize it with add_bos off); plain text gets BOS as the GGUF says."""
    return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)


def greedy(
    llm, prompt: list[int], max_new: int, stops: set[int], leads: list[float] | None = None
) -> tuple[list[int], int | None, float]:
    """Argmax decoding straight from llama.cpp's logits (no sampler settings to disagree on):
    (answer, stop token or None, seconds spent generating). `leads`, when given, gets the nats by which
    each step's top token led its runner-up (answer tokens, then the stop)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    answer: list[int] = []
    started = time.perf_counter()
    for _ in range(max_new):
        row = llm.scores[llm.n_tokens - 1]
        token = int(np.argmax(row))
        if leads is not None:
            second, first = np.partition(row, -2)[-2:]
            leads.append(round(float(first - second), 5))
        if token in stops:
            return answer, token, time.perf_counter() - started
        answer.append(token)
        llm.eval([token])
    return answer, None, time.perf_counter() - started


def logprobs_at(llm, ids: list[int], positions: list[int]):
    """llama.cpp's log-softmax at the given positions after evaluating ids (float64, [n, vocab])."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)[positions]
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
