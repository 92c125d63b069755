"""`pld`: Google's dp-accounting privacy loss distributions, add/remove, pessimistic.

Every number returned here is an upper bound: dp-accounting's pessimistic discretisation
rounds privacy losses up and moves truncated tail mass to +inf, whatever the grid.
A coarse grid therefore gives a valid (looser) bound, which is how we pick the fine grid:
a first pass at 1e-3 estimates epsilon, the second pass uses a grid of ~5e-5 * epsilon,
and the smaller of the two valid bounds is reported.
"""

from __future__ import annotations

from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.pure import step_epsilon
from dpaudit.accounting.result import ADD_REMOVE, SINGLE_RELEASE, EpsilonResult

COARSE_GRID = 1e-3
RELATIVE_GRID = 5e-5
FINEST_GRID = 2e-6


def composed_pld(mech: Mechanism, grid: float, pessimistic: bool = True) -> pld_lib.PrivacyLossDistribution:
    # Connect-the-dots is pessimistic only; the optimistic estimate uses privacy buckets.
    options = {} if pessimistic else {"use_connect_dots": False}
    if mech.kind == "gaussian":
        single = pld_lib.from_gaussian_mechanism(
            mech.sigma, sensitivity=1.0, pessimistic_estimate=pessimistic,
            value_discretization_interval=grid, sampling_prob=mech.sampling_rate, **options)
    else:
        single = pld_lib.from_laplace_mechanism(
            mech.sigma, sensitivity=1.0, pessimistic_estimate=pessimistic,
            value_discretization_interval=grid, sampling_prob=mech.sampling_rate, **options)
    return single.self_compose(mech.steps) if mech.steps > 1 else single


def _directions(pld: pld_lib.PrivacyLossDistribution, delta: float) -> dict[str, float]:
    # dp-accounting keeps the two directions as _pmf_remove / _pmf_add and returns their max;
    # we read them apart to report which direction binds.
    remove = float(pld._pmf_remove.get_epsilon_for_delta(delta))  # noqa: SLF001
    add = float(pld._pmf_add.get_epsilon_for_delta(delta))  # noqa: SLF001
    return {"remove": remove, "add": add}


def epsilon_estimate_below(mech: Mechanism, delta: float, grid: float = COARSE_GRID) -> float:
    """A *lower* estimate of eps (dp-accounting's optimistic discretisation rounds losses down): never
    reported as a guarantee, only used to bracket searches (the true eps is at least this)."""
    return max(_directions(composed_pld(mech, grid, pessimistic=False), delta).values())


def epsilon(mech: Mechanism, delta: float, grid: float | None = None) -> EpsilonResult:
    if grid is None:
        coarse = _directions(composed_pld(mech, COARSE_GRID), delta)
        eps_coarse = max(coarse.values())
        fine_grid = max(FINEST_GRID, RELATIVE_GRID * eps_coarse)
        if fine_grid < COARSE_GRID:
            fine = _directions(composed_pld(mech, fine_grid), delta)
            # Both are valid upper bounds; the tighter one is reported.
            best, grid = (fine, fine_grid) if max(fine.values()) <= eps_coarse else (coarse, COARSE_GRID)
        else:
            best, grid = coarse, COARSE_GRID
    else:
        best = _directions(composed_pld(mech, grid), delta)
    if mech.kind == "laplace":
        # A Laplace run is also pure (T * eps_1)-DP; pessimistic rounding can put PLD a grid step
        # above that, and the smaller of two valid upper bounds is still valid.
        cap = mech.steps * step_epsilon(mech.sigma, mech.sampling_rate)
        best = {k: min(v, cap) for k, v in best.items()}
    return EpsilonResult(
        accountant="pld",
        epsilon=max(best.values()),
        delta=delta,
        relation=SINGLE_RELEASE if mech.is_single_release else ADD_REMOVE,
        guarantee="upper bound (dp-accounting PLD, pessimistic discretisation)",
        directions=best,
        details={"discretisation": grid},
    )
