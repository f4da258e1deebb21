"""Adaptive draft length: per request and step, the number of drafts (0..k) that pays most.

Each step a request gets the length L that maximises

    (E[accepted drafts | L] + 1) / R(L)

where E comes from the request's own recent per-position acceptance (decayed
counts, shrunk towards a pooled estimate from every request of the pair that
drafts the same kind of draft: string or TLI), and
R(L) is the step's cost when the batch drafts L per request, relative to the
plain target step (``StepCostModel``: configured, then measured while serving,
``cost_calibration.py``). L = 0 scores exactly 1, so a length is
chosen only when it beats the target alone; then the drafter does no work for
the request. Requests left at 0 are probed with one draft every
``probe_interval`` steps of the policy, all in the same step so that they share
one drafter forward, and only where such a probe could pay (one accepted draft
each would beat the target alone, with the drafter first fed the tokens it
missed since the last probe), so that their estimates cannot freeze at 0. A
policy whose costs are still being measured (``costs_pending``) drafts nothing:
no length is known to pay yet. Where steps with drafts were measured to
emit fewer tokens per second than steps without (``slower_buckets``, from
``step_rates.py``), the batch-size bucket drafts only in a re-test window of
``RETEST_STEPS`` steps every ``RETEST_INTERVAL``, whatever the model says; a bucket
that drafts but has no steps without drafts to compare with
(``unmeasured_plain_buckets``) drafts nothing in that window.

Determinism: the choice depends only on acceptance counts (from the tokens
every rank samples alike), the batch size, the cost model and the number of
steps: never on this rank's timings, randomness or this step's target output.
The measured cost model is rank 0's, broadcast to every rank, so every
tensor-parallel rank chooses the same lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, MutableMapping, Sequence

from vllm_usd.drafting.step_rates import bucket

DECAY = 0.9  # a request's counts fade by this at each of its observed steps (~10 steps of memory)
PRIOR_WEIGHT = 3.0  # pseudo-steps of the pooled estimate inside a request's estimate
POOL_MAX_WEIGHT = 256.0  # the pooled counts are a moving average over about this many drafts per position
INITIAL_ACCEPTANCE = 0.7  # the pooled estimate before any step was seen (the pair's first steps draft)
INITIAL_WEIGHT = 4.0
MIN_GAIN = 1.02  # a length must beat the target alone by 2%: the model's errors must not make it slower
RETEST_INTERVAL = 512  # steps between re-test windows in a bucket where drafting was measured slower ...
RETEST_STEPS = 16  # ... and their length: a lagging drafter's catch-up is spread as in steady drafting

# cost defaults, measured on the 2-core CPU VM (benchmarks/results/2026-11-30-vm.md, 2026-12-01-drafter-step.json)
VERIFY_TOKEN_COST = 0.045  # at batch 1, verifying 3 more tokens costs ~1.13x one token
COMPUTE_BOUND_TOKENS = 5.0  # Gemma-3 270M: 8 tokens a step cost 1.6-2.2x one, 32 cost 5.4-7x
DRAFT_COST_FIXED = 0.05  # a drafter forward: fixed share of a target step, ...
DRAFT_COST_PER_WEIGHT = 0.2  # ... plus this times drafter bytes / target bytes (tiny pair: 0.25; measured 0.2-0.33)


def draft_cost_from_weights(drafter_bytes: int, target_bytes: int) -> float:
    """A drafter forward for one request, relative to a plain target step at batch 1."""
    ratio = drafter_bytes / target_bytes if drafter_bytes > 0 and target_bytes > 0 else 1.0
    return round(DRAFT_COST_FIXED + DRAFT_COST_PER_WEIGHT * ratio, 4)


def measured_cost(points: Sequence[tuple[int, float]], batch: int) -> float:
    """A cost measured at some batch sizes (``points``, by size), read at ``batch``: linear between
    two measured sizes, the smallest's below it, and past the largest its average per request times
    ``batch`` (a size never measured is not assumed to come cheap)."""
    first_batch, first = points[0]
    if batch <= first_batch:
        return first
    for (b0, c0), (b1, c1) in zip(points, points[1:]):
        if batch <= b1:
            return c0 + (c1 - c0) * (batch - b0) / (b1 - b0)
    last_batch, last = points[-1]
    return last * batch / last_batch


@dataclass(frozen=True)
class StepCostModel:
    """Engine step time in units of a plain target step at batch 1.

    The target step with N tokens costs max(1 + verify_token_cost * (N - 1), N / compute_bound_tokens):
    nearly flat while reading the weights dominates, then linear once compute-bound. Past
    ``measured_tokens``, the largest step a measured model has seen, every token costs what the
    average token of that step cost: a step the engine never ran is not assumed to come cheap.
    Each draft position adds one drafter forward: ``draft_forward_cost`` for the forward, shared by
    the batch, plus ``draft_cost`` per request in it. The configured model has no shared part;
    a measured one (``cost_calibration.py``) has both, and ``draft_forward_points``: the forward's
    cost timed at each of some batch sizes, which then prices it (``measured_cost``) in place of the line.
    """

    draft_cost: float = DRAFT_COST_FIXED + DRAFT_COST_PER_WEIGHT
    verify_token_cost: float = VERIFY_TOKEN_COST
    compute_bound_tokens: float = COMPUTE_BOUND_TOKENS
    draft_forward_cost: float = 0.0
    measured_tokens: float = float("inf")
    draft_forward_points: tuple[tuple[int, float], ...] = ()

    def _shape(self, tokens: float) -> float:
        return max(1.0 + self.verify_token_cost * (tokens - 1), tokens / self.compute_bound_tokens)

    def target_step(self, tokens: int) -> float:
        if tokens <= self.measured_tokens:
            return self._shape(tokens)
        return self._shape(self.measured_tokens) * tokens / self.measured_tokens

    def relative_cost(self, batch: int, length: int, extra_forwards: int = 0) -> float:
        """The step's time when each of ``batch`` requests drafts ``length`` (in ``length + extra_forwards``
        drafter forwards), over the plain step."""
        batch = max(batch, 1)
        forwards = length + extra_forwards
        drafted = self.target_step(batch * (1 + length)) + forwards * self.drafter_forward(batch)
        return drafted / self.target_step(batch)

    def drafter_forward(self, batch: int) -> float:
        """A one-token drafter forward of ``batch`` requests."""
        if self.draft_forward_points:
            return measured_cost(self.draft_forward_points, batch)
        return self.draft_forward_cost + batch * self.draft_cost

    def catch_up_cost(self, batch: int, tokens: int) -> float:
        """Feeding ``tokens`` missed tokens to each of ``batch`` requests' drafters first, over the plain step
        (priced as that many one-token forwards: an upper bound for a batched feed; of the line,
        its part per request only)."""
        batch = max(batch, 1)
        per_token = self.drafter_forward(batch) if self.draft_forward_points else batch * self.draft_cost
        return tokens * per_token / self.target_step(batch)


class _Acceptance:
    """Decayed counts per draft position: drafts offered there (all before accepted) and accepted."""

    __slots__ = ("offered", "accepted")

    def __init__(self, k: int, offered: float = 0.0, accepted: float = 0.0) -> None:
        self.offered = [offered] * k
        self.accepted = [accepted] * k

    def add(self, length: int, num_accepted: int, decay: float) -> None:
        if decay != 1.0:
            self.offered = [x * decay for x in self.offered]
            self.accepted = [x * decay for x in self.accepted]
        for j in range(min(num_accepted + 1, length)):
            self.offered[j] += 1.0
            if j < num_accepted:
                self.accepted[j] += 1.0

    def rate(self, j: int) -> float:
        return self.accepted[j] / self.offered[j] if self.offered[j] > 0 else 0.0


class _RequestRecord:
    __slots__ = ("counts", "drafted", "kind")

    def __init__(self, k: int) -> None:
        self.counts = _Acceptance(k)
        self.drafted = 0  # drafts handed over last step (0: nothing to observe)
        self.kind = ""  # how its drafts are made: its pooled estimate is that kind's


class DraftLengthPolicy:
    """Chooses each request's draft length from its past acceptance and the step's cost."""

    def __init__(self, k: int, costs: StepCostModel | None = None, *, probe_interval: int = 8,
                 costs_pending: bool = False, counters: MutableMapping[str, int] | None = None) -> None:
        self.k = k
        self._pays: dict[int, bool] = {}  # batch size -> whether any length could pay there
        self._probes_pay: dict[tuple[int, int], bool] = {}  # (batch size, extra forwards) -> whether a probe could
        self.costs = costs or StepCostModel()
        self.costs_pending = costs_pending
        self.slower_buckets: frozenset[int] = frozenset()  # batch-size buckets where drafting measured slower
        self.unmeasured_plain_buckets: frozenset[int] = frozenset()  # drafting ones with no plain steps to compare
        self.probe_interval = max(int(probe_interval), 1)
        self.counters: MutableMapping[str, int] = counters if counters is not None else {}
        self._pools: dict[str, _Acceptance] = {}  # kind of draft -> its pooled counts
        self._records: dict[str, _RequestRecord] = {}
        self._steps = 0  # steps observed: probes fall on the same steps for every request

    @property
    def costs(self) -> StepCostModel:
        return self._costs

    @costs.setter
    def costs(self, costs: StepCostModel) -> None:
        """New costs (measured ones, say): whether a batch size can pay is worked out again."""
        self._costs = costs
        self._pays.clear()
        self._probes_pay.clear()

    # -- what happened last step -----------------------------------------------------------
    def observe(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]]) -> None:
        """Row i of the batch emitted ``sampled_token_ids[i]``: its accepted drafts and one more token.
        Called once per engine step."""
        self._steps += 1
        for req_id, sampled in zip(req_ids, sampled_token_ids):
            record = self._records.get(req_id)
            if record is None or not record.drafted:
                continue
            length, record.drafted = record.drafted, 0
            if not sampled:
                continue  # nothing emitted (discarded step): no evidence
            num_accepted = min(len(sampled) - 1, length)
            record.counts.add(length, num_accepted, DECAY)
            self._pool(record.kind).add(length, num_accepted, 1.0)
        self._cap_pools()

    def _pool(self, kind: str) -> _Acceptance:
        """The pooled counts of one kind of draft (string or TLI drafts accept differently)."""
        pool = self._pools.get(kind)
        if pool is None:
            pool = self._pools[kind] = _Acceptance(self.k, INITIAL_WEIGHT, INITIAL_WEIGHT * INITIAL_ACCEPTANCE)
        return pool

    def _cap_pools(self) -> None:
        for pool in self._pools.values():
            for j in range(self.k):
                if pool.offered[j] > POOL_MAX_WEIGHT:
                    scale = POOL_MAX_WEIGHT / pool.offered[j]
                    pool.offered[j] *= scale
                    pool.accepted[j] *= scale

    def drafted(self, req_ids: Sequence[str], lengths: Sequence[int]) -> None:
        """What was handed over this step: observed from the next step's sampled tokens."""
        for req_id, length in zip(req_ids, lengths):
            self._record(req_id).drafted = length

    def forget_all_but(self, live: Collection[str]) -> None:
        """Drop the records of requests the engine no longer holds (``live``: a set or mapping)."""
        for req_id in [r for r in self._records if r not in live]:
            del self._records[req_id]

    def _record(self, req_id: str) -> _RequestRecord:
        record = self._records.get(req_id)
        if record is None:
            record = self._records[req_id] = _RequestRecord(self.k)
        return record

    # -- this step ---------------------------------------------------------------------------
    def acceptance(self, req_id: str) -> list[float]:
        """Estimated acceptance at each draft position, given the earlier ones were accepted: the
        request's own counts, shrunk towards the pooled counts of its kind of draft."""
        record = self._record(req_id)
        counts, pool = record.counts, self._pool(record.kind)
        return [(counts.accepted[j] + PRIOR_WEIGHT * pool.rate(j)) / (counts.offered[j] + PRIOR_WEIGHT)
                for j in range(self.k)]

    def pooled_acceptance(self) -> dict[str, list[float]]:
        """Per kind of draft: the pooled acceptance at each position (for stats and logs)."""
        return {kind: [round(pool.rate(j), 4) for j in range(self.k)] for kind, pool in sorted(self._pools.items())}

    def best_length(self, acceptance: Sequence[float], batch: int, extra_forwards: int = 0) -> int:
        """The length with the most (expected accepted + 1) per unit of step time; 0 unless one pays.
        ``extra_forwards``: drafter forwards a draft takes past one per drafted token."""
        best, best_score = 0, MIN_GAIN
        expected, reach = 0.0, 1.0
        for length in range(1, self.k + 1):
            reach *= acceptance[length - 1]
            expected += reach
            score = (expected + 1.0) / self.costs.relative_cost(batch, length, extra_forwards)
            if score > best_score:
                best, best_score = length, score
        return best

    def may_draft(self, batch: int) -> bool:
        """False where no request can get a draft at this batch size: the costs are still being
        measured, drafting was measured slower here (but for a re-test window now and then), this is
        a window for measuring steps without drafts, or not even perfect acceptance would beat the
        target alone. Every length is 0 then, and the step
        needs no per-request work."""
        if self.costs_pending:
            return False
        if self.slower_buckets or self.unmeasured_plain_buckets:
            in_window = self._steps % RETEST_INTERVAL < RETEST_STEPS
            b = bucket(batch)
            if (b in self.slower_buckets and not in_window) or (b in self.unmeasured_plain_buckets and in_window):
                return False
        pays = self._pays.get(batch)
        if pays is None:
            pays = self._pays[batch] = self.best_length([1.0] * self.k, batch) > 0
        return pays

    def lengths(self, req_ids: Sequence[str], batch: int, extra_forwards: int = 0, kind: str = "") -> list[int]:
        """This step's length for each request. ``batch``: requests in the target's step (drafted or not).
        ``extra_forwards``: drafter forwards their drafts take past one per drafted token (string
        drafting writes one token past the last it proposes, which more text could still grow).
        ``kind``: how they are drafted; each kind has its own pooled estimate (greedy string drafts
        and sampled TLI drafts of one pair accept at different rates)."""
        if not self.may_draft(batch):
            return [0] * len(req_ids)
        probe_step = self._steps % self.probe_interval == 0 and self._probe_pays(batch, extra_forwards)
        out: list[int] = []
        for req_id in req_ids:
            self._record(req_id).kind = kind
            length = self.best_length(self.acceptance(req_id), batch, extra_forwards)
            if length == 0 and probe_step:
                length = 1
                self.counters["probes"] = self.counters.get("probes", 0) + 1
            out.append(length)
        return out

    def _probe_pays(self, batch: int, extra_forwards: int) -> bool:
        """Whether one accepted draft each could pay for a probe step: its drafts, and feeding each
        probed request's drafter the ``probe_interval`` tokens it missed since its last probe."""
        key = (batch, extra_forwards)
        pays = self._probes_pay.get(key)
        if pays is None:
            cost = (self.costs.relative_cost(batch, 1, extra_forwards)
                    + self.costs.catch_up_cost(batch, self.probe_interval))
            pays = self._probes_pay[key] = 2.0 / cost > MIN_GAIN
        return pays


class FixedLength:
    """``adaptive_length: false``: every request drafts k, as before the policy."""

    def __init__(self, k: int) -> None:
        self.k = k

    def observe(self, req_ids: Sequence[str], sampled_token_ids: Sequence[Sequence[int]]) -> None:
        pass

    def drafted(self, req_ids: Sequence[str], lengths: Sequence[int]) -> None:
        pass

    def forget_all_but(self, live: Collection[str]) -> None:
        pass

    def may_draft(self, batch: int) -> bool:
        return True

    def lengths(self, req_ids: Sequence[str], batch: int, extra_forwards: int = 0, kind: str = "") -> list[int]:
        return [self.k] * len(req_ids)
