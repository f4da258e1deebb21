"""Whether drafting pays, measured: tokens per second of engine steps with drafts and without.

The cost model (``length_policy.StepCostModel``) prices what it knows: the target's step
against its tokens, and the drafter's forwards. A drafting step also costs what no model term
holds: the proposer's translation, sampling and hand-over, and vLLM's verification of the
drafts, which for a small or fast target can outweigh the forwards. ``StepRates`` checks the
outcome instead: for each batch-size bucket (1, 2-3, 4-7, 8-15, ...) it keeps the latest
cycles with drafts and without, each cycle being one engine step and the drafting that fed it
(from the start of one propose to the start of the next) with the tokens the step emitted. Where
both kinds have enough cycles and the drafted ones emitted fewer tokens per second, drafting
does not pay at that batch size, whatever the model says: the policy then drafts there only in
an occasional re-test window of consecutive steps (a request that drafted nothing for a while
first catches its drafter up, a cost a window spreads as steady drafting does), so that a
change (another request mix, longer contexts) is seen. A bucket that drafts but has too
few cycles without drafts to compare with (the engine reached it after its costs were
measured) goes without drafts in such a window, so that the comparison can be made.

The verdicts are rank 0's, broadcast by the caller with the fitted costs: timings differ
between ranks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

KEPT_CYCLES = 32  # the latest cycles kept per bucket and kind: two re-test windows replace them
MIN_CYCLES = 16  # a verdict needs at least this many cycles of each kind in a bucket
OUTLIER_FACTOR = 3.0  # cycles longer than this times the median of their kind are left out


def bucket(batch: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share a bucket (0, 1, 2, 3, ...)."""
    return max(int(batch), 1).bit_length() - 1


class StepRates:
    """Tokens per second of drafted and undrafted engine cycles, per batch-size bucket."""

    def __init__(self) -> None:
        # bucket -> drafted -> (tokens, seconds) of the latest cycles
        self._cycles: dict[int, dict[bool, deque[tuple[int, float]]]] = defaultdict(
            lambda: {True: deque(maxlen=KEPT_CYCLES), False: deque(maxlen=KEPT_CYCLES)})

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if batch > 0 and tokens > 0 and seconds > 0:
            self._cycles[bucket(batch)][bool(drafted)].append((tokens, seconds))

    def rate(self, batch_bucket: int, drafted: bool) -> float | None:
        """Tokens per second of the kept cycles of that kind; None with fewer than MIN_CYCLES.

        Tokens over seconds (a median of each cycle's rate would count a cycle whose drafts were all
        rejected as much as one that emitted four tokens), leaving out cycles that took over
        ``OUTLIER_FACTOR`` times the median: a one-off cost (a new request's prompt fed to its
        drafter, a pause of the machine) does not decide the verdict."""
        cycles = self._cycles.get(batch_bucket, {}).get(drafted, ())
        if len(cycles) < MIN_CYCLES:
            return None
        limit = OUTLIER_FACTOR * statistics.median(s for _, s in cycles)
        kept = [(t, s) for t, s in cycles if s <= limit]
        return sum(t for t, _ in kept) / sum(s for _, s in kept)

    def rates(self) -> dict[str, dict[str, float | None]]:
        """Per bucket ("1-1", "2-3", ...): tokens per second with drafts and without (for stats and logs)."""
        return {f"{1 << b}-{(2 << b) - 1}": {"drafted": self.rate(b, True), "plain": self.rate(b, False)}
                for b in sorted(self._cycles)}

    def unmeasured_plain_buckets(self) -> frozenset[int]:
        """The buckets with enough drafted cycles but too few without drafts for a verdict."""
        return frozenset(b for b, kinds in self._cycles.items()
                         if len(kinds[True]) >= MIN_CYCLES and len(kinds[False]) < MIN_CYCLES)

    def slower_buckets(self) -> frozenset[int]:
        """The buckets where steps with drafts emitted fewer tokens per second than steps without."""
        slower = set()
        for b in self._cycles:
            drafted, plain = self.rate(b, True), self.rate(b, False)
            if drafted is not None and plain is not None and drafted < plain:
                slower.add(b)
        return frozenset(slower)
