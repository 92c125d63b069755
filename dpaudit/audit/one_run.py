"""The one-run auditing bound of Steinke, Nasr & Jagielski (NeurIPS 2023, Theorem 3.1 / Prop. 5.7).

m canaries are each included independently with probability 1/2. The auditor guesses on r of them
(abstaining on the rest) and v guesses are right. Under (eps, delta)-DP, with q = e^eps / (1 + e^eps)
and f(v) = P[Binomial(r, q) >= v]:

    P[V >= v] <= f(v) + 2 m delta * max_{1 <= i <= v} (f(v - i) - f(v)) / i.

The eps lower bound at confidence 1 - alpha is the largest eps whose p-value is still <= alpha.
No maintained library ships this bound (the authors' code is a notebook), so it is written here
from the statement above; tests reproduce the paper's reference values from first principles.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy import optimize, stats

from dpaudit.core.errors import DPAuditError
from dpaudit.core.validate import check_alpha, check_delta

EPS_CEILING = 100.0  # no audit with fewer than ~1e40 guesses can certify more


def p_value(eps: float, m: int, r: int, v: int, delta: float) -> float:
    """Upper bound on P[V >= v] for an (eps, delta)-DP algorithm (probability of the observed success)."""
    if v <= 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-eps))
    tail = stats.binom.sf(np.arange(v + 1) - 1, r, q)  # tail[j] = P[Binomial(r, q) >= j]
    f_v = float(tail[v])
    if delta == 0:
        return min(1.0, f_v)
    i = np.arange(1, v + 1)
    slack = float(np.max((tail[v - i] - f_v) / i))
    return min(1.0, f_v + 2.0 * m * delta * slack)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, alpha: float = 0.05,
                        floor: float = 0.0) -> float:
    """Largest eps rejected at level alpha: with probability >= 1 - alpha the true eps is at least this.

    Returns ``floor`` (default 0) when no eps above it is rejected (at 0: v is no better than coin
    flips); a search over many guess sets passes the best bound so far and skips the rest cheaply.
    """
    if not (0 <= v <= r <= m):
        raise DPAuditError(f"need 0 <= v <= r <= m, got m={m}, r={r}, v={v}")
    check_alpha(alpha)
    check_delta(delta, allow_zero=True)
    if r == 0 or p_value(floor, m, r, v, delta) > alpha:
        return floor
    if p_value(EPS_CEILING, m, r, v, delta) <= alpha:
        return EPS_CEILING
    # p_value is increasing in eps (q grows, and so does every binomial tail); bisect the crossing.
    return float(optimize.brentq(lambda e: p_value(e, m, r, v, delta) - alpha, floor, EPS_CEILING,
                                 xtol=1e-10, rtol=1e-12))


@lru_cache(maxsize=4096)  # a pure function of its numbers, asked again at every look and for every guess set's size
def ceiling(m: int, r: int, delta: float = 0.0, alpha: float = 0.05, right: int | None = None) -> float:
    """The largest bound r guesses can report: all of them correct, or ``right`` of them where the membership allows
    no more (r above the number of members)."""
    return epsilon_lower_bound(m, r, r if right is None else right, delta, alpha)
