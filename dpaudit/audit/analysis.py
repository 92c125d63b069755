"""From canary scores to an audit: ROC, every eps lower bound, the headline, and the verdict.

The headline is one rule, fixed before the scores are seen (so it needs no further correction):
- white-box scores that sum canary-aligned signals (delta > 0): the continuous Gaussian audit, its mean shift
  read through the run's own mechanism family where the run's rate and steps are known (family.py), else
  through G_mu;
- other scores, delta > 0: the f-DP one-run test of the Gaussian family, one-sided top-k guesses for 12
  counts fixed in advance (label-free, so Bonferroni over them is exact; jax_privacy's ROC-hull rule
  picks its thresholds with the labels and is reported beside it);
- delta = 0 (pure eps claims): Steinke et al.'s bound with the same guesses, valid for any mechanism (for
  pure eps it matches the f-DP test of the eps trade-off curve, and is a hair stronger in our checks).
Every other bound is reported beside it, each valid on its own at level alpha, none used for the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np


from dpaudit.audit.auditor import Bound, CanaryScoreAuditor, GuessCounts
from dpaudit.audit.guesses import check_scores
from dpaudit.audit.headlines import BOUNDS, HEADLINES, WHY
from dpaudit.audit.roc import RocSummary, summarise
from dpaudit.audit.scores import Score, get_score
from dpaudit.core.errors import DPAuditError
from dpaudit.core.validate import check_alpha, check_claimed_epsilon, check_delta
from dpaudit.audit.ceiling import claim_ceiling

@dataclass
class AuditResult:
    m: int
    members: int
    nonmembers: int
    alpha: float
    delta: float
    claimed_epsilon: float | None
    score: Score
    bounds: dict[str, Bound]
    headline: str
    roc: RocSummary = field(repr=False)
    # A white-box probe given the model: trainable tensors the DP optimizer never clips or noises. Any finite
    # claim is then false for them, whatever the canaries say.
    unprotected: tuple = ()
    # The most TPR the claim allows at each FPR (ceiling.py), for the report to set the measured TPR beside.
    ceiling: object = None
    # A PipelineProbe that saw each step's batch: the sampler audit of its member canaries' inclusions (a
    # SamplerVerdict). Inclusions that are not Poisson at the accounted rate void the claim's accounting.
    sampler: object = None
    # A probe whose canaries entered as examples: the per-example clipping check (clipping.ClippingCheck). Canaries
    # whose contribution grows with their size void the claim's sensitivity.
    clipping: object = None
    # A gradient probe that knows the accounted noise: the per-tensor noise check (noise_check.NoiseCheck). A tensor
    # released with less noise than accounted voids the claim, however few canaries it holds.
    noise: object = None
    # Where the rate the run is accounted with was checked against the rate its data loader samples at
    # (rates.RateCheck): a loader that samples more often than the accountant counts understates eps.
    rate: object = None
    # What this audit can refute: its headline bound on perfect scores of the same membership (every member above
    # every non-member), the same guess counts, alpha split and headline: the most it could ever report. The one
    # oracle the report's "can refute" line and the pre-training power note read (power.most_certifiable).
    refutable: float | None = None

    @property
    def epsilon_lower_bound(self) -> float:
        return self.bounds[self.headline].epsilon

    @property
    def headline_bound(self) -> Bound:
        return self.bounds[self.headline]

    @property
    def violation(self) -> bool:
        return bool(self.unprotected) or self._sampler_refused or self._clipping_refused or self._noise_refused \
            or self._rate_refused or (
            self.claimed_epsilon is not None
                                          and self.epsilon_lower_bound > self.claimed_epsilon)

    @property
    def verdict(self) -> str:
        if self.unprotected:
            names = ", ".join(self.unprotected[:3]) + (f" and {len(self.unprotected) - 3} more"
                                                       if len(self.unprotected) > 3 else "")
            return (f"VIOLATION: {len(self.unprotected)} trainable tensors are updated outside DP (no clipping, no "
                    f"noise): {names}")
        if self._noise_refused:
            return f"VIOLATION: {self.noise.reason}; eps lower bound {self.epsilon_lower_bound:.3f}"
        if self._rate_refused:
            return f"VIOLATION: {self.rate.reason}; eps lower bound {self.epsilon_lower_bound:.3f}"
        if self._clipping_refused:
            return (f"VIOLATION: the canaries were not clipped per example: {self.clipping.reason}"
                    f"; eps lower bound {self.epsilon_lower_bound:.3f}")
        if self._sampler_refused:
            return (f"VIOLATION: the canaries were not sampled as accounted (Poisson at rate "
                    f"{self.sampler.sample_rate:.4g}): their inclusions look like {self.sampler.looks_like}; "
                    f"eps lower bound {self.epsilon_lower_bound:.3f}")
        if self.claimed_epsilon is None:
            return f"empirical eps >= {self.epsilon_lower_bound:.3f} (no claimed eps given)"
        if self.violation:
            return (f"VIOLATION: empirical eps >= {self.epsilon_lower_bound:.3f} > claimed "
                    f"{self.claimed_epsilon:.4g}")
        return f"consistent with eps = {self.claimed_epsilon:.4g}"

    def resolves(self, fpr: float) -> bool:
        """Whether the ROC's non-members resolve this FPR (at least one of them above the threshold)."""
        return fpr * (self.roc.negatives or self.nonmembers) >= 1

    @property
    def _sampler_refused(self) -> bool:
        return self.sampler is not None and not self.sampler.poisson_accounting_valid

    @property
    def _clipping_refused(self) -> bool:
        return self.clipping is not None and self.clipping.refused

    @property
    def _noise_refused(self) -> bool:
        return self.noise is not None and self.noise.refused

    @property
    def _rate_refused(self) -> bool:
        return self.rate is not None and self.rate.refused

    def to_dict(self) -> dict:
        eps = self.epsilon_lower_bound
        return {
            "verdict": self.verdict,
            "violation": self.violation,
            "claimed_epsilon": self.claimed_epsilon,
            "epsilon_lower_bound": eps if math.isfinite(eps) else "inf",
            "headline": {"bound": self.headline, "why_valid": WHY[self.headline],
                         "valid_for": self.headline_bound.valid_for},
            "delta": self.delta, "alpha": self.alpha,
            "canaries": {"m": self.m, "members": self.members, "nonmembers": self.nonmembers,
                         "roc_negatives": self.roc.negatives or self.nonmembers},
            "score": {"name": self.score.name, "description": self.score.description},
            "auc": self.roc.auc,
            "tpr_at_fpr": {f"{k:g}": v for k, v in self.roc.tpr_at_fpr.items()},
            "tpr_at_fpr_withheld": {f"{k:g}": f"fewer than 1 / FPR = {1 / k:.0f} non-members: report.md does not show it"
                                    for k in self.roc.tpr_at_fpr if not self.resolves(k)},
            "tpr_interval": {f"{k:g}": list(v) for k, v in (self.roc.tpr_interval or {}).items()},
            "bounds": {k: b.to_dict() for k, b in self.bounds.items()},
            **({"unprotected_parameters": list(self.unprotected)} if self.unprotected else {}),
            **({"canary_sampler_audit": self.sampler.to_dict()} if self.sampler is not None else {}),
            **({"clipping_check": self.clipping.to_dict()} if self.clipping is not None else {}),
            **({"noise_check": self.noise.to_dict()} if self.noise is not None else {}),
            **({"rate_check": self.rate.to_dict()} if self.rate is not None else {}),
            **({"claim_ceiling": self.ceiling.to_dict(self.roc.tpr_at_fpr)} if self.ceiling is not None else {}),
            **({"refutable_ceiling": self.refutable if math.isfinite(self.refutable) else "inf"}
               if self.refutable is not None else {}),
        }


def refutable_bound(members, *, delta: float, alpha: float, guess_counts: list[int] | None = None, seed: int = 0,
                    score: str = "unnamed", headline: str = "auto", mechanism: str | None = None,
                    model=None) -> float:
    """The most an audit of this membership can report: its headline bound on perfect scores (every member above
    every non-member), the same guess counts, alpha split and headline rule. On perfect scores the membership
    matters only through how many members there are (every guess set of a size is as right wherever the members
    sit; a test holds it), so the answer is computed once per count, on the members first, and cached."""

    members = np.asarray(members, dtype=bool)
    key = (int(members.sum()), int(members.size), float(delta), float(alpha),
           None if guess_counts is None else tuple(guess_counts), seed, score, headline, mechanism, model)
    try:
        return _refutable_by_count(*key)
    except TypeError:   # an argument that cannot key a cache: computed as it is
        return _perfect_bound(members, *key[2:])


@lru_cache(maxsize=1024)
def _refutable_by_count(members: int, m: int, *rest) -> float:
    return _perfect_bound(np.arange(m) < members, *rest)


def _perfect_bound(members, delta, alpha, guess_counts, seed, score, headline, mechanism, model) -> float:
    counts = None if guess_counts is None else list(guess_counts)
    # every member above every non-member: the tied blocks stand for any order inside them (the guess sets cut
    # there are decided, guesses.decided with perfect), and the continuous bounds read them as the exact split
    return analyse(members.astype(float), members, delta=delta, alpha=alpha, guess_counts=counts, seed=seed,
                   score=score, headline=headline, mechanism=mechanism, model=model, _perfect=True).epsilon_lower_bound


def check_audit_parameters(alpha: float, delta: float, claimed_epsilon: float | None) -> None:
    check_alpha(alpha)
    check_delta(delta, allow_zero=True)
    check_claimed_epsilon(claimed_epsilon)


def choose_headline(score: Score, delta: float, headline: str = "auto", mechanism: str | None = None,
                    model=None) -> str:
    """The headline bound, fixed before the scores are seen. ``auto`` fits the mechanism: a Gaussian-shaped
    run (DP-SGD, Gaussian DP-ZO) headlines the Gaussian-family bounds, read through the run's own family
    (gaussian-run) where its rate and steps are known (``model``); a Laplace run, whose trade-off curve is
    not Gaussian, one valid for any (eps, delta)-DP mechanism (steinke at delta = 0, else fdp)."""
    if headline not in HEADLINES:
        raise DPAuditError(f"unknown headline bound {headline!r}; use {', '.join(HEADLINES)}")
    if headline == "auto":
        if delta == 0:
            return "steinke"
        if mechanism is not None and mechanism != "gaussian":
            return "fdp"
        if score.gaussian_sum:
            return "gaussian-run" if model is not None else "gaussian"
        return "fdp-gdp"
    if BOUNDS[headline].needs_delta and delta == 0:
        raise DPAuditError(f"the {headline} bound needs delta > 0 (a Gaussian curve has no finite pure eps)")
    if BOUNDS[headline].needs_run and model is None:
        raise DPAuditError(f"the {headline} bound needs a white-box run's rate, steps and scores (a run folder or a "
                           "probe's), not a score file")
    return headline


def analyse(scores, members, *, claimed_epsilon: float | None = None, delta: float = 0.0,
            alpha: float = 0.05, guess_counts: list[int] | None = None, seed: int = 0,
            score: str = "unnamed", headline: str = "auto", mechanism: str | None = None,
            ceiling=None, model=None, _perfect: bool = False) -> AuditResult:
    """Audit canary scores (higher = member). Guess counts and the headline rule are fixed before looking
    at the scores; each bound pays for the guess sets it tries (Bonferroni). ``ceiling``: the most TPR the claim
    allows (ceiling.run_ceiling, from the run's mechanism); by default the claim's own (eps, delta) region.
    ``model``: how white-box scores were formed from a Poisson-sampled Gaussian run (family.ScoreModel), for the
    gaussian-run bound."""

    check_audit_parameters(alpha, delta, claimed_epsilon)
    scores, members = check_scores(scores, members)
    m = len(scores)
    if delta * m >= 1:
        raise DPAuditError(f"delta = {delta:g} >= 1/m = {1 / m:.3g}: a claim with delta this large allows "
                           "leaking a canary outright, so no audit of m canaries can bound eps (vacuous)")
    kind = get_score(score)
    if model is not None and (not kind.gaussian_sum or (mechanism or "gaussian") != "gaussian"):
        model = None  # the family is a Gaussian run's white-box sums
    head = choose_headline(kind, delta, headline, mechanism, model)
    counts = GuessCounts(tuple(guess_counts) if guess_counts else None)
    resolved = counts.resolve(m)
    if resolved[0] < 1 or resolved[-1] > m:
        raise DPAuditError(f"guess counts must lie in [1, m={m}], got {resolved}")
    auditor = CanaryScoreAuditor.from_labels(scores, members, seed, model)
    auditor.perfect = _perfect
    n_in, n_out = int(members.sum()), int((~members).sum())
    bounds = {}
    for name, spec in BOUNDS.items():  # every bound the registry holds that applies here
        if spec.needs_delta and delta == 0:
            continue
        if spec.white_box_only and not ((kind.gaussian_sum or head == name) and min(n_in, n_out) >= 2):
            continue
        if spec.needs_run and model is None:
            continue
        bounds[name] = spec.compute(auditor, alpha, delta, counts)
    if head not in bounds:
        raise DPAuditError("the gaussian bound needs at least 2 members and 2 non-members")
    refutable = None if _perfect else refutable_bound(members, delta=delta, alpha=alpha, guess_counts=guess_counts,
                                                      seed=seed, score=score, headline=head, mechanism=mechanism,
                                                      model=model)
    return AuditResult(m=m, members=n_in, nonmembers=n_out, alpha=alpha, delta=delta,
                       claimed_epsilon=claimed_epsilon, score=kind, bounds=bounds, headline=head,
                       roc=summarise(scores, members), refutable=refutable,
                       ceiling=ceiling if ceiling is not None else claim_ceiling(claimed_epsilon, delta))
