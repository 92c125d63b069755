"""The f-DP one-run audit of Mahloujifar, Melis & Chaudhuri (ICML 2025, "Auditing f-differential
privacy in one run"), for the Gaussian family f = G_mu and for the (eps, delta) trade-off curve.

m canaries are each included with probability 1/2; the auditor makes k guesses of which v are right.
If the mechanism is f-DP, the probability of v or more right guesses is bounded by a recursion over the
trade-off curve (the paper's Theorem 9 / Algorithm "audit with cap"): start from the mass
r = alpha v / m on right and h = alpha (k - v) / m on wrong guesses, then for i = v - 1, ..., 0 raise h
to f's inverse blow-up of r, h <- max(h, finv(r)), and r by i / (k - i) times the rise of h. The claim
"f-DP" is rejected at level alpha when the final r + h exceeds k / m. For f = G_mu the inverse blow-up
is finv(x) = Phi(Phi^{-1}(x) - mu); for (eps, delta)-DP, finv(x) = max(0, e^-eps (x - delta),
1 - delta - e^eps (1 - x)).

The bound reported is mu_lb, the largest mu whose claim "mu-GDP" is rejected, and the eps it implies at
the run's delta (``gdp.epsilon_from_mu``). It is valid (exceeds the truth with probability <= alpha)
for mechanisms whose trade-off curve is Gaussian, as DP-SGD / DP-ZO with many steps are (CLT); the
(eps, delta) form (``epsilon_lower_bound``) and the Steinke et al. bound in ``one_run`` need no such
shape. No maintained library without JAX ships this
test (jax_privacy's ``auditing.py`` does), so it is written here from the paper; tests reproduce
jax_privacy's published test values from first principles.
"""

from __future__ import annotations

import math
from functools import lru_cache

from scipy import optimize
from scipy.special import ndtr, ndtri

from dpaudit.core.errors import DPAuditError

MU_CEILING = 40.0  # beyond this every G_mu is indistinguishable from "no privacy" at double precision
EPS_CEILING = 100.0


def gdp_inverse_blow_up(mu: float):
    """G_mu: an event of probability y with the canary in has probability >= Phi(Phi^{-1}(y) - mu) without."""
    return lambda y: float(ndtr(ndtri(y) - mu))


def approx_dp_inverse_blow_up(eps: float, delta: float):
    """(eps, delta)-DP: probability y with the canary in forces >= max(0, e^-eps (y - delta),
    1 - delta - e^eps (1 - y)) without (the trade-off curve of every (eps, delta)-DP mechanism)."""
    def finv(y: float) -> float:
        return max(0.0, math.exp(-eps) * (y - delta), 1.0 - delta - math.exp(eps) * (1.0 - y))
    return finv


def statistic(finv, m: int, k: int, v: int, alpha: float) -> float:
    """Positive when v right guesses out of k (of m canaries) reject "f-DP" at level alpha."""
    if k == 0 or v == 0:
        return -1.0
    r = alpha * v / m
    h = alpha * (k - v) / m
    for i in range(v - 1, -1, -1):
        h_new = max(h, finv(r))
        if h_new == h:
            break  # from here on neither h nor r can change
        r = min(r + i / (k - i) * (h_new - h), 1.0)
        h = h_new
    return r + h - k / m


def rejects(mu: float, m: int, k: int, v: int, alpha: float) -> float:
    """Positive when the guesses reject "mu-GDP" at level alpha."""
    return statistic(gdp_inverse_blow_up(mu), m, k, v, alpha)


def mu_lower_bound(m: int, k: int, v: int, alpha: float, floor: float = 0.0) -> float:
    """The largest mu rejected at level alpha (``floor`` when none above it is): P[mu_lb > mu] <= alpha."""
    if not (0 <= v <= k <= m):
        raise DPAuditError(f"need 0 <= v <= k <= m, got m={m}, k={k}, v={v}")
    if rejects(floor, m, k, v, alpha) <= 0:
        return floor
    if rejects(MU_CEILING, m, k, v, alpha) > 0:
        return MU_CEILING
    # Larger mu is a weaker claim, so the statistic falls with mu: one crossing.
    return float(optimize.brentq(lambda mu: rejects(mu, m, k, v, alpha), floor, MU_CEILING, xtol=1e-7))


@lru_cache(maxsize=4096)  # pure: asked again at every look and for every guess set's size
def ceiling(m: int, k: int, alpha: float, right: int | None = None) -> float:
    """The largest mu any k guesses on m canaries can show (all right, or ``right`` of them where no more can be)."""
    return mu_lower_bound(m, k, k if right is None else right, alpha)


@lru_cache(maxsize=4096)
def epsilon_ceiling(m: int, k: int, delta: float, alpha: float, right: int | None = None) -> float:
    """The largest eps any k guesses on m canaries can show against the (eps, delta) curve (all right, or
    ``right`` of them where no more can be)."""
    return epsilon_lower_bound(m, k, k if right is None else right, delta, alpha)


def epsilon_lower_bound(m: int, k: int, v: int, delta: float, alpha: float, floor: float = 0.0) -> float:
    """The largest eps whose "(eps, delta)-DP" claim the guesses reject: valid for every mechanism."""
    def stat(eps: float) -> float:
        return statistic(approx_dp_inverse_blow_up(eps, delta), m, k, v, alpha)

    if stat(floor) <= 0:
        return floor
    hi = max(1.0, 2 * floor)
    while stat(hi) > 0:
        if hi > EPS_CEILING:
            return EPS_CEILING
        floor, hi = hi, 2 * hi
    return float(optimize.brentq(stat, floor, hi, xtol=1e-7))
