"""What an audit of m canaries can refute, known before any training: the largest eps lower bound it could ever
report (every guess right), and the smallest m whose audit could exceed a claim.

With every guess right, each one-run bound (Steinke, Nasr & Jagielski 2023; the f-DP bounds of Mahloujifar et al.)
reaches its ceiling for the guess counts it tries, having paid alpha over them (Bonferroni). A claim at or above it cannot be refuted by this audit whatever the run leaks: "consistent" would then
say nothing, and the user should hear so before spending a training run on it.
"""

from __future__ import annotations

import math

import numpy as np

from dpaudit.audit.analysis import refutable_bound

MAX_CANARIES = 100_000  # the most canaries a manifest holds (canaries.manifest; that layer is above this one)


def most_certifiable(m: int, delta: float, alpha: float, score: str = "neg-loss",
                     mechanism: str | None = None) -> float:
    """The largest eps the audit's headline bound can report with m canaries: the audit itself (``analyse``, the
    same guess counts, alpha split and headline rule) run on scores that put every member above every non-member,
    so every guess is right. An oracle, not a formula beside the audit, so the two cannot drift apart."""

    return float(refutable_bound(np.arange(m) % 2 == 0, delta=delta, alpha=alpha, score=score, mechanism=mechanism))


def smallest_m(claimed: float, delta: float, alpha: float, most: int = MAX_CANARIES) -> int | None:
    """The fewest canaries (from 4) whose audit could report a bound above ``claimed`` (None: not even ``most``, or
    m below 1 / delta, where a claim's delta no longer allows leaking a canary outright). The ceiling grows with m,
    so a doubling bracket and a bisection find it."""
    if delta > 0:
        most = min(most, math.ceil(1 / delta) - 1)
    if most < 4:
        return None
    if most_certifiable(4, delta, alpha) > claimed:
        return 4
    lo, hi = 4, min(8, most)
    while most_certifiable(hi, delta, alpha) <= claimed:
        if hi >= most:
            return None
        lo, hi = hi, min(most, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if most_certifiable(mid, delta, alpha) <= claimed else (lo, mid)
    return hi


def power_note(m: int, claimed: float | None, delta: float, alpha: float) -> str | None:
    """One line when m canaries cannot refute the claim, naming the smallest m that could; else None."""
    if claimed is None or m < 4 or delta * m >= 1:
        return None
    ceiling = most_certifiable(m, delta, alpha)
    if ceiling > claimed:
        return None
    need = smallest_m(claimed, delta, alpha)
    fix = f"the smallest m that could is {need}" if need else f"no m up to {MAX_CANARIES} could"
    return (f"m = {m} canaries can certify at most eps {ceiling:.3g} at alpha = {alpha:g}, not above the claim eps = "
            f"{claimed:.4g}: this audit cannot refute it whatever the run leaks; {fix}")
