"""The white-box audit of a BandMF run (audit/correlated.py): its view against the dense algebra, its validity by
simulating the exact mechanism at the true claim, its power at claimed eps = 4, and the planted bugs."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from dpaudit.accounting.calibrate import calibrate_sigma
from dpaudit.accounting.matrix.strategy import Strategy
from dpaudit.accounting.mechanism import schedule
from dpaudit.audit import correlated as cr

ALPHA = 0.05


def _sigma(p: float, steps: int, bands: int, eps: float) -> float:
    template = schedule("gaussian", 1.0, p=p, steps=steps, strategy=Strategy("bandmf", bands=bands))
    return calibrate_sigma(template, eps, 1e-5).sigma


def test_the_view_is_the_signal_plus_independent_unit_noise():
    """Noise-free: each round's view is exactly the canary's signed participation; signal-free: the views are
    i.i.d. N(0, sigma^2) (their covariance is the identity: disjoint unit columns)."""
    steps, bands = 40, 4
    coefs = np.array([0.6, 0.5, 0.4, 0.3])
    coefs /= np.linalg.norm(coefs)
    rng = np.random.default_rng(0)
    groups = np.arange(8) % bands
    signs = rng.choice([-1.0, 1.0], size=(steps, 8))
    sampled = (np.arange(steps)[:, None] % bands == groups[None, :]) & (rng.random((steps, 8)) < 0.5)
    views = cr.round_view(signs * sampled, signs, coefs, groups)
    at = groups[None, :] + bands * np.arange(cr.rounds(steps, bands))[:, None]
    np.testing.assert_allclose(views, sampled[at, np.arange(8)[None, :]], atol=1e-12)
    from scipy.signal import lfilter

    z = rng.normal(size=(steps, 4000))
    noise_views = cr.round_view(lfilter([1.0], coefs, z, axis=0), np.ones((steps, 4000)), coefs, np.zeros(4000, int))
    np.testing.assert_allclose(np.cov(noise_views), np.eye(noise_views.shape[0]), atol=0.08)


@pytest.mark.parametrize("rate", [1.0, 0.25])
def test_validity_at_the_true_claim(rate):
    """200 audits of the exact mechanism: the member the run is, refuted at most alpha of the time (the binomial
    99.9 % quantile)."""
    steps, bands, m, sigma = 60, 3, 300, 2.0
    refuted = 0
    for seed in range(200):
        releases, signs, members, groups, coefs = cr.simulate(m, steps, bands, rate, sigma, seed)
        res = cr.audit(cr.round_view(releases, signs, coefs, groups), members, rate, 1e-5, ALPHA, bound=False)
        refuted += cr.refuted(res, sigma)
    assert refuted <= binom.ppf(0.999, 200, ALPHA)


def test_power_and_no_false_violation_at_claimed_eps_4():
    """The embedded model's schedule (p = 0.064, T = 300) with b = 4 at claimed eps 4, m = 1000: 20 seeds."""
    p, steps, bands = 0.064, 300, 4
    sigma = _sigma(p, steps, bands, 4.0)
    bounds = []
    for seed in range(20):
        releases, signs, members, groups, coefs = cr.simulate(1000, steps, bands, p * bands, sigma, seed)
        bounds.append(cr.audit(cr.round_view(releases, signs, coefs, groups), members, p * bands, 1e-5)
                      ["epsilon_lower_bound"])
    assert max(bounds) <= 4.0
    assert np.median(bounds) >= 2.0


def test_batches_closer_than_the_bands_are_a_violation():
    """The planted bug 'bands > the cyclic separation': batches cycling every 2 steps under a 4-band strategy.
    The log check finds it with certainty; a correct cyclic log has none."""
    rng = np.random.default_rng(3)
    good = [np.flatnonzero((np.arange(200) % 4 == t % 4) & (rng.random(200) < 0.5)) for t in range(40)]
    bad = [np.flatnonzero((np.arange(200) % 2 == t % 2) & (rng.random(200) < 0.5)) for t in range(40)]
    assert cr.separation_violations(good, 4) == []
    assert len(cr.separation_violations(bad, 4)) > 0


def test_independent_noise_at_the_banded_sigma_is_not_a_violation():
    """The other planted bug, 'noise not correlated as accounted': with cyclic batches each example still meets
    ceil(T / b) independent subsampled-Gaussian rounds at sigma, the event BandMF is accounted as, so its true eps
    is the claim; the audit must not (and does not) read it above the claim. It reads less: the views' noise is
    larger (C applied to white noise)."""
    p, steps, bands = 0.064, 300, 4
    sigma = _sigma(p, steps, bands, 4.0)
    for seed in range(3):
        releases, signs, members, groups, coefs = cr.simulate(1000, steps, bands, p * bands, sigma, seed,
                                                              independent=True)
        res = cr.audit(cr.round_view(releases, signs, coefs, groups), members, p * bands, 1e-5)
        assert res["epsilon_lower_bound"] <= 4.0


def test_audit_sampler_checks_the_cyclic_separation(tmp_path):
    from cli_helpers import dpaudit

    rng = np.random.default_rng(4)
    for name, period, code in (("good", 4, 0), ("bad", 2, 1)):
        log = tmp_path / f"{name}.log"
        log.write_text("".join(str(np.flatnonzero((np.arange(100) % period == t % period)
                                                  & (rng.random(100) < 0.5)).tolist()) + "\n" for t in range(30)))
        out = dpaudit("audit", "sampler", "--log", log, "--bands", 4)
        assert out.returncode == code, out.stderr
        assert ("VIOLATION" in out.stdout) == (code == 1)
