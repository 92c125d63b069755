"""Turn canary scores into the auditor's guesses: top scores guessed member, bottom guessed non-member.

Score direction is fixed in advance: higher score = more likely a member (score = -loss).
Ties are broken by a seeded random permutation, never by canary index (which could leak order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpaudit.core.errors import DPAuditError

DEFAULT_GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class Guesses:
    r: int          # guesses made (the rest abstain)
    correct: int    # v
    k_member: int   # top-scored canaries guessed "member"
    k_nonmember: int


def check_scores(scores, members) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=float)
    members = np.asarray(members)
    if scores.ndim != 1 or members.shape != scores.shape:
        raise DPAuditError("scores and membership must be 1-D and of equal length")
    if not np.all(np.isfinite(scores)):
        raise DPAuditError("scores contain NaN or infinity")
    if not np.isin(members, (0, 1, True, False)).all():
        raise DPAuditError("membership labels must be 0/1 (or true/false)")
    members = members.astype(bool)
    if members.sum() == 0:
        raise DPAuditError("no member canaries: the member set is empty")
    if (~members).sum() == 0:
        raise DPAuditError("no non-member canaries: every canary is a member")
    return scores, members


def ranking(scores: np.ndarray, seed: int = 0) -> np.ndarray:
    """Indices from highest to lowest score, ties in a seeded random order."""
    tiebreak = np.random.default_rng(seed).permutation(len(scores))
    return np.lexsort((tiebreak, -scores))


def decided(ranked_scores: np.ndarray, *cuts: int, perfect: bool = False) -> bool:
    """Whether the scores themselves choose the guess set cut from the ranking at ``cuts`` (the first k canaries;
    or the last m - k): not when the set is every canary (m guesses of one kind, whatever the scores), nor when a
    cut falls inside a run of tied scores (the seeded tie-break, not the model, picks who is in). A guess set the
    scores do not choose tests the membership coin alone; it stays in the count paid for and is scored as no right
    guess, so it can never raise a bound (all-tied scores give 0 whatever the number of members)."""
    m = len(ranked_scores)
    return all(0 < k < m and (perfect or ranked_scores[k - 1] != ranked_scores[k]) for k in cuts if k != 0)


def default_guess_counts(m: int) -> list[int]:
    """The r values tried by default, fixed before seeing scores; every one is paid for (Bonferroni)."""
    return sorted({max(1, int(round(f * m))) for f in DEFAULT_GUESS_FRACTIONS})


def make_guesses(order: np.ndarray, members: np.ndarray, r: int) -> Guesses:
    """Guess on r canaries: ceil(r/2) from the top of ``order`` as members, floor(r/2) from the bottom as not."""
    m = len(order)
    if not 1 <= r <= m:
        raise DPAuditError(f"number of guesses must be in [1, {m}], got {r}")
    k_member = (r + 1) // 2
    k_nonmember = r - k_member
    top = order[:k_member]
    bottom = order[m - k_nonmember:] if k_nonmember else order[:0]
    correct = int(members[top].sum() + (~members[bottom]).sum())
    return Guesses(r=r, correct=correct, k_member=k_member, k_nonmember=k_nonmember)


def roc_hull(scores: np.ndarray, members: np.ndarray) -> list[tuple[int, int, float]]:
    """One-sided guesses at the ROC convex-hull thresholds: (k guessed member, v of them right, threshold).

    A threshold t guesses "member" for every score >= t. Only the vertices of the ROC's upper convex
    hull are kept (a point on or under a chord is never the best test), from (0, 0) to (all, all), so
    the Bonferroni correction pays for exactly these.
    """
    order = np.argsort(-scores, kind="stable")
    s, mem = scores[order], members[order]
    last = np.flatnonzero(np.r_[s[1:] != s[:-1], True])  # last index of each distinct score
    k = np.r_[0, last + 1]
    v = np.r_[0, np.cumsum(mem)[last]]
    thresholds = np.r_[np.inf, s[last]]
    fp, tp = k - v, v
    hull: list[int] = []
    for i in range(len(k)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            cross = (fp[b] - fp[a]) * (tp[i] - tp[a]) - (tp[b] - tp[a]) * (fp[i] - fp[a])
            if cross >= 0:  # b is on or under the chord a-i
                hull.pop()
            else:
                break
        hull.append(i)
    return [(int(k[i]), int(v[i]), float(thresholds[i])) for i in hull]


@dataclass(frozen=True)
class Candidate:
    k: int            # guesses made (the rest abstain)
    v: int            # right guesses
    label: str        # threshold or guess count, for the report


ONE_SIDED_FRACTIONS = tuple(float(f) for f in np.geomspace(0.002, 1.0, 12))


@dataclass(frozen=True)
class TopGuesses:
    """One-sided: guess "member" for the k highest scores, k on a geometric grid of m fixed in advance
    (0.2 % ... 100 %, 12 counts). The guess sets depend on the ranking alone, never on the labels, so
    Bonferroni over the 12 holds exactly."""
    fractions: tuple[float, ...] = ONE_SIDED_FRACTIONS
    name = "one-sided, top-k for counts k on a geometric grid fixed in advance (at most 12; equal ones merged)"
    two_sided = False

    def candidates(self, scores: np.ndarray, members: np.ndarray, seed: int, perfect: bool = False) -> list[Candidate]:
        order = ranking(scores, seed)
        hits, ranked = np.cumsum(members[order]), scores[order]
        counts = sorted({min(len(scores), max(1, int(round(f * len(scores))))) for f in self.fractions})
        chosen = {k: decided(ranked, k, perfect=perfect) for k in counts}
        return [Candidate(k, int(hits[k - 1]) if chosen[k] else 0,
                          f"top {k}" + ("" if chosen[k] else " (not chosen by the scores: not scored)"))
                for k in counts]


@dataclass(frozen=True)
class HullThresholds:
    """One-sided: guess "member" above each ROC-convex-hull threshold, alpha split over the hull's vertices
    (the rule of jax_privacy). The hull is found with the labels, so this correction is not a union bound
    over label-free choices: at the null we measured 6.5 % (400 trials) and 9 % (200) false positives
    at alpha = 5 %. Reported for comparison, never the automatic headline."""
    name = "one-sided, ROC-hull thresholds (jax_privacy's rule)"
    two_sided = False

    def candidates(self, scores: np.ndarray, members: np.ndarray, seed: int, perfect: bool = False) -> list[Candidate]:
        # Every hull vertex is paid for, (0, 0) included (it can never win), as jax_privacy counts them; the last,
        # every canary guessed member, is not chosen by the scores (decided) and scores no right guess.
        m = len(scores)
        return [Candidate(k, v if k < m else 0, f"score >= {t:.6g}") for k, v, t in roc_hull(scores, members)]
