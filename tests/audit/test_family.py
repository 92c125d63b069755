"""The gaussian-run bound (audit/family.py): the white-box mean shift read through the run's own mechanism family.

Validity first (issue 55): exact mechanisms simulated at p = 1, 0.1 and 0.01, 200 audits each at the true sigma;
the bound may exceed the true eps in at most the binomial 99.9 % quantile of 200 draws at alpha. Beside each, the
same audits against a claim 15 % more private than the run must be refuted often: the check can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpaudit.audit import family, gdp
from dpaudit.audit.analysis import analyse

ALPHA, DELTA = 0.05, 1e-5


def _transcript(rng, m: int, p: float, steps: int, sigma: float, size: float = 1.0):
    """(x: steps x m, members): each member in each step with probability p, adding ``size`` (x C)."""
    members = rng.random(m) < 0.5
    x = size * ((rng.random((steps, m)) < p) & members) + sigma * rng.standard_normal((steps, m))
    return x, members


def _robust_scale(x) -> float:
    return 1.4826 * float(np.median(np.abs(x - np.median(x))))


def _sigma_star(x, members, p, kind: str):
    """The procedure of whitebox.py: scale blind to membership, score, mu lower limit, s*."""
    from dpaudit.audit import gaussian

    scale = _robust_scale(x)
    model = family.likelihood_ratio(p, len(x), scale) if kind == "llr" else family.linear(p, len(x), scale)
    scores = model.step(x).sum(0)
    mu, _ = gaussian.mu_lower_bound(scores[members], scores[~members], ALPHA)
    return family.sigma_bound(model, mu, int(members.sum()), int((~members).sum()))


@pytest.mark.parametrize("p, steps, sigma, m", [(1.0, 10, 3.0, 400), (0.1, 100, 1.0, 400), (0.01, 1000, 0.6, 400)])
@pytest.mark.parametrize("kind", ["llr", "linear"])
def test_the_bound_is_above_the_truth_at_most_alpha_of_the_time(p, steps, sigma, m, kind):
    rng = np.random.default_rng(55)
    audits = 200
    over, refuted = 0, 0
    for _ in range(audits):
        x, members = _transcript(rng, m, p, steps, sigma)
        star = _sigma_star(x, members, p, kind)
        # reported eps = eps(s* (1 + SAFE_STEP)) > eps(sigma) exactly when s* (1 + SAFE_STEP) < sigma
        over += star * (1 + family.SAFE_STEP) < sigma
        refuted += star * (1 + family.SAFE_STEP) < 1.15 * sigma  # a claim 15 % more private than the run
    most = stats.binom.ppf(0.999, audits, ALPHA)
    assert over <= most, f"{over} of {audits} audits above the true eps (at most {most:.0f} allowed)"
    assert refuted > 2 * most, f"the check cannot fail: only {refuted} refutations of a claim 15 % too private"


def test_standardised_shift_matches_a_simulation():
    rng = np.random.default_rng(1)
    p, steps, sigma = 0.064, 50, 1.3
    x, members = _transcript(rng, 40000, p, steps, sigma)
    for model in (family.likelihood_ratio(p, steps, sigma), family.linear(p, steps, sigma)):
        scores = model.step(x).sum(0)
        a, b = scores[members], scores[~members]
        pooled = math.sqrt((((a - a.mean()) ** 2).sum() + ((b - b.mean()) ** 2).sum()) / (len(a) + len(b) - 2))
        simulated = (a.mean() - b.mean()) / pooled
        exact = family.standardised_shift(model, sigma, len(a), len(b))[0]
        assert abs(simulated - exact) < 0.03, (model.words, simulated, exact)


def test_the_family_eps_is_below_the_exact_eps_of_a_full_batch_gaussian():
    """At p = 1 the family is the Gaussian mechanism composed T times: mu = sqrt(T) / sigma exactly."""
    for sigma, steps in ((3.0, 10), (8.0, 100), (1.5, 4)):
        exact = gdp.epsilon_from_mu(math.sqrt(steps) / sigma, DELTA)
        got = family.family_epsilon(sigma, 1.0, steps, DELTA)
        assert got <= exact and got >= 0.97 * exact, (sigma, steps, got, exact)


def test_the_family_headline_is_tighter_than_g_mu_and_a_run_outside_the_family_reads_far_above_it():
    rng = np.random.default_rng(3)
    p, steps, sigma = 0.064, 200, 1.273  # eps 4.0 at delta 1e-5 (pld)
    x, members = _transcript(rng, 5000, p, steps, sigma)
    scale = _robust_scale(x)
    model = family.likelihood_ratio(p, steps, scale)
    result = analyse(model.step(x).sum(0), members, claimed_epsilon=4.0, delta=DELTA, score="white-box-dp-sgd",
                     model=model)
    assert result.headline == "gaussian-run"
    assert result.bounds["gaussian"].epsilon < result.epsilon_lower_bound <= 4.0
    assert result.epsilon_lower_bound > 3.0  # within 25 % of the truth at m = 5000
    # no clipping: a member adds 3 C where the family allows C
    x, members = _transcript(rng, 1000, p, steps, sigma, size=3.0)
    scale = _robust_scale(x)
    model = family.likelihood_ratio(p, steps, scale)
    bug = analyse(model.step(x).sum(0), members, claimed_epsilon=4.0, delta=DELTA, score="white-box-dp-sgd",
                  model=model)
    assert bug.violation and bug.epsilon_lower_bound > 8.0


def test_without_the_run_the_headline_stays_gaussian_and_naming_gaussian_run_is_refused():
    from dpaudit.core.errors import DPAuditError

    rng = np.random.default_rng(4)
    x, members = _transcript(rng, 200, 0.1, 50, 1.0)
    result = analyse(x.sum(0), members, delta=DELTA, score="white-box-dp-sgd")
    assert result.headline == "gaussian" and "gaussian-run" not in result.bounds
    with pytest.raises(DPAuditError, match="gaussian-run"):
        analyse(x.sum(0), members, delta=DELTA, score="white-box-dp-sgd", headline="gaussian-run")
    # a Laplace run's scores are not the family's
    model = family.linear(0.1, 50, 1.0)
    laplace = analyse(x.sum(0), members, delta=DELTA, score="white-box-dp-sgd", mechanism="laplace", model=model)
    assert "gaussian-run" not in laplace.bounds
