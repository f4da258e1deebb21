"""The draft-length policy's step costs, measured on this engine while it serves.

The configured costs (``usd.draft_cost``, ``verify_token_cost``, ``compute_bound_tokens``)
are estimates from weight sizes and from one CPU; a GPU, another target or another drafter
runtime can be far from them. The drafter's forward is timed once at start-up
(``drafter_timing.py``); ``CostCalibration`` times the target's step while the engine serves
and puts both in one unit:

* the target's step: seconds from the end of one propose to the start of the next (target
  forward, sampling, scheduling), against the tokens the step computed, in steps where every
  request decoded (a prefill costs by its prompt, not by its drafts). Fitted to the median
  time at each N (medians: a pause or a slow step is not a trend) in the configured shape:
  t(N) = max(a + b N, s N), a line while reading the weights dominates, proportional once
  compute-bound.

In units of a + b (a plain step of one token): ``verify_token_cost`` b / (a + b),
``compute_bound_tokens`` (a + b) / s (unbounded where no measured size is compute-bound),
``measured_tokens`` the largest N timed (past it, each token costs the average of that step),
``draft_forward_cost`` and ``draft_cost``: the drafter timing's per-forward and per-request
seconds over a + b, and ``draft_forward_points`` its time at each timed batch size over a + b
(these price the drafter where the timing kept them). With one N only, the configured shape is
kept, scaled to the time measured at that N.

The first fit is due after ``steps`` engine steps; later fits after twice as many steps each
time, up to one every ``MAX_FIT_INTERVAL`` steps, over every timing kept so far (the latest
``KEPT_PER_SIZE`` per N), so sizes the engine reaches later (a bigger batch, steps with drafts)
come into the model. Each fit also says where drafting was measured not to pay
(``step_rates.py``: whole cycles with drafts against cycles without). Rank 0's fit is the one
used, broadcast by the caller: timings differ between ranks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import replace

from vllm_usd.drafting.drafter_timing import DrafterTiming
from vllm_usd.drafting.length_policy import StepCostModel
from vllm_usd.drafting.step_rates import StepRates

WARMUP_STEPS = 16  # the first steps of an engine run slow (allocations, first calls): not recorded
MIN_SAMPLES = 8  # a fit needs at least this many timings
KEPT_PER_SIZE = 64  # the latest timings kept per step size: the fits follow the engine, memory stays bounded
UNBOUNDED_TOKENS = 1e9  # compute_bound_tokens of a line: no compute-bound regime past it
MAX_FIT_INTERVAL = 64  # steps between fits, once the doubling reaches it


class CostCalibration:
    """Collects the target's step timings and fits the policy's costs after ``steps`` engine steps,
    then again after twice as many each time, up to every ``MAX_FIT_INTERVAL`` steps."""

    def __init__(self, configured: StepCostModel, steps: int, drafter: DrafterTiming | None = None) -> None:
        self.configured = configured
        self.steps = max(int(steps), 1)
        self.drafter = drafter
        self.seen = 0
        self._next_fit = self.steps
        self._step_times: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=KEPT_PER_SIZE))
        self.rates = StepRates()

    def count_step(self) -> bool:
        """One more engine step seen; True at a step after which a fit is due."""
        self.seen += 1
        if self.seen < self._next_fit:
            return False
        self._next_fit += min(self._next_fit, MAX_FIT_INTERVAL)
        return True

    def record_step(self, tokens: int, seconds: float) -> None:
        """The target's step (without the proposer's time) that computed ``tokens`` tokens."""
        if self.seen > WARMUP_STEPS and tokens > 0 and seconds > 0:
            self._step_times[tokens].append(seconds)

    def record_cycle(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A whole engine step and the drafting that fed it: ``tokens`` emitted by ``batch`` requests."""
        if self.seen > WARMUP_STEPS:
            self.rates.record(batch, drafted, tokens, seconds)

    # -- the fit ------------------------------------------------------------------------------
    def fit(self) -> StepCostModel | None:
        """The measured model, or None where the target's steps were too few to measure.

        Without a drafter timing the drafting costs stay the configured ones, relative to the
        measured step.
        """
        target = self._fit_target()
        if target is None:
            return None
        unit, model = target
        if self.drafter is None:
            return model
        return replace(model, draft_forward_cost=round(self.drafter.per_forward / unit, 6),
                       draft_cost=round(self.drafter.per_request / unit, 6),
                       draft_forward_points=tuple((b, round(t / unit, 6)) for b, t in self.drafter.points))

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
        model = replace(self.configured, verify_token_cost=round(b / unit, 6), compute_bound_tokens=round(bound, 4),
                        measured_tokens=float(points[-1][0]))
        return unit, model


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
