"""`wor-pld`: fixed-size batches (B of N drawn without replacement, independently each step) with Gaussian
noise, as a privacy loss distribution: an upper bound under replace-one and under add/remove alike.

Theorem (the dominating pair; derived here, it is Dong, Roth & Su's C_gamma(f) for subsampling without
replacement, "Gaussian differential privacy", JRSS-B 2022, with f the Gaussian trade-off of
sensitivity 2C). C = 1 below; gamma = B / N; H_a(P||Q) = sup_E P(E) - a Q(E) the hockey-stick divergence.
Let
    R_rem = ((1 - gamma) N(0, s^2) + gamma N(2, s^2),  N(0, s^2))      (Poisson's remove pair, shift 2C)
    R_add = (N(0, s^2),  (1 - gamma) N(0, s^2) + gamma N(2, s^2))      (its mirror, Poisson's add pair)
and S the pair whose hockey-stick curve is H_a(R_rem) for a >= 1 and H_a(R_add) for a < 1. Then every
ordered replace-one pair (D, D'), at every step and whatever the past outputs, has
H_a(M(D) || M(D')) <= H_a(S) for all a >= 0; T steps are dominated by S composed T times.
Proof. D and D' differ in x against x'. Couple the draws on the same indices: with probability 1 - gamma the
slot of x is not drawn and both outputs have the law A (a B-subset of the other N - 1 examples, plus noise);
otherwise they have B_x and B_x' (g(x) or g(x'), plus a (B-1)-subset of the others, plus noise):
    M(D) = (1 - gamma) A + gamma B_x,   M(D') = (1 - gamma) A + gamma B_x'.
For a' >= 1 write a' = 1 + gamma (a - 1), b = a' / a. Advanced joint convexity (Balle, Barthe &
Gaboardi 2018) gives H_a'(M(D) || M(D')) = gamma H_a(B_x || (1 - b) A + b B_x'); convexity in the second
argument bounds it by gamma [(1 - b) H_a(B_x || A) + b H_a(B_x || B_x')]. B_x against B_x' shares the (B-1)-subset and
differs by g(x) - g(x'), norm <= 2; A is B_x with g(x) swapped for g(y), y uniform among the undrawn others
(draw a B-subset of the others, drop a uniform member), so by joint convexity over that coupling each term is
at most G_a = H_a(N(2) || N(0)). Hence H_a'(M(D) || M(D')) <= gamma G_a = H_a'(R_rem) (the last equality is
exact: H_a'((1 - gamma) Q + gamma P || Q) = gamma H_a(P || Q)). For a' < 1, H_a'(U || V) = 1 - a' +
a' H_{1/a'}(V || U); (D', D) is a replace-one pair too, so H_a'(M(D) || M(D')) <= 1 - a' + a' H_{1/a'}(R_rem)
= H_a'(R_add). S exists: its curve is convex (each piece is; at a = 1 both equal the total variation and the
left slope -(1 - P_rem(E)) is <= the right slope -Q_rem(E), E = {y > 1}, since P_rem(E) + Q_rem(E) <= 1 for
gamma <= 1), starts at 1 and lies above (1 - a)_+. Its privacy loss law is R_rem's on the positive losses,
R_add's on the negative ones and an atom at 0 with the rest. Adaptive composition of dominating pairs (Zhu,
Dong & Wang 2022) gives the T-fold product.
The bound is tight per step: D = {-1, +1, ..., +1} against D' = {+1, ..., +1} (1-D, replace-one; removing the
-1 gives the same law) is exactly R_rem: the -1 is drawn with probability gamma and then displaces a +1, a shift
of 2C; not drawn, the batch sums to B. The swapped pair is exactly R_add. At B = N (gamma = 1) S is the
full-batch Gaussian of sensitivity 2, exactly.
(The pair used here until 2026-11, P = (1 - gamma) N(0) + gamma N(-1) against (1 - gamma) N(0) + gamma N(+1), is
Poisson sampling's under replace-one. It is not valid without replacement: when x is not drawn another example
takes its slot, so the "not drawn" part is not shared. It under-counted eps 4.22 against 8.98 at sigma 1, B 2,
N 4, T 1; tests/accounting/test_brute_force.py enumerates such mechanisms exactly.)

Add/remove. Remove x from D (N examples) to get D' (N - 1). Couple the draws: a batch S of D without x is also a
uniform B-subset of D' (use it); a batch with x becomes S - {x} + {z}, z uniform over D' - S, which is a uniform
B-subset of D' by symmetry. So M(D) = (1 - gamma) A + gamma B_x and M(D') = (1 - gamma) A + gamma E_z[B_z]
with the same A, and the proof above goes through with B_x' replaced by the mixture E_z[B_z] (convexity again);
adding x to D is the swapped case at rate B / (N + 1) < gamma, which S at gamma dominates (C_gamma(f) only
weakens as gamma grows). So one bound answers both relations; it is reported under the scheme's relation.

Computation: S's delta(eps) is R_rem's (eps >= 0) or R_add's (eps < 0), each dp-accounting's subsampled
Gaussian privacy loss (sampling_prob gamma, sensitivity 2, REMOVE and ADD adjacency), so no new formula is
written here. dp-accounting's connect-the-dots discretisation (Doroshenko et al. 2022; pessimistic: an upper
bound on any grid) turns those deltas on a loss grid into S's PMF, which is composed by our PLD kernel. The
grid is refined until the bound moves by less than ``CONVERGED`` (as pld.py's ladder), within the memory budget.
dp-accounting has no such class (its PLDs are Poisson's, one pair per direction; the max of each direction
composed alone does not bound S composed: 14.71 against 18.44 on the docs' MNIST-like schedule, and an adaptive
run may meet either direction at each step), hence this module.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dpaudit.accounting.mechanism import Mechanism, Phases
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core import limits as budgets
from dpaudit.core.errors import DPAuditError
from dpaudit.accounting import pld
from dpaudit.accounting.pld import kernel

POINTS_PER_STEP = 200     # first grid: one step's loss range / this
REFINE = 3.0
CONVERGED = 1e-3          # stop refining when the bound moves by less than this (relative)
MAX_RUNGS = 6
SENSITIVITY = 2.0         # replace-one: a clipped sum moves by up to 2C


def limitation(mech: Mechanism | Phases) -> str | None:
    return None


@functools.lru_cache(maxsize=64)
def _directions(sigma: float, gamma: float):
    """dp-accounting's subsampled Gaussian losses: R_rem (REMOVE) and R_add (ADD) of the module docstring (kept:
    every rung of the grid ladder reads the same pair for its range and its deltas)."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    return tuple(plm.GaussianPrivacyLoss(sigma, sensitivity=SENSITIVITY, sampling_prob=gamma, adjacency_type=kind)
                 for kind in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD))


def loss_range(sigma: float, gamma: float) -> tuple[float, float]:
    """S's loss range for connect-the-dots: R_add's lowest loss to R_rem's highest (each at dp-accounting's
    tail truncation; the mass beyond goes to +inf (pessimistic) or to the lowest point)."""
    remove, add = _directions(sigma, gamma)
    return (min(add.connect_dots_bounds().epsilon_lower, 0.0), max(remove.connect_dots_bounds().epsilon_upper, 0.0))


def delta_curve(sigma: float, gamma: float, epsilons):
    """H_{e^eps}(S) at each eps: R_rem's delta at eps >= 0, R_add's below (the module docstring's S)."""

    remove, add = _directions(sigma, gamma)
    eps = np.asarray(epsilons, dtype=float)
    out = np.empty_like(eps)
    upper = eps >= 0
    if upper.any():
        out[upper] = remove.get_delta_for_epsilon(eps[upper])
    if (~upper).any():
        out[~upper] = add.get_delta_for_epsilon(eps[~upper])
    # S's curve is non-increasing; float noise of the two formulas must not break connect-the-dots' check
    return np.minimum.accumulate(np.clip(out, 0.0, 1.0))


def one_step_pmf(sigma: float, gamma: float, grid: float):
    """One step's pessimistic (connect-the-dots) PMF of S on ``grid``."""

    low, high = loss_range(sigma, gamma)
    lower, upper = math.floor(low / grid), math.ceil(high / grid)
    deltas = delta_curve(sigma, gamma, np.arange(lower, upper + 1) * grid)
    return kernel.connect_dots_pmf(grid, lower, upper, deltas)


def _step_range(m: Mechanism) -> float:
    low, high = loss_range(m.sigma, m.sampling_rate)
    return max(high - low, 1e-9)


def _composed_epsilon(mech, delta: float, grid: float) -> float:
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
        guarantee=("upper bound: the dominating pair of sampling without replacement (Dong, Roth & Su's "
                   "C_gamma of the sensitivity-2C Gaussian, gamma = B/N; both directions), dp-accounting "
                   f"connect-the-dots at grid {best_grid:.3g}, composed; it holds under add/remove too")
        + (f"; refinement stopped: {limited}" if limited else ""),
        details={"grids": [{"grid": g, "epsilon": e} for g, e in rungs], "limited_by": limited})
