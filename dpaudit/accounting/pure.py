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

Fixed-size batches (B of N without replacement, replace-one neighbours): replacing one example moves the
clipped sum by up to 2C in L1, so one Laplace release is (2 / sigma)-DP, and sampling without replacement
amplifies it to log(1 + (B / N)(e^{2/sigma} - 1)) (Balle, Barthe & Gaboardi 2018: sampling without
replacement under the substitution relation). Phases add up (basic composition).

User level, ELS (accounting/unit.py): a user's k records each sampled at rate p make a step pure (k eps_1)-DP,
exactly: sup_x P(x) / Q(x) = E[e^{J / sigma}] = (1 - p + p e^{1/sigma})^k for J ~ Binomial(k, p), the remove
direction (the add direction's -k log(1 - p + p e^{-1/sigma}) is smaller). Both routes here take that eps_1.
"""

from __future__ import annotations

import math

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.samplers import relation_of, scheme
from dpaudit.core.errors import DPAuditError
from dpaudit.core import limits as budget

RR_BYTES_PER_STEP = 48  # randomized_response_delta: a few float64 arrays of T + 1 entries


def step_epsilon(sigma: float, p: float) -> float:
    """eps_1 = log(1 - p + p e^{1/sigma}), computed without overflow for small sigma."""
    if p == 1.0:
        return 1.0 / sigma
    return _logaddexp(math.log1p(-p), math.log(p) + 1.0 / sigma)


def _logaddexp(a: float, b: float) -> float:
    """log(e^a + e^b) in plain floats (the closed forms stay free of numpy for a fast start)."""
    hi, lo = max(a, b), min(a, b)
    return hi + math.log1p(math.exp(lo - hi))


def sigma_for_step_epsilon(eps1: float, p: float) -> float:
    """Inverse of ``step_epsilon``: sigma = 1 / log(1 + (e^{eps_1} - 1) / p)."""
    if p == 1.0:
        return 1.0 / eps1
    return 1.0 / _logaddexp(0.0, math.log(math.expm1(eps1)) - math.log(p))


def _require_laplace(mech: Mechanism, name: str) -> None:
    if mech.kind != "laplace":
        raise DPAuditError(f"the {name} accountant is for the Laplace mechanism (a Gaussian step is not pure eps-DP)")


def phase_epsilon(mech: Mechanism) -> float:
    """eps_1 of one step of ``mech``: Poisson (add/remove) or without replacement (replace-one: the sampler's
    sensitivity 2, so 2 / sigma); an ELS user's k records: k times the record's."""
    return mech.group * step_epsilon(mech.sigma / scheme(mech.sampling).sensitivity, mech.sampling_rate)


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    for part in mech.phases:
        _require_laplace(part, "pure")
    eps1 = phase_epsilon(mech.phases[0])
    return EpsilonResult(
        accountant="pure",
        epsilon=sum(part.steps * phase_epsilon(part) for part in mech.phases),
        delta=delta,
        relation=relation_of(mech),
        guarantee="pure eps-DP by basic composition: exact at delta = 0, an upper bound at any delta",
        details={"step_epsilon": eps1},
    )


def sigma_closed_form(mech: Mechanism, target_eps: float) -> float | None:
    """Smallest sigma with T * eps_1(sigma) <= target (exact inverse of the `pure` bound); None for phases
    (calibration searches their multiplier)."""
    if not isinstance(mech, Mechanism):
        return None
    sigma = sigma_for_step_epsilon(target_eps / (mech.steps * mech.group), mech.sampling_rate)
    return scheme(mech.sampling).sensitivity * sigma


def prv_epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    _require_laplace(mech, "pure-prv")
    if delta <= 0:
        raise DPAuditError("pure-prv needs delta > 0; at delta = 0 use the pure accountant")

    budget.current().require(RR_BYTES_PER_STEP * (mech.steps + 1), f"pure-prv at T = {mech.steps}",
                             "the pure accountant (T * eps_1) answers at any T")
    eps1 = phase_epsilon(mech)
    eps = randomized_response_epsilon(eps1, mech.steps, delta)
    return EpsilonResult(
        accountant="pure-prv",
        epsilon=eps,
        delta=delta,
        relation=relation_of(mech),
        guarantee="upper bound (each step as randomized response with eps_1, composed exactly)",
        details={"step_epsilon": eps1},
    )


def randomized_response_delta(eps1: float, steps: int, eps: float) -> float:
    """Exact delta(eps) of T-fold randomized response with eps_1 (the pure-DP dominating pair)."""
    import numpy as np
    from scipy.special import expit, logsumexp
    from scipy.stats import binom

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
    from scipy.optimize import brentq

    top = steps * eps1
    if randomized_response_delta(eps1, steps, 0.0) <= delta:
        return 0.0
    root = brentq(lambda e: randomized_response_delta(eps1, steps, e) - delta, 0.0, top, xtol=1e-10)
    return min(top, root + 1e-9)
