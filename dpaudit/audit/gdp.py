"""Gaussian differential privacy (Dong, Roth & Su 2022): the trade-off curve G_mu and its (eps, delta).

A mechanism is mu-GDP when telling D from D' is no easier than telling N(0, 1) from N(mu, 1):
type-II error >= G_mu(type-I error) = Phi(Phi^{-1}(1 - a) - mu). Its (eps, delta) curve is exactly
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)            (Corollary 2.13),
the privacy curve of one Gaussian release with noise multiplier 1/mu, which dp-accounting computes
(``get_epsilon_gaussian``); we only wrap it for mu = 0 and mu = infinity.
"""

from __future__ import annotations

import math
from functools import lru_cache


@lru_cache(maxsize=4096)  # pure; the ceilings ask it for the same mu at every look and guess set's size
def epsilon_from_mu(mu: float, delta: float) -> float:
    """The smallest eps such that every mu-GDP mechanism is (eps, delta)-DP."""
    if mu <= 0:
        return 0.0
    if not math.isfinite(mu):
        return math.inf
    if delta <= 0:
        return math.inf  # G_mu touches the axes only at infinity: no finite pure eps
    from dp_accounting import get_epsilon_gaussian

    return float(get_epsilon_gaussian(1.0 / mu, delta))


def mu_from_epsilon(eps: float, delta: float) -> float:
    """The mu whose (eps, delta) curve passes through (eps, delta)."""
    if delta <= 0:
        return 0.0
    from dp_accounting import get_sigma_gaussian

    sigma = float(get_sigma_gaussian(eps, delta))
    return math.inf if sigma == 0 else 1.0 / sigma
