"""The per-tensor noise check of a white-box gradient probe: does every released tensor carry the accounted noise?

Fact. A DP-SGD step releases, at each coordinate j, x_t = g_t + c_t + z_t: the clipped sum of the batch's gradients
g_t and of any sampled canary c_t (both fixed once the step's batch and the model before it are), plus fresh noise
z_t ~ N(0, s^2) with s = sigma x C, drawn independently of everything before. Given the past, (x_t / s)^2 is then a
noncentral chi-square with one degree of freedom, which is stochastically at least a central one; summed over the
n canary coordinates a tensor carries and the T steps, S = sum (x / s)^2 is stochastically at least chi2(n T)
(conditionally step by step, so whatever the data and however the run adapted to its past noise). The same holds
for the steps' differences x_t - x_{t-1} = z_t + (terms fixed before step t), whose sum of squares D over
(T - 1) n terms is at least chi2((T - 1) n): it cancels a data gradient that drifts slowly from step to step, which
the plain sum would take for noise.

Test. For each tensor, the lower-tail p-values of S and D against chi2; H0 (every release of the tensor carries at
least the accounted noise) is refused at level alpha_n when either is below alpha_n / (2 x tensors) (Bonferroni
over tensors and the two statistics). A refusal is a VIOLATION that names the tensor: the accountant's sigma does
not describe what that tensor's releases carry, whatever the eps bounds read (a tensor without noise leaks its
canaries' membership fully, yet holds only its share of the canaries). The audit pays for it:
alpha_n = alpha x NOISE_SHARE, the bounds the rest. s is the noise the claim is accounted with (the optimizer's
noise multiplier times the probe's clip norm, or ``noise_multiplier=`` given to a plain loop's probe); a probe that
does not know it says the check was not made.

Only full-precision releases are checked. In bf16 (fp16) the release is the clipped sum plus noise rounded to 8 (11)
bits: where the sum at a coordinate is some 256 (2048) times the noise or more, rounding can return the sum itself, a
post-processing that keeps DP but reads as noise missing. A tensor released in 16 bits is named as not checked.

Written here: two chi-square tails over memory-mapped columns; scipy gives the chi-square distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_record import unstamped
from dpaudit.core.safe_json import load_json_file

NOISE_SHARE = 0.05  # of alpha, where the check is made
TALLY = "noise_tally.json"  # an attached probe's direct measurement: each tensor's squared noise and steps measured
BLOCK_VALUES = 1 << 21  # transcript values read at a time


@dataclass(frozen=True)
class TensorNoise:
    name: str
    canaries: int
    ratio: float        # the measured noise std over the accounted one (the direct tally's where there is one, else
                        # sqrt of S / its degrees of freedom)
    ratio_diff: float   # the same from the steps' differences (sqrt of D / its degrees of freedom / 2)
    p_value: float      # the smaller lower-tail p-value of the two statistics
    blind: bool = False  # read from canaries alone, and the data's share there is as large as the noise itself
    direct: bool = False  # the noise itself measured (the probe's tally), not only the canaries' releases


@dataclass(frozen=True)
class NoiseCheck:
    alpha: float
    noise_std: float            # s = sigma x C, in the release's units
    tensors: tuple[TensorNoise, ...]
    statistics: int = 2         # per tensor: the canary columns' two, and the direct tally where there is one
    unchecked: tuple = ()       # tensors released in 16 bits: not checked (module doc)

    @property
    def level(self) -> float:
        return self.alpha / (self.statistics * max(1, len(self.tensors)))  # Bonferroni: tensors x statistics

    @property
    def _unchecked(self) -> str:
        if not self.unchecked:
            return ""
        names = ", ".join(self.unchecked[:3]) + (f" and {len(self.unchecked) - 3} more" if len(self.unchecked) > 3
                                                 else "")
        return (f"; {len(self.unchecked)} released in 16 bits not checked (rounding can swallow noise there and keep "
                f"DP): {names}")

    @property
    def missing(self) -> tuple[TensorNoise, ...]:
        return tuple(t for t in self.tensors if t.p_value < self.level)

    @property
    def refused(self) -> bool:
        return bool(self.missing)

    @property
    def reason(self) -> str:
        missing = self.missing
        names = ", ".join(f"{t.name} (noise measured {t.ratio:.3g}x the accounted)" for t in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return (f"{len(missing)} of {len(self.tensors)} trainable tensors were released with less than the accounted "
                f"noise (std {self.noise_std:.4g}): {names}{more}")

    @property
    def blind(self) -> tuple[TensorNoise, ...]:
        return tuple(t for t in self.tensors if t.blind and t.p_value >= self.level)

    @property
    def verdict(self) -> str:
        if self.refused:
            return f"noise missing: {self.reason}{self._unchecked}"
        if not self.tensors:
            return "no tensor checked" + self._unchecked
        measured = [t for t in self.tensors if t.direct]
        words = (f"no trainable tensor was released with less than the accounted noise (std {self.noise_std:.4g}; "
                 f"lowest measured {min(t.ratio for t in self.tensors):.3g}x)")
        if measured:
            words += f"; the noise itself measured on {len(measured)} of {len(self.tensors)}"
        if len(measured) < len(self.tensors):
            words += (f"; {len(self.tensors) - len(measured)} read from the canaries' releases alone, where a tensor "
                      "released without noise passes if the data's gradient at its canaries is as large as the noise "
                      "(give observe() the clipped sums, or attach to the Opacus optimizer, to measure the noise)")
        blind = self.blind
        if blind:
            names = ", ".join(f"{t.name} ({t.ratio:.3g}x)" for t in blind[:3])
            more = f" and {len(blind) - 3} more" if len(blind) > 3 else ""
            words += f"; as it is on {len(blind)}, so not shown either way: {names}{more}"
        return words + self._unchecked

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "refused": self.refused, "alpha": self.alpha, "noise_std": self.noise_std,
                "tensors": [{"name": t.name, "canaries": t.canaries, "noise_ratio": t.ratio,
                             "noise_ratio_differences": t.ratio_diff, "p_value": t.p_value,
                             "noise_measured": t.direct, "data_as_large_as_noise": t.blind} for t in self.tensors],
                "unchecked_16_bit": list(self.unchecked)}


def column_squares(releases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of the (steps, m) releases: the sum of squares, and the sum of squares of the steps'
    differences, read a block of steps at a time (memory O(block))."""
    steps, m = releases.shape
    block = max(2, BLOCK_VALUES // max(1, m))
    squares, diffs = np.zeros(m), np.zeros(m)
    last = None
    for start in range(0, steps, block):
        part = np.asarray(releases[start:start + block], float)
        squares += (part ** 2).sum(0)
        joined = part if last is None else np.vstack([last, part])
        diffs += (np.diff(joined, axis=0) ** 2).sum(0)
        last = part[-1:]
    return squares, diffs


def read_tally(folder: Path, run_id: str) -> dict | None:
    """A probe folder's per-tensor noise tally, checked; None where there is none (a plain loop's probe)."""

    path = Path(folder) / TALLY
    if not path.is_file():
        return None
    data = unstamped(TALLY, load_json_file(path, "noise tally", max_bytes=1 << 22), path)
    try:
        ok = (data["run_id"] == run_id and len(data["sizes"]) == len(data["squares"]) == len(data["steps"])
              and all(type(n) is int and n >= 0 for n in data["steps"])
              and all(type(n) is int and n > 0 for n in data["sizes"])
              and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in data["squares"]))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise DPAuditError(f"{path} is not as a probe of this run writes it")
    return data


def check(releases: np.ndarray, tensor_of: np.ndarray, names: list[str], noise_std: float,
          alpha: float, tally: dict | None = None, skipped: set | None = None) -> NoiseCheck:
    """``releases``: (steps, m) released values at the canary coordinates; ``tensor_of[i]``: the tensor canary i
    sits on (an index into ``names``); ``noise_std``: s, the accounted noise's std in the releases' units;
    ``tally``: the probe's direct measurement of each tensor's noise (read_tally), a third statistic where given:
    its sum of squares over s^2 is exactly chi2(size x steps) when the noise is as accounted. ``skipped``: the
    indices of tensors released in 16 bits (not checked, named)."""
    from scipy.stats import chi2

    steps = releases.shape[0]
    squares, diffs = column_squares(releases)
    direct = tally is not None and any(tally["steps"]) and len(tally["sizes"]) == len(names)
    statistics = 3 if direct else 2
    skipped = skipped or set()
    level = alpha / (statistics * max(1, len(set(tensor_of.tolist()) - skipped)))  # Bonferroni: tensors x statistics
    out = []
    for k, name in enumerate(names):
        cols = np.flatnonzero(tensor_of == k)
        if cols.size == 0 or k in skipped:
            continue
        n = cols.size * steps
        s = float(squares[cols].sum()) / noise_std ** 2
        p = float(chi2.cdf(s, n))
        # Blind: the data's own share (what is measured above the accounted noise) alone clears the refusal's
        # threshold, so a release without noise would pass as well.
        blind = s - n >= chi2.ppf(level, n)
        ratio_diff = math.nan
        if steps > 1:
            nd = cols.size * (steps - 1)
            d = float(diffs[cols].sum()) / noise_std ** 2
            p = min(p, float(chi2.cdf(d, nd)))
            blind = blind and d - 2 * nd >= chi2.ppf(level, nd)
            ratio_diff = math.sqrt(d / nd / 2)
        if direct and tally["steps"][k]:  # exact: the noise itself, every coordinate of the tensor
            nn = tally["sizes"][k] * tally["steps"][k]
            measured = tally["squares"][k] / noise_std ** 2
            p, blind, direct = min(p, float(chi2.cdf(measured, nn))), False, True
            ratio = math.sqrt(measured / nn)
        else:
            ratio, direct = math.sqrt(s / n), False
        out.append(TensorNoise(name=name, canaries=int(cols.size), ratio=ratio, ratio_diff=ratio_diff,
                               p_value=p, blind=bool(blind), direct=direct))
    return NoiseCheck(alpha=alpha, noise_std=float(noise_std), tensors=tuple(out), statistics=statistics,
                      unchecked=tuple(names[k] for k in sorted(skipped)))
