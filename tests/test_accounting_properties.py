"""Property tests: monotonicity, direction bounds, pure >= approximate, calibration sides."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpaudit.accounting import Mechanism, calibrate_sigma, epsilon
from dpaudit.accounting import pure as pure_mod

FAST = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
sigmas = st.floats(1.0, 20.0)
rates = st.floats(0.001, 0.5)
steps = st.integers(1, 200)
kinds = st.sampled_from(["gaussian", "laplace"])
deltas = st.sampled_from([1e-3, 1e-5, 1e-7])


@FAST
@given(kinds, sigmas, st.floats(1.02, 3.0), rates, steps, deltas)
def test_epsilon_decreases_in_sigma(kind, sigma, factor, p, t, delta):
    low = epsilon(Mechanism(kind, sigma, p, t), delta, "pld").epsilon
    high = epsilon(Mechanism(kind, sigma * factor, p, t), delta, "pld").epsilon
    assert high <= low + 1e-9


@FAST
@given(kinds, sigmas, rates, st.floats(1.05, 2.0), steps, deltas)
def test_epsilon_increases_in_sampling_rate(kind, sigma, p, factor, t, delta):
    small = epsilon(Mechanism(kind, sigma, p, t), delta, "pld").epsilon
    large = epsilon(Mechanism(kind, sigma, min(1.0, p * factor), t), delta, "pld").epsilon
    assert large >= small - 1e-9


@FAST
@given(kinds, sigmas, rates, steps, st.integers(2, 300), deltas)
def test_epsilon_increases_in_steps(kind, sigma, p, t, extra, delta):
    fewer = epsilon(Mechanism(kind, sigma, p, t), delta, "pld").epsilon
    more = epsilon(Mechanism(kind, sigma, p, t + extra), delta, "pld").epsilon
    assert more >= fewer - 1e-9


@FAST
@given(kinds, sigmas, rates, steps, deltas)
def test_add_remove_answer_is_at_least_each_direction(kind, sigma, p, t, delta):
    res = epsilon(Mechanism(kind, sigma, p, t), delta, "pld")
    assert set(res.directions) == {"add", "remove"}
    assert all(res.epsilon >= v for v in res.directions.values())
    assert res.epsilon == max(res.directions.values())


@FAST
@given(st.floats(0.6, 20.0), rates, steps, deltas)
def test_pure_bounds_every_approximate_laplace_accountant(sigma, p, t, delta):
    mech = Mechanism("laplace", sigma, p, t)
    pure = epsilon(mech, 0.0, "pure").epsilon
    assert pure == t * pure_mod.step_epsilon(sigma, p)
    for name in ("pld", "pure-prv"):
        assert epsilon(mech, delta, name).epsilon <= pure + 1e-9


@settings(max_examples=12, deadline=None)
@given(kinds, st.floats(0.2, 8.0), rates, st.integers(1, 3000), st.sampled_from([1e-5, 1e-6]))
def test_calibrated_sigma_meets_its_bound_and_a_smaller_one_does_not(kind, target, p, t, delta):
    template = Mechanism(kind, 1.0, p, t)
    cal = calibrate_sigma(template, target, delta, "pld")
    assert epsilon(template.with_sigma(cal.sigma), delta, "pld").epsilon <= target
    assert epsilon(template.with_sigma(cal.sigma * (1 - 1e-3)), delta, "pld").epsilon > target


@settings(max_examples=15, deadline=None)
@given(st.floats(0.1, 10.0), rates, st.integers(1, 5000))
def test_pure_calibration_is_the_exact_inverse(target, p, t):
    cal = calibrate_sigma(Mechanism("laplace", 1.0, p, t), target, 0.0, "pure")
    assert cal.result.epsilon <= target
    assert epsilon(Mechanism("laplace", cal.sigma * (1 - 1e-3), p, t), 0.0, "pure").epsilon > target
