"""Audit statistics: the one-run bound against ../shared/reference/auditing.md (recomputed, not copied),
null scores, perfect separation, AUC without inflation, Clopper-Pearson."""

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dpaudit.audit import clopper_pearson, one_run
from dpaudit.audit.analysis import analyse
from dpaudit.audit.guesses import default_guess_counts

TWO = "steinke-two-sided"  # today's bound: two-sided guesses at counts fixed in advance


def reference_rows(reference_dir):
    text = (reference_dir / "auditing.md").read_text()
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\de.\-]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|$",
                      text, flags=re.M)
    assert len(rows) >= 3, "the reference table was not found"
    return [(int(m), int(r), int(v), float(d), float(a), float(e)) for m, r, v, d, a, e in rows]


def test_one_run_bound_reproduces_reference_table(reference_dir):
    for m, r, v, delta, alpha, expected in reference_rows(reference_dir):
        assert one_run.epsilon_lower_bound(m, r, v, delta, alpha) == pytest.approx(expected, abs=0.006)


def test_one_run_bound_closed_form_at_delta_zero():
    # All r correct, delta = 0: q^r = alpha, eps = logit(q).
    q = 0.05 ** (1 / 100)
    assert one_run.epsilon_lower_bound(1000, 100, 100, 0.0, 0.05) == pytest.approx(math.log(q / (1 - q)), rel=1e-8)


@settings(max_examples=40, deadline=None)
@given(r=st.integers(1, 300), frac=st.floats(0, 1), delta=st.sampled_from([0.0, 1e-6, 1e-4]),
       alpha=st.sampled_from([0.01, 0.05, 0.2]))
def test_one_run_bound_is_monotone_and_its_p_value_is_alpha(r, frac, delta, alpha):
    m = 2 * r
    v = int(round(frac * r))
    eps = one_run.epsilon_lower_bound(m, r, v, delta, alpha)
    assert eps >= 0
    if v < r:
        assert one_run.epsilon_lower_bound(m, r, v + 1, delta, alpha) >= eps - 1e-9
    assert one_run.epsilon_lower_bound(m, r, v, delta, alpha / 2) <= eps + 1e-9
    assert one_run.epsilon_lower_bound(m, r, v, delta + 1e-3, alpha) <= eps + 1e-9
    if 0 < eps < one_run.EPS_CEILING:
        assert one_run.p_value(eps, m, r, v, delta) == pytest.approx(alpha, rel=1e-6)


def test_null_scores_give_chance_auc_and_zero_bound_in_95_percent():
    rng = np.random.default_rng(12345)
    trials, zero, aucs = 200, 0, []
    for _ in range(trials):
        members = rng.random(1000) < 0.5
        result = analyse(rng.normal(size=1000), members, alpha=0.05, delta=1e-5)
        zero += result.epsilon_lower_bound == 0
        aucs.append(result.roc.auc)
    assert zero / trials >= 0.95
    assert abs(np.mean(aucs) - 0.5) < 0.01


def test_perfect_separation_reaches_the_ceiling_for_m_and_k():
    rng = np.random.default_rng(0)
    members = rng.random(1000) < 0.5
    scores = members + rng.normal(scale=0.01, size=1000)
    fixed = analyse(scores, members, guess_counts=[100], delta=0.0)
    assert fixed.bounds[TWO].epsilon == pytest.approx(one_run.ceiling(1000, 100, 0.0, 0.05))
    assert fixed.bounds[TWO].epsilon == pytest.approx(3.49, abs=0.006)  # the reference row m=1000, r=v=100
    # The default grid pays for its 6 guess counts with alpha / 6.
    grid = analyse(scores, members, delta=1e-5)
    counts = default_guess_counts(1000)
    assert grid.bounds[TWO].epsilon == pytest.approx(max(
        one_run.ceiling(1000, r, 1e-5, 0.05 / len(counts)) for r in counts
        if r // 2 <= min(members.sum(), (~members).sum())), rel=1e-9)
    assert grid.roc.auc == 1.0 and grid.violation is False


def test_auc_is_not_inflated_for_reversed_scores():
    rng = np.random.default_rng(1)
    members = rng.random(500) < 0.5
    result = analyse(-members.astype(float) + rng.normal(scale=0.1, size=500), members, claimed_epsilon=1.0,
                     delta=1e-5)
    assert result.roc.auc < 0.05            # reported as measured, never max(AUC, 1 - AUC)
    assert all(b.epsilon == 0.0 for b in result.bounds.values())  # the direction was fixed in advance
    assert not result.violation and result.verdict == "consistent with eps = 1"


def test_violation_verdict():
    rng = np.random.default_rng(2)
    members = rng.random(1000) < 0.5
    result = analyse(members * 3.0 + rng.normal(size=1000), members, claimed_epsilon=0.5, delta=1e-5)
    assert result.violation and result.verdict.startswith("VIOLATION: empirical eps >= ")
    assert result.epsilon_lower_bound > 0.5


def test_clopper_pearson_bound():
    assert clopper_pearson.epsilon_lower_bound(50, 500, 50, 500) == 0.0
    # TPR 0.9 vs FPR 0.01 on 1000 each: clearly above 3, below the point estimate log(90).
    eps = clopper_pearson.epsilon_lower_bound(900, 1000, 10, 1000)
    assert 3 < eps < math.log(90)
    assert clopper_pearson.epsilon_lower_bound(900, 1000, 10, 1000, delta=0.1) < eps


@pytest.mark.parametrize("scores,members,message", [
    ([0.1, 0.2], [0, 0], "member set is empty"),
    ([0.1, 0.2], [1, 1], "every canary is a member"),
    ([0.1, float("nan")], [0, 1], "NaN"),
    ([0.1, 0.2, 0.3], [0, 1], "equal length"),
])
def test_bad_scores_are_refused(scores, members, message):
    with pytest.raises(ValueError, match=message):
        analyse(scores, members)


def test_the_automatic_headline_fits_the_mechanism():
    """A Laplace run's trade-off curve is not Gaussian: its headline is valid for any (eps, delta)-DP
    mechanism; a Gaussian one keeps the Gaussian-family bound."""
    import numpy as np

    from dpaudit.audit.analysis import analyse

    rng = np.random.default_rng(0)
    members = rng.random(400) < 0.5
    scores = rng.normal(members * 0.5, 1)
    laplace = analyse(scores, members, claimed_epsilon=4.0, delta=1e-5, mechanism="laplace")
    gaussian = analyse(scores, members, claimed_epsilon=4.0, delta=1e-5, mechanism="gaussian")
    pure = analyse(scores, members, claimed_epsilon=4.0, delta=0.0, mechanism="laplace")
    assert laplace.headline == "fdp" and laplace.headline_bound.valid_for.startswith("any")
    assert gaussian.headline == "fdp-gdp" and pure.headline == "steinke"


def test_the_headline_help_is_built_from_the_registry_the_audit_uses():
    import re

    from cli_helpers import dpaudit
    from dpaudit.audit.analysis import choose_headline
    from dpaudit.audit.headlines import AUTO_RULE, BOUNDS, HEADLINES, SCOPES
    from dpaudit.audit.scores import get_score

    text = " ".join(dpaudit("audit", "scores", "--help").stdout.split()).replace("- ", "-")  # click breaks at "-"
    assert all(re.search(rf"\b{re.escape(h)}\b", text) for h in HEADLINES)
    assert " ".join(AUTO_RULE.split()) in text
    for name, spec in BOUNDS.items():  # each bound that may headline, in the group of what it is valid for
        group = re.search(rf"valid for {re.escape(SCOPES[spec.valid_for])}[^:;]*:[^;)]*\b{re.escape(name)}\b", text)
        assert (group is not None) is spec.headline, name
    # The rule in words is the rule in code.
    white, plain = get_score("white-box-dp-sgd"), get_score("neg-loss")
    assert choose_headline(plain, 0.0) == "steinke" and choose_headline(plain, 1e-5, mechanism="laplace") == "fdp"
    assert choose_headline(white, 1e-5) == "gaussian" and choose_headline(plain, 1e-5) == "fdp-gdp"


def test_every_registered_bound_is_computed_named_and_explained_as_the_registry_says():
    from dpaudit.audit.analysis import analyse
    from dpaudit.audit.headlines import BOUNDS

    rng = np.random.default_rng(3)
    members = rng.random(400) < 0.5
    scores = rng.normal(0, 1, 400) + members
    from dpaudit.audit.family import linear

    result = analyse(scores, members, claimed_epsilon=1.0, delta=1e-5, score="white-box-dp-sgd")
    assert list(result.bounds) == [n for n, b in BOUNDS.items() if not b.needs_run]  # no run's family given
    run = analyse(scores, members, claimed_epsilon=1.0, delta=1e-5, score="white-box-dp-sgd",
                  model=linear(0.1, 100, 1.0))
    assert list(run.bounds) == list(BOUNDS) and run.headline == "gaussian-run"
    for name, bound in run.bounds.items():
        assert bound.name == name and bound.valid_for == BOUNDS[name].valid_for
    pure = analyse(scores, members, claimed_epsilon=1.0, delta=0.0, score="neg-loss")
    assert set(pure.bounds) == {n for n, b in BOUNDS.items() if not b.needs_delta and not b.white_box_only}
    assert result.to_dict()["headline"]["why_valid"] == BOUNDS["gaussian"].why


def test_a_consistent_audit_says_what_it_could_have_refuted_even_at_a_zero_bound():
    """The reach line ("What this audit can refute") matters most when nothing leaked: a headline of 0 still
    reports the most this audit could have certified, the same audit on perfect scores of this membership
    (issue 53: not one guess set's ceiling, which can assume more right guesses than there are members)."""
    from dpaudit.audit.report import markdown

    rng = np.random.default_rng(0)
    members = rng.random(200) < 0.5
    result = analyse(rng.normal(0, 1, 200), members, claimed_epsilon=1.0, delta=1e-5, score="neg-loss")
    head = result.headline_bound
    ordered = members + np.linspace(0.5, 0.0, 200)  # every member above every non-member, no two tied
    perfect = analyse(ordered, members, claimed_epsilon=1.0, delta=1e-5, score="neg-loss")
    assert head.epsilon == 0.0 and result.refutable == pytest.approx(perfect.epsilon_lower_bound) and result.refutable > 1
    assert f"cannot exceed {result.refutable:.3g}" in markdown(result, {})


def test_the_refutable_bound_depends_on_the_membership_only_through_its_count():
    """refutable_bound caches its answer by the member count (analysis.py): on perfect scores, any membership of
    that count reads the same bound, whatever the headline and guess counts."""
    import numpy as np

    from dpaudit.audit.analysis import _perfect_bound, refutable_bound

    rng = np.random.default_rng(4)
    for m, share, headline, guesses in [(200, 0.5, "auto", None), (101, 0.3, "steinke", (5, 20)),
                                        (60, 0.7, "fdp", None), (80, 0.5, "fdp-gdp", (3, 9, 27)),
                                        (90, 0.4, "steinke-hull", None), (70, 0.5, "steinke-two-sided", None)]:
        members = rng.random(m) < share
        direct = _perfect_bound(members, 1e-5, 0.05, guesses, 0, "unnamed", headline, None, None)
        assert direct > 0
        assert refutable_bound(members, delta=1e-5, alpha=0.05, guess_counts=guesses, headline=headline) == direct
        assert refutable_bound(rng.permutation(members), delta=1e-5, alpha=0.05, guess_counts=guesses,
                               headline=headline) == direct
