"""CanaryScoreAuditor(in_scores, out_scores): every eps lower bound from one set of canary scores.

In the spirit of jax_privacy's auditor: it does not care what the score is (higher = member), and how
guesses are chosen is a small strategy object. Every bound pays for its own choices: a strategy that
offers n guess sets splits alpha over them (Bonferroni), so each reported bound holds on its own with
probability >= 1 - alpha. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from dpaudit.audit import clopper_pearson, family, fdp, gaussian, gdp, one_run
from dpaudit.audit.guesses import (  # noqa: F401 - the strategies, importable from here as before
    Candidate, HullThresholds, TopGuesses, decided, default_guess_counts, make_guesses, ranking, roc_hull,
)
from dpaudit.core.errors import DPAuditError
from dpaudit.audit.headlines import ANY_MECHANISM, GAUSSIAN_SHAPE, INDEPENDENT, RUN_FAMILY, WHITE_BOX_SUMS


@dataclass(frozen=True)
class GuessCounts:
    """Two-sided: ceil(r/2) top scores guessed member, floor(r/2) bottom ones non-member, r fixed in advance."""
    counts: tuple[int, ...] | None = None          # None: DEFAULT_GUESS_FRACTIONS of m
    name = "two-sided, guess counts fixed in advance"
    two_sided = True

    def resolve(self, m: int) -> list[int]:
        return sorted(set(self.counts)) if self.counts else default_guess_counts(m)

    def candidates(self, scores: np.ndarray, members: np.ndarray, seed: int, perfect: bool = False) -> list[Candidate]:
        order = ranking(scores, seed)
        ranked, m = scores[order], len(scores)
        return [Candidate(r, make_guesses(order, members, r).correct
                          if decided(ranked, (r + 1) // 2, *([m - r // 2] if r // 2 else []), perfect=perfect)
                          else 0, f"r = {r}") for r in self.resolve(m)]


@dataclass(frozen=True)
class Bound:
    name: str                 # key in the report: fdp-gdp, fdp, steinke (+ -hull, -two-sided), gaussian, ...
    method: str
    epsilon: float
    delta: float
    alpha: float
    guesses: str = ""
    tests: int = 1            # guess sets paid for (alpha / tests each)
    k: int | None = None
    v: int | None = None
    at: str | None = None
    mu: float | None = None   # GDP-based bounds: the mu lower bound
    mu_estimate: float | None = None
    ceiling: float | None = None
    valid_for: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("epsilon", "mu", "mu_estimate", "ceiling"):
            if isinstance(d[key], float) and not math.isfinite(d[key]):
                d[key] = "inf"
        return d


def _suffix(strategy) -> str:
    return {TopGuesses: "", HullThresholds: "-hull", GuessCounts: "-two-sided"}[type(strategy)]


class CanaryScoreAuditor:
    def __init__(self, in_scores, out_scores, seed: int = 0, model=None):
        self.in_scores = np.asarray(in_scores, dtype=float)
        self.out_scores = np.asarray(out_scores, dtype=float)
        if self.in_scores.size == 0 or self.out_scores.size == 0:
            raise DPAuditError("need at least one member and one non-member score")
        self.scores = np.r_[self.in_scores, self.out_scores]
        self.members = np.r_[np.ones(self.in_scores.size, bool), np.zeros(self.out_scores.size, bool)]
        self.m = self.scores.size
        self.seed = seed
        self.model = model  # family.ScoreModel: how the scores were formed from the run's releases (or None)
        self.perfect = False  # the perfect-score audit: its tied blocks decide (guesses.decided)

    @classmethod
    def from_labels(cls, scores, members, seed: int = 0, model=None) -> "CanaryScoreAuditor":
        scores, members = np.asarray(scores, float), np.asarray(members, bool)
        auditor = cls(scores[members], scores[~members], seed, model)
        auditor.scores, auditor.members = scores, members  # keep the canaries' order for seeded tie-breaks
        return auditor

    def _search(self, strategy, bound_at, alpha: float) -> tuple[float, Candidate | None, int, list[int]]:
        """Best bound over the strategy's guess sets, each tested at alpha / (number of sets); also the sets'
        distinct sizes k (for the ceiling when no set gave a bound)."""
        cands = strategy.candidates(self.scores, self.members, self.seed, perfect=self.perfect)
        a = alpha / max(1, len(cands))
        best, arg = 0.0, None
        # Most precise guess sets first: a later set is then mostly ruled out by one cheap test at `best`.
        for c in sorted(cands, key=lambda c: -c.v / c.k if c.k else 0.0):
            if c.v == 0:
                continue
            value = bound_at(c, a, best)
            if value > best:
                best, arg = value, c
        return best, arg, len(cands), sorted({c.k for c in cands if c.k >= 1})

    @staticmethod
    def _ceiling(c: Candidate | None, counts: list[int], f) -> float | None:
        """``f(k)``: the bound had every guess of the k that can be right been right (``_most_right``). At the guess
        set chosen; when none was (a bound of 0), the most any of the sets' sizes ``counts`` could give: what this
        audit could have refuted at all."""
        if c is not None:
            return f(c.k)
        return max((f(k) for k in counts), default=None)

    def _most_right(self, k: int, two_sided: bool = False) -> int:
        """The most of k guesses this membership lets be right: k guessed member cannot all be right when fewer
        are members (a ceiling of "all k right" would overstate what the audit can show)."""
        n_in = int(self.members.sum())
        if two_sided:
            return min((k + 1) // 2, n_in) + min(k // 2, self.m - n_in)
        return min(k, n_in)

    def epsilon_one_run(self, alpha: float, delta: float, strategy=TopGuesses()) -> Bound:
        """Steinke, Nasr & Jagielski (2023): valid for any (eps, delta)-DP mechanism."""
        eps, c, n, counts = self._search(strategy, lambda c, a, floor: one_run.epsilon_lower_bound(
            self.m, c.k, c.v, delta, a, floor=floor), alpha)
        ceiling = self._ceiling(c, counts, lambda k: one_run.ceiling(self.m, k, delta, alpha / n,
                                                                     self._most_right(k, strategy.two_sided)))
        return Bound(name="steinke" + _suffix(strategy),
                     method="Steinke, Nasr & Jagielski 2023 (one run)", epsilon=eps, delta=delta, alpha=alpha,
                     guesses=strategy.name, tests=n, k=c.k if c else None, v=c.v if c else None,
                     at=c.label if c else None, ceiling=ceiling, valid_for=ANY_MECHANISM)

    def epsilon_one_run_fdp(self, alpha: float, delta: float, family: str = "gdp",
                            strategy=TopGuesses()) -> Bound:
        """Mahloujifar, Melis & Chaudhuri (2025), one-sided guesses; family "gdp" tests G_mu (report mu and
        its eps at delta), family "approx" tests the (eps, delta) trade-off curve itself."""
        if strategy.two_sided:
            raise DPAuditError("the f-DP one-run test here takes one-sided guesses")
        if family == "gdp":
            mu, c, n, counts = self._search(
                strategy, lambda c, a, floor: fdp.mu_lower_bound(self.m, c.k, c.v, a, floor), alpha)
            ceiling = self._ceiling(c, counts, lambda k: gdp.epsilon_from_mu(
                fdp.ceiling(self.m, k, alpha / n, self._most_right(k)), delta))
            return Bound(name="fdp-gdp" + _suffix(strategy), method="Mahloujifar, Melis & Chaudhuri 2025 (f-DP in one run), G_mu family",
                         epsilon=gdp.epsilon_from_mu(mu, delta), delta=delta, alpha=alpha, guesses=strategy.name,
                         tests=n, k=c.k if c else None, v=c.v if c else None, at=c.label if c else None, mu=mu,
                         ceiling=ceiling, valid_for=GAUSSIAN_SHAPE)
        if family != "approx":
            raise DPAuditError(f"unknown f-DP family {family!r}; use gdp or approx")
        eps, c, n, counts = self._search(strategy, lambda c, a, floor: fdp.epsilon_lower_bound(
            self.m, c.k, c.v, delta, a, floor), alpha)
        return Bound(name="fdp" + _suffix(strategy), method="Mahloujifar, Melis & Chaudhuri 2025 (f-DP in one run), (eps, delta) curve",
                     epsilon=eps, delta=delta, alpha=alpha, guesses=strategy.name, tests=n,
                     k=c.k if c else None, v=c.v if c else None, at=c.label if c else None,
                     ceiling=self._ceiling(c, counts, lambda k: fdp.epsilon_ceiling(self.m, k, delta, alpha / n,
                                                                                     self._most_right(k))),
                     valid_for=ANY_MECHANISM)

    def epsilon_gaussian(self, alpha: float, delta: float) -> Bound:
        """The continuous-statistic audit: mu from all scores (noncentral t), eps at delta through G_mu."""
        mu, mu_hat = gaussian.mu_lower_bound(self.in_scores, self.out_scores, alpha)
        return Bound(name="gaussian", method="continuous statistic (Agrawal et al. 2026, 'Let's Ask Gauss')",
                     epsilon=gdp.epsilon_from_mu(mu, delta), delta=delta, alpha=alpha,
                     guesses="none: the mean shift of all scores", mu=mu, mu_estimate=mu_hat,
                     valid_for=WHITE_BOX_SUMS)

    def epsilon_gaussian_run(self, alpha: float, delta: float) -> Bound:
        """The continuous statistic's mu lower limit read through the run's own mechanism family (family.py)."""
        if self.model is None:
            raise DPAuditError("the gaussian-run bound needs the run's family (rate, steps, how scores were formed)")
        mu, mu_hat = gaussian.mu_lower_bound(self.in_scores, self.out_scores, alpha)
        eps, sigma = family.epsilon_lower_bound(self.model, mu, self.in_scores.size, self.out_scores.size, delta)
        return Bound(name="gaussian-run", method="continuous statistic read through the run's mechanism family ("
                     + self.model.describe() + ")", epsilon=eps, delta=delta, alpha=alpha,
                     guesses="none: the mean shift of all scores", mu=mu, mu_estimate=mu_hat,
                     at=f"family member refuted down to sigma = {sigma:.4g}" if math.isfinite(sigma) else None,
                     valid_for=RUN_FAMILY)

    def epsilon_clopper_pearson(self, alpha: float, delta: float, strategy=TopGuesses()) -> Bound:
        """TPR/FPR intervals at each threshold (Jagielski et al. 2020). Treats canaries as independent trials:
        exact across independent runs, indicative inside one run."""
        n_in, n_out = int(self.members.sum()), int((~self.members).sum())
        eps, c, n, _ = self._search(strategy, lambda c, a, floor: clopper_pearson.epsilon_lower_bound(
            c.v, n_in, c.k - c.v, n_out, delta, a), alpha)
        return Bound(name="clopper-pearson", method="Clopper-Pearson on TPR/FPR (independent trials)", epsilon=eps,
                     delta=delta, alpha=alpha, guesses=strategy.name, tests=n, k=c.k if c else None,
                     v=c.v if c else None, at=c.label if c else None,
                     valid_for=INDEPENDENT)
