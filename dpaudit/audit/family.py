"""The white-box mean-shift audit read through the run's own mechanism family, not through G_mu.

Model. A white-box canary's per-step observation (its release times its public sign, in units of C) in a run that
Poisson-samples it at rate p and adds N(0, sigma^2 C^2) noise is

    x_t = b_t + sigma xi_t,   b_t ~ Bernoulli(p) for a member, 0 for a non-member,   xi_t ~ N(0, 1) i.i.d.,

which is the Poisson-subsampled Gaussian mechanism itself, composed over the run's T steps: the family
F = {M_s : s > 0} at the run's p and T, of which the claim is one member. Noise that does not depend on the canary
(other examples' gradients on its coordinate, the other canaries in DP-ZO's shared scalar), if Gaussian, only moves
the run to a member with larger s (more private), so what follows stays on the safe side.

Theorem (the test). A score S = sum_t h(x_t) with a fixed h has, under M_s, an exact per-step mean and variance for
members and non-members (one-dimensional Gaussian integrals: Gauss-Hermite quadrature), hence an exact
standardised shift

    g(s) = sqrt(T) (E_in h - E_out h) / sqrt(((n1 - 1) V_in + (n0 - 1) V_out) / (n1 + n0 - 2)),

the quantity whose one-sided (1 - alpha) lower confidence limit mu_lb the continuous audit computes from all m
scores (gaussian.py: noncentral t). With s* = sup {s : g(s) >= mu_lb}: if the run is M_s0 then P[mu_lb > g(s0)] <=
alpha, and otherwise s0 <= s*, so eps(s*) <= eps(s0): eps(s*) is a lower bound on the run's eps with confidence
1 - alpha. (No monotonicity of g is needed: s* is a supremum.) When mu_lb exceeds g(s) at every member scanned, the
bound is the eps of the least private member scanned (s_h / 64): the supremum, if any, lies below it.

Why it is tighter than G_mu: a Poisson-subsampled Gaussian at small p is far from Gaussian, and mapping its shift
through G_mu reads its eps too low (at p = 0.064, T = 200, claimed eps 4, the best linear score cannot pass 2.96).
Here the shift is mapped through the family's own eps (the pld accountant's, at s*(1 + SAFE_STEP): the accountant's
converged discretisation error, below 1e-3, is far smaller than what that step of s costs, so the value reported
is below the family member's true eps).

Scores. ``linear`` (h(x) = x: the alignment statistic) and ``likelihood_ratio`` at a fixed s_h, h(x) =
log(1 - p + p e^{(x - 1/2) / s_h^2}): the Neyman-Pearson statistic of each step, and the exact log-likelihood
ratio of a canary's transcript under M_{s_h}. s_h is read from the transcript blind to membership (the robust
scale of all entries), the same for every canary, so the scores stay exchangeable.

Steps read in noise units (a PipelineProbe: each step's row movements standardised across the canaries, the pull
of a member in units of C unknown, since the learning rate and the optimizer scale it). Divide x_t by the step's
noise scale s C: z_t = b_t / s + xi_t, the same family with the member's pull 1 / s in units of the noise. A fixed h
of z (the sum, the sum clipped to +-c, the likelihood ratio at a fixed pull a_h) then has exact moments under each
member, as above, and the same test applies. A member's pull below 1 / s (a clipped gradient only partly on its
canary's row) is a member of the family with a larger s: on the safe side again. Valid where each step's reading is
that step's release alone (memoryless: the probe checks the steps' correlation, audit/whitebox.py) and the noise
scale is read well (m entries a step; the validity test simulates it, tests/audit/test_pipeline_scores.py).

Assumptions, said in every answer: the canaries Poisson-sampled at p (the probes sample them so; the bundled
white-box runs are Poisson only), Gaussian noise, each member's step contribution at most C (its clipped size),
and scores Gaussian enough for the noncentral t (sums over many steps: the validity tests simulate p = 1, 0.1,
0.01). Written here: no maintained library reads a one-run audit through a subsampled mechanism's own curve
(jax_privacy's auditing.py tests the GDP and (eps, delta) curves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from dpaudit.accounting import pld
from dpaudit.accounting.mechanism import Mechanism

_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(160)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()  # E[f(xi)], xi ~ N(0, 1), exact for polynomials of degree < 320
SIGMA_GRID = 400         # log-spaced family members scanned for the supremum
SPAN = 2.0 ** 24         # the scan runs over [s_h / SPAN^(1/4), s_h x SPAN]
SAFE_STEP = 0.005        # eps is read at s*(1 + SAFE_STEP): see the module docstring


@dataclass(frozen=True)
class ScoreModel:
    """What the family audit needs of a statistic: the run's Poisson rate and steps, and the per-step function h
    whose sum over the steps is each canary's score (vectorised over x, in units of C)."""
    rate: float
    steps: int
    step: Callable[[np.ndarray], np.ndarray]
    scale: float              # s_h: the score's reference scale (the likelihood ratio's s; the linear score's spread)
    words: str                # what the score is, for the report
    units: str = "C"          # "C": x = b + s xi; "noise": each step standardised by its noise, z = b / s + xi

    def describe(self) -> str:
        read = "" if self.units == "C" else ", each step in units of its noise"
        return (f"Poisson-subsampled Gaussian at p = {self.rate:.4g}, T = {self.steps} (the run's){read}, "
                f"score: {self.words}")


def linear(rate: float, steps: int, scale: float) -> ScoreModel:
    return ScoreModel(float(rate), int(steps), lambda x: np.asarray(x, float), float(scale), "the sum of x_t")


def likelihood_ratio_step(x, rate: float, scale: float) -> np.ndarray:
    """log(1 - p + p exp((x - 1/2) / s^2)), without overflow (p = 1: the linear (x - 1/2) / s^2)."""
    x = np.asarray(x, float)
    u = (x - 0.5) / (scale * scale)
    if rate >= 1.0:
        return u
    return np.logaddexp(math.log1p(-rate), math.log(rate) + u)


def likelihood_ratio(rate: float, steps: int, scale: float) -> ScoreModel:
    return ScoreModel(float(rate), int(steps), lambda x: likelihood_ratio_step(x, rate, scale), float(scale),
                      f"the family's log-likelihood ratio at s = {scale:.4g}")


def standardised_linear(rate: float, steps: int) -> ScoreModel:
    """The sum of steps standardised by their noise (noise units): the same shift as ``linear``, scale-free."""
    return ScoreModel(float(rate), int(steps), lambda z: np.asarray(z, float), 1.0,
                      "the sum of the standardised steps", "noise")


def standardised_clipped(rate: float, steps: int, cut: float) -> ScoreModel:
    """The sum of standardised steps, each clipped to +-cut noise units."""
    return ScoreModel(float(rate), int(steps), lambda z: np.clip(np.asarray(z, float), -cut, cut), 1.0,
                      f"the sum of the standardised steps clipped to +-{cut:g}", "noise")


def pull_likelihood_ratio_step(z, rate: float, pull: float) -> np.ndarray:
    """log(1 - p + p exp(a z - a^2 / 2)): a step's log-likelihood ratio, in noise units, at the pull a."""
    u = pull * np.asarray(z, float) - 0.5 * pull * pull
    if rate >= 1.0:
        return u
    return np.logaddexp(math.log1p(-rate), math.log(rate) + u)


def standardised_likelihood_ratio(rate: float, steps: int, pull: float) -> ScoreModel:
    """The family's log-likelihood ratio of standardised steps at a fixed pull a (a member at s = 1 / a)."""
    return ScoreModel(float(rate), int(steps), lambda z: pull_likelihood_ratio_step(z, rate, pull), 1.0 / pull,
                      f"the family's log-likelihood ratio at a pull of {pull:.4g} noise sd", "noise")


def standardised_shift(model: ScoreModel, sigma, n1: int, n0: int) -> np.ndarray:
    """g(s) for each s in ``sigma``: the exact standardised mean shift of the model's score under M_s."""
    s = np.atleast_1d(np.asarray(sigma, float))[:, None]
    p = model.rate
    if model.units == "noise":  # z = b / s + xi
        out = np.broadcast_to(model.step(_NODES), (s.shape[0], _NODES.size))
        inside = model.step(1.0 / s + _NODES)
    else:                       # x = b + s xi
        out = model.step(s * _NODES)
        inside = model.step(1.0 + s * _NODES)
    e_out = out @ _WEIGHTS
    e_in1 = inside @ _WEIGHTS
    v_out = np.maximum((out - e_out[:, None]) ** 2 @ _WEIGHTS, 0.0)
    e_in = (1 - p) * e_out + p * e_in1
    v_in = np.maximum((1 - p) * ((out - e_in[:, None]) ** 2 @ _WEIGHTS)
                      + p * ((inside - e_in[:, None]) ** 2 @ _WEIGHTS), 0.0)
    pooled = np.sqrt(((n1 - 1) * v_in + (n0 - 1) * v_out) / max(n1 + n0 - 2, 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(pooled > 0, math.sqrt(model.steps) * (e_in - e_out) / pooled, np.inf)
    return g


def sigma_bound(model: ScoreModel, mu_lb: float, n1: int, n0: int) -> float:
    """s* = sup {s : g(s) >= mu_lb}, read on the safe side (the upper end of a bracket); inf where mu_lb <= 0 or
    even the noisiest member scanned reaches it (then eps 0). Where no member scanned reaches it, the least s
    scanned: the supremum, if any, is below it (and if none, the scores refute every member)."""
    if not mu_lb > 0:
        return math.inf
    grid = model.scale * np.geomspace(SPAN ** -0.25, SPAN, SIGMA_GRID)
    g = standardised_shift(model, grid, n1, n0)
    reached = np.flatnonzero(g >= mu_lb)
    if reached.size == 0:
        return float(grid[0])
    i = int(reached[-1])
    if i == len(grid) - 1:
        return math.inf
    lo, hi = math.log(grid[i]), math.log(grid[i + 1])
    for _ in range(40):  # keep g(lo) >= mu_lb > g(hi)
        mid = 0.5 * (lo + hi)
        if standardised_shift(model, math.exp(mid), n1, n0)[0] >= mu_lb:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


@lru_cache(maxsize=256)
def family_epsilon(sigma: float, rate: float, steps: int, delta: float) -> float:
    """The family member's eps at delta, read below its true value (at sigma (1 + SAFE_STEP))."""
    if math.isinf(sigma):
        return 0.0

    return float(pld.epsilon(Mechanism("gaussian", sigma * (1 + SAFE_STEP), rate, steps), delta).epsilon)


def epsilon_lower_bound(model: ScoreModel, mu_lb: float, n1: int, n0: int, delta: float) -> tuple[float, float]:
    """(eps lower bound, s*): the largest eps the family's members can be refuted at."""
    sigma = sigma_bound(model, mu_lb, n1, n0)
    key = round(sigma, 12) if math.isfinite(sigma) else sigma
    return family_epsilon(key, model.rate, model.steps, delta), sigma
