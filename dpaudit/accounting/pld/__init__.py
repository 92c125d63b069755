"""`pld`: Google's dp-accounting privacy loss distributions, add/remove, pessimistic: the accountant.

Every number returned here is an upper bound: dp-accounting's pessimistic (connect-the-dots)
discretisation dominates the true privacy loss distribution on any grid and moves truncated
tail mass to an infinite loss. A coarse grid therefore gives a valid, looser bound.

The package, one idea a module:
- ``kernel``: all that reads dp-accounting's internals (the PMF's fields, its self-composition, the Chernoff
  window, eps for delta), the upstream version it mirrors at the top; composition with one transform per step;
- ``compose``: one step on a grid and its T-fold composition, reused across T (``StepsCurve``);
- ``phases``: phases composed in sequence;
- ``ladder``: the grid refined until the bound has converged;
- here: the accountant (``epsilon``, ``delta``, the search hooks, the fallbacks).

Tails: dp-accounting truncates e^-50 of each step's noise and 1e-15 of the composed mass into the
infinite loss, so delta below ``MIN_DELTA`` is not resolved
(it used to answer eps = inf). There the answer comes from a method valid at any delta: Renyi DP
for the Gaussian (dp-accounting), the exact randomized-response composition (or plain composition)
of the pure-DP step for Laplace; ``details['fallback']`` says which and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.noises import noise
from dpaudit.accounting.pld import kernel
from dpaudit.accounting.pld.compose import (Event, StepsCurve, _as_composed, _log_mass_truncation,  # noqa: F401
                                            ComposedPLD, composed_pld, step_loss_range)
from dpaudit.accounting.pld.kernel import (MIN_DELTA, TAIL_MASS_TRUNCATION, _convolve_bounds,  # noqa: F401
                                           _fft_bytes, _normalised, _self_compose, dropped_bound, epsilon_for_delta,
                                           round_off)
from dpaudit.accounting.pld.ladder import (COARSE_GRID, CONVERGED, MAX_GRID, POINTS_PER_STEP, REFINE,  # noqa: F401
                                           _fitted, _measured, _refine, first_grid)
from dpaudit.accounting.pld.phases import PhasedPLD  # noqa: F401
from dpaudit.accounting.result import DeltaResult, EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core import limits as budgets
from dpaudit.core.errors import DPAuditError
from dpaudit.accounting import pure, rdp
from dpaudit.accounting.pure import step_epsilon
from dpaudit.accounting.search import SearchHooks

RR_MAX_STEPS = 10**6     # Laplace fallback: exact randomized-response composition up to here, T * eps_1 beyond


@dataclass(frozen=True)
class PldOptions:
    """``grid``: one fixed discretisation (a valid bound at any grid) instead of refining until converged;
    searches (calibrate, max-steps) fix it once from a converged ladder and reuse it."""

    grid: float | None = None


def converged_grid(mech: Event, delta: float, result: EpsilonResult | None = None) -> float:
    """The grid the refinement ladder settles on for ``mech``: its coarsest rung within ``CONVERGED``
    (relative) of the smallest bound. Where the ladder improves steadily the smallest is its last rung, the
    one that only shows convergence and costs ~3x the one before (p = 1e-3, T = 1e7, eps = 50, delta = 1e-10:
    8.4 s against 2.6 s an evaluation, for 2e-4 relative)."""
    result = result if result is not None else epsilon(mech, delta)
    rungs = result.details.get("grids") or []
    finite = [r for r in rungs if math.isfinite(r["epsilon"])]
    if not finite:
        return first_grid(mech, delta)
    best = min(r["epsilon"] for r in finite)
    return float(max(r["grid"] for r in finite if r["epsilon"] <= best * (1 + CONVERGED)))


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
    return _answer(mech, delta, best, rungs, rung_eps, limited, refined=grid is None)


def _answer(mech: Event, delta: float, best: dict, rungs: list, rung_eps: list, limited: str | None,
            refined: bool) -> EpsilonResult:
    """The result of per-direction bounds ``best`` (the smallest over the grids ``rungs`` tried)."""
    eps = max(best.values())
    if all(noise(m.kind).pure_dp for m in mech.phases):
        # A Laplace run is also pure (T * eps_1)-DP; pessimistic rounding can put PLD a grid step
        # above that, and the smaller of two valid upper bounds is still valid.

        cap = sum(m.steps * m.group * step_epsilon(m.sigma, m.sampling_rate) for m in mech.phases)
        best = {k: min(v, cap) for k, v in best.items()}
        eps = max(best.values())
    details = {"discretisation": rungs[int(min(range(len(rung_eps)), key=rung_eps.__getitem__))],
               "grids": [{"grid": g, "epsilon": e} for g, e in zip(rungs, rung_eps)],
               # whether this evaluation refined its grid to convergence (False on a fixed grid, as a
               # calibration's search uses): not the calibration's own `converged`
               "grid_refined_to_convergence": limited is None and refined, "limited_by": limited}
    if not math.isfinite(eps) or limited is not None:
        alt = _alternative(mech, delta)
        if alt is not None and alt.epsilon < eps:
            why = "pld found no finite epsilon" if not math.isfinite(eps) else f"pld grid limited by {limited}"
            return alt.standing_in_for("pld", f"{why}; this bound is {alt.accountant} (smaller, also valid)",
                                       pld_epsilon=eps)
    return EpsilonResult(
        accountant="pld", epsilon=eps, delta=delta, relation=relation_of(mech),
        guarantee="upper bound (dp-accounting PLD, pessimistic discretisation"
                  + (", grid limited by the " + limited + " budget)" if limited else ")"),
        directions=best, details=details,
    )


def steps_curve(template: Mechanism, delta: float, options: PldOptions | None = None):
    """T -> ``epsilon`` of ``template`` with T steps, on one grid (``options.grid``, else the ladder's first
    rung): the step is discretised once and each direction's transform reused (``compose.StepsCurve``). Where
    that does not apply or does not fit (p = 1 Gaussian steps collapse to one; delta below ``MIN_DELTA``; over
    the memory budget), each T is ``epsilon`` on that grid, as valid."""
    grid = options.grid if options is not None and options.grid is not None else first_grid(template, delta)
    if delta < MIN_DELTA or _as_composed(template.with_steps(2)).steps == 1:
        return lambda steps: epsilon(template.with_steps(steps), delta, grid)
    shared: list = []

    def at(steps: int) -> EpsilonResult:
        mech = template.with_steps(steps)
        try:
            if not shared:
                shared.append(StepsCurve(template, grid, delta))
            found = shared[0].at(steps).epsilons(delta)
        except (budgets.OverBudget, OverflowError):
            return epsilon(mech, delta, grid)
        return _answer(mech, delta, found, [grid], [max(found.values())], None, refined=False)

    return at


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


def _alternative(mech: Event, delta: float) -> EpsilonResult | None:
    """A bound valid at any delta, chosen by the noise records: RDP where every phase's noise has an RDP event
    (the Gaussian's), randomized-response composition or pure composition where every phase is pure DP (Laplace);
    None otherwise (phases that mix the two)."""

    if rdp.limitation(mech) is None:
        return rdp.epsilon(mech, delta)
    if not all(noise(part.kind).pure_dp for part in mech.phases):
        return None

    if delta > 0 and isinstance(mech, Mechanism) and mech.steps <= RR_MAX_STEPS:
        return pure.prv_epsilon(mech, delta)
    return pure.epsilon(mech, delta)


def _fallback(mech: Event, delta: float, why: str) -> EpsilonResult:
    alternative = _alternative(mech, delta)
    if alternative is None:
        raise DPAuditError(f"{why}, and no other accountant here covers {mech.kind} noise")
    return alternative.standing_in_for("pld", why)


def _coarse_options(mech: Event, delta: float) -> PldOptions:
    return PldOptions(grid=max(COARSE_GRID, first_grid(mech, delta)))


def _first_options(mech: Event, delta: float) -> PldOptions:
    return PldOptions(grid=first_grid(mech, delta))


def _resolution(anchor: Event, delta: float):
    """One refinement ladder at ``anchor`` fixes the grid relative to one step's loss range; every other event
    of the schedule is then evaluated on a single grid at that resolution (the ladder's last rung, the one that
    shows it has converged, alone costs ~3x the converged one)."""
    return _Resolution(anchor, delta)


class _Resolution:
    """``_resolution``'s rule: event -> options at the anchor's converged grid relative to one step's loss range;
    ``improvement``: how much the ladder's last rung improved on the first there (relative), which bounds how much
    lower the converged evaluation reads than the fixed one (a search uses it to skip a pointless check)."""

    def __init__(self, anchor: Event, delta: float) -> None:
        result = epsilon(anchor, delta)
        rungs = [r["epsilon"] for r in result.details.get("grids") or [] if math.isfinite(r["epsilon"])]
        self.improvement = (rungs[0] - min(rungs)) / min(rungs) if rungs and min(rungs) > 0 else None
        self.ratio = converged_grid(anchor, delta, result) / step_loss_range(anchor, delta)
        self.delta = delta

    def __call__(self, mech: Event) -> PldOptions:
        return PldOptions(grid=min(MAX_GRID, self.ratio * step_loss_range(mech, self.delta)))


def search_hooks():
    return SearchHooks(coarse=_coarse_options, first=_first_options, resolution=_resolution,
                       curve=steps_curve)
