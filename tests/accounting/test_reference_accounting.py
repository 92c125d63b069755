"""Published values of ../shared/reference/accounting.md, computed from first principles.

The published numbers are the *inputs and expectations* of these tests; every epsilon and
sigma checked here is computed by dpaudit's own accountants.
"""

import math

import pytest
from scipy.stats import norm

from dpaudit.accounting import Mechanism, calibrate_sigma, epsilon
from dpaudit.core import limits as budget
from dpaudit.accounting.montecarlo import MonteCarloSettings
from dpaudit.accounting.prv import PrvOptions

P, T, DELTA = 16 / 1000, 75_000, 1e-5
PAPER_SIGMAS = {0.5: 30.9, 1.0: 16.4, 4.0: 4.8}


def _table(text: str, heading: str) -> dict[float, float]:
    """The (target eps -> sigma) rows of the markdown table under ``heading`` in the reference file."""
    section = text[text.index(heading):]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2:
            try:
                rows[float(cells[0])] = float(cells[1])
            except ValueError:
                continue  # the header and the rule
    return rows


def test_the_reference_table_is_reproduced_by_our_accountant(reference_dir):
    """The published (eps, sigma) pairs, read from the reference file (not copied here), each checked by
    computation: the paper's sigma spends at most its eps under pld, and our calibration needs no more sigma."""
    table = _table((reference_dir / "accounting.md").read_text(), "## Poisson-subsampled Gaussian")
    assert table == PAPER_SIGMAS  # the constants the other tests use are the file's
    for target, sigma in table.items():
        assert round(epsilon(Mechanism("gaussian", sigma, P, T), DELTA, "pld").epsilon, 3) <= target


@pytest.mark.parametrize("target", sorted(PAPER_SIGMAS))
def test_pld_calibration_no_larger_than_paper_sigma(target):
    cal = calibrate_sigma(Mechanism("gaussian", 1.0, P, T), target, DELTA, "pld")
    assert cal.result.epsilon <= target
    assert cal.sigma <= PAPER_SIGMAS[target] * 1.002
    assert cal.epsilon_rejected > target


@pytest.mark.parametrize("target", sorted(PAPER_SIGMAS))
def test_paper_sigma_meets_its_target_under_pld(target):
    res = epsilon(Mechanism("gaussian", PAPER_SIGMAS[target], P, T), DELTA, "pld")
    assert round(res.epsilon, 3) <= target
    assert res.relation.startswith("add/remove")
    assert res.epsilon == max(res.directions.values())


def test_prv_listing_for_sigma_16_4_is_just_under_one():
    # The paper's PRV listing: eps_error=0.001, 75,000 compositions -> upper bound just under 1.0.
    with budget.limits(max_memory="4G"):  # the listing's mesh (eps_error 1e-3) needs ~3 GB
        res = epsilon(Mechanism("gaussian", 16.4, P, T), DELTA, "prv", PrvOptions(eps_error=1e-3))
    assert 0.98 < res.epsilon < 1.0
    assert res.epsilon == max(res.directions["remove"], res.directions["add"])


def test_pure_laplace_table():
    # N = 1000, B = 20, T = 2000: sigma = 10.5 gives eps = 4 to two significant figures (3.99 exactly).
    res = epsilon(Mechanism("laplace", 10.5, 20 / 1000, 2000), 0.0, "pure")
    assert f"{res.epsilon:.2g}" == "4"
    assert round(res.epsilon, 2) == 3.99
    cal = calibrate_sigma(Mechanism("laplace", 1.0, 20 / 1000, 2000), 4.0, 0.0, "pure")
    assert cal.result.epsilon <= 4.0 and abs(cal.sigma - 10.5) / 10.5 < 0.01


def test_laplace_approximate_dp_routes_and_their_order():
    mech = Mechanism("laplace", 30.8, P, T)
    pure_prv = epsilon(mech, DELTA, "pure-prv").epsilon
    assert round(pure_prv, 2) == 0.51
    pld = epsilon(mech, DELTA, "pld").epsilon
    assert pld < pure_prv  # the Laplace-aware routes are tighter than treating steps as RR
    mc = epsilon(mech, DELTA, "mc", MonteCarloSettings(samples=150_000, seed=1))
    estimate = mc.details["epsilon_estimate"]
    assert abs(estimate - 0.5) < 0.025
    # 1.5e5 samples cannot certify delta = 1e-5; the bound must say so rather than undercut.
    assert mc.epsilon >= estimate


def test_single_release_laplace_scale_is_a_quarter_for_eps_4():
    cal = calibrate_sigma(Mechanism("laplace", 1.0), 4.0, 0.0)
    assert cal.sigma == pytest.approx(0.25, rel=1e-12)
    assert cal.result.epsilon <= 4.0


@pytest.mark.parametrize("target,delta", [(1.0, 1e-5), (0.3, 1e-6), (4.0, 1e-3)])
def test_single_release_gaussian_is_the_analytic_gaussian(target, delta):
    cal = calibrate_sigma(Mechanism("gaussian", 1.0), target, delta)
    s = cal.sigma
    # Balle & Wang (2018): delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s), Delta = 1
    exact = norm.cdf(1 / (2 * s) - target * s) - math.exp(target) * norm.cdf(-1 / (2 * s) - target * s)
    assert exact <= delta * (1 + 1e-6)
    assert exact == pytest.approx(delta, rel=1e-3)
