"""The continuous-statistic audit for white-box scores (Agrawal et al. 2026, "Let's Ask Gauss").

A white-box score that sums a canary-aligned signal over many released updates (the alignment of every
noisy DP-SGD gradient with the canary's direction, or the correlation of DP-ZO's released scalars with
the canary's sign pattern) is, by the central limit theorem, Gaussian: N(0, s^2) for a canary left
out and N(mu s, s^2) for one put in, and the best test between the two is mu-GDP's. So the audit
estimates mu with all m scores rather than a few tail counts. With n1 members and n0 non-members,
t = (mean_in - mean_out) / (s_pooled sqrt(1/n1 + 1/n0)) has a noncentral t law with n1 + n0 - 2
degrees of freedom and noncentrality mu / sqrt(1/n1 + 1/n0) (exact for Gaussian scores); the
one-sided (1 - alpha) lower confidence limit of mu inverts it, and eps follows at the run's delta
through G_mu (``gdp.epsilon_from_mu``).

Valid as the scores are Gaussian shifts: asymptotically for sums over many steps, not for a single
black-box loss. scipy's noncentral t does the numerics.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, stats

from dpaudit.core.errors import DPAuditError


def mu_estimate(in_scores: np.ndarray, out_scores: np.ndarray) -> tuple[float, float, float]:
    """(mu_hat, t statistic, scale factor sqrt(1/n1 + 1/n0)) with the pooled standard deviation."""
    n1, n0 = len(in_scores), len(out_scores)
    ss = ((in_scores - in_scores.mean()) ** 2).sum() + ((out_scores - out_scores.mean()) ** 2).sum()
    sd = math.sqrt(ss / (n1 + n0 - 2))
    factor = math.sqrt(1 / n1 + 1 / n0)
    diff = float(in_scores.mean() - out_scores.mean())
    if sd == 0:
        return (math.inf if diff > 0 else 0.0), (math.inf if diff > 0 else 0.0), factor
    return diff / sd, diff / (sd * factor), factor


def mu_lower_bound(in_scores, out_scores, alpha: float = 0.05) -> tuple[float, float]:
    """(mu_lb, mu_hat): P[mu_lb > mu] <= alpha for Gaussian-shift scores; mu_lb is 0 when not positive."""
    in_scores, out_scores = np.asarray(in_scores, float), np.asarray(out_scores, float)
    if len(in_scores) < 2 or len(out_scores) < 2:
        raise DPAuditError("the Gaussian audit needs at least 2 members and 2 non-members")
    mu_hat, t, factor = mu_estimate(in_scores, out_scores)
    if not math.isfinite(t):
        return (math.inf, math.inf) if t > 0 else (0.0, mu_hat)
    df = len(in_scores) + len(out_scores) - 2

    def tail(nc: float) -> float:  # P[T >= t | noncentrality nc], increasing in nc
        return float(stats.nct.sf(t, df, nc)) - alpha

    if tail(0.0) >= 0:
        return 0.0, mu_hat
    lo, hi = 0.0, max(1.0, 2 * t)
    while tail(hi) < 0:
        lo, hi = hi, 2 * hi
    return float(optimize.brentq(tail, lo, hi, xtol=1e-9)) * factor, mu_hat
