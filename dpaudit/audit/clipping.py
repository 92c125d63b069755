"""The per-example clipping check of a white-box probe whose canaries enter as examples (``canary_examples``).

Fact. Per-example clipping at C maps every example whose gradient is larger than C to norm exactly C, so two
canaries of sizes gain x C and SIZE_RATIO x gain x C (gain >= 1) add the same +C along their own coordinates:
whatever the rest of the batch, the noise or the data's gradients there, the mean signed contribution of a sampled
canary is the same for both sizes. A loop that clips the batch's summed gradient instead (one example can then
move the release by 2C: the true eps is that of sigma / 2), clips at a norm above the stated C, or does not clip,
makes the larger canaries move the release more.

Test. The probe tallies, for each size, the sampled member canaries' signed contributions (count, sum, sum of
squares, in units of C). H0 (per-example clipping at a norm <= gain x C): equal means. The one-sided Welch z of
large minus small rejects H0 at level alpha_c when z > Phi^-1(1 - alpha_c) (normal approximation: thousands of
sampled canaries a run). A rejection is a VIOLATION: the sensitivity the claim is accounted with does not hold,
whatever the eps bounds read (the one-run bounds cannot show this bug: with the batch's sum clipped to C, m
canaries share C a step, so each looks more private than under correct clipping). The audit pays for it:
alpha_c = alpha x CLIP_SHARE, the bounds the rest.

Power. Under batch-sum clipping the k large canaries of a step share at most C of the clipped sum, each at most
about C / sqrt(k), while the noise gives each observation a standard deviation near sigma C; over T steps (k T / 2
observations of each size) the z-statistic then reaches at most about sqrt(T / 2) / sigma, whatever the canaries'
sizes or number. The check says that reach beside a "consistent" answer: it catches batch-sum clipping reliably only
where the reach clears the threshold by about 1.3 (90 % power), e.g. T = 200 needs sigma <= 2.0 at alpha_c 0.005
(measured: at eps 1, sigma 3.59, T 200 it read z 2.35, 1.71, 1.21 over three seeds; its reach
there is 2.8).

Written here: a two-sample z on tallies; scipy gives the normal quantile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_record import unstamped
from dpaudit.core.safe_json import load_json_file

TALLY = "clipping_check.json"  # the probe's tally beside its transcript (0600: made from the members)
CLIP_SHARE = 0.1   # of alpha, where the check is made
MIN_SAMPLED = 30   # sampled canaries of each size needed to test


@dataclass(frozen=True)
class ClippingCheck:
    alpha: float
    small: tuple[float, float, float]   # count, mean, standard deviation (units of C)
    large: tuple[float, float, float]
    size_ratio: float
    z: float | None                     # None: too few sampled canaries to test
    steps: int = 0                      # steps tallied (for the check's reach)

    @property
    def refused(self) -> bool:
        from scipy.stats import norm

        return self.z is not None and self.z > float(norm.isf(self.alpha))

    @property
    def verdict(self) -> str:
        if self.z is None:
            return (f"not tested: {int(self.small[0])} and {int(self.large[0])} sampled canaries of each size (at "
                    f"least {MIN_SAMPLED} each are needed)")
        if self.refused:
            return f"not per-example clipping: {self.reason}"
        return f"consistent with per-example clipping: {self._measured}{self._reach}"

    @property
    def reach(self) -> float | None:
        """The largest z a loop that clips the batch's sum could give here: about sqrt(T / 2) / sd (module doc)."""
        sd = max(self.small[2], self.large[2])
        return math.sqrt(self.steps / 2) / sd if self.steps and sd > 0 else None

    @property
    def _reach(self) -> str:
        from scipy.stats import norm

        reach = self.reach
        if reach is None:
            return ""
        needed = float(norm.isf(self.alpha)) + 1.28
        return (f"; against a loop that clips the batch's sum it could reach z = {reach:.2f} here"
                + ("" if reach >= needed else f", short of the {needed:.2f} that catches it 9 times in 10: not shown "
                                               "either way (more steps, or less noise, give it the power)"))

    @property
    def _measured(self) -> str:
        return (f"canaries {self.size_ratio:g}x larger moved the release by {self.large[1]:.3g} C on average against "
                f"{self.small[1]:.3g} C (z = {self.z:.2f}, one-sided at alpha {self.alpha:g})")

    @property
    def reason(self) -> str:
        """What the check read and what a refusal means (the audit's VIOLATION verdict quotes it)."""
        return (f"{self._measured}; clipping each example at C gives both sizes the same contribution, so the "
                "sensitivity the claim is accounted with does not hold (a loop that clips the batch's sum, clips "
                "above C, or does not clip)")

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "refused": self.refused, "alpha": self.alpha, "z": self.z, "reach": self.reach,
                "size_ratio": self.size_ratio,
                "small": dict(zip(("sampled", "mean_x_C", "sd_x_C"), self.small)),
                "large": dict(zip(("sampled", "mean_x_C", "sd_x_C"), self.large))}


def read_tally(folder: Path, run_id: str) -> dict | None:
    """A probe folder's clipping tally (probe.CLIP_TALLY), checked; None where there is none (the canaries were
    added after the loop's clipping, or the folder is older than the check)."""

    path = Path(folder) / TALLY
    if not path.is_file():
        return None
    data = unstamped(TALLY, load_json_file(path, "clipping check tally", max_bytes=1 << 16), path)
    try:
        ok = (data["run_id"] == run_id and all(len(data[k]) == 3 and all(isinstance(v, (int, float)) and
              math.isfinite(v) for v in data[k]) for k in ("small", "large"))
              and float(data["size_ratio"]) > 1 and data["small"][0] >= 0 and data["large"][0] >= 0)
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise DPAuditError(f"{path} is not as a probe of this run writes it")
    return data


def check(tally: dict, alpha: float) -> ClippingCheck:
    def summary(t):
        n, total, squares = (float(v) for v in t)
        mean = total / n if n else 0.0
        var = max(squares / n - mean * mean, 0.0) * n / (n - 1) if n > 1 else 0.0
        return n, mean, math.sqrt(var)

    small, large = summary(tally["small"]), summary(tally["large"])
    z = None
    if min(small[0], large[0]) >= MIN_SAMPLED:
        se = math.sqrt(small[2] ** 2 / small[0] + large[2] ** 2 / large[0])
        diff = large[1] - small[1]
        z = diff / se if se > 0 else (math.inf if diff > 0 else 0.0)
    return ClippingCheck(alpha=alpha, small=small, large=large, size_ratio=float(tally["size_ratio"]), z=z,
                         steps=int(tally.get("steps") or 0))
