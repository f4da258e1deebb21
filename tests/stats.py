"""Two-sample test that two samplers draw from the same distribution."""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

from scipy.stats import chi2_contingency

# The pass threshold of every two-sample test of the suite (11 of them, unseeded: they draw
# fresh samples each run). At 1e-3 each, a clean suite run failed about 1.1% of the time, and
# one did (stop 20's CI, p = 7.6e-4 on a setting that gave p = 0.6 on 80,000 samples per side
# here); at 1e-4 it is about 0.11%. The tests raised N by 1.5x with it: for a chi-square test
# with 4 or more degrees of freedom, the noncentrality that gives 50% (90%) power at 1e-4 is at
# most 1.33x (1.24x) the one at 1e-3, so every shift is found at least as often as before.
ALPHA = 1e-4


def homogeneity_pvalue(a: Sequence[Hashable], b: Sequence[Hashable], min_count: int = 10) -> float:
    """Chi-square test of homogeneity on the outcome counts of ``a`` and ``b``.

    Outcomes seen fewer than ``min_count`` times in both samples together are
    pooled into one cell, so every expected count is reasonably large.
    Under the null (same distribution) the p-value is uniform: the threshold
    ``ALPHA`` (1e-4) gives a false-alarm rate of 0.01% per test.
    """
    ca, cb = Counter(a), Counter(b)
    cells = sorted(set(ca) | set(cb), key=repr)
    big = [c for c in cells if ca[c] + cb[c] >= min_count]
    rare = [c for c in cells if ca[c] + cb[c] < min_count]
    row_a = [ca[c] for c in big]
    row_b = [cb[c] for c in big]
    if rare:
        row_a.append(sum(ca[c] for c in rare))
        row_b.append(sum(cb[c] for c in rare))
    if len(row_a) < 2:
        return 1.0
    _, p, _, _ = chi2_contingency([row_a, row_b], correction=False)
    return float(p)
