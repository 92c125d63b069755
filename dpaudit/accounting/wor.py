"""`wor-pld`: fixed-size batches (B of N drawn without replacement, independently each step) with Gaussian
noise, as a privacy loss distribution: an upper bound under replace-one and under add/remove alike.

Theorem (the dominating pair; Lebeda, Regehr, Kamath & Steinke 2024, "Avoiding pitfalls for privacy accounting
of subsampled mechanisms under composition", for substitution). Let gamma = B / N. One step of the
clipped-sum Gaussian mechanism (sensitivity C per example, noise N(0, sigma^2 C^2 I)) on a batch drawn without
replacement is dominated, for neighbours that replace one example, by the pair on R (C = 1)
    P = (1 - gamma) N(0, sigma^2) + gamma N(-1, sigma^2),   Q = (1 - gamma) N(0, sigma^2) + gamma N(+1, sigma^2).
Sketch: with probability 1 - gamma the replaced example is not drawn and both batches are equal; otherwise the
batches share B - 1 examples and their sums differ by g(x) - g(x'), of norm at most 2C, placed at -1 and +1
around the shared part (the worst case of the vector mechanism is this scalar one). The pair is its own mirror
image (Q(y) = P(-y)), so both directions have the same privacy loss distribution. Steps draw independently, so
T steps are dominated by the T-fold product: one PLD composed T times.
At B = N (gamma = 1) the pair is N(-1) against N(+1): the full-batch Gaussian with sensitivity 2, exactly.

Add/remove (derived here). Remove x from D (N examples) to get D' (N - 1). Couple the draws: a batch S of D
without x is also a uniform B-subset of D' (use it); a batch with x becomes S - {x} + {z}, z uniform over D' - S,
which is a uniform B-subset of D' by symmetry. So the two outputs differ exactly as under replacement (g(x)
against g(z)) with probability gamma = B / N, and the same pair dominates (adding x: gamma = B / (N + 1),
smaller, dominated by the same pair). So one bound answers both relations; it is reported under the scheme's
relation, replace-one.

Computation: dp-accounting's connect-the-dots discretisation of a monotone privacy loss (pessimistic: an upper
bound on any grid) needs the loss's range and delta(eps) of one step, both in closed form here:
L(y) = log P(y) / Q(y) is decreasing in y, so delta(eps) = P(y < y*) - e^eps Q(y < y*) with L(y*) = eps, found by
bisection; each side is a two-Gaussian mixture CDF (log-space, so small deltas do not cancel). The grid is refined
until the bound moves by less than ``CONVERGED`` (as pld.py's ladder), within the memory budget. dp-accounting
has no such class (its MixtureGaussianPrivacyLoss puts a plain Gaussian on one side), hence this one.
"""

from __future__ import annotations

import functools
import math

from dpaudit.accounting.mechanism import Mechanism, Phases
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core import limits as budgets
from dpaudit.core.errors import DPAuditError

POINTS_PER_STEP = 200     # first grid: one step's loss range / this
REFINE = 3.0
CONVERGED = 1e-3          # stop refining when the bound moves by less than this (relative)
MAX_RUNGS = 6
TAIL = 1e-22              # each side's mass left beyond the connect-the-dots range (into the infinite loss)


def limitation(mech: Mechanism | Phases) -> str | None:
    return None


@functools.cache
def _loss_class():
    """dp-accounting's MonotonePrivacyLoss for the pair of the module docstring (built lazily: scipy, dp-accounting)."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_mechanism as plm
    from scipy.special import log_ndtr, logsumexp
    from scipy.stats import norm

    class WithoutReplacementLoss(plm.MonotonePrivacyLoss):
        def __init__(self, sigma: float, gamma: float) -> None:
            super().__init__(is_discrete=False)
            self.sigma, self.gamma = sigma, gamma
            self.low = -1 + sigma * norm.ppf(TAIL)      # P(y < low) <= TAIL
            self.high = 1 + sigma * norm.isf(TAIL)      # P(y > high) <= TAIL

        def _log_mixture(self, y, shift, log_cdf):
            sigma, gamma = self.sigma, self.gamma
            parts = [log_cdf((y - shift) / sigma) + math.log(gamma)]
            if gamma < 1:
                parts.append(log_cdf(y / sigma) + math.log1p(-gamma))
            return logsumexp(np.stack(parts), axis=0)

        def privacy_loss(self, x):
            x = np.asarray(x, dtype=float)
            s2, gamma = self.sigma ** 2, self.gamma
            up = (-2 * x - 1) / (2 * s2)   # log phi(x + 1) / phi(x)
            down = (2 * x - 1) / (2 * s2)  # log phi(x - 1) / phi(x)
            if gamma == 1:
                return up - down
            lg, l1 = math.log(gamma), math.log1p(-gamma)
            return np.logaddexp(l1, lg + up) - np.logaddexp(l1, lg + down)

        def inverse_privacy_loss(self, privacy_loss):
            target = np.atleast_1d(np.asarray(privacy_loss, dtype=float))
            lo = np.full(target.shape, self.low - 1.0)
            hi = np.full(target.shape, self.high + 1.0)
            for _ in range(200):  # decreasing in x: where the loss is above the target, x is too small
                mid = (lo + hi) / 2
                above = self.privacy_loss(mid) > target
                lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
                if float(np.max(hi - lo)) < 1e-13 * (1 + float(np.max(np.abs(hi)))):
                    break
            return (lo + hi) / 2

        def mu_upper_cdf(self, x):
            return np.exp(self._log_mixture(np.asarray(x, dtype=float), -1.0, log_ndtr))

        def mu_lower_log_cdf(self, x):
            return self._log_mixture(np.asarray(x, dtype=float), 1.0, log_ndtr)

        def get_delta_for_epsilon(self, epsilon):
            eps = np.atleast_1d(np.asarray(epsilon, dtype=float))
            y = self.inverse_privacy_loss(eps)
            log_p = self._log_mixture(y, -1.0, log_ndtr)
            log_q = self._log_mixture(y, 1.0, log_ndtr)
            with np.errstate(over="ignore"):
                delta = np.exp(log_p) * -np.expm1(np.minimum(eps + log_q - log_p, 0.0))
            delta = np.maximum(delta, 0.0)
            return delta if np.ndim(epsilon) else float(delta[0])

        def privacy_loss_tail(self):
            return plm.TailPrivacyLossDistribution(self.low, self.high, {
                math.inf: float(self.mu_upper_cdf(self.low)),
                float(self.privacy_loss(self.high)): float(1 - self.mu_upper_cdf(self.high))})

        def connect_dots_bounds(self):
            return plm.ConnectDotsBounds(epsilon_upper=float(self.privacy_loss(self.low)),
                                         epsilon_lower=float(self.privacy_loss(self.high)))

    return WithoutReplacementLoss


def one_step_pmf(sigma: float, gamma: float, grid: float):
    """One step's pessimistic (connect-the-dots) PMF on ``grid``."""
    from dpaudit.accounting.pld import kernel

    return kernel.monotone_pmf(_loss_class()(sigma, gamma), grid).to_dense_pmf()


def _step_range(m: Mechanism) -> float:
    loss = _loss_class()(m.sigma, m.sampling_rate)
    bounds = loss.connect_dots_bounds()
    return max(bounds.epsilon_upper - bounds.epsilon_lower, 1e-9)


def _composed_epsilon(mech, delta: float, grid: float) -> float:
    from dpaudit.accounting import pld

    composed = None
    for m in mech.phases:
        pmf = one_step_pmf(m.sigma, m.sampling_rate, grid)
        bounds = pld._convolve_bounds(pmf, m.steps)  # noqa: SLF001 - our own pld module's estimate
        budgets.current().require(pld._fft_bytes(pmf, bounds), f"fixed-size PLD at grid {grid:.3g}")  # noqa: SLF001
        part = pmf.self_compose(m.steps) if m.steps > 1 else pmf
        composed = part if composed is None else composed.compose(part)
    return float(composed.get_epsilon_for_delta(delta))


def epsilon(mech: Mechanism | Phases, delta: float) -> EpsilonResult:
    """Upper bound on eps at ``delta`` (replace-one; the same bound holds under add/remove)."""
    if delta <= 0:
        raise DPAuditError("wor-pld needs delta > 0")
    grid = min(_step_range(m) for m in mech.phases) / POINTS_PER_STEP
    rungs: list[tuple[float, float]] = []
    limited = None
    for _ in range(MAX_RUNGS):
        try:
            rungs.append((grid, _composed_epsilon(mech, delta, grid)))
        except budgets.OverBudget as exc:
            if not rungs:
                raise
            limited = str(exc)
            break
        if len(rungs) >= 2 and abs(rungs[-2][1] - rungs[-1][1]) <= CONVERGED * rungs[-1][1]:
            break
        grid /= REFINE
    best_grid, best = min(rungs, key=lambda r: r[1])
    return EpsilonResult(
        accountant="wor-pld", epsilon=best, delta=delta, relation=relation_of(mech),
        guarantee=("upper bound: Lebeda et al.'s dominating pair of sampling without replacement (sensitivity 2C "
                   f"at rate B/N), dp-accounting connect-the-dots at grid {best_grid:.3g}, composed; it holds under "
                   "add/remove too") + (f"; refinement stopped: {limited}" if limited else ""),
        details={"grids": [{"grid": g, "epsilon": e} for g, e in rungs], "limited_by": limited})
