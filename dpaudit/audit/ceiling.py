"""The claim's own ceiling: the most TPR at a given FPR that any membership test can reach against a run that meets
its claim, so that a reviewer sees how close the attack came to what the claim allows.

Theorem (Kairouz, Oh & Viswanath 2015; Dong, Roth & Su 2022, Prop. 2.11): a mechanism is (eps, delta)-DP if and only
if every test of "member" against "non-member" has

    TPR <= min(1, e^eps FPR + delta, 1 - e^-eps (1 - delta - FPR))          (the (eps, delta) region)

A mechanism whose privacy profile delta(eps) holds at every eps is in every such region at once, so

    TPR <= inf over eps of the right-hand side at delta(eps),

which is the exact trade-off of its dominating pair (Zhu, Dong & Wang 2022, Thm. 8). Any eps grid gives an upper
bound on the TPR (each point is a valid region); a finer one is only tighter. delta(eps) is the pld accountant's
pessimistic composed PLD, the max of both directions plus its FFT round-off, itself an upper bound: so every
ceiling here is an upper bound on the TPR the claim allows, never an estimate.

Two sources, said in every answer:
- ``run``: the run's own mechanism (noise, sampler, sigma, p, T) through the composed PLD: the tight ceiling.
- ``claim``: only (eps, delta) is known (an audit of scores alone, a group claim for repeated canaries, a mechanism
  the pld accountant does not cover): the pure (eps, delta) region, looser than the run's own curve.

Written here because dp-accounting 0.6 (pinned) has no trade-off or TPR read-out of a PLD (``get_true_positive_
rates`` came later); the region is three lines and the PLD is ours (accounting/pld.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dpaudit.accounting import pld
from dpaudit.core.errors import DPAuditError

# where the ceiling is computed: the reported FPRs exactly, and enough points to draw the plot's forbidden region
CURVE_FPRS = np.unique(np.concatenate([[0.0, 0.001, 0.01, 0.1], np.geomspace(1e-4, 1.0, 120)]))
EPS_POINTS = 160                                                     # the eps grid the infimum runs over


@dataclass(frozen=True)
class Ceiling:
    source: str                         # "run" or "claim"; "none" when there is no ceiling
    words: str                          # what it was computed from, or why there is none
    fpr: np.ndarray = field(repr=False, default_factory=lambda: CURVE_FPRS)
    tpr: np.ndarray | None = field(repr=False, default=None)  # the largest TPR allowed at each fpr (None: none)

    def at(self, fpr: float) -> float | None:
        return None if self.tpr is None else float(_on_curve(self, fpr))

    def to_dict(self, measured: dict[float, float]) -> dict:
        if self.tpr is None:
            return {"source": "none", "why": self.words}
        rows = {}
        for x, got in measured.items():
            most = self.at(x)
            rows[f"{x:g}"] = {"max_tpr": most, "measured_tpr": got,
                              "share": got / most if most > 0 else None}
        return {"source": self.source, "computed_from": self.words, "guarantee": "upper bound on the TPR a test can "
                "reach against any run that meets the claim", "tpr_at_fpr": rows}


def region(eps: float, delta: float, fpr) -> np.ndarray:
    """The largest TPR at ``fpr`` that (eps, delta)-DP allows (both inequalities of the region)."""
    fpr = np.asarray(fpr, dtype=float)
    if math.isinf(eps):
        return np.ones_like(fpr)
    grow = np.exp(min(eps, 700.0))
    return np.clip(np.minimum.reduce([np.ones_like(fpr), grow * fpr + delta,
                                      1.0 - (1.0 - delta - fpr) / grow]), 0.0, 1.0)


def profile_ceiling(delta_of, fprs, eps_max: float) -> np.ndarray:
    """inf over an eps grid in [0, eps_max] of the region at delta_of(eps): an upper bound on the TPR."""
    grid = np.concatenate([[0.0], np.geomspace(max(eps_max, 1e-3) * 1e-3, max(eps_max, 1e-3), EPS_POINTS - 1)])
    best = np.ones(len(fprs))
    for eps in grid:
        best = np.minimum(best, region(eps, min(1.0, delta_of(float(eps))), fprs))
    return best


def claim_ceiling(eps: float | None, delta: float, words: str | None = None) -> Ceiling:
    """The pure (eps, delta) region of a claim (no mechanism known)."""
    if eps is None:
        return Ceiling("none", "no claim: nothing to set the measured TPR beside")
    if not math.isfinite(eps):
        return Ceiling("none", "the claim is eps = inf: it forbids no TPR")
    return Ceiling("claim", words or f"the (eps, delta) region of the claim eps = {eps:.4g}, delta = {delta:g} "
                   "(no mechanism given: looser than a run's own curve)", tpr=region(eps, delta, CURVE_FPRS))


def run_ceiling(mech, delta: float, claimed_eps: float, fprs=()) -> Ceiling:
    """The run's mechanism through the pld accountant's composed PLD; where it does not cover the mechanism (or
    the PLD does not fit the budget), the claim's region instead, saying why. ``fprs``: more points to compute it
    at exactly (the curve is read at the next point up between them)."""

    at = np.unique(np.concatenate([CURVE_FPRS, np.asarray(fprs, dtype=float)]))
    try:
        composed = pld.composed_pld(mech, pld.first_grid(mech, delta), pessimistic=True, delta=delta)
        tpr = profile_ceiling(composed.get_delta_for_epsilon, at, 2.0 * claimed_eps + 4.0)
    except (DPAuditError, ValueError, NotImplementedError, MemoryError) as exc:
        return claim_ceiling(claimed_eps, delta, f"the (eps, delta) region of the claim (the run's own PLD is not "
                                                 f"available: {str(exc).splitlines()[0][:160]})")
    # The claim (eps, delta) is itself one point of the run's profile: never looser than the claim's region.
    tpr = np.minimum(tpr, region(claimed_eps, delta, at))
    return Ceiling("run", f"the run's composed PLD ({mech.describe()}; pessimistic, max of add and remove), "
                          f"inf over eps of the (eps, delta(eps)) regions", fpr=at, tpr=tpr)


def _on_curve(ceiling: Ceiling, fpr: float) -> float:
    """The ceiling at ``fpr``, read on the safe side: the curve's value at the next grid point at or above it (the
    ceiling rises with the FPR; the reported FPRs are grid points, so they are read exactly)."""
    i = int(np.searchsorted(ceiling.fpr, fpr, side="left"))
    return float(ceiling.tpr[min(i, len(ceiling.tpr) - 1)])
