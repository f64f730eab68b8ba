"""ScorerPool: a slow load holds only its own scorer; one key loads once; at most max_loaded_scorers stay."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scoring import Scorer
from service.jobs.scorers import ScorerPool
from service.jobs.vllm import AnyScorer
from service.settings import Settings

WAIT_SECONDS = 60.0  # generous: only a pool that serialises loads waits this long


class SlowDiskPool(ScorerPool):
    """Loads the real tiny model; a load of ``slow`` first blocks until ``release`` (a slow disk, say)."""

    def __init__(self, settings: Settings, slow: str) -> None:
        super().__init__(settings)
        self.slow = slow
        self.loading_slow, self.release = threading.Event(), threading.Event()
        self.loads: Counter[str] = Counter()

    def _load(self, name: str, checkpoint: Path | None, kind: str) -> AnyScorer:
        self.loads[name] += 1
        if name == self.slow:
            self.loading_slow.set()
            assert self.release.wait(WAIT_SECONDS)
        return super()._load(name, checkpoint, kind)

    @contextmanager
    def loading(self) -> Iterator[tuple[threading.Thread, list]]:
        """A get of ``slow`` in a thread of its own, held inside its load until the block ends, then joined."""
        thread, got = in_thread(lambda: self.get(self.slow))
        try:
            assert self.loading_slow.wait(WAIT_SECONDS)
            yield thread, got
        finally:
            self.release.set()
        thread.join(WAIT_SECONDS)


def pool_of(settings_for, tmp_path, slow: str = "slow", **overrides) -> SlowDiskPool:
    scorers = {"tiny-random": "tiny-random", "slow": "tiny-random", "other": "tiny-random"}
    return SlowDiskPool(settings_for(f"sqlite:///{tmp_path / 'unused.db'}", scorers=scorers, **overrides), slow)


def in_thread(work) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out


def test_a_slow_load_does_not_hold_the_scorers_of_other_runs(settings_for, tmp_path):
    pool = pool_of(settings_for, tmp_path)
    with pool.loading() as (slow, _):
        fast, got = in_thread(lambda: pool.get("tiny-random"))
        fast.join(WAIT_SECONDS)
        assert not fast.is_alive(), "another scorer's get waited for the slow load"
        assert slow.is_alive()  # still loading
        assert isinstance(got[0], Scorer)
        assert pool.loaded() == ["tiny-random"]
    assert pool.loaded() == ["tiny-random", "slow"]


def test_two_gets_of_one_scorer_at_once_load_it_once(settings_for, tmp_path):
    pool = pool_of(settings_for, tmp_path)
    with pool.loading() as (_, got_first):
        second, got_second = in_thread(lambda: pool.get("slow"))
        time.sleep(0.2)  # the second get reaches the key's lock (if it comes later, it finds the scorer loaded)
    second.join(WAIT_SECONDS)
    assert got_first[0] is got_second[0]
    assert pool.loads["slow"] == 1


def test_at_most_max_loaded_scorers_stay_loaded_the_least_recently_used_leaves(settings_for, tmp_path):
    pool = pool_of(settings_for, tmp_path, slow="", max_loaded_scorers=2)
    for name in ("tiny-random", "slow", "tiny-random", "other"):
        pool.get(name)
    assert pool.loaded() == ["tiny-random", "other"]
    assert pool.loads == Counter({"tiny-random": 1, "slow": 1, "other": 1})
