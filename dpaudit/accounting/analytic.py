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
from dpaudit.accounting.result import NO_SUBSAMPLING, SINGLE_RELEASE, EpsilonResult
from dpaudit.errors import DPAuditError


def limitation(mech: Mechanism) -> str | None:
    """None when this accountant is exact for ``mech``, else why it does not apply."""
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


def sigma_closed_form(mech: Mechanism, target_eps: float, delta: float) -> float:
    _require(mech)
    if mech.kind == "gaussian":
        from dp_accounting.gaussian_mechanism import get_sigma_gaussian

        return float(get_sigma_gaussian(target_eps, delta)) * math.sqrt(mech.steps)
    # eps = 1/b + 2 log(1 - delta)  =>  b = 1 / (eps - 2 log(1 - delta))
    return 1.0 / (target_eps - 2.0 * math.log1p(-delta))
