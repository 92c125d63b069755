"""`pure` and `pure-prv`: the subsampled Laplace mechanism as a pure eps-DP step.

Per step, Poisson subsampling amplifies the Laplace mechanism's 1/sigma to
eps_1 = log(1 + p (e^{1/sigma} - 1)) (Balle, Barthe & Gaboardi 2018; tight for add/remove).
`pure` composes basically: eps = T * eps_1, tight at delta = 0 and an upper bound at every
delta. `pure-prv` is the DP-ZO paper's "pure-DP PRV" route for delta > 0: each step is
replaced by its dominating pair, randomized response with eps_1 (Kairouz, Oh & Viswanath
2015), and the T-fold composition is computed. The composed privacy loss of randomized
response is eps_1 (2K - T) with K ~ Binomial(T, e^{eps_1} / (1 + e^{eps_1})), so its
delta(eps) is a finite binomial sum that we evaluate exactly (in log space) instead of
discretising it as prv-accountant would; tests check the two agree.
"""

from __future__ import annotations

import math

import numpy as np

from scipy.optimize import brentq
from scipy.special import expit, logsumexp
from scipy.stats import binom

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import ADD_REMOVE, SINGLE_RELEASE, EpsilonResult
from dpaudit.errors import DPAuditError


def step_epsilon(sigma: float, p: float) -> float:
    """eps_1 = log(1 - p + p e^{1/sigma}), computed without overflow for small sigma."""
    if p == 1.0:
        return 1.0 / sigma
    return float(np.logaddexp(math.log1p(-p), math.log(p) + 1.0 / sigma))


def sigma_for_step_epsilon(eps1: float, p: float) -> float:
    """Inverse of ``step_epsilon``: sigma = 1 / log(1 + (e^{eps_1} - 1) / p)."""
    if p == 1.0:
        return 1.0 / eps1
    return 1.0 / float(np.logaddexp(0.0, math.log(math.expm1(eps1)) - math.log(p)))


def _require_laplace(mech: Mechanism, name: str) -> None:
    if mech.kind != "laplace":
        raise DPAuditError(f"the {name} accountant is for the Laplace mechanism (a Gaussian step is not pure eps-DP)")


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    _require_laplace(mech, "pure")
    eps1 = step_epsilon(mech.sigma, mech.sampling_rate)
    return EpsilonResult(
        accountant="pure",
        epsilon=mech.steps * eps1,
        delta=delta,
        relation=SINGLE_RELEASE if mech.is_single_release else ADD_REMOVE,
        guarantee="pure eps-DP by basic composition: exact at delta = 0, an upper bound at any delta",
        details={"step_epsilon": eps1},
    )


def sigma_closed_form(mech: Mechanism, target_eps: float) -> float:
    """Smallest sigma with T * eps_1(sigma) <= target (exact inverse of the `pure` bound)."""
    return sigma_for_step_epsilon(target_eps / mech.steps, mech.sampling_rate)


def prv_epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    _require_laplace(mech, "pure-prv")
    if delta <= 0:
        raise DPAuditError("pure-prv needs delta > 0; at delta = 0 use the pure accountant")
    eps1 = step_epsilon(mech.sigma, mech.sampling_rate)
    eps = randomized_response_epsilon(eps1, mech.steps, delta)
    return EpsilonResult(
        accountant="pure-prv",
        epsilon=eps,
        delta=delta,
        relation=SINGLE_RELEASE if mech.is_single_release else ADD_REMOVE,
        guarantee="upper bound (each step as randomized response with eps_1, composed exactly)",
        details={"step_epsilon": eps1},
    )


def randomized_response_delta(eps1: float, steps: int, eps: float) -> float:
    """Exact delta(eps) of T-fold randomized response with eps_1 (the pure-DP dominating pair)."""
    k = np.arange(steps + 1)
    loss = eps1 * (2 * k - steps)
    keep = loss > eps
    if not keep.any():
        return 0.0
    k, loss = k[keep], loss[keep]
    log_pmf = binom.logpmf(k, steps, expit(eps1))
    # sum_k P(K=k) (1 - e^{eps - L_k}), every term positive
    return float(np.exp(logsumexp(log_pmf + np.log(-np.expm1(eps - loss)))))


def randomized_response_epsilon(eps1: float, steps: int, delta: float) -> float:
    """Smallest eps with delta(eps) <= delta, found to 1e-9 and rounded up to stay a bound."""
    top = steps * eps1
    if randomized_response_delta(eps1, steps, 0.0) <= delta:
        return 0.0
    root = brentq(lambda e: randomized_response_delta(eps1, steps, e) - delta, 0.0, top, xtol=1e-10)
    return min(top, root + 1e-9)
