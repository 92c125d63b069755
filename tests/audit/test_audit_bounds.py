"""The f-DP one-run bound, the ROC-hull guesses, the continuous Gaussian audit and the headline:
jax_privacy's published test values recomputed from first principles, statistical validity on exactly
mu-GDP mechanisms, power against the old headline, and bad inputs."""

import numpy as np
import pytest
from scipy import stats

from dpaudit import CanaryScoreAuditor
from dpaudit.audit import fdp, gaussian, gdp
from dpaudit.audit.analysis import analyse
from dpaudit.audit.auditor import HullThresholds
from dpaudit.audit.guesses import roc_hull
from dpaudit.core.errors import DPAuditError


def deterministic_normal(mu, n):
    """n scores at the normal quantiles (i + 1/2)/n, shifted by mu (jax_privacy's test construction)."""
    return stats.norm.ppf(np.linspace(0, 1, n, endpoint=False) + 1 / (2 * n)) + mu


@pytest.mark.parametrize("shift,steinke,fdp_gdp", [
    (0, 0.0, 0.0), (1, 1.13346, 2.164749), (2, 2.311945, 4.7218075), (4, 4.395568, 9.133752)])
def test_reproduces_jax_privacy_one_run_values(shift, steinke, fdp_gdp):
    # jax_privacy tests/auditing_test.py, test_epsilon_one_run_close: 10,000 in / 10,000 out, alpha 0.05,
    # delta 1e-6, one-sided guesses at ROC-hull thresholds with Bonferroni over them.
    auditor = CanaryScoreAuditor(deterministic_normal(shift, 10_000), deterministic_normal(0, 10_000))
    hull = HullThresholds()
    assert auditor.epsilon_one_run(0.05, 1e-6, hull).epsilon == pytest.approx(steinke, rel=1e-4, abs=1e-9)
    assert auditor.epsilon_one_run_fdp(0.05, 1e-6, "gdp", hull).epsilon == pytest.approx(fdp_gdp, rel=1e-4, abs=1e-9)
    # The headline's label-free top-k guesses are at least as strong on these files.
    assert auditor.epsilon_one_run_fdp(0.05, 1e-6).epsilon >= fdp_gdp * 0.999


def test_roc_hull_keeps_only_convex_vertices():
    # The frontier example of jax_privacy's tests: in 0 4 6 7 vs out 1 2 3 5 -> (fp, tp) (0,0) (0,2) (1,3) (4,4).
    scores = np.array([0, 4, 6, 7, 1, 2, 3, 5], float)
    members = np.array([1, 1, 1, 1, 0, 0, 0, 0], bool)
    assert [(k - v, v) for k, v, _ in roc_hull(scores, members)] == [(0, 0), (0, 2), (1, 3), (4, 4)]


def test_fdp_statistic_is_monotone_in_mu():
    values = [fdp.rejects(mu, 1000, 100, 95, 0.05) for mu in np.linspace(0, 5, 26)]
    assert all(a >= b - 1e-12 for a, b in zip(values, values[1:]))
    mu = fdp.mu_lower_bound(1000, 100, 95, 0.05)
    assert fdp.rejects(mu - 1e-4, 1000, 100, 95, 0.05) > 0 >= fdp.rejects(mu + 1e-4, 1000, 100, 95, 0.05)


def test_gdp_conversions_agree():
    for eps, delta in [(0.5, 1e-5), (4.0, 1e-5), (8.0, 1e-6)]:
        assert gdp.epsilon_from_mu(gdp.mu_from_epsilon(eps, delta), delta) == pytest.approx(eps, rel=1e-3)
    assert gdp.epsilon_from_mu(0.0, 1e-5) == 0.0


def _simulated(mu, m, rng):
    members = rng.random(m) < 0.5
    return np.where(members, rng.normal(mu, 1, m), rng.normal(0, 1, m)), members


@pytest.mark.parametrize("score,rule,m", [("unnamed", "fdp-gdp", 1000), ("white-box-dp-sgd", "gaussian", 1000),
                                          ("white-box-dp-sgd", "gaussian", 5000)])
def test_headline_exceeds_the_true_epsilon_at_most_alpha_of_the_time(score, rule, m):
    """200 audits of an exactly mu-GDP mechanism (Gaussian shift mu = 1): the headline bound may exceed the
    true eps(delta) in at most alpha of them; 21 of 200 is P < 0.001 under rate 0.05. m = 5000: white-box DP-SGD's
    default canary count."""
    rng = np.random.default_rng(2024)
    mu, delta, alpha, trials = 1.0, 1e-5, 0.05, 200
    true_eps = gdp.epsilon_from_mu(mu, delta)
    over, bounds = 0, []
    for _ in range(trials):
        scores, members = _simulated(mu, m, rng)
        auditor = CanaryScoreAuditor.from_labels(scores, members)
        b = auditor.epsilon_gaussian(alpha, delta) if rule == "gaussian" else auditor.epsilon_one_run_fdp(alpha, delta)
        over += b.epsilon > true_eps
        bounds.append(b.epsilon)
    assert over <= stats.binom.ppf(0.999, trials, alpha)
    assert np.median(bounds) > 0.2 * true_eps  # and it is not vacuous


def test_gaussian_lower_limit_has_its_coverage():
    rng = np.random.default_rng(7)
    misses = sum(gaussian.mu_lower_bound(rng.normal(0.5, 1, 300), rng.normal(0, 1, 300), 0.1)[0] > 0.5
                 for _ in range(400))
    assert 20 <= misses <= 60  # exact: 10 % of 400 = 40


@pytest.mark.parametrize("m,mu", [(1000, 2.0), (10_000, 1.0), (1000, 1.0)])
def test_headline_is_near_jax_privacys_rule_and_beats_the_old_headline(m, mu):
    rng = np.random.default_rng(0)
    scores, members = _simulated(mu, m, rng)
    result = analyse(scores, members, delta=1e-5)
    assert result.headline == "fdp-gdp"
    assert result.bounds["fdp-gdp-hull"].epsilon > 0  # jax_privacy's rule, reported beside it
    assert result.epsilon_lower_bound >= 0.95 * result.bounds["fdp-gdp-hull"].epsilon
    assert result.epsilon_lower_bound >= result.bounds["steinke-two-sided"].epsilon


def test_headline_is_calibrated_at_the_null():
    """No leakage at all: the headline must stay at 0 in >= 1 - alpha of the audits (label-free guesses)."""
    rng = np.random.default_rng(99)
    positive = 0
    for _ in range(400):
        members = rng.random(1000) < 0.5
        positive += CanaryScoreAuditor.from_labels(rng.normal(size=1000), members).epsilon_one_run_fdp(
            0.05, 1e-5).epsilon > 0
    assert positive <= stats.binom.ppf(0.999, 400, 0.05)


def test_report_dict_has_top_level_bound_and_every_bound():
    rng = np.random.default_rng(3)
    scores, members = _simulated(1.5, 600, rng)
    d = analyse(scores, members, delta=1e-5, claimed_epsilon=0.5, score="neg-loss").to_dict()
    assert d["epsilon_lower_bound"] == d["bounds"][d["headline"]["bound"]]["epsilon"] > 0.5
    assert set(d["bounds"]) >= {"fdp-gdp", "fdp-gdp-hull", "fdp", "steinke", "steinke-hull", "steinke-two-sided",
                                "clopper-pearson"}
    assert d["score"]["name"] == "neg-loss" and d["violation"]


def test_pure_epsilon_claims_use_a_bound_valid_for_any_mechanism():
    rng = np.random.default_rng(4)
    scores, members = _simulated(3.0, 1000, rng)
    result = analyse(scores, members, delta=0.0)
    assert result.headline == "steinke" and "fdp-gdp" not in result.bounds
    # For pure eps the f-DP test of the eps curve and Steinke et al.'s nearly coincide.
    assert result.epsilon_lower_bound == pytest.approx(result.bounds["fdp"].epsilon, rel=0.01)
    assert result.epsilon_lower_bound > 3


@pytest.mark.parametrize("kwargs,message", [
    ({"delta": 1e-2}, "vacuous"),
    ({"delta": 1e-5, "headline": "nope"}, "unknown headline"),
    ({"delta": 0.0, "headline": "gaussian"}, "needs delta > 0"),
    ({"delta": 1e-5, "score": "mystery"}, "unknown score"),
])
def test_bad_audit_parameters_are_refused(kwargs, message):
    rng = np.random.default_rng(5)
    scores, members = _simulated(1.0, 200, rng)
    with pytest.raises(DPAuditError, match=message):
        analyse(scores, members, **kwargs)


@pytest.mark.parametrize("p,sigma,steps", [(0.5, 8.0, 150), (0.064, 8.0, 1000), (0.01, 4.0, 1000), (0.25, 4.0, 100),
                                           (1.0, 4.0, 10)])
def test_the_gaussian_headline_reads_a_subsampled_run_below_its_accounted_eps(p, sigma, steps):
    """The white-box score of a Poisson-subsampled Gaussian run shifts by at most mu = p sqrt(T) / sigma (each
    inclusion adds <= C against noise sigma C a step). The headline converts mu through G_mu, which is not the
    subsampled mechanism's curve; it stays valid only if G_mu's eps at that mu is <= the run's accounted eps.
    Checked here against the PLD accountant (equal at p = 1, where the run is exactly mu-GDP)."""
    from dpaudit import epsilon

    delta = 1e-5
    accounted = epsilon(sigma=sigma, p=p, steps=steps, delta=delta).epsilon
    assert gdp.epsilon_from_mu(p * steps ** 0.5 / sigma, delta) <= accounted * (1 + 1e-6)


def _optimal_audit_violations(p: float, sigma: float, steps: int, trials: int, m: int = 1000, seed: int = 0) -> int:
    """Audits of an exactly Poisson-subsampled Gaussian mechanism (each member's release: T steps, each including it
    with probability p, noise sigma) with the optimal score (the exact log-likelihood ratio, summed over steps),
    claimed at the mechanism's PLD eps: how many of ``trials`` read VIOLATION."""
    from dpaudit.accounting import pld
    from dpaudit.accounting.mechanism import Mechanism

    claim = pld.epsilon(Mechanism("gaussian", sigma, p, steps), 1e-5).epsilon
    rng = np.random.default_rng(seed)
    wrong = 0
    for _ in range(trials):
        members = rng.random(m) < 0.5
        x = rng.normal(size=(m, steps)) * sigma + ((rng.random((m, steps)) < p) & members[:, None])
        llr = np.log1p(p * np.expm1((2 * x - 1) / (2 * sigma ** 2))).sum(axis=1)
        wrong += analyse(llr, members, claimed_epsilon=claim, delta=1e-5, mechanism="gaussian").violation
    return wrong


@pytest.mark.parametrize("p,sigma,steps", [(0.01, 0.7, 30), (0.01, 0.6, 10), (0.1, 1.0, 10), (1.0, 1.0, 4)])
def test_optimal_attacks_on_subsampled_gaussians_read_violation_at_most_alpha(p, sigma, steps):
    """Validity where the headline's Gaussian shape is least true (p = 0.01: most members are never included, the
    few included ones stand out): 200 audits each, at claims of eps 1.9, 2.6, 2.9 and 10.0. Measured: 0 violations
    in each (the largest headline seen: 0.43, 0.74, 1.32, 5.18)."""
    assert _optimal_audit_violations(p, sigma, steps, 200) <= stats.binom.ppf(0.999, 200, 0.05)


def test_optimal_attacks_on_a_subsampled_gaussian_read_violation_at_most_alpha_quick():
    """The fast tier's sibling of the test above: 40 audits at p = 0.1."""
    assert _optimal_audit_violations(0.1, 1.0, 10, 40, seed=1) <= stats.binom.ppf(0.999, 40, 0.05)


@pytest.mark.parametrize("members_n", [1, 20, 29, 35, 39])
def test_all_tied_scores_give_zero_whatever_the_membership_count(members_n):
    """A model equal to its base scores every canary alike: no guess set is chosen by the scores (top m, or a cut
    inside the tie), so no bound may rise, however lopsided the membership coin fell (29 of 40 read 0.148)."""
    from dpaudit.audit.analysis import analyse

    members = np.zeros(40, bool)
    members[:members_n] = True
    result = analyse(np.zeros(40), members, claimed_epsilon=0.1, delta=1e-5, alpha=0.05, score="loss-vs-base")
    assert result.epsilon_lower_bound == 0 and not result.violation
    assert all(b.epsilon == 0 for b in result.bounds.values())


def test_a_guess_set_cut_inside_a_tie_is_not_scored_but_still_paid_for():
    from dpaudit.audit.guesses import TopGuesses, decided

    scores = np.r_[np.full(13, 5.0), np.zeros(27)]
    members = np.r_[np.ones(13, bool), np.zeros(27, bool)]
    cands = {c.k: c for c in TopGuesses().candidates(scores, members, seed=0)}  # k = 1, 2, 4, 7, 13, 23, 40
    assert cands[13].v == 13 and cands[40].v == 0 and cands[7].v == 0  # 7 cuts inside the top 13's tie
    assert len(cands) == len(TopGuesses().candidates(np.arange(40.0), members, seed=0))  # the same count paid for
    assert decided(np.array([3.0, 2.0, 1.0]), 1, 2) and not decided(np.array([1.0, 1.0, 0.0]), 1)
