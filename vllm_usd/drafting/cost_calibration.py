"""The draft-length policy's step costs, measured on this engine while it serves.

The configured costs (``usd.draft_cost``, ``verify_token_cost``, ``compute_bound_tokens``)
are estimates from weight sizes and from one CPU; a GPU, another target or another drafter
runtime can be far from them. ``CostCalibration`` records two kinds of timings over the first
steps an engine serves and fits a ``StepCostModel`` to them:

* the target's step: seconds from the end of one propose to the start of the next (target
  forward, sampling, scheduling), against the tokens the step computed, in steps where every
  request decoded (a prefill costs by its prompt, not by its drafts). Fitted to the median
  time at each N (medians: a pause or a slow step is not a trend) in the configured shape:
  t(N) = max(a + b N, s N), a line while reading the weights dominates, proportional once
  compute-bound.
* drafting: seconds of the proposer's drafting work in a step, against its draft positions
  (drafter forwards) and drafted tokens (the caller records TLI steps only): d = f0 positions + f1 tokens, least squares on the
  medians of each (positions, tokens), both terms at least 0.

In units of a + b (a plain step of one token): ``verify_token_cost`` b / (a + b),
``compute_bound_tokens`` (a + b) / s (unbounded where no measured size is compute-bound),
``draft_forward_cost`` f0 / (a + b) and ``draft_cost`` f1 / (a + b). A term the timings cannot
tell keeps its configured value: with one N only, the configured target model is kept and
only the drafting costs are measured, in its units; where tokens grow with positions in one
ratio (a single batch size), the whole drafting cost is charged per token (the larger cost
once batches grow).

A window without drafting timings (the configured costs chose no drafts) measures only the
target; the caller then opens another window on the new model, where drafting may pay.
Rank 0's fit is the one used, broadcast by the caller: timings differ between ranks.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import replace

from vllm_usd.drafting.length_policy import StepCostModel

WARMUP_STEPS = 16  # the first steps of an engine run slow (allocations, first calls): not recorded
MIN_SAMPLES = 8  # a fit needs at least this many timings of its kind
UNBOUNDED_TOKENS = 1e9  # compute_bound_tokens of a line: no compute-bound regime past it


class CostCalibration:
    """Collects step and drafting timings for ``steps`` engine steps, then fits the costs."""

    def __init__(self, configured: StepCostModel, steps: int) -> None:
        self.configured = configured
        self.steps = steps
        self.seen = 0
        self.drafting_measured = False
        self._step_times: dict[int, list[float]] = defaultdict(list)  # tokens -> seconds
        self._draft_times: dict[tuple[int, int], list[float]] = defaultdict(list)  # (positions, tokens) -> s

    def count_step(self) -> bool:
        """One more engine step seen; True at the step after which the fit is due."""
        self.seen += 1
        return self.seen == self.steps

    def record_step(self, tokens: int, seconds: float) -> None:
        if self.seen > WARMUP_STEPS and tokens > 0 and seconds > 0:
            self._step_times[tokens].append(seconds)

    def record_drafting(self, positions: int, tokens: int, seconds: float) -> None:
        if self.seen > WARMUP_STEPS and positions > 0 and tokens > 0 and seconds > 0:
            self._draft_times[(positions, tokens)].append(seconds)

    # -- the fit ------------------------------------------------------------------------------
    def fit(self) -> StepCostModel | None:
        """The measured model, or None where the target's steps were too few to measure.

        Without drafting timings (the configured costs drafted nothing) the drafting costs stay
        the configured ones, relative to the measured step; ``drafting_measured`` says which.
        """
        target = self._fit_target()
        if target is None:
            return None
        unit, model = target
        drafting = self._fit_drafting()
        self.drafting_measured = drafting is not None
        if drafting is None:
            return model
        f0, f1 = drafting
        return replace(model, draft_forward_cost=round(f0 / unit, 6), draft_cost=round(f1 / unit, 6))

    def _fit_target(self) -> tuple[float, StepCostModel] | None:
        """(seconds of a one-token step, the target part of the model in that unit).

        The configured shape, fitted: a line a + b N up to a knee (reading the weights
        dominates), then proportional, s N (compute-bound). Every knee between measured sizes
        is tried (past the last one: a line throughout); the one with the least relative
        error wins, so a step of 1 token and one of 32 count alike.
        """
        if sum(len(v) for v in self._step_times.values()) < MIN_SAMPLES:
            return None
        points = [(n, statistics.median(v), len(v)) for n, v in sorted(self._step_times.items())]
        if len(points) < 2:  # one N: the configured shape, scaled by the time measured at it
            n, t, _ = points[0]
            return t / self.configured.target_step(n), self.configured
        best: tuple[float, float, float, float | None] | None = None  # (error, a, b, s)
        for knee in range(2, len(points) + 1):
            low, high = points[:knee], points[knee:]
            a, b = _line(low)
            if b < 0:  # noise over a flat range: no measurable cost per token
                a, b = _weighted_mean(low), 0.0
            if a < 0:  # steeper than proportional: through the origin
                a, b = 0.0, _through_origin(low)
            s = _through_origin(high) if high else None
            error = sum(w * ((t - max(a + b * n, s * n if s else 0.0)) / t) ** 2 for n, t, w in points)
            if best is None or error < best[0]:
                best = (error, a, b, s)
        _, a, b, s = best
        unit = a + b
        if not unit > 0:
            return None
        bound = unit / s if s else UNBOUNDED_TOKENS
        model = replace(self.configured, verify_token_cost=round(b / unit, 6), compute_bound_tokens=round(bound, 4))
        return unit, model

    def _fit_drafting(self) -> tuple[float, float] | None:
        """(seconds per drafter forward, seconds per drafted token)."""
        if sum(len(v) for v in self._draft_times.values()) < MIN_SAMPLES:
            return None
        rows = [(p, n, statistics.median(v), len(v)) for (p, n), v in sorted(self._draft_times.items())]
        ratios = [n / p for p, n, _, _ in rows]
        if max(ratios) <= 1.05 * min(ratios):  # one batch shape: all per token
            return 0.0, sum(w * d * n for p, n, d, w in rows) / sum(w * n * n for p, n, d, w in rows)
        f0, f1 = _two_terms(rows)
        if f0 < 0 or f1 < 0:  # the better of the one-term fits
            only_f0 = sum(w * d * p for p, n, d, w in rows) / sum(w * p * p for p, n, d, w in rows)
            only_f1 = sum(w * d * n for p, n, d, w in rows) / sum(w * n * n for p, n, d, w in rows)
            err0 = sum(w * (d - only_f0 * p) ** 2 for p, n, d, w in rows)
            err1 = sum(w * (d - only_f1 * n) ** 2 for p, n, d, w in rows)
            f0, f1 = (only_f0, 0.0) if err0 < err1 else (0.0, only_f1)
        return f0, f1


# The target's fits weigh each size's median by its count over its square: relative errors.
def _weighted_mean(points: list[tuple[int, float, int]]) -> float:
    return sum(w / t for _, t, w in points) / sum(w / (t * t) for _, t, w in points)


def _line(points: list[tuple[int, float, int]]) -> tuple[float, float]:
    """Least squares t = a + b n, in relative error."""
    weights = [w / (t * t) for _, t, w in points]
    sw = sum(weights)
    mn = sum(x * n for x, (n, _, _) in zip(weights, points)) / sw
    mt = sum(x * t for x, (_, t, _) in zip(weights, points)) / sw
    snn = sum(x * (n - mn) ** 2 for x, (n, _, _) in zip(weights, points))
    b = sum(x * (n - mn) * (t - mt) for x, (n, t, _) in zip(weights, points)) / snn
    return mt - b * mn, b


def _through_origin(points: list[tuple[int, float, int]]) -> float:
    """Least squares t = s n, in relative error."""
    return sum(w / t * n for n, t, w in points) / sum(w / (t * t) * n * n for n, t, w in points)


def _two_terms(rows: list[tuple[int, int, float, int]]) -> tuple[float, float]:
    """Weighted least squares d = f0 p + f1 n (no intercept)."""
    spp = sum(w * p * p for p, n, d, w in rows)
    snn = sum(w * n * n for p, n, d, w in rows)
    spn = sum(w * p * n for p, n, d, w in rows)
    spd = sum(w * p * d for p, n, d, w in rows)
    snd = sum(w * n * d for p, n, d, w in rows)
    det = spp * snn - spn * spn
    if not abs(det) > 1e-12 * max(spp * snn, 1e-300):
        return 0.0, snd / snn
    f0 = (spd * snn - snd * spn) / det
    f1 = (snd * spp - spd * spn) / det
    return (f0, f1) if math.isfinite(f0) and math.isfinite(f1) else (0.0, snd / snn)
