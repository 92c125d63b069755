"""`prv`: Microsoft's prv-accountant for the Poisson-subsampled Gaussian, both directions.

prv-accountant's ``PoissonSubsampledGaussianMechanism`` is the privacy random variable of
the *remove* direction only (P = (1-p)N(0,s^2) + pN(1,s^2) against Q = N(0,s^2)). Under
add/remove neighbours the *add* direction (Q against P) must be composed as well; neither
dominates the other, so we compose both with prv-accountant's own machinery and report the
max of their upper bounds. The add-direction variable below is not in the library: that is
why it is written here.
"""

from __future__ import annotations

import numpy as np
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import (
    PoissonSubsampledGaussianMechanism,
    PrivacyRandomVariable,
)
from scipy.special import ndtr

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import ADD_REMOVE, SINGLE_RELEASE, EpsilonResult
from dpaudit.errors import DPAuditError

EPS_ERROR = 1e-3
DELTA_ERROR_FRACTION = 1e-3


class PoissonSubsampledGaussianAdd(PrivacyRandomVariable):
    """Privacy loss L = log(Q(x)/P(x)), x ~ Q = N(0, s^2), P = (1-p)N(0,s^2) + pN(1,s^2).

    L(x) = -log(1 - p + p exp((2x - 1) / (2 s^2))) is decreasing in x with sup -log(1-p), so
    P[L <= t] = P[x >= x*(t)] = Phi(-x*/s) with x*(t) = s^2 log((e^{-t} - 1 + p)/p) + 1/2.
    """

    def __init__(self, sampling_probability: float, noise_multiplier: float) -> None:
        self.p = float(sampling_probability)
        self.sigma = float(noise_multiplier)
        # RDP is only used by prv-accountant to size its domain. For alpha >= 1 the add
        # direction's Renyi divergence is at most the remove direction's (Mironov, Talwar &
        # Zhang 2019, Thm. 5), so the remove direction's RDP is a valid bound here.
        self._remove = PoissonSubsampledGaussianMechanism(sampling_probability, noise_multiplier)

    def cdf(self, t):
        t = np.asarray(t, dtype=np.float64)
        top = -np.log1p(-self.p) if self.p < 1 else np.inf
        inside = t < top
        arg = np.where(inside, np.expm1(-np.minimum(t, top)) + self.p, 1.0)
        arg = np.where(arg > 0, arg, np.finfo(float).tiny)
        x_star = self.sigma ** 2 * (np.log(arg) - np.log(self.p)) + 0.5
        return np.where(inside, ndtr(-x_star / self.sigma), 1.0)

    def rdp(self, alpha: float) -> float:
        return self._remove.rdp(alpha)


def _compose_upper(prv: PrivacyRandomVariable, steps: int, delta: float, eps_error: float) -> float:
    delta_error = DELTA_ERROR_FRACTION * delta
    try:
        accountant = PRVAccountant(prvs=[prv], max_self_compositions=[steps],
                                   eps_error=eps_error, delta_error=delta_error)
        _, _, upper = accountant.compute_epsilon(delta=delta, num_self_compositions=[steps])
    except (ValueError, RuntimeError) as exc:
        raise DPAuditError(f"prv-accountant cannot answer this query ({exc})") from None
    return float(upper)


def epsilon(mech: Mechanism, delta: float, eps_error: float = EPS_ERROR) -> EpsilonResult:
    """Max over both directions of prv-accountant's upper bounds. A larger ``eps_error`` is
    faster (coarser mesh) and still an upper bound, looser by about ``eps_error``."""
    if mech.kind != "gaussian":
        raise DPAuditError("the prv accountant covers the subsampled Gaussian; for Laplace use pld, mc or pure-prv")
    remove = _compose_upper(PoissonSubsampledGaussianMechanism(mech.sampling_rate, mech.sigma), mech.steps, delta, eps_error)
    if mech.sampling_rate < 1:
        add = _compose_upper(PoissonSubsampledGaussianAdd(mech.sampling_rate, mech.sigma), mech.steps, delta, eps_error)
    else:
        add = remove
    return EpsilonResult(
        accountant="prv",
        epsilon=max(remove, add),
        delta=delta,
        relation=SINGLE_RELEASE if mech.is_single_release else ADD_REMOVE,
        guarantee=f"upper bound (prv-accountant, eps_error={eps_error:g}, delta_error={DELTA_ERROR_FRACTION:g}*delta)",
        directions={"remove": remove, "add": add},
        details={"eps_error": eps_error, "delta_error": DELTA_ERROR_FRACTION * delta},
    )

