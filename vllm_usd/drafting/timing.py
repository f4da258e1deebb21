"""Timing: phase timers for ``usd.profile``, and the median of a few timed calls."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

TIMED_CALLS = 9  # calls timed by ``median_seconds``, after one untimed warm-up call


def median_seconds(call: Callable[[], None], *, clock: Callable[[], float] | None = None,
                   repeats: int = TIMED_CALLS) -> float:
    """The median wall time of ``repeats`` calls of ``call``, after one untimed (a first call allocates)."""
    clock = clock or time.perf_counter
    call()
    times = []
    for _ in range(repeats):
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
