"""Timing: phase timers for ``usd.profile``, and the median of a few timed calls."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

TIMED_CALLS = 9  # calls timed by ``median_seconds``, after one untimed warm-up call
TIMED_SECONDS = 0.5  # ... fewer once the timed calls took this long (a drafter's first forward over 128 tokens: 1 s)


def median_seconds(call: Callable[[], None], *, clock: Callable[[], float] | None = None,
                   repeats: int = TIMED_CALLS, seconds: float = float("inf")) -> float:
    """The median wall time of ``repeats`` calls of ``call``, after one untimed (a first call allocates);
    no more calls once the timed ones took ``seconds``, but at least 3 (their median drops one outlier)."""
    clock = clock or time.perf_counter
    call()
    times: list[float] = []
    while len(times) < repeats and (len(times) < 3 or sum(times) < seconds):
        start = clock()
        call()
        times.append(clock() - start)
    return statistics.median(times)


class PhaseTimer:
    """Adds the seconds spent in each phase to ``timings[name]``; free when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.timings: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self.timings[name] += seconds
