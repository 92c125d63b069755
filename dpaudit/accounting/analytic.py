"""`analytic`: exact epsilon without subsampling (p = 1).

Gaussian: the analytic Gaussian mechanism (Balle & Wang 2018) via dp-accounting, exact:
delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s). T full-batch steps compose
to one Gaussian release with s / sqrt(T) (the privacy loss of each step is Gaussian, and
sums of Gaussians are Gaussian), so this is exact for any T at p = 1.
Laplace: eps = 1/b at delta = 0 (Dwork & Roth); for delta > 0 the hockey-stick divergence
of Lap(0,b) vs Lap(1,b) is delta(eps) = 1 - exp((eps - 1/b)/2), so eps = 1/b + 2 log(1 - delta).
"""

from __future__ import annotations

import math

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import NO_SUBSAMPLING, SINGLE_RELEASE, DeltaResult, EpsilonResult
from dpaudit.core.errors import DPAuditError


def limitation(mech: Mechanism) -> str | None:
    """None when this accountant is exact for ``mech``, else why it does not apply."""
    if not isinstance(mech, Mechanism):  # the samplers it covers: the registry's rule (Accountant.covers)
        return "analytic covers one phase without subsampling; use pld for this schedule"
    if mech.kind == "gaussian" and mech.sampling_rate == 1.0:
        return None
    if mech.is_single_release:
        return None
    return "analytic covers the gaussian without subsampling and one laplace release; use pld for this run"


def _require(mech: Mechanism) -> None:
    reason = limitation(mech)
    if reason:
        raise DPAuditError(reason)


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    _require(mech)
    if mech.kind == "gaussian":
        if delta <= 0:
            raise DPAuditError("the Gaussian mechanism has no finite epsilon at delta = 0; give delta > 0")
        from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

        eps = float(get_epsilon_gaussian(mech.sigma / math.sqrt(mech.steps), delta))
        how = "exact (analytic Gaussian mechanism, Balle & Wang 2018)"
    else:
        eps = max(0.0, 1.0 / mech.sigma + 2.0 * math.log1p(-delta))
        how = "exact (Laplace mechanism hockey-stick divergence)"
    relation = SINGLE_RELEASE if mech.is_single_release else NO_SUBSAMPLING
    return EpsilonResult("analytic", eps, delta, relation, how)


def has_delta(mech: Mechanism) -> bool:
    """delta(eps) in closed form: the Gaussian at p = 1 (the Laplace release is answered by pld)."""
    return mech.kind == "gaussian"


def delta(mech: Mechanism, eps: float) -> DeltaResult:
    """Exact delta(eps) of T full-batch Gaussian steps (one Gaussian release with sigma / sqrt(T)), so that
    epsilon(delta) and delta(epsilon) are the same curve read both ways."""
    _require(mech)
    if not has_delta(mech):
        raise DPAuditError("analytic delta(eps) covers the Gaussian; use pld for the Laplace mechanism")
    from scipy.special import log_ndtr

    s = mech.sigma / math.sqrt(mech.steps)  # the formula in the module docstring, in log space for its tails
    value = max(0.0, float(math.exp(log_ndtr(0.5 / s - eps * s)) - math.exp(eps + log_ndtr(-0.5 / s - eps * s))))
    relation = SINGLE_RELEASE if mech.is_single_release else NO_SUBSAMPLING
    return DeltaResult("analytic", value, eps, relation, "exact (analytic Gaussian mechanism, Balle & Wang 2018)")


def sigma_closed_form(mech: Mechanism, target_eps: float, delta: float) -> float:
    _require(mech)
    if mech.kind == "gaussian":
        from dp_accounting.gaussian_mechanism import get_sigma_gaussian

        return float(get_sigma_gaussian(target_eps, delta)) * math.sqrt(mech.steps)
    # eps = 1/b + 2 log(1 - delta)  =>  b = 1 / (eps - 2 log(1 - delta))
    return 1.0 / (target_eps - 2.0 * math.log1p(-delta))
