"""Clopper-Pearson eps lower bound from one decision threshold (Jagielski et al. 2020 style).

(eps, delta)-DP forces TPR <= e^eps FPR + delta and TNR <= e^eps FNR + delta. With exact one-sided
binomial intervals TPR >= TPR_lo and FPR <= FPR_hi (each at alpha/2), both hold with probability >= 1 - alpha:
    eps >= max(log((TPR_lo - delta) / FPR_hi), log((1 - FPR_hi - delta) / (1 - TPR_lo))).
It treats each canary as an independent trial; in a one-run audit that is an approximation (the
one-run bound in ``one_run`` is the one that holds for a single training run).
"""

from __future__ import annotations

import math

from scipy import stats


def lower_rate(successes: int, trials: int, alpha: float) -> float:
    """One-sided Clopper-Pearson lower limit at level alpha."""
    return 0.0 if successes == 0 else float(stats.beta.ppf(alpha, successes, trials - successes + 1))


def upper_rate(successes: int, trials: int, alpha: float) -> float:
    """One-sided Clopper-Pearson upper limit at level alpha."""
    return 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha, successes + 1, trials - successes))


def _log_ratio(num: float, den: float) -> float:
    if num <= 0:
        return 0.0
    if den <= 0:
        return math.inf
    return max(0.0, math.log(num / den))


def epsilon_lower_bound(true_pos: int, members: int, false_pos: int, nonmembers: int,
                        delta: float = 0.0, alpha: float = 0.05) -> float:
    tpr_lo = lower_rate(true_pos, members, alpha / 2)
    fpr_hi = upper_rate(false_pos, nonmembers, alpha / 2)
    return max(_log_ratio(tpr_lo - delta, fpr_hi), _log_ratio(1 - fpr_hi - delta, 1 - tpr_lo))
