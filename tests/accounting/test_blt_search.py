"""The BLT search (``blt,buffers=d``): the theta and omega it finds stay where the sensitivity formula is exact,
reach the optimal Toeplitz error under one participation, beat the sqrt strategy under several, and every answer
names them."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dpaudit.accounting.matrix import toeplitz
from dpaudit.accounting.matrix.strategy import parse
from dpaudit.accounting.mechanism import Mechanism
from dpaudit.core.errors import DPAuditError
from correlated_helpers import dense


def _sqrt_loss(n: int, sep: int, k: int) -> float:
    c = toeplitz.sqrt_coefs(n)
    return toeplitz.max_error(c, [1.0], n) * toeplitz.minsep_sensitivity_squared(c, sep, k)


def _brute_sensitivity_squared(coefs: np.ndarray, sep: int, k: int) -> float:
    """max ||C u||^2 over every 0/1 pattern u with at most k ones at least sep apart (dense C)."""
    n = coefs.size
    c = dense(coefs, n)
    best = 0.0
    for count in range(1, k + 1):
        for steps in itertools.combinations(range(n), count):
            if all(b - a >= sep for a, b in zip(steps, steps[1:])):
                best = max(best, float(np.sum(c[:, list(steps)].sum(axis=1) ** 2)))
    return best


@pytest.mark.parametrize("n,sep,k", [(12, 1, 3), (12, 4, 3), (10, 2, 5)])
def test_the_search_stays_where_the_sensitivity_is_exact(n, sep, k):
    theta, omega = toeplitz.optimal_blt(n, 2, sep, k)
    coefs = np.asarray(toeplitz.series(*toeplitz.blt_rational(theta, omega), n))
    assert np.all(coefs >= 0) and np.all(np.diff(coefs) <= 1e-15)
    assert toeplitz.minsep_sensitivity_squared(coefs, sep, k) == pytest.approx(
        _brute_sensitivity_squared(coefs, sep, k), rel=1e-12)


def test_one_participation_reaches_the_sqrt_strategy_and_several_beat_it():
    # one participation: sqrt(A) is within a few per cent of the optimal Toeplitz strategy; three buffers reach it
    assert toeplitz.blt_loss(*toeplitz.optimal_blt(1000, 3), 1000) <= 1.01 * _sqrt_loss(1000, 1, 1)
    assert toeplitz.blt_loss(*toeplitz.optimal_blt(1000, 1), 1000) >= 1.2 * _sqrt_loss(1000, 1, 1)  # one is not enough
    # nine epochs of 234 steps (the 60k schedule): sqrt(A) is not the optimum there
    assert toeplitz.blt_loss(*toeplitz.optimal_blt(2000, 3, 234, 9), 2000, 234, 9) <= 0.9 * _sqrt_loss(2000, 234, 9)


def test_a_searched_blt_is_resolved_for_the_schedule_and_named():
    strategy = parse("blt,buffers=3")
    assert strategy.buffers == 3 and not strategy.theta and strategy.spec() == "blt,buffers=3"
    mech = Mechanism("gaussian", 1.0, 0.064, 300, "balls-in-bins", 64, 1000, strategy=strategy)
    found = mech.strategy
    assert len(found.theta) == 3 and found.spec().startswith("blt,theta=")
    assert parse(found.spec()).theta == pytest.approx(found.theta, rel=1e-10)   # a spec that can be pinned
    assert mech.with_steps(10).strategy == found   # a partial run keeps the run's strategy
    assert toeplitz.blt_loss(found.theta, found.omega, 300, 1, 20) <= toeplitz.blt_loss((0.99, 0.8), (0.05, 0.2),
                                                                                         300, 1, 20)


@pytest.mark.parametrize("spec", ["blt,buffers=9", "blt,buffers=0", "blt,buffers=2,theta=0.5", "blt,d=x"])
def test_bad_searched_specs_are_refused(spec):
    with pytest.raises(DPAuditError):
        parse(spec)


@pytest.mark.parametrize("sampling,words", [("fixed", "replace-one"), ("shuffle", "zero-out"),
                                            ("balls-in-bins", "add/remove")])
def test_the_matrix_answer_names_the_relation_its_sensitivity_is_computed_under(sampling, words):
    from dpaudit.accounting import epsilon

    mech = Mechanism("gaussian", 2.0, 0.064, 30, sampling, 64, 1000, strategy=parse("blt,theta=0.9,omega=0.3"))
    result = epsilon(mech, 1e-5, "matrix")
    assert result.relation.startswith(words), result.relation


def test_a_resumed_run_is_never_below_its_concrete_pair():
    """single.resumed_epsilon (n attempts: sigma / sqrt(n)) against the exact eps of a concrete neighbouring pair of
    a fixed-order run resumed at step s: the example at its worst positions, the two attempts' releases one
    Gaussian vector with mean (C u, (C u)_{t >= s}) at noise sigma x sens (Gaussian: exact, analytic)."""
    from dpaudit.accounting import analytic
    from dpaudit.accounting.matrix import single

    steps, per_epoch, sigma = 12, 4, 1.5
    mech = Mechanism("gaussian", sigma, 0.25, steps, "shuffle", 4, 16, strategy=parse("blt,buffers=2,order=fixed"))
    sens = single.sensitivity(mech)
    coefs = np.asarray(mech.strategy.coefs(steps))
    c = dense(coefs, steps)
    bound = single.resumed_epsilon(mech, 2, 1e-5).epsilon
    for first in range(per_epoch):
        shift = c[:, first::per_epoch].sum(axis=1)          # one participation an epoch, at its fixed position
        for s in (0, 1, 5, steps - 1):
            mu = math.sqrt(shift @ shift + shift[s:] @ shift[s:]) / (sigma * sens)
            exact = analytic.epsilon(Mechanism("gaussian", 1.0 / mu), 1e-5).epsilon
            assert exact <= bound + 1e-9
            if s == 0 and first == 0:
                assert exact == pytest.approx(bound, rel=1e-6)   # resumed at the start: the bound is attained


def test_the_spec_and_the_search_take_the_same_buffers():
    from dpaudit.accounting.matrix import strategy

    assert strategy.MAX_BUFFERS == toeplitz.MAX_BLT_BUFFERS
