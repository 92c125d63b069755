"""The claim's ceiling (dpaudit/audit/ceiling.py): the most TPR at a given FPR a test can reach against a run that
meets its claim. Checked against trade-offs computed here from first principles (the exact Neyman-Pearson test of
a Gaussian and of a Poisson-subsampled Gaussian), never against stored numbers."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.audit.ceiling import claim_ceiling, region, run_ceiling

FPRS = (0.001, 0.01, 0.1)


def _exact_subsampled_gaussian(p: float, sigma: float, fpr: float) -> float:
    """TPR of the likelihood-ratio test of (1 - p) N(0, s^2) + p N(1, s^2) against N(0, s^2) at ``fpr``: the ratio
    rises with x, so the test is a threshold on x, set at the null's (1 - fpr) quantile."""
    t = sigma * norm.isf(fpr)
    return (1 - p) * fpr + p * norm.sf((t - 1) / sigma)


@pytest.mark.parametrize("sigma", [0.8, 2.0])
def test_a_single_gaussian_release_meets_its_exact_trade_off(sigma):
    """One release, sensitivity 1: the trade-off is G_mu, mu = 1/sigma (Dong, Roth & Su): TPR = Phi(Phi^-1(FPR) +
    mu). The ceiling never falls below it (valid) and is within 2 % of it (tight)."""
    ceiling = run_ceiling(Mechanism("gaussian", sigma, 1.0, 1), 1e-5, 50.0)
    assert ceiling.source == "run"
    for x in FPRS:
        exact = norm.cdf(norm.ppf(x) + 1 / sigma)
        assert exact - 1e-9 <= ceiling.at(x) <= exact * 1.02 + 1e-4


@pytest.mark.parametrize("p,sigma,steps", [(0.1, 1.0, 1), (0.01, 0.7, 1)])
def test_a_subsampled_gaussian_step_never_exceeds_the_ceiling(p, sigma, steps):
    ceiling = run_ceiling(Mechanism("gaussian", sigma, p, steps), 1e-5, 50.0)
    for x in FPRS:
        exact = _exact_subsampled_gaussian(p, sigma, x)
        assert exact - 1e-9 <= ceiling.at(x) <= exact * 1.05 + 1e-4


def test_the_optimal_attack_on_a_composed_run_stays_under_its_ceiling():
    """Validity (and tightness) over many draws: 20 steps of a Poisson-subsampled Gaussian, the exact log-likelihood
    ratio (a sum over steps) as the score, 20,000 member runs; each threshold is set on 200,000 non-member runs, so
    its true FPR is within a few per cent of the target. The empirical TPR stays under the ceiling read at the
    FPR's upper three-sigma end, up to three standard errors, and within 5 % of it (the ceiling is the exact
    trade-off, not a loose bound)."""
    p, sigma, steps, n, null = 0.2, 1.0, 20, 20_000, 200_000
    rng = np.random.default_rng(0)

    def llr(x):  # log of ((1 - p) N(0, s) + p N(1, s)) / N(0, s), per step, summed
        return np.log1p(p * np.expm1((2 * x - 1) / (2 * sigma ** 2))).sum(axis=1)

    members = llr(rng.normal(size=(n, steps)) * sigma + (rng.random((n, steps)) < p))
    others = np.concatenate([llr(rng.normal(size=(null // 10, steps)) * sigma) for _ in range(10)])
    targets = [x * (1 + side * 3 / math.sqrt(x * null)) for x in (0.01, 0.1) for side in (-1, 1)]
    ceiling = run_ceiling(Mechanism("gaussian", sigma, p, steps), 1e-5, 50.0, fprs=targets)
    for x in (0.01, 0.1):
        tpr = float(np.mean(members > np.quantile(others, 1 - x)))
        most = ceiling.at(x * (1 + 3 / math.sqrt(x * null)))
        assert tpr <= most + 3 * math.sqrt(most * (1 - most) / n)
        assert tpr >= 0.95 * ceiling.at(x * (1 - 3 / math.sqrt(x * null)))


@settings(max_examples=60, deadline=None)
@given(eps=st.floats(0.0, 20.0), delta=st.floats(0.0, 0.1), x=st.floats(0.0, 1.0))
def test_the_region_is_the_eps_delta_dp_inequalities(eps, delta, x):
    """Brute force: the region's value is the largest y in [0, 1] with y <= e^eps x + delta and
    1 - x >= e^-eps (1 - delta - y) ... written the other way round: (1 - y) >= e^-eps (1 - delta - x)."""
    ys = np.linspace(0, 1, 20001)
    ok = (ys <= math.exp(eps) * x + delta + 1e-12) & (1 - ys >= math.exp(-eps) * (1 - delta - x) - 1e-12)
    assert float(region(eps, delta, x)) == pytest.approx(ys[ok].max(), abs=1e-4)


def test_the_run_is_never_looser_than_its_claim_and_undefined_claims_have_no_ceiling():
    run = run_ceiling(Mechanism("laplace", 4.0, 0.05, 200), 1e-5, 2.0)
    claim = claim_ceiling(2.0, 1e-5)
    assert run.source == "run" and all(run.at(x) <= claim.at(x) + 1e-12 for x in FPRS)
    assert np.all(np.diff(run.tpr) >= -1e-12)  # a ceiling rises with the FPR
    for eps, why in ((None, "no claim"), (math.inf, "eps = inf")):
        none = claim_ceiling(eps, 1e-5)
        assert none.source == "none" and why in none.words and none.at(0.01) is None
        assert none.to_dict({0.01: 0.5}) == {"source": "none", "why": none.words}
