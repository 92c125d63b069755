"""Issue 53, items 9-12: every statement of a report is checked against the numbers in its report.json, on reports
built from crafted scores (including exposure tiers where a tier drew no member).

Before: "What this audit can refute" read one guess count's ceiling (m = 16, 8 members: "cannot exceed 2.28" where
perfect scores certify 0.000); a tiered verdict named a one-example claim no tier had tested; a TPR above the
claim's ceiling sat beside "consistent" with a share over 100 % and no reason; report.json held a TPR at 1 % FPR
that report.md withheld, unmarked."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dpaudit.audit.analysis import analyse
from dpaudit.audit.report import write_report

DELTA = 1e-5


def _report(tmp_path, scores, members, claimed=1.0, **kw):
    result = analyse(np.asarray(scores, float), np.asarray(members, bool), claimed_epsilon=claimed, delta=DELTA,
                     score="neg-loss", **kw)
    write_report(tmp_path, result, scores, members, {})
    return result, json.loads((tmp_path / "report.json").read_text()), (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("m, members_in, expected", [(16, 8, 0.0), (40, 22, 1.84)])
def test_the_refutable_ceiling_is_the_perfect_score_audit_and_the_report_says_that_number(tmp_path, m, members_in,
                                                                                         expected):
    members = np.zeros(m, bool)
    members[:members_in] = True
    scores = np.random.default_rng(0).normal(size=m)
    result, data, text = _report(tmp_path, scores, members)
    ordered = members.astype(float) + np.linspace(0.5, 0.0, m)  # every member above every non-member, untied
    perfect = analyse(ordered, members, claimed_epsilon=1.0, delta=DELTA, score="neg-loss")
    assert data["refutable_ceiling"] == pytest.approx(perfect.epsilon_lower_bound) == pytest.approx(expected, abs=5e-3)
    said = float(re.search(r"the headline bound cannot exceed ([0-9.]+)", text).group(1))
    assert said == pytest.approx(data["refutable_ceiling"], abs=5e-3)
    if data["refutable_ceiling"] <= 1.0:
        assert "this audit could not have refuted it" in text
    # the bounds table's ceiling column never says more than the audit can refute (it read 4.15 beside a "can
    # refute at most 1.28": guess sets larger than the members counted as all right)
    assert data["bounds"][data["headline"]["bound"]]["ceiling"] <= data["refutable_ceiling"] + 1e-6  # root tolerance


def test_a_tpr_above_the_ceiling_beside_consistent_says_why(tmp_path):
    # 8 members, 16 non-members: 3 members above all but one non-member, so TPR 0.375 at FPR 10 %
    members = np.array([True] * 8 + [False] * 16)
    scores = np.concatenate([[5.0, 4.9, 4.8], np.linspace(-1, 0, 5), [4.95], np.linspace(0.1, 1.0, 15)])
    result, data, text = _report(tmp_path, scores, members)
    row = data["claim_ceiling"]["tpr_at_fpr"]["0.1"]
    assert not data["violation"] and row["share"] > 1
    line = next(x for x in text.splitlines() if x.startswith("| TPR at FPR 10.0%"))
    assert "above the ceiling, not a violation" in line and "16 non-members" in line


def test_a_tpr_the_markdown_withholds_is_marked_in_the_json(tmp_path):
    members = np.array([True, False] * 20)
    result, data, text = _report(tmp_path, np.random.default_rng(1).normal(size=40), members)
    assert set(data["tpr_at_fpr_withheld"]) == {k for k in data["tpr_at_fpr"] if float(k) * 20 < 1}
    assert "0.01" in data["tpr_at_fpr_withheld"] and "TPR at FPR 1.0%" not in text
    assert "TPR at FPR 10.0%" in text


def test_a_tiered_verdict_never_names_a_claim_no_tier_tested():
    from dpaudit.integrations.hf import _Settings, audit_tiers, tiers_verdict

    m = 60
    members = np.arange(m) % 2 == 1
    members[np.arange(m) % 3 == 0] = False           # the 1x tier (canary i, i mod 3 == 0) drew no member
    scores = np.random.default_rng(2).normal(size=m)
    settings = _Settings(m=m, kind="existing", row_format="text", text_field="text", repeats=[1, 4, 16],
                         claimed_eps=0.25, delta=DELTA, alpha=0.05, preflight="refuse", reference=None,
                         regurgitation=False, inserted_rows=0, dataset_rows=1000)
    _, tiers = audit_tiers(scores, members, "neg-loss", settings, 0.25)
    violation, verdict = tiers_verdict(tiers, 0.25)
    assert not violation
    assert "one-example claim eps = 0.25 was NOT tested" in verdict and "all non-members" in verdict
    assert not verdict.startswith("consistent with eps")


def test_the_cli_table_fits_a_pipe_and_says_why_a_tpr_above_the_ceiling_is_consistent(tmp_path):
    """In a pipe the table was about 250 characters wide, and a TPR above "the claim allows at most" beside a
    consistent verdict had no note (report.md had one)."""
    from cli_helpers import dpaudit

    members = np.array([True] * 8 + [False] * 16)
    scores = np.concatenate([[5.0, 4.9, 4.8], np.linspace(-1, 0, 5), [4.95], np.linspace(0.1, 1.0, 15)])
    path = tmp_path / "scores.csv"
    path.write_text("score,member\n" + "".join(f"{s},{int(b)}\n" for s, b in zip(scores, members)))
    out = dpaudit("audit", "scores", path, "--delta", "1e-5", "--claimed-eps", "1")
    assert out.returncode == 0, out.stderr
    table = [line for line in out.stdout.splitlines() if line[:1] in "┌│└├"]
    assert table and max(len(line) for line in table) <= 120
    assert "above it, not a violation" in out.stdout
