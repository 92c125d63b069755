"""From canary scores to an audit: ROC, eps lower bounds, and the verdict against the claimed eps."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dpaudit.audit import clopper_pearson, one_run
from dpaudit.audit.guesses import check_scores, default_guess_counts, make_guesses, ranking
from dpaudit.audit.roc import RocSummary, summarise
from dpaudit.errors import DPAuditError


@dataclass(frozen=True)
class BoundAtGuesses:
    r: int
    correct: int
    one_run_epsilon: float
    clopper_pearson_epsilon: float


@dataclass
class AuditResult:
    m: int
    members: int
    nonmembers: int
    alpha: float
    delta: float
    claimed_epsilon: float | None
    guess_counts: list[int]
    per_guess: list[BoundAtGuesses]
    one_run_epsilon: float          # best over guess_counts, Bonferroni-corrected
    one_run_r: int
    one_run_ceiling: float          # what all-correct guesses at that r would give
    clopper_pearson_epsilon: float
    roc: RocSummary = field(repr=False)

    @property
    def violation(self) -> bool:
        return self.claimed_epsilon is not None and self.one_run_epsilon > self.claimed_epsilon

    @property
    def verdict(self) -> str:
        if self.claimed_epsilon is None:
            return f"empirical eps >= {self.one_run_epsilon:.3f} (no claimed eps given)"
        if self.violation:
            return (f"VIOLATION: empirical eps >= {self.one_run_epsilon:.3f} > claimed "
                    f"{self.claimed_epsilon:g}")
        return f"consistent with eps = {self.claimed_epsilon:g}"

    def to_dict(self) -> dict:
        corrected = self.alpha / len(self.guess_counts)
        return {
            "verdict": self.verdict,
            "violation": self.violation,
            "claimed_epsilon": self.claimed_epsilon,
            "canaries": {"m": self.m, "members": self.members, "nonmembers": self.nonmembers},
            "score": "-loss on the secret token (higher = member), fixed in advance",
            "auc": self.roc.auc,
            "tpr_at_fpr": {f"{k:g}": v for k, v in self.roc.tpr_at_fpr.items()},
            "one_run": {
                "epsilon_lower_bound": self.one_run_epsilon,
                "method": "Steinke, Nasr & Jagielski 2023 (one training run)",
                "m": self.m, "r": self.one_run_r, "delta": self.delta, "alpha": self.alpha,
                "guess_counts_tried": self.guess_counts,
                "alpha_per_guess_count": corrected,
                "ceiling_at_r": self.one_run_ceiling,
            },
            "clopper_pearson": {
                "epsilon_lower_bound": self.clopper_pearson_epsilon,
                "delta": self.delta, "alpha": self.alpha, "thresholds_tried": len(self.guess_counts),
                "note": "treats canaries as independent trials; indicative in a one-run audit",
            },
            "per_guess_count": [asdict(b) for b in self.per_guess],
        }


def check_audit_parameters(alpha: float, delta: float, claimed_epsilon: float | None) -> None:
    if not 0 < alpha < 1:
        raise DPAuditError(f"alpha must be in (0, 1), got {alpha}")
    if not 0 <= delta < 1:
        raise DPAuditError(f"delta must be in [0, 1), got {delta}")
    if claimed_epsilon is not None and not (claimed_epsilon >= 0 and math.isfinite(claimed_epsilon)):
        raise DPAuditError(f"claimed eps must be a finite number >= 0, got {claimed_epsilon}")


def analyse(scores, members, *, claimed_epsilon: float | None = None, delta: float = 0.0,
            alpha: float = 0.05, guess_counts: list[int] | None = None, seed: int = 0) -> AuditResult:
    """Audit canary scores. ``guess_counts`` (r values) must be fixed before looking at the scores;
    the default grid is, and alpha is split evenly over however many are tried (Bonferroni)."""
    check_audit_parameters(alpha, delta, claimed_epsilon)
    scores, members = check_scores(scores, members)
    m = len(scores)
    counts = sorted(set(guess_counts)) if guess_counts else default_guess_counts(m)
    if counts[0] < 1 or counts[-1] > m:
        raise DPAuditError(f"guess counts must lie in [1, m={m}], got {counts}")
    a = alpha / len(counts)
    order = ranking(scores, seed)
    n_mem, n_non = int(members.sum()), int((~members).sum())
    per_guess = []
    for r in counts:
        g = make_guesses(order, members, r)
        top = order[:r]  # Clopper-Pearson threshold: the r highest scores are called "member"
        tp = int(members[top].sum())
        per_guess.append(BoundAtGuesses(
            r=r, correct=g.correct,
            one_run_epsilon=one_run.epsilon_lower_bound(m, r, g.correct, delta, a),
            clopper_pearson_epsilon=clopper_pearson.epsilon_lower_bound(tp, n_mem, r - tp, n_non, delta, a)))
    best = max(per_guess, key=lambda b: b.one_run_epsilon)
    return AuditResult(
        m=m, members=n_mem, nonmembers=n_non, alpha=alpha, delta=delta, claimed_epsilon=claimed_epsilon,
        guess_counts=counts, per_guess=per_guess, one_run_epsilon=best.one_run_epsilon, one_run_r=best.r,
        one_run_ceiling=one_run.ceiling(m, best.r, delta, a),
        clopper_pearson_epsilon=max(b.clopper_pearson_epsilon for b in per_guess),
        roc=summarise(scores, members))
