"""Fixed-size batches as a PLD (issue 40, item 2; the pair corrected in issue 53: S, the symmetrised
sensitivity-2C pair of accounting/wor.py). Checked against the exact full-batch Gaussian at B = N, against RDP
and against dp-accounting's composed directions; tests/accounting/test_brute_force.py checks it against every
enumerated tiny mechanism."""

import pytest

from dpaudit.accounting.mechanism import schedule
from dpaudit.accounting.registry import ACCOUNTANTS, epsilon
from dpaudit.accounting.result import NeighboringRelation
from dpaudit.core.errors import DPAuditError


def fixed(sigma, b, n, steps):
    return schedule("gaussian", sigma, None, b, n, steps, None, "fixed")


def test_full_batch_equals_the_exact_gaussian_of_sensitivity_two():
    ours = epsilon(fixed(2.0, 100, 100, 10), 1e-5, "wor-pld")
    exact = epsilon(schedule("gaussian", 1.0, 1.0, None, None, 10), 1e-5)   # sigma / 2, analytic
    assert exact.accountant == "analytic"
    assert exact.epsilon <= ours.epsilon <= exact.epsilon * (1 + 1e-4)


@pytest.mark.parametrize("sigma, b, n, steps", [(1.1, 256, 60_000, 14_040), (16.4, 16, 1000, 75_000),
                                                (1.0, 50, 1000, 200)])
def test_tighter_than_rdp_on_the_benchmark_schedules(sigma, b, n, steps):
    mech = fixed(sigma, b, n, steps)
    assert epsilon(mech, 1e-5, "wor-pld").epsilon < 0.8 * epsilon(mech, 1e-5, "rdp").epsilon


@pytest.mark.parametrize("sigma, b, n, steps", [(1.1, 256, 60_000, 2000), (1.0, 50, 1000, 200), (0.7, 3, 10, 5)])
def test_at_least_either_direction_composed(sigma, b, n, steps):
    """Both directions are realised by a dataset (D = {-1, +1, ...} against all +1, and the swap), so the bound
    is at least each one's composed eps (dp-accounting's Poisson pair of shift 2C at rate B/N, pessimistic: up to
    its grid); an adaptive run may switch direction, which S composed covers."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    ours = epsilon(fixed(sigma, b, n, steps), 1e-5, "wor-pld").epsilon
    pld = pld_lib.from_gaussian_mechanism(sigma, sensitivity=2.0, sampling_prob=b / n,
                                          value_discretization_interval=1e-3, use_connect_dots=True)
    either = pld.self_compose(steps).get_epsilon_for_delta(1e-5)   # the max over both directions
    assert ours >= either - steps * 1e-3


def test_both_relations_and_monotone_in_sigma():
    mech = fixed(1.5, 20, 500, 100)
    replace_one = epsilon(mech, 1e-5, "wor-pld")
    add_remove = epsilon(mech, 1e-5, "wor-pld", relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert add_remove.epsilon == replace_one.epsilon
    assert add_remove.neighboring == NeighboringRelation.ADD_OR_REMOVE_ONE
    assert "not add/remove" in ACCOUNTANTS["rdp"].supports(mech, 1e-5, NeighboringRelation.ADD_OR_REMOVE_ONE)
    values = [epsilon(mech.with_sigma(s), 1e-5, "wor-pld").epsilon for s in (1.0, 1.5, 2.5)]
    assert values == sorted(values, reverse=True)
    with pytest.raises(DPAuditError, match="delta > 0"):
        epsilon(mech, 0.0, "wor-pld")
