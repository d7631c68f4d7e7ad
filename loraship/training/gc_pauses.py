"""Python's cyclic garbage collector in the step loop: what the train stage built before the loop is frozen out of its
scans, and every collection during the loop is timed for the manifest.

By the loop, the process holds torch's, transformers', peft's and inductor's objects and the model's modules: about
500,000 tracked objects with a tiny model on this CPU, where one full (generation 2) collection walking them takes
0.41-0.45 s. The steps' autograd contexts live from forward to backward, long enough to reach the oldest generation,
so a full collection comes due every so often and stalls the step it lands in: on Gemma-3-12B, 331 and 492 ms inside
steps of 0.89 and 1.07 s among ones of 0.58-0.60 s (bench/results/train_bench_gemma3_copies.json, the loraship-before
rows). Frozen (gc.freeze), those objects are never walked again. The first step compiles (flex attention's kernels
under inductor) and adds tens of thousands of objects more, so after it the collector runs once in full and freezes
again: without that second freeze, full collections of up to 63 ms were left. Collections still run, over what the
loop creates.

LORASHIP_GC_FREEZE=0 leaves the collector as Python has it and still times its collections (bench/train_bench.py's
loraship-before rows).
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Pauses:
    """The collections that ran inside the loop: how many, how many full, their total and longest seconds."""

    collections: int = 0
    full: int = 0
    seconds: float = 0.0
    longest_s: float = 0.0
    frozen: bool = True
    steps: int = 0

    def step_done(self) -> None:
        """After each optimizer step: after the first, what it compiled is collected once and frozen too."""
        self.steps += 1
        if self.frozen and self.steps == 1:
            gc.collect()
            gc.freeze()

    def add(self, generation: int, seconds: float) -> None:
        self.collections += 1
        self.full += generation == 2
        self.seconds += seconds
        self.longest_s = max(self.longest_s, seconds)

    def as_json(self) -> dict:
        return {
            "collections": self.collections,
            "full_collections": self.full,
            "seconds": round(self.seconds, 6),
            "longest_s": round(self.longest_s, 6),
            "setup_frozen": self.frozen,
        }


@contextmanager
def setup_frozen():
    """Freeze what exists, time each collection until exit (yields the Pauses); unfreeze at exit. No collection first:
    the train stage has just run one (loraship/training/device.py release_memory, after the eval before training), and
    a second full walk of the same objects would cost as much again."""
    pauses = Pauses(frozen=os.environ.get("LORASHIP_GC_FREEZE", "1") != "0")
    began: list[float] = []

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            pauses.add(info["generation"], time.perf_counter() - began.pop())

    if pauses.frozen:
        gc.freeze()
    gc.callbacks.append(timer)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timer)
        if pauses.frozen:
            gc.unfreeze()
