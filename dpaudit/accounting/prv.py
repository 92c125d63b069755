"""`prv`: Microsoft's prv-accountant for the Poisson-subsampled Gaussian, both directions.

prv-accountant's ``PoissonSubsampledGaussianMechanism`` is the privacy random variable of
the *remove* direction only (P = (1-p)N(0,s^2) + pN(1,s^2) against Q = N(0,s^2)). Under
add/remove neighbours the *add* direction (Q against P) must be composed as well; neither
dominates the other, so we compose both with prv-accountant's own machinery and report the
max of their upper bounds. The add-direction variable below is not in the library: that is
why it is written here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from prv_accountant import PRVAccountant
from prv_accountant.privacy_random_variables import (
    PoissonSubsampledGaussianMechanism,
    PrivacyRandomVariable,
)
from scipy.special import ndtr

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core.errors import DPAuditError
from dpaudit.core import limits as budget

EPS_ERROR = 1e-3         # the finest mesh we ask for; coarser when the budget needs it
DELTA_ERROR_FRACTION = 1e-3
MESH_BYTES = 400         # measured: prv-accountant's discretise + compose, per mesh point and direction
MESH_SECONDS = 4e-6      # measured (2 cores), per mesh point and direction
SECONDS_PER_EVALUATION = 6.0  # both directions; fixed (answers do not depend on the clock), so a
                              # calibration (~8 evaluations) fits the default 60 s
MAX_EPS_ERROR = 0.5      # coarser than this is refused: the bound would be loose by more than 0.5


@dataclass(frozen=True)
class PrvOptions:
    """``eps_error``: prv-accountant's mesh error; larger is faster and still an upper bound (looser by
    about eps_error). None: chosen so the mesh fits the memory budget."""

    eps_error: float | None = None


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


def mesh_points(prv: PrivacyRandomVariable, steps: int, delta: float, eps_error: float) -> float:
    """prv-accountant's mesh size for this query, computed as it will (Gopi et al. 2021, remark 5.6):
    domain [-L, L] from RDP, mesh eps_error / sqrt(T/2 log(12/delta_error)). Nothing is allocated."""
    from prv_accountant.accountant import compute_safe_domain_size

    delta_error = DELTA_ERROR_FRACTION * delta
    half = compute_safe_domain_size([prv], [steps], eps_error=eps_error, delta_error=delta_error)
    return 2 * half * np.sqrt(steps / 2 * np.log(12 / delta_error)) / eps_error


def choose_eps_error(mech: Mechanism, delta: float, requested: float | None) -> float:
    """``requested``, or the finest eps_error (>= EPS_ERROR) whose mesh fits the memory budget and
    SECONDS_PER_EVALUATION; refused (one line, the reason) when even MAX_EPS_ERROR does not fit."""

    directions = 2 if mech.sampling_rate < 1 else 1
    probe = PoissonSubsampledGaussianMechanism(mech.sampling_rate, mech.sigma)
    per_unit = mesh_points(probe, mech.steps, delta, 1.0)  # the mesh scales as 1 / eps_error
    by_memory = per_unit * MESH_BYTES / max(budget.current().available, 1)
    by_time = per_unit * MESH_SECONDS * directions / SECONDS_PER_EVALUATION
    if requested is not None:
        budget.current().require(per_unit / requested * MESH_BYTES, f"prv at eps_error={requested:g}",
                                 f"eps_error >= {by_memory:.3g} would fit")
        return requested
    chosen = max(EPS_ERROR, by_memory, by_time)
    if chosen > MAX_EPS_ERROR:
        limit = "memory budget (--max-memory)" if by_memory >= by_time else f"{SECONDS_PER_EVALUATION:g} s per evaluation"
        raise budget.OverBudget(f"prv at T = {mech.steps} would need eps_error = {chosen:.3g} to fit the {limit}; "
                                f"use the pld accountant")
    return float(chosen)


def _compose_upper(prv: PrivacyRandomVariable, steps: int, delta: float, eps_error: float) -> float:
    delta_error = DELTA_ERROR_FRACTION * delta
    try:
        accountant = PRVAccountant(prvs=[prv], max_self_compositions=[steps],
                                   eps_error=eps_error, delta_error=delta_error)
        _, _, upper = accountant.compute_epsilon(delta=delta, num_self_compositions=[steps])
    except (ValueError, RuntimeError) as exc:
        raise DPAuditError(f"prv-accountant cannot answer this query ({exc})") from None
    return float(upper)


def epsilon(mech: Mechanism, delta: float, settings: PrvOptions = PrvOptions()) -> EpsilonResult:
    """Max over both directions of prv-accountant's upper bounds. A larger ``eps_error`` is
    faster (coarser mesh) and still an upper bound, looser by about ``eps_error``."""
    if mech.kind != "gaussian":
        raise DPAuditError("the prv accountant covers the subsampled Gaussian; for Laplace use pld, mc or pure-prv")
    eps_error = choose_eps_error(mech, delta, settings.eps_error)
    remove = _compose_upper(PoissonSubsampledGaussianMechanism(mech.sampling_rate, mech.sigma), mech.steps, delta, eps_error)
    if mech.sampling_rate < 1:
        add = _compose_upper(PoissonSubsampledGaussianAdd(mech.sampling_rate, mech.sigma), mech.steps, delta, eps_error)
    else:
        add = remove
    return EpsilonResult(
        accountant="prv",
        epsilon=max(remove, add),
        delta=delta,
        relation=relation_of(mech),
        guarantee=f"upper bound (prv-accountant, eps_error={eps_error:g}, delta_error={DELTA_ERROR_FRACTION:g}*delta)",
        directions={"remove": remove, "add": add},
        details={"eps_error": eps_error, "delta_error": DELTA_ERROR_FRACTION * delta},
    )

