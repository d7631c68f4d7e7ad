"""loraship/training/gc_pauses.py: the step loop's collector freezes what setup built and times every collection."""

import gc

from loraship.training.gc_pauses import setup_frozen


class Cycle:
    def __init__(self):
        self.me = self


def test_setup_is_frozen_in_the_loop_and_every_collection_is_timed(monkeypatch):
    monkeypatch.delenv("LORASHIP_GC_FREEZE", raising=False)
    before = gc.get_freeze_count()
    with setup_frozen() as pauses:
        assert gc.get_freeze_count() > before  # what existed is out of every scan
        Cycle()
        assert gc.collect() >= 1  # the loop's own garbage is still collected
        gc.collect(0)
        frozen = gc.get_freeze_count()
        compiled = [Cycle() for _ in range(100)]  # what the first step builds and keeps
        pauses.step_done()  # after the first step: collected in full and frozen as well
        assert gc.get_freeze_count() >= frozen + len(compiled)
        after_first = gc.get_freeze_count()
        later = [Cycle() for _ in range(100)]
        pauses.step_done()  # not after later ones: what they build stays out of the frozen generation
        # (the count may still fall: a frozen object another thread of this worker lets go leaves it)
        assert gc.get_freeze_count() < after_first + len(later)
    assert gc.get_freeze_count() == before  # handed back at exit
    record = pauses.as_json()
    assert record["collections"] >= 3 and record["full_collections"] >= 2 and record["setup_frozen"] is True
    assert 0 < record["longest_s"] <= record["seconds"]


def test_the_collector_left_as_it_is_still_times_its_collections(monkeypatch):
    monkeypatch.setenv("LORASHIP_GC_FREEZE", "0")
    before = gc.get_freeze_count()
    with setup_frozen() as pauses:
        assert gc.get_freeze_count() == before
        gc.collect()
    record = pauses.as_json()
    assert record["setup_frozen"] is False and record["full_collections"] == 1
