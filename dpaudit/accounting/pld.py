"""`pld`: Google's dp-accounting privacy loss distributions, add/remove, pessimistic.

Every number returned here is an upper bound: dp-accounting's pessimistic (connect-the-dots)
discretisation dominates the true privacy loss distribution on any grid and moves truncated
tail mass to an infinite loss. A coarse grid therefore gives a valid, looser bound.

Choosing the grid so that the answer has converged. How close the bound is to the true epsilon
depends on how finely the grid resolves *one step's* privacy loss, not on epsilon (at p = 1e-3,
T = 1e6 a step's loss spans ~0.1, at p = 1e-4 ~0.01). So the first grid puts ``POINTS_PER_STEP``
points on one step's loss range (dp-accounting's own connect-the-dots bounds, read before
anything is allocated) and the grid is refined by ``REFINE`` while the bound improves by more
than ``CONVERGED`` (relative). The error shrinks about tenfold per rung, so the last improvement
bounds what is left. At very large T the FFT round-off of the finest grids makes the bound
*worse*: the refinement stops there too, and the smallest bound seen is reported (each is valid).

Bounded: before each allocation the rung's memory is estimated (one step: ``STEP_BYTES`` a grid
point per direction; composition: the FFT length dp-accounting will use, from its own Chernoff
truncation, ``FFT_BYTES`` a point) against the active ``budget.Budget``, and its time from the
previous rung. A first rung that does not fit is coarsened until it does; a later one that does
not fit ends the refinement. Both are reported in ``details`` (``limited_by``).

Tails: dp-accounting truncates e^-50 of each step's noise and 1e-15 of the composed mass into the
infinite loss, and FFT round-off sits near 1e-16, so delta below ``MIN_DELTA`` is not resolved
(it used to answer eps = inf). There the answer comes from a method valid at any delta: Renyi DP
for the Gaussian (dp-accounting), the exact randomized-response composition (or plain composition)
of the pure-DP step for Laplace; ``details['fallback']`` says which and why.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from dpaudit.accounting import budget as budgets
from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.noise import noise
from dpaudit.accounting.result import DeltaResult, EpsilonResult, relation_of

POINTS_PER_STEP = 1000   # first grid: one step's loss range / this
REFINE = 3.0             # each rung divides the grid by this
CONVERGED = 3e-4         # stop refining when the bound improves by less than this (relative)
MAX_RUNGS = 8
MIN_DELTA = 1e-12        # below: the composed truncation (1e-15) and FFT round-off are not negligible
TAIL_MASS_TRUNCATION = 1e-15  # dp-accounting's default for self-composition
STEP_BYTES = 110         # measured: building one direction's single-step PMF, per grid point
STEP_SECONDS = 8e-6      # measured (2 cores): building one direction's single-step PMF, per grid point
FFT_BYTES = 72           # self_convolve: complex FFT, its power, inverse, real part, roll; per point
SCAN_BYTES = 64          # per composed point: the kept PMF and epsilon_for_delta's running sums
COARSE_GRID = 1e-3       # for cheap *bracketing* bounds only (valid, loose)
RR_MAX_STEPS = 10**6     # Laplace fallback: exact randomized-response composition up to here, T * eps_1 beyond
MAX_GRID = 100.0         # connect-the-dots needs expm1(grid) finite (grid < 709); eps ~ 1e6 needs no finer start


def _log_mass_truncation(mech: Mechanism, delta: float) -> float:
    """Per-step noise tail truncated into the infinite loss: dp-accounting's e^-50, or less so that
    T steps together stay below 1e-4 delta."""
    return min(-50.0, math.log(max(delta, 1e-300) * 1e-4 / mech.steps))


def _adjacencies(mech: Mechanism):
    from dp_accounting.pld import privacy_loss_mechanism as plm

    kinds = [plm.AdjacencyType.REMOVE]
    return kinds if mech.sampling_rate == 1.0 else kinds + [plm.AdjacencyType.ADD]


def step_loss_range(mech: Mechanism, delta: float) -> float:
    """Width of one step's discretised privacy-loss range (the widest direction), from dp-accounting's
    connect-the-dots bounds: no grid is built."""
    facts = noise(mech.kind)
    widths = []
    for adjacency in _adjacencies(mech):
        loss = facts.pld_loss(mech, adjacency, _log_mass_truncation(mech, delta))
        bounds = loss.connect_dots_bounds()
        widths.append(bounds.epsilon_upper - bounds.epsilon_lower)
    return max(widths)


def _step_bytes(mech: Mechanism, width: float, grid: float) -> float:
    return STEP_BYTES * len(_adjacencies(mech)) * (width / grid + 2)


@dataclass(frozen=True)
class PldOptions:
    """``grid``: one fixed discretisation (a valid bound at any grid) instead of refining until converged;
    searches (calibrate, max-steps) fix it once from a converged ladder and reuse it."""

    grid: float | None = None


def converged_grid(mech: Mechanism, delta: float) -> float:
    """The grid the refinement ladder settles on for ``mech`` (the rung with the smallest bound)."""
    res = epsilon(mech, delta)
    return float(res.details.get("discretisation") or first_grid(mech, delta))


def first_grid(mech: Mechanism, delta: float) -> float:
    width = step_loss_range(mech, delta)
    return min(MAX_GRID, width / POINTS_PER_STEP) if math.isfinite(width) and width > 0 else COARSE_GRID


class ComposedPLD:
    """The two directions' composed PMFs (one object when p = 1: they coincide)."""

    def __init__(self, pmfs: dict) -> None:
        self.pmfs = pmfs

    def epsilons(self, delta: float) -> dict[str, float]:
        return {d: epsilon_for_delta(pmf, delta) for d, pmf in self.pmfs.items()}

    def deltas(self, eps: float) -> dict[str, float]:
        return {d: float(pmf.get_delta_for_epsilon(eps)) for d, pmf in self.pmfs.items()}

    def get_delta_for_epsilon(self, eps: float) -> float:
        return max(self.deltas(eps).values())


def composed_pld(mech: Mechanism, grid: float, pessimistic: bool = True, delta: float = 1e-5) -> ComposedPLD:
    """The T-fold composed PLD on ``grid``; memory is checked against the budget before each allocation."""
    from dp_accounting.pld import common

    width = step_loss_range(mech, delta)
    budget = budgets.current()
    budget.require(_step_bytes(mech, width, grid), f"one step's PLD at grid {grid:.3g}",
                   f"a grid of {grid * _step_bytes(mech, width, grid) / max(budget.available, 1):.3g} would fit")
    single = noise(mech.kind).pld(mech, grid, pessimistic, _log_mass_truncation(mech, delta))
    # Dense before composing: dp-accounting's sparse self_compose first computes size**T as a Python
    # integer, which alone takes minutes at T = 1e7.
    pmfs = {"remove": single._pmf_remove.to_dense_pmf()}  # noqa: SLF001
    if not single._symmetric:  # noqa: SLF001
        pmfs["add"] = single._pmf_add.to_dense_pmf()  # noqa: SLF001
    if mech.steps > 1:
        need = sum(_fft_bytes(pmf, mech.steps, common) for pmf in pmfs.values())
        budget.require(need, f"composing {mech.steps} steps at grid {grid:.3g}")
        pmfs = {d: pmf.self_compose(mech.steps, tail_mass_truncation=TAIL_MASS_TRUNCATION) for d, pmf in pmfs.items()}
    if "add" not in pmfs:
        pmfs["add"] = pmfs["remove"]
    return ComposedPLD(pmfs)


def epsilon_for_delta(pmf, delta: float) -> float:
    """dp-accounting's ``DensePLDPmf.get_epsilon_for_delta``, vectorised (its Python loop over the PMF
    takes ~10 s at 1e7 points). The same rule and sums: walking down from the largest loss L_k, stop
    at the first k where log((U_k - delta) / W_k) >= L_k, with U_k = inf mass + mass above,
    W_k = sum of p e^{-L} above; or where W is still 0 once U >= delta. Losses are index x grid here
    (dp-accounting subtracts the grid step repeatedly), so the two agree to ~1e-10 relative (tested)."""
    import numpy as np

    inf_mass = pmf._infinity_mass  # noqa: SLF001
    if inf_mass > delta:
        return math.inf
    probs = np.flip(np.asarray(pmf._probs, dtype=float))  # noqa: SLF001
    losses = (pmf._lower_loss + len(probs) - 1 - np.arange(len(probs))) * pmf._discretization  # noqa: SLF001
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        weighted = np.exp(-losses) * probs
        upper_after = inf_mass + np.cumsum(probs)     # U after adding entry k
        lower_after = np.cumsum(weighted)             # W after adding entry k
        upper_before = np.concatenate(([inf_mass], upper_after[:-1]))
        lower_before = np.concatenate(([0.0], lower_after[:-1]))
        stop = (upper_before > delta) & (lower_before > 0) & (np.log((upper_before - delta) / lower_before) >= losses)
        zero = (upper_after >= delta) & (lower_after == 0)
    k_stop = int(np.argmax(stop)) if stop.any() else len(probs)
    k_zero = int(np.argmax(zero)) if zero.any() else len(probs)
    if k_zero < k_stop:
        return max(0.0, float(losses[k_zero]))
    if k_stop < len(probs):
        u, w = upper_before[k_stop], lower_before[k_stop]
    else:
        u = upper_after[-1] if len(probs) else inf_mass
        w = lower_after[-1] if len(probs) else 0.0
    if u <= w + delta:
        return 0.0
    return math.log((u - delta) / w)


def _fft_bytes(pmf, steps: int, common) -> float:
    """Memory of dp-accounting's self-convolution of ``pmf``: the Chernoff-truncated output length it
    will use (computed the same way, cheaply), rounded to its FFT length."""
    from scipy import fft

    probs = pmf.to_dense_pmf()._probs  # noqa: SLF001
    lo, hi = common.compute_self_convolve_bounds(probs, steps, TAIL_MASS_TRUNCATION)
    length = fft.next_fast_len(max(hi - lo + 1, len(probs)))
    return FFT_BYTES * length + SCAN_BYTES * (hi - lo + 1)


def epsilon_estimate_below(mech: Mechanism, delta: float, grid: float = COARSE_GRID) -> float:
    """A *lower* estimate of eps (dp-accounting's optimistic discretisation rounds losses down): never
    reported as a guarantee, only used to bracket searches (the true eps is at least this)."""
    return max(_fitted(mech, delta, grid, pessimistic=False)[0].values())


def _fitted(mech: Mechanism, delta: float, grid: float, pessimistic: bool = True, measure=None) -> tuple[dict, float]:
    """Both directions' eps on ``grid``, or on the finest coarser grid that fits the memory budget
    (a coarser pessimistic grid is still a valid bound). Returns (directions, grid used)."""
    cap = budgets.current().available
    measure = measure or (lambda pld: pld.epsilons(delta))
    for _ in range(8):
        try:
            return measure(composed_pld(mech, grid, pessimistic, delta)), grid
        except budgets.OverBudget as exc:
            if not math.isfinite(exc.needed):
                raise
            if grid >= MAX_GRID:
                break
            grid = min(MAX_GRID, grid * max(1.5, 1.1 * exc.needed / cap))
    raise budgets.OverBudget(f"no PLD grid fits the memory budget of {budgets.human_bytes(cap)} (--max-memory)")


def epsilon(mech: Mechanism, delta: float, grid: float | None = None,
            settings: PldOptions = PldOptions()) -> EpsilonResult:
    """Upper bound on eps at ``delta``: on ``grid`` when given, else on a grid refined until converged."""
    grid = grid if grid is not None else settings.grid
    if delta < MIN_DELTA:
        return _fallback(mech, delta, f"pld does not resolve delta < {MIN_DELTA:g} "
                                      f"(composed tail truncation {TAIL_MASS_TRUNCATION:g})")
    try:
        best, rungs, rung_eps, limited = _measured(mech, delta, grid)
    except budgets.OverBudget as exc:
        return _fallback(mech, delta, f"pld does not fit the budget ({exc})")
    except OverflowError:  # dp-accounting evaluates e^{1/sigma} in floats: Laplace with sigma < ~1/700
        return _fallback(mech, delta, f"dp-accounting's PLD overflows at sigma = {mech.sigma:g}")
    eps = max(best.values())
    if noise(mech.kind).pure_dp:
        # A Laplace run is also pure (T * eps_1)-DP; pessimistic rounding can put PLD a grid step
        # above that, and the smaller of two valid upper bounds is still valid.
        from dpaudit.accounting.pure import step_epsilon

        cap = mech.steps * step_epsilon(mech.sigma, mech.sampling_rate)
        best = {k: min(v, cap) for k, v in best.items()}
        eps = max(best.values())
    details = {"discretisation": rungs[int(min(range(len(rung_eps)), key=rung_eps.__getitem__))],
               "grids": [{"grid": g, "epsilon": e} for g, e in zip(rungs, rung_eps)],
               "converged": limited is None and (grid is None), "limited_by": limited}
    if not math.isfinite(eps) or limited is not None:
        alt = _alternative(mech, delta)
        if alt is not None and alt.epsilon < eps:
            why = "pld found no finite epsilon" if not math.isfinite(eps) else f"pld grid limited by {limited}"
            return _with_note(alt, f"{why}; this bound is {alt.accountant} (smaller, also valid)", eps)
    return EpsilonResult(
        accountant="pld", epsilon=eps, delta=delta, relation=relation_of(mech),
        guarantee="upper bound (dp-accounting PLD, pessimistic discretisation"
                  + (", grid limited by the " + limited + " budget)" if limited else ")"),
        directions=best, details=details,
    )


def _measured(mech: Mechanism, delta: float, grid: float | None, measure=None):
    """(per-direction values, grids, each grid's max, limited_by) on ``grid`` when given (coarsened if it
    does not fit), else on the refinement ladder. ``measure``: composed PLD -> per-direction values
    (default: eps at ``delta``; smaller is tighter)."""
    measure = measure or (lambda pld: pld.epsilons(delta))
    if grid is None:
        return _refine(mech, delta, measure)
    found, used = _fitted(mech, delta, grid, measure=measure)
    return found, [used], [max(found.values())], "memory" if used != grid else None


def _refine(mech: Mechanism, delta: float, measure):
    """Rungs of ever finer grids until the bound stops improving, the budget is reached, or MAX_RUNGS."""
    budget = budgets.current()
    width = step_loss_range(mech, delta)
    grid = first_grid(mech, delta)
    first = STEP_SECONDS * len(_adjacencies(mech)) * width / grid
    if first > budget.seconds_left():
        raise budgets.OverBudget(f"one step's PLD alone would take about {first:.0f} s, over the time budget")
    best, best_eps, rungs, rung_eps, limited = None, math.inf, [], [], None
    last_seconds = 0.0
    for rung in range(MAX_RUNGS):
        if rung and (not budget.fits(_step_bytes(mech, width, grid))):
            limited = "memory"
            break
        if rung and last_seconds * (REFINE + 0.5) > budget.seconds_left():
            limited = "time"
            break
        began = time.perf_counter()
        if not rung:
            found, used = _fitted(mech, delta, grid, measure=measure)
            limited, grid = ("memory" if used != grid else None), used
        else:
            try:
                found = measure(composed_pld(mech, grid, delta=delta))
            except budgets.OverBudget:
                limited = "memory"
                break
        last_seconds = time.perf_counter() - began
        eps = max(found.values())
        rungs.append(grid)
        rung_eps.append(eps)
        improved = best_eps - eps
        if eps < best_eps:
            best, best_eps = found, eps
        if limited or (rung and not improved > CONVERGED * eps):
            break  # converged, round-off now outweighs resolution, or the first grid was already coarsened
        grid /= REFINE
    return best, rungs, rung_eps, limited


def delta(mech: Mechanism, eps: float, settings: PldOptions = PldOptions()) -> DeltaResult:
    """Upper bound on delta at ``eps`` (max of both directions), on a grid refined until converged."""
    best, rungs, values, limited = _measured(mech, MIN_DELTA, settings.grid, lambda pld: pld.deltas(eps))
    best = {k: min(1.0, v) for k, v in best.items()}  # delta <= 1 always; FFT round-off can overshoot it
    upper = max(best.values())
    return DeltaResult(
        accountant="pld", delta=upper, epsilon=eps, relation=relation_of(mech),
        guarantee="upper bound (pessimistic PLD, max of add and remove"
                  + (f", grid limited by the {limited} budget)" if limited else ")")
                  + (f"; below {TAIL_MASS_TRUNCATION:g} it is the truncated tail, not resolved" if upper < 1e-14
                     else ""),
        directions=best, details={"grids": [{"grid": g, "delta": v} for g, v in zip(rungs, values)],
                                  "limited_by": limited})


def _alternative(mech: Mechanism, delta: float) -> EpsilonResult | None:
    """A bound valid at any delta: RDP (Gaussian), randomized-response composition or pure (Laplace)."""
    if mech.kind == "gaussian":
        from dpaudit.accounting import rdp

        return rdp.epsilon(mech, delta)
    from dpaudit.accounting import pure

    if delta > 0 and mech.steps <= RR_MAX_STEPS:
        return pure.prv_epsilon(mech, delta)
    return pure.epsilon(mech, delta)


def _fallback(mech: Mechanism, delta: float, why: str) -> EpsilonResult:
    return _with_note(_alternative(mech, delta), why, None)


def _with_note(result: EpsilonResult, why: str, pld_eps: float | None) -> EpsilonResult:
    details = dict(result.details, fallback=result.accountant, requested="pld", reason=why)
    if pld_eps is not None:
        details["pld_epsilon"] = pld_eps
    return replace(result, guarantee=result.guarantee + f" — {why}", details=details)
