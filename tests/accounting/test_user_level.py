"""User-level accounting (accounting/unit.py, user_level.py): ELS against dp-accounting's PLD of the same mixture
event (the oracle) and against an exact enumeration of tiny user-level mechanisms (the floor), k = 1 against the
example-level answer, ULS as the example-level mechanism at the users' rate, and group privacy beside them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from brute_force import ROUNDING, delta_floor, poisson_law, signed_datasets
from dpaudit.accounting.calibrate import calibrate_sigma, max_steps
from dpaudit.accounting.mechanism import Mechanism, schedule, with_unit
from dpaudit.accounting.registry import default_accountant, epsilon
from dpaudit.accounting.unit import EXAMPLE, Unit, unit_from
from dpaudit.accounting import user_level
from dpaudit.core.errors import DPAuditError


def els(k: int) -> Unit:
    return Unit("user", k)


def _oracle(sigma: float, p: float, steps: int, k: int, delta: float) -> float:
    """dp-accounting's own PLD accountant on its MixtureOfGaussiansDpEvent (Binomial(k, p) sensitivities)."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from scipy.stats import binom

    event = dp_event.MixtureOfGaussiansDpEvent(sigma, list(range(k + 1)), binom.pmf(range(k + 1), k, p).tolist())
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(event, steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("sigma, p, steps, k, delta", [
    (1.0, 0.01, 1000, 4, 1e-6),        # the issue's schedule: example-level 2.12, user-level about 10
    (2.1, 0.01024, 293, 16, 1e-6),     # 100,000 records, B 1,024, 3 epochs, k 16
])
def test_els_is_within_a_thousandth_of_dp_accountings_pld_of_the_mixture_and_never_below(sigma, p, steps, k, delta):
    ours = epsilon(Mechanism("gaussian", sigma, p, steps, unit=els(k)), delta)
    oracle = _oracle(sigma, p, steps, k, delta)
    assert ours.accountant == "pld" and oracle <= ours.epsilon <= oracle * 1.001, (ours.epsilon, oracle)
    assert ours.unit == f"user (ELS, k = {k})" and "one user's records" in ours.relation


def test_the_issues_figures_example_level_2_12_user_level_about_10():
    example = epsilon(Mechanism("gaussian", 1.0, 0.01, 1000), 1e-6).epsilon
    user = epsilon(Mechanism("gaussian", 1.0, 0.01, 1000, unit=els(4)), 1e-6).epsilon
    assert example == pytest.approx(2.12, abs=0.01) and 9.5 < user < 10.5


@pytest.mark.parametrize("kind, sigma, delta", [("gaussian", 1.3, 1e-5), ("laplace", 3.0, 0.0), ("laplace", 3.0, 1e-6)])
def test_k_1_is_the_example_level_answer(kind, sigma, delta):
    record = Mechanism(kind, sigma, 0.02, 200)
    user = with_unit(record, els(1))
    a, b = epsilon(record, delta), epsilon(user, delta)
    assert a.epsilon == b.epsilon and a.accountant == b.accountant
    assert calibrate_sigma(record.with_sigma(1.0), 3.0, delta).sigma == calibrate_sigma(user.with_sigma(1.0), 3.0,
                                                                                        delta).sigma


def test_uls_is_the_example_level_mechanism_at_the_users_rate():
    record = Mechanism("gaussian", 0.9, 0.03, 150)
    uls = with_unit(record, Unit("user", 8, "user"))
    a, b = epsilon(record, 1e-5), epsilon(uls, 1e-5)
    assert a.epsilon == b.epsilon and b.unit == "user (ULS, k = 8)"


def test_laplace_els_is_k_times_the_records_step_epsilon_exactly():
    """sup_x P/Q = (1 - p + p e^{1/sigma})^k: pure composition at delta = 0 is k times the record's."""
    record = Mechanism("laplace", 2.0, 0.05, 40)
    for k in (1, 3, 7):
        assert epsilon(with_unit(record, els(k)), 0.0).epsilon == pytest.approx(k * epsilon(record, 0.0).epsilon,
                                                                                 rel=1e-12)
    assert default_accountant(with_unit(record, els(3)), 1e-6) == "pure-prv"


# --- the floor: every batch of a tiny user-level mechanism enumerated ------------------------------------------
SIGMAS = (0.7, 1.5)
RATES = (0.2, 0.5)


def _user_pairs(k: int, others: int):
    """Every add/remove-a-user pair: others' +-1 records, the user's k records +-1 (aligned and not), both orders."""
    for rest in [()] + [d for n in range(1, others + 1) for d in signed_datasets(n)]:
        for user in signed_datasets(k):
            with_user = rest + user
            yield with_user, rest
            yield rest, with_user


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("k", [2, 3])
def test_els_is_never_below_any_enumerated_user_pair(k, steps):
    failures = []
    for sigma in SIGMAS:
        for rate in RATES:
            eps = epsilon(Mechanism("gaussian", sigma, rate, steps, unit=els(k)), 1e-5).epsilon
            for d, d2 in _user_pairs(k, 2):
                floor = float(delta_floor(poisson_law(d, rate), poisson_law(d2, rate), sigma, steps, [eps])[0])
                if floor > 1e-5 + ROUNDING:
                    failures.append(f"sigma {sigma} p {rate} k {k}: eps {eps:.4f}, {(d, d2)}: delta >= {floor:.3g}")
    assert not failures, failures


def test_els_is_tight_on_a_users_aligned_records():
    """The user's k records all +C, nobody else: at 0.98 of the accountant's eps the pair's delta is over delta."""
    sigma, rate, k, steps = 1.0, 0.5, 3, 2
    eps = epsilon(Mechanism("gaussian", sigma, rate, steps, unit=els(k)), 1e-5).epsilon
    user = (1,) * k
    floors = [delta_floor(poisson_law(a, rate), poisson_law(b, rate), sigma, steps, [0.98 * eps])[0]
              for a, b in ((user, ()), ((), user))]
    assert max(floors) > 1e-5


def test_the_example_level_answer_is_below_a_users_enumerated_pair():
    """The floor can fail: the example-level eps (the classic overclaim) under-counts a user of 3 records."""
    sigma, rate, k, steps = 1.0, 0.5, 3, 2
    eps = epsilon(Mechanism("gaussian", sigma, rate, steps), 1e-5).epsilon
    floor = delta_floor(poisson_law((1,) * k, rate), poisson_law((), rate), sigma, steps, [eps])[0]
    assert floor > 1e-5


@pytest.mark.parametrize("k", [2, 3])
def test_laplace_els_is_never_below_any_enumerated_user_pair(k):
    """At delta = 0 (pure DP) no enumerated loss may exceed the accountant's eps: the floor reads 0."""
    for sigma in (1.0, 2.5):
        for rate in RATES:
            eps = epsilon(Mechanism("laplace", sigma, rate, 2, unit=els(k)), 0.0).epsilon
            for d, d2 in _user_pairs(k, 1):
                floor = delta_floor(poisson_law(d, rate), poisson_law(d2, rate), sigma, 2, [eps], noise="laplace")[0]
                assert floor <= ROUNDING, (sigma, rate, d, d2, eps, floor)


# --- group privacy -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, sigma, p, steps, delta", [("gaussian", 1.0, 0.01, 1000, 1e-6),
                                                          ("gaussian", 2.0, 0.05, 100, 1e-5),
                                                          ("laplace", 4.0, 0.02, 100, 0.0)])
def test_group_privacy_is_valid_and_els_is_never_looser(kind, sigma, p, steps, delta):
    record = Mechanism(kind, sigma, p, steps)
    for k in (1, 2, 4):
        group = user_level.group_privacy(record, k, delta)
        assert group.details["record_delta"] * user_level.group_factor(group.details["record_epsilon"], k) \
            <= delta * (1 + 1e-12)
        assert group.epsilon == pytest.approx(k * group.details["record_epsilon"])
        assert epsilon(with_unit(record, els(k)), delta).epsilon <= group.epsilon * (1 + 1e-9)
    assert user_level.group_privacy(record, 1, delta).epsilon == pytest.approx(epsilon(record, delta).epsilon,
                                                                               rel=1e-3)


def test_group_privacy_is_never_below_an_enumerated_user_pair():
    sigma, rate, k, steps, delta = 1.0, 0.3, 3, 2, 1e-5
    group = user_level.group_privacy(Mechanism("gaussian", sigma, rate, steps), k, delta).epsilon
    worst = max(float(delta_floor(poisson_law(a, rate), poisson_law(b, rate), sigma, steps, [group])[0])
                for a, b in _user_pairs(k, 1))
    assert worst <= delta + ROUNDING


def test_the_issues_goal_els_sigma_below_group_privacys_at_k_16():
    """100,000 records, B 1,024, 3 epochs, delta 1e-6, k 16, user-level eps 8: ELS calibrates below group privacy
    (a tighter valid bound, a modest gap), ULS beside them at the same rate with k times ELS's noise per signal
    budget."""
    records = schedule("gaussian", 1.0, None, 1024, 100_000, None, 3)
    rows = {r.name: r for r in user_level.rows(records, 16, 1e-6, 8.0)}
    els_sigma, group_sigma, uls_sigma = (rows[n].sigma for n in ("ELS", "group privacy", "ULS"))
    assert els_sigma < group_sigma < 1.2 * els_sigma
    assert all(rows[n].result.epsilon <= 8.0 for n in rows)
    assert uls_sigma == pytest.approx(calibrate_sigma(records, 8.0, 1e-6).sigma)
    assert rows["ULS"].noise_per_signal == pytest.approx(16 * uls_sigma / els_sigma)


# --- properties and refusals -------------------------------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(sigma=st.floats(0.6, 4.0), p=st.floats(0.001, 0.3), steps=st.integers(1, 300), k=st.integers(2, 6))
def test_els_grows_with_k_and_is_never_below_the_example_level(sigma, p, steps, k):
    record = Mechanism("gaussian", sigma, p, steps)
    one, fewer, more = (epsilon(with_unit(record, els(j)), 1e-5).epsilon for j in (1, k - 1, k))
    assert one == epsilon(record, 1e-5).epsilon
    assert fewer <= more * (1 + 1e-6)


def test_els_max_steps_and_calibration_meet_their_user_level_target():
    record = Mechanism("gaussian", 1.5, 0.01, 1, unit=els(4))
    answer = max_steps(record, 6.0, 1e-6)
    assert answer.result.epsilon <= 6.0 < epsilon(record.with_steps(answer.steps + 1), 1e-6).epsilon
    cal = calibrate_sigma(record.with_steps(500), 6.0, 1e-6)
    assert cal.result.epsilon <= 6.0 < epsilon(record.with_steps(500).with_sigma(cal.sigma_rejected), 1e-6).epsilon


@pytest.mark.parametrize("make, message", [
    (lambda: Mechanism("gaussian", 1.0, 0.1, 10, "fixed", 10, 100, unit=els(3)), "Poisson"),
    (lambda: unit_from("user", None), "records-per-user"),
    (lambda: unit_from("example", 4), "--unit user"),
    (lambda: unit_from("user", 4, "sometimes"), "els"),
    (lambda: Unit("user", 0), "records per user"),
    (lambda: epsilon(Mechanism("gaussian", 1.0, 0.1, 10, unit=els(3)), 1e-5, "rdp"), "one record a step"),
    (lambda: epsilon(Mechanism("laplace", 1.0, 0.1, 10, unit=els(3)), 1e-5, "pld"), "pure"),
])
def test_refusals_name_what_is_missing(make, message):
    with pytest.raises(DPAuditError, match=message):
        make()


def test_below_pld_resolution_an_els_query_is_refused_not_answered_at_the_example_level():
    """pld falls back on rdp below delta 1e-12; rdp accounts one record a step, so an ELS query there is refused."""
    with pytest.raises(DPAuditError):
        epsilon(Mechanism("gaussian", 1.0, 0.01, 100, unit=els(4)), 1e-14)
    assert math.isfinite(epsilon(Mechanism("gaussian", 1.0, 0.01, 100), 1e-14).epsilon)
    assert EXAMPLE.mixture == 1


def test_the_group_accountant_answers_a_user_level_query_and_can_beat_pure_prv_for_laplace():
    """Laplace ELS at delta > 0: the default (pure-prv, the exact k eps_1 step as randomized response) and group
    privacy of the record-level PLD are both valid; here the second is tighter, and `-a group` asks for it."""
    mech = Mechanism("laplace", 2.0, 0.01, 1000, unit=els(4))
    default, group = epsilon(mech, 1e-6), epsilon(mech, 1e-6, "group")
    assert default.accountant == "pure-prv" and group.accountant == "group"
    assert group.epsilon == pytest.approx(user_level.group_privacy(mech, 4, 1e-6).epsilon)
    assert group.epsilon < default.epsilon
    cal = calibrate_sigma(mech, 3.0, 1e-6, "group")
    assert cal.result.epsilon <= 3.0


def test_the_python_api_takes_the_unit_as_the_cli_does():
    from dpaudit import calibrate, epsilon as api_epsilon, max_steps as api_max_steps

    spent = api_epsilon(sigma=1.0, delta=1e-6, p=0.01, steps=1000, unit="user", records_per_user=4)
    assert spent.epsilon == epsilon(Mechanism("gaussian", 1.0, 0.01, 1000, unit=els(4)), 1e-6).epsilon
    assert spent.unit == "user (ELS, k = 4)"
    plan = calibrate(eps=8.0, delta=1e-6, p=0.01, steps=1000, unit="user", records_per_user=4)
    assert plan.epsilon <= 8.0 and plan.result.mechanism.unit == els(4)
    assert api_max_steps(1.0, 8.0, delta=1e-6, p=0.01, unit="user", records_per_user=4).steps < 1000
    with pytest.raises(DPAuditError, match="records-per-user"):
        api_epsilon(sigma=1.0, p=0.01, steps=10, unit="user")


@pytest.mark.parametrize("k, p, sigma", [(4, 0.01, 0.9), (3, 0.3, 2.0)])
def test_the_vectorised_mixture_inverse_is_dp_accountings_to_the_bit(k, p, sigma):
    """vectorised_loss.MixtureLoss runs dp-accounting's shared bisection for every loss at once: the deltas (and so
    the PMFs built from them) equal the library's exactly, in both directions."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_mechanism as plm

    from dpaudit.accounting.noises.gaussian import binomial_weights
    from dpaudit.accounting.vectorised_loss import MixtureLoss

    weights = binomial_weights(k, p)
    for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD):
        ours = MixtureLoss(sigma, list(range(k + 1)), weights, adjacency_type=adjacency)
        theirs = plm.MixtureGaussianPrivacyLoss(sigma, list(range(k + 1)), weights, adjacency_type=adjacency)
        bounds = theirs.connect_dots_bounds()
        eps = np.linspace(bounds.epsilon_lower, bounds.epsilon_upper, 3001)
        assert np.array_equal(ours.get_delta_for_epsilon(eps), theirs.get_delta_for_epsilon(eps))
