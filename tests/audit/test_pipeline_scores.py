"""The PipelineProbe's scores (audit/whitebox.py, torch-free): each step's row movements standardised across the
canaries, summed; validity at the null and on exactly Poisson-subsampled Gaussian row movements, claimed at the
mechanism's PLD eps (both statistics, alpha split as audit_run_folder splits it); and power where it should have it."""

import numpy as np
import pytest
from scipy import stats

from dpaudit.audit.analysis import analyse
from dpaudit.audit.whitebox import _pipeline_scores


def _moves(rng, members, steps: int, p: float, sigma: float, signal: float = 1.0, reuse: int = 1):
    """Row movements along each canary's direction: noise sigma a step (its scale drifting, as a learning-rate
    schedule makes it), a background shared by all canaries (the tied softmax's push), and, for a member included
    at a step (Poisson at rate p; a batch used ``reuse`` times), ``signal`` (the clipped row gradient, C = 1)."""
    m = members.size
    scale = np.linspace(1.0, 0.3, steps)[:, None]
    drawn = (rng.random((steps // reuse, m)) < p) & members
    included = np.repeat(drawn, reuse, axis=0)
    return scale * (rng.normal(size=(steps, m)) * sigma + rng.normal() + signal * included)


def _violations(trials: int, p: float, sigma: float, steps: int, m: int = 500, seed: int = 0,
                claim: float | None = None, signal: float = 1.0) -> int:
    from dpaudit.accounting import pld
    from dpaudit.accounting.mechanism import Mechanism

    claim = claim if claim is not None else pld.epsilon(Mechanism("gaussian", sigma, p, steps), 1e-5).epsilon
    rng = np.random.default_rng(seed)
    wrong = 0
    for _ in range(trials):
        members = rng.random(m) < 0.5
        scores = _pipeline_scores(_moves(rng, members, steps, p, sigma, signal))[0]
        wrong += any(analyse(s, members, claimed_epsilon=claim, delta=1e-5, alpha=0.05 / len(scores),
                             score="white-box-pipeline").violation for s in scores.values())
    return wrong


@pytest.mark.parametrize("p,sigma,steps", [(0.05, 1.1, 200), (0.2, 2.0, 50)])
def test_pipeline_scores_read_violation_at_most_alpha_on_subsampled_gaussian_rows(p, sigma, steps):
    """200 audits each, the canaries' rows moved exactly as a Poisson-subsampled Gaussian run moves them (the
    whole clipped gradient in the row: the most a member can move it), claimed at the run's PLD eps."""
    assert _violations(200, p, sigma, steps) <= stats.binom.ppf(0.999, 200, 0.05)


def test_pipeline_scores_read_violation_at_most_alpha_quick():
    """The fast tier's sibling of the two tests around it (measured there: 0 violations in 200 each)."""
    assert _violations(40, 0.05, 1.1, 100, m=300, seed=1) <= stats.binom.ppf(0.999, 40, 0.05)


def test_pipeline_scores_at_the_null_read_violation_at_most_alpha():
    """No member moves its row at all: 200 audits at a small claim (eps 0.3)."""
    assert _violations(200, 0.05, 1.0, 100, claim=0.3, signal=0.0) <= stats.binom.ppf(0.999, 200, 0.05)


def test_pipeline_scores_see_a_run_without_noise_and_a_still_step_says_nothing():
    rng = np.random.default_rng(1)
    members = rng.random(200) < 0.5
    loud = _pipeline_scores(_moves(rng, members, 60, 0.1, 0.05))[0]  # noise 0.05 for a claim made for sigma 1
    result = analyse(loud["row movement"], members, claimed_epsilon=2.0, delta=1e-5, alpha=0.025,
                     score="white-box-pipeline")
    assert result.violation and result.headline == "gaussian"
    still = np.zeros((5, 200))
    still[2] = rng.normal(size=200)
    assert np.allclose(_pipeline_scores(still)[0]["row movement"], _pipeline_scores(still[2:3])[0]["row movement"])


# -- the run's own family (issue 70 item 2): validity first ---------------------------------------------------------
def _family_bound(rng, members, p, sigma, steps, claim, signal=1.0, momentum=0.0):
    """The bound audit_run_folder reads from a pipeline transcript whose canaries' sampler audit passed: the three
    statistics in noise units at alpha / 3 through the family, the larger kept; None where the steps are too
    correlated for it (today's Gaussian reading then)."""
    from dpaudit.audit.whitebox import INDEPENDENT, claim_pull, pipeline_models

    x = _moves(rng, members, steps, p, sigma, signal)
    if momentum:
        x = x.copy()
        for t in range(1, steps):
            x[t] += momentum * x[t - 1]
    pull = claim_pull(claim, 1e-5, p, steps)
    scores, correlation = _pipeline_scores(x, p, pull)
    if abs(correlation) > INDEPENDENT:
        return None
    models = pipeline_models(p, steps, pull)
    assert set(models) == set(scores)
    return max(analyse(scores[k], members, claimed_epsilon=claim, delta=1e-5, alpha=0.05 / len(models),
                       model=models[k], score="white-box-pipeline").epsilon_lower_bound for k in models)


def _family_trials(trials, p, sigma, steps, m=500, seed=0, momentum=0.0):
    from dpaudit.accounting import pld
    from dpaudit.accounting.mechanism import Mechanism

    truth = pld.epsilon(Mechanism("gaussian", sigma, p, steps), 1e-5).epsilon
    rng = np.random.default_rng(seed)
    bounds = []
    for _ in range(trials):
        members = rng.random(m) < 0.5
        bounds.append(_family_bound(rng, members, p, sigma, steps, truth, momentum=momentum))
    return truth, bounds


@pytest.mark.parametrize("p,sigma,steps,momentum", [(0.064, 1.273, 200, 0.0), (0.2, 2.0, 50, 0.0),
                                                    (0.064, 1.273, 200, 0.04)])
def test_the_family_reading_of_pipeline_rows_is_above_the_truth_at_most_alpha(p, sigma, steps, momentum):
    """200 exact runs (each member's whole clipped gradient in its row, the most it can pull) claimed at their true
    eps, scored as the probe scores them (noise scale read from the m rows each step). Also at a momentum whose
    lag-1 correlation sits just under the INDEPENDENT the reading accepts."""
    truth, bounds = _family_trials(200, p, sigma, steps, momentum=momentum)
    read = [b for b in bounds if b is not None]
    assert len(read) >= 190, f"only {len(read)} of 200 runs with independent enough steps read through the family"
    over = sum(b > truth for b in read)
    assert over <= stats.binom.ppf(0.999, 200, 0.05), f"{over} of 200 above the true eps {truth:.3f}"


def test_the_family_reading_can_fail_and_is_refused_under_momentum():
    """A claim 15 % more private than the run is refuted often (the test above can fail), the family reading reads
    above the Gaussian one at full pull, and momentum 0.9 (Adam's and SGD's default beta) is not read through it."""
    from dpaudit.accounting import pld
    from dpaudit.accounting.mechanism import Mechanism

    p, sigma, steps = 0.064, 1.273, 200
    claim = pld.epsilon(Mechanism("gaussian", sigma * 1.15, p, steps), 1e-5).epsilon
    rng = np.random.default_rng(3)
    refuted, family, gaussian = 0, [], []
    for _ in range(40):
        members = rng.random(500) < 0.5
        bound = _family_bound(rng, members, p, sigma, steps, claim)
        refuted += bound > claim
        family.append(bound)
        today = _pipeline_scores(_moves(np.random.default_rng(len(family)), members, steps, p, sigma))[0]
        gaussian.append(max(analyse(v, members, claimed_epsilon=claim, delta=1e-5, alpha=0.025,
                                    score="white-box-pipeline").epsilon_lower_bound for v in today.values()))
    assert refuted >= 8, f"only {refuted} of 40 refuted a claim 15 % too private"
    assert np.median(family) > 1.15 * np.median(gaussian), (np.median(family), np.median(gaussian))
    members = rng.random(500) < 0.5
    assert _family_bound(rng, members, p, sigma, steps, 4.0, momentum=0.9) is None
