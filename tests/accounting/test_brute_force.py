"""Issue 53, item 1: every hand-written accountant against an exact enumeration of tiny mechanisms.

For fixed-size batches (wor-pld) every B-subset is enumerated, for all N <= 8, B < N, T <= 3, a grid of sigma
and every ordered pair of +-C datasets under replace-one and under add/remove (the relations wor-pld claims);
the accountant's eps must never be below the exact eps of any such pair, i.e. the pair's delta at the
accountant's eps (bounded from below by ``brute_force.delta_floor``) must not exceed delta. The same floor is
run for every other hand-written accountant with a small exact case: Poisson sampling (our PLD composition of
dp-accounting's pair; every inclusion pattern enumerated), pure eps-DP Laplace (Poisson and fixed-size: at the
accountant's eps no loss may exceed it), and balls-in-bins (the allocation lattice; t = 2 steps an epoch, every
allocation of every example enumerated, the plane cut into cells), and shuffled epochs (the no-amplification
bound under zero-out; every permutation enumerated, t = 2).
The old fixed-size pair (Poisson's replace-one pair at rate B/N) fails this test: sigma 1, B 2, N 4, T 1 read
eps 4.22 where D = {-1, +1, +1, +1} against D' = {+1, +1, +1, +1} reaches 8.98.
"""

from __future__ import annotations

import functools

import pytest

from brute_force import (ROUNDING, add_remove_pairs, allocation_bins, composed_floor, delta_floor, fixed_size_law,
                         poisson_law, replace_one_pairs, shuffle_bins, zero_out_pairs)
from dpaudit.accounting.mechanism import schedule
from dpaudit.accounting.registry import epsilon
from dpaudit.accounting.result import NeighboringRelation

DELTA = 1e-5
SIGMAS = (0.5, 1.0, 2.0)
SIZES = [(n, b) for n in range(2, 9) for b in range(1, n)]


@functools.cache
def _fixed_eps(sigma: float, b: int, n: int, steps: int) -> float:
    result = epsilon(schedule("gaussian", sigma, None, b, n, steps, None, "fixed"), DELTA)
    assert result.accountant == "wor-pld"
    return result.epsilon


def _worst(pairs, law, sigma, steps, eps):
    """The largest delta floor at ``eps`` over ``pairs``, with the pair that reaches it."""
    best = (-1.0, None)
    for d, d2 in pairs:
        floor = float(delta_floor(law(d), law(d2), sigma, steps, [eps])[0])
        best = max(best, (floor, (d, d2)), key=lambda t: t[0])
    return best


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("sigma", SIGMAS)
def test_fixed_size_is_never_below_any_enumerated_pair(sigma, steps):
    failures = []
    for n, b in SIZES:
        eps = _fixed_eps(sigma, b, n, steps)
        law = functools.partial(_law_fixed, b)
        worst, pair = _worst(replace_one_pairs(n), law, sigma, steps, eps)
        # add/remove with the real dataset of size n: the smaller (n - 1 >= B) still holds a batch
        worst_ar, pair_ar = _worst(add_remove_pairs(n), law, sigma, steps, eps)
        if worst_ar > worst:
            worst, pair = worst_ar, pair_ar
        if worst > DELTA + ROUNDING:
            failures.append(f"N {n} B {b}: eps {eps:.4f}, {pair} has delta >= {worst:.3g}")
    assert not failures, failures


def _law_fixed(b, data):
    return fixed_size_law(data, b)


def test_fixed_size_is_tight_on_the_worst_pair():
    """One step: S is R_rem for eps >= 0, which D = {-1, +1, +1, +1} against {+1, +1, +1, +1} attains."""
    eps = _fixed_eps(1.0, 2, 4, 1)
    d, d2 = (-1, 1, 1, 1), (1, 1, 1, 1)
    assert 8.98 <= eps <= 8.99   # the quadrature: 8.98137
    floor = delta_floor(fixed_size_law(d, 2), fixed_size_law(d2, 2), 1.0, 1, [0.99 * eps, eps])
    assert floor[0] > DELTA >= floor[1] - ROUNDING


def test_the_old_pair_would_fail_the_floor():
    """The floor can fail: at the old accountant's 4.2226 the worst pair's delta is far above 1e-5."""
    floor = delta_floor(fixed_size_law((-1, 1, 1, 1), 2), fixed_size_law((1, 1, 1, 1), 2), 1.0, 1, [4.2226])
    assert floor[0] > 100 * DELTA


@pytest.mark.parametrize("sigma, n, b, steps", [(1.0, 4, 2, 1), (0.8, 6, 1, 3), (1.5, 8, 3, 2)])
def test_fixed_size_add_remove_answer_is_the_same_bound(sigma, n, b, steps):
    mech = schedule("gaussian", sigma, None, b, n, steps, None, "fixed")
    both = epsilon(mech, DELTA, "wor-pld", relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert both.epsilon == _fixed_eps(sigma, b, n, steps)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("sigma", SIGMAS)
def test_poisson_is_never_below_any_enumerated_pair(sigma, steps):
    failures = []
    for n in range(1, 7):
        for rate in (0.1, 0.5, 0.9):
            eps = epsilon(schedule("gaussian", sigma, rate, None, None, steps), DELTA).epsilon
            worst, pair = _worst(add_remove_pairs(n), functools.partial(_law_poisson, rate), sigma, steps, eps)
            if worst > DELTA + ROUNDING:
                failures.append(f"n {n} p {rate}: eps {eps:.4f}, {pair} has delta >= {worst:.3g}")
    assert not failures, failures


def _law_poisson(rate, data):
    return poisson_law(data, rate)


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_pure_laplace_is_never_below_any_enumerated_pair(sigma, steps):
    """At delta = 0 the accountant's eps must bound every loss: the floor of delta there must be 0."""
    failures = []
    for n in range(1, 6):
        for rate in (0.2, 0.5, 1.0):
            result = epsilon(schedule("laplace", sigma, rate, None, None, steps), 0.0)
            assert result.accountant in ("pure", "analytic")   # analytic: one release, p = 1
            for d, d2 in add_remove_pairs(n):
                floor = delta_floor(poisson_law(d, rate), poisson_law(d2, rate), sigma, steps, [result.epsilon],
                                    noise="laplace")[0]
                if floor > ROUNDING:
                    failures.append(f"poisson n {n} p {rate}: eps {result.epsilon:.4f}, {(d, d2)}: {floor:.3g}")
    for n, b in [(2, 1), (3, 1), (4, 2), (5, 2)]:
        result = epsilon(schedule("laplace", sigma, None, b, n, steps, None, "fixed"), 0.0)
        for d, d2 in replace_one_pairs(n):
            floor = delta_floor(fixed_size_law(d, b), fixed_size_law(d2, b), sigma, steps, [result.epsilon],
                                noise="laplace")[0]
            if floor > ROUNDING:
                failures.append(f"fixed N {n} B {b}: eps {result.epsilon:.4f}, {(d, d2)}: {floor:.3g}")
    assert not failures, failures


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0])
def test_balls_in_bins_is_never_below_any_enumerated_pair(sigma):
    """t = 2 steps an epoch (N // B = 2), one and two epochs, every add/remove pair of +-1 datasets."""
    failures = []
    for n, b in [(2, 1), (4, 2)]:
        for epochs in (1, 2):
            result = epsilon(schedule("gaussian", sigma, None, b, n, 2 * epochs, None, "balls-in-bins"), DELTA)
            for d, d2 in add_remove_pairs(n):
                floor = composed_floor(allocation_bins(d, d2, sigma), epochs, [result.epsilon])[0]
                if floor > DELTA + ROUNDING:
                    failures.append(f"N {n} B {b} E {epochs}: eps {result.epsilon:.4f} ({result.accountant}), "
                                    f"{(d, d2)}: {floor:.3g}")
    assert not failures, failures


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0])
def test_shuffle_is_never_below_any_enumerated_pair(sigma):
    """Shuffled epochs (a random permutation cut into t = 2 batches of N / 2), one and two epochs, every zero-out
    pair of +-1 datasets (the relation the shuffle bound claims): the no-amplification upper bound is never below
    the exact mechanism. It is loose by construction (no amplification), so the check is against the truth only."""
    failures = []
    for n, b in [(2, 1), (4, 2)]:
        for epochs in (1, 2):
            result = epsilon(schedule("gaussian", sigma, None, b, n, 2 * epochs, None, "shuffle"), DELTA)
            assert result.accountant == "shuffle"
            for d, d2 in zero_out_pairs(n):
                floor = composed_floor(shuffle_bins(d, d2, sigma), epochs, [result.epsilon])[0]
                if floor > DELTA + ROUNDING:
                    failures.append(f"N {n} B {b} E {epochs}: eps {result.epsilon:.4f}, {(d, d2)}: {floor:.3g}")
    assert not failures, failures


def test_the_shuffle_floor_can_fail():
    """The floor is not vacuous: at an eps well below the bound (a tenth of it) some pair's delta exceeds DELTA."""
    result = epsilon(schedule("gaussian", 1.0, None, 1, 2, 2, None, "shuffle"), DELTA)
    worst = max(composed_floor(shuffle_bins(d, d2, 1.0), 1, [result.epsilon / 10])[0] for d, d2 in zero_out_pairs(2))
    assert worst > DELTA
