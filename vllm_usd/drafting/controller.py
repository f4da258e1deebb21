"""The draft-length controller: each step, the length (0..k) with the most measured tokens per second.

Two things are kept, both from what the engine did:

* **acceptance per draft position**, over all requests, apart for greedy and sampled rows (they draft differently:
  by default greedy rows draft text, sampled rows TLI with q): of the drafts vLLM scheduled for verification at
  position j (all before it accepted), the share accepted. A request emitting ``a + 1`` tokens after ``n`` scheduled
  drafts had positions ``0..min(a, n - 1)`` offered and ``0..a - 1`` accepted. Drafts vLLM trimmed (token budget,
  structured output) were never offered. The counts start at 1 accepted of 2 offered and fade with the steps served
  (about the last ``ACCEPTANCE_MEMORY`` count), never below the weight of 2 drafts: after steps without drafts, the
  next drafts (exploring's) soon outweigh the estimate.
* **the cost of an engine cycle** (one propose, the drafting it did, and the target step that verified it: start of
  one propose to the start of the next) for each batch-size bucket (1, 2-3, 4-7, ...) and length: the start-up
  estimate (the target's forward timed at the cycle's token count, the drafter's forwards timed at that batch, and
  what verifying the bucket's share of sampled drafts adds) times how far such estimates were off, measured: the
  median of measured/estimated over the cell's last ``CYCLES_KEPT`` cycles, or over its bucket's where the cell has
  none yet, or over every bucket's. Only cycles in which every request decoded are measured: a prefill costs by its
  prompt. Not a drafted cycle right after a plain one: its drafter catches up on what its rows missed, once (the
  budget counts it).

A step of ``batch`` rows gets the length L maximising ``E(L) / cost(batch, L)``, with ``E(L) = 1 + a_0 + a_0 a_1``
``+ ...`` the tokens a row is expected to emit (L = 0: one token, at the plain step's cost; the mean over the rows,
greedy and sampled). Ties go to the shorter length. Where the rows' drafters lack context (a new request's prompt,
or tokens emitted while nothing was drafted), the step drafts only if what drafting saves over the tokens the rows
have left (as far as max_tokens says) exceeds the catch-up, priced as a prompt of that many tokens (the drafter's
first forward timed at start-up): the drafter's prompt is paid once per request, where it pays back. Now and then a
step takes another length, the one tried least recently (never tried first, the shorter on a tie) of plain and those
that would beat plain at the start-up estimate were the next 2 drafts at each position accepted (every draft, once
what was measured there weighs 4 or less), so that a length that looked worse is measured again: in each bucket, once
the steps since its last such step number ``EXPLORE_EVERY`` times that length's cost over the best's. A drafted length
explored after a plain step is taken twice where the next step's rows have
caught up (the same requests): the first cycle pays the catch-up, the second is measured.

**What exploring may cost is bounded** (the loss budget). Every measured drafted cycle is compared with the target
alone: it took ``seconds`` and its rows emitted ``t`` tokens each, which plain cycles would have taken
``t x cost(batch, 0)`` to emit; the difference (a gain when negative) adds to its bucket's loss. A bucket explores
only while its loss, with what the exploring step is expected to lose (the drafter's catch-up on what its rows missed
included, priced as a prompt of that many tokens, as timed at start-up), stays within ``LOSS_BUDGET`` of the time its
cycles took. The best length is not held to the budget (a request's first drafted step pays the catch-up before its
drafts pay it back). Where drafting never pays, the loss is exploring's (at most ``LOSS_BUDGET`` of the served time,
plus what the cycles until the next share lose) and the prior's (the first few rejections: it weighs 2 drafts).

Tensor parallelism: acceptance comes from the tokens every rank samples alike, the step counts are alike, and the
cycle costs are rank 0's, sent every ``SHARE_EVERY`` steps with the step's one collective (the start-up timings
once): every rank chooses the same length.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

ACCEPTANCE_MEMORY = 256  # steps over which a draft's outcome counts (older ones fade)
ACCEPTANCE_PRIOR = (1.0, 2.0)  # (accepted, offered) at each position before any draft was verified; the least weight
CYCLES_KEPT = 16  # the latest measured cycles per (bucket, length)
EXPLORE_EVERY = 32  # exploring takes at most about 1/EXPLORE_EVERY of each bucket's time
SHARE_EVERY = 8  # steps between broadcasts of rank 0's measured costs
LOSS_BUDGET = 0.02  # exploring may cost a bucket this share of its served time over the target alone


def bucket(batch: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share a bucket (0, 1, 2, 3, ...)."""
    return max(int(batch), 1).bit_length() - 1


def bucket_label(b: int) -> str:
    return "1" if b == 0 else f"{1 << b}-{(2 << b) - 1}"


def interpolate(points: Sequence[tuple[int, float]], x: int) -> float:
    """A time measured at some sizes (``points``, increasing), read at ``x``: linear between two,
    the smallest's below them, and past the largest proportional to ``x`` (never assumed cheaper)."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, t0), (x1, t1) in zip(points, points[1:]):
        if x <= x1:
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
    last_x, last = points[-1]
    return last * x / last_x


@dataclass(frozen=True)
class StartupTimings:
    """Seconds measured before serving: the target's forward at token counts, a one-token drafter
    forward at batch sizes, a new drafter request's first forward at prompt lengths, and what verifying
    sampled drafts adds at drafted-row counts (their probabilities and a recovered token over the target's
    vocabulary; greedy rows take an argmax). Any may be empty (not timed): then it prices nothing."""

    target: tuple[tuple[int, float], ...] = ()
    drafter: tuple[tuple[int, float], ...] = ()
    drafter_prefill: tuple[tuple[int, float], ...] = ()
    verify: tuple[tuple[int, float], ...] = ()

    def estimate(self, batch: int, length: int, sampled: float = 1.0) -> float:
        """A cycle of ``batch`` rows drafting ``length`` each, a ``sampled`` share of them sampled; without the
        target's timing, 1.0 for every cycle (the drafter's timing alone has no unit to join)."""
        if not self.target:
            return 1.0
        drafter = interpolate(self.drafter, batch) if self.drafter else 0.0
        verify = sampled * interpolate(self.verify, batch * length) if self.verify and length else 0.0
        return max(interpolate(self.target, batch * (1 + length)) + length * drafter + verify, 1e-9)

    def catch_up(self, tokens: int) -> float:
        """The drafter's forward over ``tokens`` missed tokens, priced as a prompt of that many (without
        that timing, as a one-token step of that many rows, which overstates it); 0 where the target or
        the drafter was not timed (there is no unit to price it in)."""
        if tokens <= 0 or not self.target or not self.drafter:
            return 0.0
        return interpolate(self.drafter_prefill or self.drafter, tokens)


class _Acceptance:
    """Accepted and offered drafts per position, faded by the steps since (see the module's docstring)."""

    def __init__(self, k: int) -> None:
        self.accepted = [ACCEPTANCE_PRIOR[0]] * k
        self.offered = [ACCEPTANCE_PRIOR[1]] * k
        self._step = 0  # the step the counts were last faded to

    def _fade_to(self, step: int) -> None:
        if step > self._step:
            fade = (1.0 - 1.0 / ACCEPTANCE_MEMORY) ** (step - self._step)
            for j, offered in enumerate(self.offered):  # the share accepted is kept; only its weight fades
                scale = max(fade, min(ACCEPTANCE_PRIOR[1] / offered, 1.0))
                self.accepted[j], self.offered[j] = self.accepted[j] * scale, offered * scale
            self._step = step

    def add(self, step: int, scheduled: int, num_accepted: int) -> None:
        self._fade_to(step)
        for j in range(min(num_accepted + 1, scheduled)):
            self.accepted[j], self.offered[j] = self.accepted[j] + float(j < num_accepted), self.offered[j] + 1.0

    def rates(self, step: int, hope: bool = False) -> list[float]:
        """The share accepted at each position (``hope``: what exploring hopes for, see the module's docstring)."""
        self._fade_to(step)
        extra = ACCEPTANCE_PRIOR[1] if hope else 0.0
        return [(a + extra) / (o + extra) if o > 2 * extra else 1.0 for a, o in zip(self.accepted, self.offered)]


class DraftLengthController:
    """Chooses each step's draft length from measured acceptance and measured cycle costs."""

    def __init__(self, k: int, timings: StartupTimings | None = None, share_every: int = SHARE_EVERY) -> None:
        """``share_every``: steps between shares of the measured costs and losses (1 where nothing needs
        sending: one rank)."""
        self.k = k
        self.share_every = share_every
        self.timings = timings or StartupTimings()
        self._acceptance = {True: _Acceptance(k), False: _Acceptance(k)}  # greedy rows', sampled rows'
        self._greedy_share: dict[int, float] = {}  # bucket -> the share of greedy rows at its last step
        self._ratios: dict[tuple[int, int], deque[float]] = defaultdict(lambda: deque(maxlen=CYCLES_KEPT))
        # (bucket, length) -> the step of its last cycle (alike on every rank: steps and lengths are)
        self._tried_at: dict[tuple[int, int], int] = {}
        # (bucket, length) -> (median ratio, cycles kept): rank 0's, as last shared
        self.shared: dict[tuple[int, int], tuple[float, int]] = {}
        self.best: dict[int, int] = {}  # bucket -> the best length at its last step (exploring aside)
        self._since_explore: dict[int, int] = defaultdict(int)  # bucket -> steps since it last explored
        self._measuring: dict[int, tuple[int, int]] = {}  # bucket -> (a length explored after a plain step, its step)
        self.current: dict[int, int] = {}  # bucket -> the length its last step got
        self._steps = 0
        # bucket -> [seconds drafted cycles took beyond the target alone (negative: gained), seconds served]
        self._loss: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.shared_loss: dict[int, tuple[float, float]] = {}  # rank 0's, as last shared
        self._previous_length: int | None = None  # the last measured cycle's

    # -- what the engine did ---------------------------------------------------------------------
    def observe(self, scheduled: Sequence[int], sampled: Sequence[Sequence[int]], greedy: Sequence[bool]) -> None:
        """Row i (greedy or not: ``greedy[i]``) had ``scheduled[i]`` drafts verified and emitted ``sampled[i]``."""
        for n, tokens, g in zip(scheduled, sampled, greedy):
            if n and tokens:
                self._acceptance[bool(g)].add(self._steps, n, min(len(tokens) - 1, n))

    def record_cycle(self, batch: int, length: int, seconds: float, tokens_per_row: float | None = None) -> None:
        """A measured cycle of ``batch`` decoding rows that drafted ``length`` (this rank's clock), whose rows
        emitted ``tokens_per_row`` tokens on average (a drafted cycle without it is not held to the budget)."""
        previous, self._previous_length = self._previous_length, length
        if batch > 0 and seconds > 0:
            cell = (bucket(batch), length)
            self._tried_at[cell] = self._steps
            if not (length and previous == 0):  # a first drafted cycle pays a one-off catch-up: the budget's
                self._ratios[cell].append(seconds / self._estimate(batch, length))
            loss = self._loss[cell[0]]
            loss[1] += seconds
            if length and tokens_per_row:
                loss[0] += seconds - tokens_per_row * self.cost(batch, 0)

    def share_due(self) -> dict | None:
        """Called once per step on every rank: this rank's measured costs and losses every ``share_every``
        calls (to be sent, rank 0's taken by every rank through ``take_shared``), else None."""
        self._steps += 1
        if self._steps % self.share_every:
            return None
        return {"cells": {cell: (statistics.median(r), len(r)) for cell, r in self._ratios.items()},
                "loss": {b: (loss, served) for b, (loss, served) in self._loss.items()}}

    def take_shared(self, shared: dict) -> None:
        """Rank 0's measured costs and losses, as ``share_due`` gave them there."""
        self.shared, self.shared_loss = shared["cells"], shared["loss"]

    # -- this step ---------------------------------------------------------------------------------
    def acceptance(self, greedy: bool, hope: bool = False) -> list[float]:
        """The estimated acceptance at each draft position, of greedy rows or of sampled ones (or ``hope``d)."""
        return self._acceptance[greedy].rates(self._steps, hope)

    def expected_tokens(self, length: int, greedy_share: float = 0.0, hope: bool = False) -> float:
        """Tokens a row is expected to emit in a cycle drafting ``length``, a ``greedy_share`` of the rows greedy."""
        total = 0.0
        for greedy, share in ((True, greedy_share), (False, 1.0 - greedy_share)):
            if share > 0:
                tokens, reach = 1.0, 1.0
                for rate in self.acceptance(greedy, hope)[:length]:
                    reach *= rate
                    tokens += reach
                total += share * tokens
        return total

    def cost(self, batch: int, length: int) -> float:
        """Seconds of a cycle: the start-up estimate, scaled as measured (see the module's docstring)."""
        b = bucket(batch)
        cell = self.shared.get((b, length))
        if cell is None:
            same_bucket = [cell[0] for (cb, _), cell in self.shared.items() if cb == b]
            cell = (statistics.median(same_bucket or [cell[0] for cell in self.shared.values()] or [1.0]),)
        return self._estimate(batch, length) * max(cell[0], 1e-9)

    def _estimate(self, batch: int, length: int) -> float:
        """The start-up estimate of a cycle, at the share of sampled rows its bucket's last step had."""
        return self.timings.estimate(batch, length, 1.0 - self._greedy_share.get(bucket(batch), 0.0))

    def rates(self, batch: int, greedy_share: float = 0.0) -> list[float]:
        """Expected tokens per second per row at each length 0..k."""
        return [self.expected_tokens(n, greedy_share) / self.cost(batch, n) for n in range(self.k + 1)]

    def length(self, batch: int, catch_up: Callable[[], tuple[int, float]] = lambda: (0, 0.0),
               greedy: int = 0) -> int:
        """This step's length for every row of a ``batch``-row step, ``greedy`` of them greedy: its best where
        drafting from now on pays the drafter's catch-up back, or now and then the length tried least
        recently, where the bucket's loss budget covers it. ``catch_up()``: (the tokens the rows' drafter
        contexts lack beyond what a drafted step feeds anyway, the tokens the rows have left on average),
        asked where a step would draft (a loop over the rows)."""
        b = bucket(batch)
        share = self._greedy_share[b] = min(greedy / batch, 1.0) if batch > 0 else 0.0
        rates = self.rates(batch, share)
        best = self.best[b] = max(range(self.k + 1), key=lambda n: (rates[n], -n))
        # not at measured costs: a length once mismeasured would never be measured again
        est, hope = self._estimate, lambda n: self.expected_tokens(n, share, hope=True)
        other = min((n for n in range(self.k + 1) if n != best and (n == 0 or hope(n) * est(batch, 0) > est(batch, n))),
                    key=lambda n: (self._tried_at.get((b, n), -1), n), default=best)
        self._since_explore[b] += 1
        chosen, outlook = best, None
        if best:
            outlook = catch_up()
            if not self._catch_up_pays(batch, best, share, *outlook):
                chosen = 0
        due = self._since_explore[b] >= EXPLORE_EVERY * self.cost(batch, other) / self.cost(batch, best)
        again, at = self._measuring.pop(b, (0, -1))
        if again and not chosen and at == self._steps - 1 and not (outlook or catch_up())[0]:
            chosen = again  # the next step, its rows caught up (the same requests): this cycle is measured
        elif due and other not in (chosen, best):
            spent, steps = self._spent(b), 2 if other and not chosen else 1
            step_loss = self._exploring_loss(batch, other, 0, share)
            # the rows' missed tokens (a loop over them) are counted only where the steps alone are affordable
            if not other or (spent + steps * step_loss <= 0 and spent + (steps - 1) * step_loss
                             + self._exploring_loss(batch, other, (outlook or catch_up())[0], share) <= 0):
                self._since_explore[b], chosen = 0, other
                if steps == 2:
                    self._measuring[b] = (other, self._steps)
        self.current[b] = chosen
        return chosen

    def _catch_up_pays(self, batch: int, length: int, greedy_share: float, missed: int, left: float) -> bool:
        """Whether drafting ``length`` from now on saves more over the ``left`` tokens each row has left (a plain
        cycle each, or a drafted cycle per E(length)) than the drafter's catch-up on ``missed`` costs first."""
        if not missed:
            return True
        saved_per_token = self.cost(batch, 0) - self.cost(batch, length) / self.expected_tokens(length, greedy_share)
        return left * saved_per_token > self.timings.catch_up(missed)

    def _spent(self, b: int) -> float:
        """Seconds bucket ``b``'s drafting lost beyond its budget (rank 0's, as last shared; <= 0 within it)."""
        loss, served = self.shared_loss.get(b, (0.0, 0.0))
        return loss - LOSS_BUDGET * served

    def _exploring_loss(self, batch: int, length: int, missed: int, greedy_share: float) -> float:
        """What one step at ``length`` is expected to lose against the target alone (0 if it gains), the
        drafter's catch-up on ``missed`` tokens included."""
        cost = self.cost(batch, length) + self.timings.catch_up(missed)
        return max(cost - self.expected_tokens(length, greedy_share) * self.cost(batch, 0), 0.0)

    # -- for stats, logs and doctor ---------------------------------------------------------------
    def _best(self, batch: int) -> tuple[int, float]:
        """(the best length at ``batch``, its expected speed-up over no drafts, at its bucket's last share of
        greedy rows), without exploring."""
        rates = self.rates(batch, self._greedy_share.get(bucket(batch), 0.0))
        best = max(range(1, self.k + 1), key=lambda n: (rates[n], -n))
        return best, rates[best] / rates[0]

    def outlook(self, batches: Sequence[int]) -> str:
        """One line: at which batch sizes drafting is expected to pay, and by how much."""
        verdicts = {b: self._best(1 << b) for b in sorted(set(bucket(x) for x in batches))}
        return "drafting pays at batch " + "; ".join(
            f"{bucket_label(b)}: " + (f"yes, {n} drafts {gain:.2f}x" if gain > 1 else f"no ({n} drafts {gain:.2f}x)")
            for b, (n, gain) in verdicts.items())

    def summary(self) -> list[str]:
        """One line per batch-size bucket served: the length chosen, and the expected tokens/s behind it."""
        lines = []
        for b, length in sorted(self.current.items()):
            batch = 1 << b
            best, gain = self._best(batch)
            plain = self.expected_tokens(0) / self.cost(batch, 0) * batch
            measured = "measured" if any(cb == b for cb, _ in self.shared) else "start-up estimate"
            lines.append(f"batch {bucket_label(b)}: length {length} last; best {best if gain > 1 else 0} "
                         f"({gain:.2f}x of {plain:.1f} tok/s without drafts at {best}, {measured}; "
                         f"{self._greedy_share[b]:.0%} of rows greedy), acceptance {self.acceptance_line()}")
        return lines

    def acceptance_line(self) -> str:
        """Greedy rows' and sampled rows' acceptance per position, in one line."""
        return "; ".join(f"{name} " + "/".join(f"{a:.2f}" for a in self.acceptance(greedy))
                         for name, greedy in (("greedy", True), ("sampled", False)))

    def lengths(self) -> dict[str, int]:
        """The best length of each batch-size bucket at its last step (exploring aside)."""
        return {bucket_label(b): n for b, n in sorted(self.best.items())}

    def state(self) -> dict[str, object]:
        return {"lengths": self.lengths(),
                "acceptance": {name: [round(a, 4) for a in self.acceptance(greedy)]
                               for name, greedy in (("greedy", True), ("sampled", False))},
                "cost_scale": {f"{bucket_label(b)}/{n}": round(cell[0], 4) for (b, n), cell in sorted(self.shared.items())},
                # per bucket: drafted cycles' seconds beyond the target alone (negative: gained), over served
                "loss_share": {bucket_label(b): round(loss / served, 4) for b, (loss, served)
                               in sorted(self.shared_loss.items()) if served > 0},
                "startup_timings": {name: list(points) for name, points in vars(self.timings).items()}}


class FixedLength:
    """``adaptive_length: false``: every step drafts k."""

    def __init__(self, k: int) -> None:
        self.k = k

    def _nothing(self, *args: object, **kwargs: object) -> None:
        """What the controller learns from (observe, record_cycle) and shares (share_due, take_shared): unused."""

    observe = record_cycle = share_due = take_shared = _nothing

    def length(self, batch: int, *args: object, **kwargs: object) -> int:
        return self.k

    def outlook(self, batches: Sequence[int]) -> str:
        return f"every batch size drafts {self.k} (adaptive_length false)"

    def summary(self) -> list[str]:
        return [self.outlook(())]

    def lengths(self) -> dict[str, int]:
        return {"all": self.k}

    def state(self) -> dict[str, object]:
        return {"lengths": self.lengths()}
