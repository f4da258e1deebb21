"""Phase timers for ``usd.profile``: wall time per named phase of the proposer."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator


class PhaseTimer:
    """Adds the seconds spent in each phase to ``timings[name]``; free when disabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.timings: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] += time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self.timings[name] += seconds
