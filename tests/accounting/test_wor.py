"""Issue 40, item 2: fixed-size batches as a PLD (Lebeda et al.'s dominating pair of sampling without
replacement). Checked against a brute-force hockey-stick divergence of the pair on small T (a worst-case dataset
attains the pair, so this is the true eps), against the exact full-batch Gaussian at B = N, and against RDP."""

import math

import numpy as np
import pytest

from dpaudit.accounting.mechanism import schedule
from dpaudit.accounting.registry import ACCOUNTANTS, epsilon
from dpaudit.accounting.result import NeighboringRelation
from dpaudit.core.errors import DPAuditError


def fixed(sigma, b, n, steps):
    return schedule("gaussian", sigma, None, b, n, steps, None, "fixed")


def _brute_delta(sigma: float, gamma: float, steps: int, eps: float) -> float:
    """E_P[(1 - e^eps Q/P)_+] for the T-fold product of P = (1-g)N(0) + gN(-1) against Q = (1-g)N(0) + gN(1),
    by a midpoint rule on a fine grid (T = 1: 1-D; T = 2: 2-D)."""
    step = sigma / 400 if steps == 1 else sigma / 80
    axis = np.arange(-1 - 10 * sigma, 1 + 10 * sigma, step) + step / 2

    def density(y, shift):
        return ((1 - gamma) * np.exp(-y ** 2 / (2 * sigma ** 2))
                + gamma * np.exp(-(y - shift) ** 2 / (2 * sigma ** 2))) / (sigma * math.sqrt(2 * math.pi))

    p, q = density(axis, -1.0), density(axis, 1.0)
    if steps == 2:
        p, q = np.outer(p, p), np.outer(q, q)
    return float(np.maximum(p - math.exp(eps) * q, 0).sum() * step ** steps)


@pytest.mark.parametrize("steps", [1, 2])
def test_upper_bound_holds_and_is_tight_against_the_brute_force_pair(steps):
    sigma, b, n, delta = 1.0, 3, 10, 1e-3
    ours = epsilon(fixed(sigma, b, n, steps), delta)
    assert ours.accountant == "wor-pld" and ours.neighboring == NeighboringRelation.REPLACE_ONE
    assert _brute_delta(sigma, b / n, steps, ours.epsilon) <= delta * (1 + 1e-5)
    assert _brute_delta(sigma, b / n, steps, 0.98 * ours.epsilon) > delta   # within 2 % of the truth


def test_full_batch_equals_the_exact_gaussian_of_sensitivity_two():
    ours = epsilon(fixed(2.0, 100, 100, 10), 1e-5, "wor-pld")
    exact = epsilon(schedule("gaussian", 1.0, 1.0, None, None, 10), 1e-5)   # sigma / 2, analytic
    assert exact.accountant == "analytic"
    assert exact.epsilon <= ours.epsilon <= exact.epsilon * (1 + 1e-4)


@pytest.mark.parametrize("sigma, b, n, steps", [(1.1, 256, 60_000, 14_040), (16.4, 16, 1000, 75_000),
                                                (1.0, 50, 1000, 200)])
def test_tighter_than_rdp_on_the_benchmark_schedules(sigma, b, n, steps):
    mech = fixed(sigma, b, n, steps)
    assert epsilon(mech, 1e-5, "wor-pld").epsilon < 0.6 * epsilon(mech, 1e-5, "rdp").epsilon


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
