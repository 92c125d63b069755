"""Issue 40: balls-in-bins (random allocation) accounting. The upper and the lower bound bracket a brute-force
hockey-stick divergence of the dominating pair (t = 2: a 2-D integral), nest inside pld-accounting's interval
(Feldman & Shenfeld's own code) where it is installed, sit below Poisson where the theory says so, and calibrate
on the safe side. No stored outputs."""

import math

import numpy as np
import pytest

import dpaudit
from dpaudit.accounting import allocation
from dpaudit.accounting.mechanism import schedule
from dpaudit.accounting.registry import epsilon
from dpaudit.accounting.result import NeighboringRelation
from dpaudit.core.errors import DPAuditError


def balls(sigma, per_epoch, epochs, batch=10):
    return schedule("gaussian", sigma, None, batch, batch * per_epoch, per_epoch * epochs, None, "balls-in-bins")


def _hockey_stick_two_steps(sigma: float, eps: float) -> float:
    """max over the two directions of E_Q[(P/Q - e^eps)_+] (and (Q, P)): P = (N(e1) + N(e2)) / 2, Q = N(0),
    sigma^2 I on R^2, by a fine 2-D midpoint rule (error ~1e-8 at these widths)."""
    step = sigma / 120
    axis = np.arange(-9 * sigma, 1 + 9 * sigma, step) + step / 2
    y1, y2 = np.meshgrid(axis, axis, indexing="ij")
    q = np.exp(-(y1 ** 2 + y2 ** 2) / (2 * sigma ** 2)) / (2 * math.pi * sigma ** 2)
    ratio = 0.5 * (np.exp((2 * y1 - 1) / (2 * sigma ** 2)) + np.exp((2 * y2 - 1) / (2 * sigma ** 2)))
    p = q * ratio
    remove = np.maximum(p - math.exp(eps) * q, 0).sum() * step ** 2
    add = np.maximum(q - math.exp(eps) * p, 0).sum() * step ** 2
    return max(remove, add)


@pytest.mark.parametrize("sigma", [0.9, 1.5])
def test_bounds_bracket_the_brute_force_divergence_of_two_steps(sigma):
    delta = 1e-3
    mech = balls(sigma, 2, 1)
    upper = epsilon(mech, delta, "allocation")
    lower = allocation.lower_bound(mech, delta, upper.details["lattice"])
    assert upper.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE
    assert lower <= upper.epsilon <= 1.01 * lower + 1e-3
    assert _hockey_stick_two_steps(sigma, upper.epsilon) <= delta * (1 + 1e-4)   # the upper bound holds
    assert _hockey_stick_two_steps(sigma, lower) >= delta * (1 - 1e-4)           # the lower bound is below the truth


def test_nested_inside_pld_accounting_interval():
    pld_accounting = pytest.importorskip("PLD_accounting")
    theirs_upper, theirs_lower = pld_accounting.gaussian_allocation_epsilon_range(
        delta=1e-5, sigma=1.0, num_steps=10, num_epochs=3)
    ours = epsilon(balls(1.0, 10, 3), 1e-5, "allocation")
    lower = allocation.lower_bound(balls(1.0, 10, 3), 1e-5, ours.details["lattice"])
    assert theirs_lower <= lower <= ours.epsilon <= theirs_upper


def test_below_poisson_at_one_hundred_steps_and_refined_towards_the_lower_bound():
    """The issue's case: t = 100, sigma 1, one epoch; Poisson at p = 1/100 for 100 steps reads 0.718."""
    mech = balls(1.0, 100, 1)
    poisson = epsilon(schedule("gaussian", 1.0, 0.01, None, None, 100), 1e-5)
    ours = epsilon(mech, 1e-5)
    assert ours.accountant == "allocation" and ours.details["converged"]
    rungs = [r["epsilon"] for r in ours.details["rungs"]]
    assert rungs == sorted(rungs, reverse=True)                     # finer lattices, smaller bounds
    lower = allocation.lower_bound(mech, 1e-5, ours.details["lattice"])
    assert lower <= ours.epsilon <= 1.005 * lower
    assert ours.epsilon < 0.9 * poisson.epsilon


def test_calibration_meets_the_target_on_the_safe_side_and_close_to_the_converged_sigma():
    target = 1.0
    cal = dpaudit.calibrate(eps=target, batch_size=10, dataset_size=300, epochs=3, sampling="balls-in-bins")
    assert cal.result.accountant == "allocation" and cal.epsilon <= target
    template = balls(1.0, 30, 3)
    # the sigma where a finer (valid) lattice meets the target is at most 1 % below the calibrated one (the search
    # settles at a coarse rung: 1e-3 here; 1e-4 reads within 1e-4 of 3e-5's answer at a fifth of its time)
    assert cal.result.details["lattice"] > allocation.LADDER[-4]
    finer = epsilon(template.with_sigma(cal.sigma * 0.99), 1e-5, "allocation",
                    allocation.AllocationOptions(lattice=allocation.LADDER[-4]))
    assert finer.epsilon > target


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(DPAuditError, match="whole number"):
        schedule("gaussian", 1.0, None, 10, 100, None, 2.5, "balls-in-bins")
    with pytest.raises(DPAuditError, match="exceeds"):
        schedule("gaussian", 1.0, None, 200, 100, 5, None, "balls-in-bins")
    with pytest.raises(DPAuditError, match="at least 2 steps an epoch"):
        epsilon(schedule("gaussian", 1.0, None, 60, 100, 5, None, "balls-in-bins"), 1e-5, "allocation")
    with pytest.raises(DPAuditError, match="delta > 0"):
        epsilon(balls(1.0, 10, 1), 0.0, "allocation")
    laplace = epsilon(schedule("laplace", 2.0, None, 10, 100, 20, None, "balls-in-bins"), 1e-5)
    assert laplace.accountant == "shuffle" and laplace.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE


def test_partial_epoch_is_accounted_as_whole():
    whole = epsilon(balls(1.2, 20, 2), 1e-5, "allocation")
    partial = epsilon(schedule("gaussian", 1.2, None, 10, 200, 25, None, "balls-in-bins"), 1e-5, "allocation")
    assert partial.epsilon == whole.epsilon and "partial last epoch" in partial.guarantee


def test_cli_balls_in_bins_and_the_sampler_table():
    import json

    from cli_helpers import assert_one_line_error, dpaudit as run

    said = run("epsilon", "--sigma", "1.2", "-B", "10", "-N", "300", "--epochs", "3", "--sampling", "balls-in-bins",
               "--json")
    assert said.returncode == 0, said.stderr
    answer = json.loads(said.stdout)
    assert answer["result"]["accountant"] == "allocation" and answer["result"]["neighboring"] == "add/remove"
    assert answer["shuffle"]["lower_bound"] <= answer["result"]["epsilon"]
    table = run("compare", "--sigma", "1.2", "-B", "10", "-N", "300", "--epochs", "3", "--sampling", "all", "--json")
    assert table.returncode == 0, table.stderr
    rows = {(r["sampler"], r["bound"], r["relation"]): r for r in json.loads(table.stdout)["rows"]}
    assert rows[("poisson", "upper", "add/remove")]["vs_poisson"] == 1.0
    assert rows[("balls-in-bins", "lower", "add/remove")]["epsilon"] \
        <= rows[("balls-in-bins", "upper", "add/remove")]["epsilon"] <= rows[("shuffle", "upper", "zero-out")]["epsilon"]
    assert_one_line_error(run("compare", "--eps", "1", "-B", "10", "-N", "300", "--epochs", "3", "--sampling", "all"))


def test_over_budget_answers_the_shuffle_bound_and_says_so():
    from dpaudit.core import limits

    mech = balls(1.0, 5000, 2)  # its coarsest lattice needs ~150 MB, over a 256M budget's ~96 MB
    with limits.limits(max_memory="256M"):
        answer = epsilon(mech, 1e-5)
        assert allocation.lower_bound(mech, 1e-5, allocation.LADDER[0]) is None
    assert answer.accountant == "shuffle" and answer.details["requested"] == "allocation"
    assert "over the budget" in answer.guarantee
    assert answer.epsilon >= epsilon(schedule("gaussian", 1.0, 1 / 5000, None, None, 10_000), 1e-5).epsilon


def test_extremes_are_answered_never_crash():
    tiny = epsilon(balls(0.05, 100, 2), 1e-5)
    assert tiny.accountant == "shuffle" and math.isfinite(tiny.epsilon)
    huge = epsilon(balls(1e6, 100, 2), 1e-5)
    assert huge.accountant == "allocation" and 0 <= huge.epsilon < 1e-3
    far = epsilon(balls(1.0, 100, 2), 1e-200)
    assert math.isfinite(far.epsilon) and far.epsilon > epsilon(balls(1.0, 100, 2), 1e-5).epsilon


def test_lower_bound_counts_complete_epochs_only():
    partial = schedule("gaussian", 1.2, None, 10, 200, 25, None, "balls-in-bins")   # 1 epoch of 20 and 5 steps
    assert allocation.lower_bound(partial, 1e-5, 1e-3) == allocation.lower_bound(balls(1.2, 20, 1), 1e-5, 1e-3)
    assert allocation.lower_bound(schedule("gaussian", 1.2, None, 10, 200, 5, None, "balls-in-bins"), 1e-5,
                                  1e-3) is None


def test_calibration_whose_anchor_falls_back_to_the_shuffle_bound_answers():
    """Issue 53, item 3: the search read the lattice of an anchor the shuffle bound had answered (KeyError,
    exit 3). At a small sigma the lattice is over budget; the calibration now answers, on the safe side."""
    from dpaudit.accounting.calibrate import calibrate_sigma

    mech = schedule("gaussian", 1.0, None, 4, 40, 3, None, "balls-in-bins")
    answer = calibrate_sigma(mech, 8.0, 1e-5)
    assert answer.epsilon <= 8.0
    assert epsilon(mech.with_sigma(answer.sigma), 1e-5).epsilon <= 8.0


def test_an_infinite_allocation_bound_gives_way_to_the_finite_shuffle_bound():
    """Issue 53, item 7: sigma 0.8, B 1, N 2, 5 epochs, delta 1e-8 read "eps <= inf" with exit 0 (the coarse
    lattice's add direction). Both bounds are valid for balls-in-bins; the smaller, finite one answers."""
    mech = schedule("gaussian", 0.8, None, 1, 2, 10, None, "balls-in-bins")
    answer = epsilon(mech, 1e-8)
    no_amplification = epsilon(mech, 1e-8, "shuffle").epsilon
    assert math.isfinite(answer.epsilon) and answer.epsilon <= no_amplification
    assert answer.epsilon >= 15.79   # pld-accounting's lower end for this schedule


def test_phases_of_two_add_remove_samplers_are_refused_for_what_it_is():
    from dpaudit.accounting.mechanism import compose_phases

    with pytest.raises(DPAuditError, match="share the add/remove relation, but no accountant here composes them"):
        compose_phases([schedule("gaussian", 1.0, 0.01, None, None, 100),
                        schedule("gaussian", 1.0, None, 4, 400, 100, None, "balls-in-bins")])
