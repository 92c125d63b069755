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
        scores = _pipeline_scores(_moves(rng, members, steps, p, sigma, signal))
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
    loud = _pipeline_scores(_moves(rng, members, 60, 0.1, 0.05))  # noise 0.05 for a claim made for sigma 1
    result = analyse(loud["row movement"], members, claimed_epsilon=2.0, delta=1e-5, alpha=0.025,
                     score="white-box-pipeline")
    assert result.violation and result.headline == "gaussian"
    still = np.zeros((5, 200))
    still[2] = rng.normal(size=200)
    assert np.allclose(_pipeline_scores(still)["row movement"], _pipeline_scores(still[2:3])["row movement"])
