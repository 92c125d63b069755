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


@settings(max_examples=40, deadline=None)
@given(kinds, st.floats(0.05, 200.0), st.sampled_from([1e-6, 1e-4, 0.01, 0.3, 0.999, 1.0]),
       st.integers(200, 20000), st.booleans())
def test_vectorised_step_pld_equals_dp_accountings(kind, sigma, p, points, pessimistic):
    """Our array-valued deltas (accounting/vectorised_loss.py) build the very PMF dp-accounting's
    per-point Python loop builds: both directions, connect-the-dots and privacy buckets."""
    import numpy as np
    from dp_accounting.pld import privacy_loss_distribution as lib

    from dpaudit.accounting import pld
    from dpaudit.accounting.noises import noise

    mech = Mechanism(kind, sigma, p, 1)
    grid = pld.step_loss_range(mech, 1e-5) / points
    ours = noise(kind).pld(mech, grid, pessimistic, -50.0)
    options = {"value_discretization_interval": grid, "sampling_prob": p, "pessimistic_estimate": pessimistic,
               "use_connect_dots": pessimistic}
    if kind == "gaussian":
        theirs = lib.from_gaussian_mechanism(sigma, log_mass_truncation_bound=-50.0, **options)
    else:
        theirs = lib.from_laplace_mechanism(sigma, **options)
    for direction in ("_pmf_remove", "_pmf_add"):
        a, b = getattr(ours, direction).to_dense_pmf(), getattr(theirs, direction).to_dense_pmf()
        assert a._lower_loss == b._lower_loss and len(a._probs) == len(b._probs)  # noqa: SLF001
        np.testing.assert_allclose(a._probs, b._probs, rtol=1e-12, atol=1e-18)  # noqa: SLF001
        assert abs(a._infinity_mass - b._infinity_mass) <= 1e-15  # noqa: SLF001


@FAST
@given(sigmas, rates, st.integers(2, 5000))
def test_our_composition_is_dp_accountings_self_compose_within_the_round_off_it_pays(sigma, p, t):
    """The kernel's composition (real transform, coefficients below DROPPED not powered, one transform reused
    for a longer window) is dp-accounting's self_compose: the same window and infinity mass, and masses within
    the two round-offs and the dropped mass (every answer pays its own), in L1."""
    import numpy as np

    from dpaudit.accounting import pld
    from dpaudit.accounting.noises import noise

    mech = Mechanism("gaussian", sigma, p, t)
    single = noise("gaussian").pld(mech, pld.first_grid(mech, 1e-5), True, -50.0)._pmf_remove.to_dense_pmf()  # noqa: SLF001
    theirs = single.self_compose(t, tail_mass_truncation=pld.TAIL_MASS_TRUNCATION)
    composition = pld.kernel.SelfComposition(single)
    bounds = composition.bounds(t)
    dropped = pld.dropped_bound(single, bounds)
    reused = composition.spectrum(t)
    longer = pld.kernel._spectrum(single, int(composition.length(t) * 1.25))  # noqa: SLF001
    for spectrum in (reused, longer):
        ours = pld._self_compose(single, t, bounds, spectrum=spectrum)  # noqa: SLF001
        assert ours._lower_loss == theirs._lower_loss and ours._infinity_mass == theirs._infinity_mass  # noqa: SLF001
        # each side errs by at most its own round-off estimate
        paid = pld.round_off(theirs, t) + pld.round_off(ours, t) + dropped
        assert np.abs(ours._probs - theirs._probs).sum() <= paid  # noqa: SLF001
    assert bounds == pld._convolve_bounds(single, t)  # noqa: SLF001


@settings(max_examples=30, deadline=None)
@given(st.floats(0.3, 200.0), st.sampled_from([1e-5, 1e-3, 0.1, 1.0]), st.integers(2, 10**7), st.booleans())
def test_our_truncation_bounds_are_dp_accountings(sigma, p, t, remove):
    """pld._convolve_bounds computes dp-accounting's Chernoff bounds by repeated multiplication instead of 40
    log-sum-exps: the same moments to ~1e-15 relative, so the same indices (one apart at most, where a bound
    falls within float error of an integer; either is a valid truncation)."""
    from dp_accounting.pld import common

    from dpaudit.accounting import pld
    from dpaudit.accounting.noises import noise

    mech = Mechanism("gaussian", sigma, p, t)
    single = noise("gaussian").pld(mech, pld.first_grid(mech, 1e-5) / 3, True, -50.0)
    pmf = (single._pmf_remove if remove else single._pmf_add).to_dense_pmf()  # noqa: SLF001
    ours = pld._convolve_bounds(pmf, t)  # noqa: SLF001
    theirs = common.compute_self_convolve_bounds(pmf._probs, t, pld.TAIL_MASS_TRUNCATION)  # noqa: SLF001
    assert abs(ours[0] - theirs[0]) <= 1 and abs(ours[1] - theirs[1]) <= 1, (ours, theirs)
