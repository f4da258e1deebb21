"""Two-sample test that two samplers draw from the same distribution."""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

from scipy.stats import chi2_contingency


def homogeneity_pvalue(a: Sequence[Hashable], b: Sequence[Hashable], min_count: int = 10) -> float:
    """Chi-square test of homogeneity on the outcome counts of ``a`` and ``b``.

    Outcomes seen fewer than ``min_count`` times in both samples together are
    pooled into one cell, so every expected count is reasonably large.
    Under the null (same distribution) the p-value is uniform: a threshold of
    1e-3 gives a false-alarm rate of 0.1% per test.
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
