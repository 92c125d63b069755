"""The privacy plan of a run, built once: mechanism (noise kind, sigma, p, T), delta, accountant and the
calibration that chose sigma. The trainer's noise and the ledger both take it from here, so what is
claimed and what is added cannot drift apart (a planted bug changes the noise, never the claim).
A run resumed on other data is several phases (``phases``: the ledger step each began at, and its sampling
rate), composed in sequence by the accountant (``accounting.mechanism.compose_phases``). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from dpaudit.accounting import Mechanism, calibrate_sigma, epsilon, pld
from dpaudit.accounting.mechanism import compose_phases
from dpaudit.training.bugs import NO_BUG, Bug
from dpaudit.accounting.matrix import bandmf, single
from dpaudit.accounting.matrix.single import sensitivity
from dpaudit.accounting.samplers import scheme
from dpaudit.accounting.unit import EXAMPLE, Unit


@lru_cache(maxsize=32)
def _calibrated_sigma(template: Mechanism, target_epsilon: float, delta: float, accountant: str | None) -> float:
    """The calibrated sigma of one run's schedule, computed once: a run's plan is built where its recipe needs the
    noise (audit run's DP-ZO rate) and again where training starts, from the same settings (the calibration is a
    deterministic search, so a repeat would give the same sigma)."""
    return calibrate_sigma(template, target_epsilon, delta, accountant).sigma


@dataclass(frozen=True)
class PrivacyPlan:
    mechanism: Mechanism | None      # None: a non-private run
    delta: float
    accountant: str | None
    target_epsilon: float            # inf for non-private
    calibrated: bool                 # sigma chosen by calibration (else given)
    phases: tuple[tuple[int, float], ...] = ()  # (first ledger step, sampling rate) of each phase; () = one
    # correlated noise resumed from checkpoints: (first step, end step, parent) of each attempt in the order they
    # ran, the running one last with end None (accounting/matrix/bandmf.py: resumed_epsilon); () = never resumed
    attempts: tuple = ()

    @property
    def private(self) -> bool:
        return self.mechanism is not None

    @property
    def sigma(self) -> float | None:
        return self.mechanism.sigma if self.mechanism else None

    @classmethod
    def build(cls, *, kind: str, rate: float, steps: int, delta: float, target_epsilon: float,
              sigma: float | None, accountant: str | None, bug: Bug = NO_BUG, sampling: str = "poisson",
              examples: int | None = None, strategy=None, unit: Unit = EXAMPLE) -> "PrivacyPlan":
        if sigma is None and not math.isfinite(target_epsilon):
            return cls(None, delta, None, math.inf, False)
        calibrated = sigma is None
        # the planted "example-level-claim": the unit dropped from the plan, so the claim is a record's
        template = replace(_template(kind, rate, steps, sampling, examples), strategy=strategy,
                           unit=EXAMPLE if bug.example_level else unit)
        if calibrated:
            sigma = (_remove_only_sigma(template, target_epsilon, delta) if bug.remove_only
                     else _calibrated_sigma(template, target_epsilon, delta, accountant))
        return cls(template.with_sigma(sigma), delta, accountant, target_epsilon, calibrated)

    def noise_sigma(self, bug: Bug = NO_BUG) -> float:
        """The noise multiplier the trainer adds: the plan's, unless a planted bug scales it. A BLT strategy's sigma
        is relative to its sensitivity under the sampler's participation (accounting/matrix/single.py), so the
        trainer adds sigma x that; BandMF under cyclic Poisson has sensitivity 1."""
        if self.mechanism is None:
            return 0.0
        scale = 1.0
        if self.mechanism.strategy is not None and self.mechanism.strategy.family == "blt":
            scale = sensitivity(self.mechanism)
        return self.mechanism.sigma * scale * bug.noise_scale

    def in_phases(self, phases: tuple[tuple[int, float], ...]) -> "PrivacyPlan":
        return replace(self, phases=tuple(phases))

    def event_at(self, steps: int):
        """What ``steps`` ledger steps released: the plan's mechanism, or each phase's share of them."""
        if not self.phases:
            return self.mechanism.with_steps(steps)
        parts = []
        for i, (first, rate) in enumerate(self.phases):
            last = self.phases[i + 1][0] if i + 1 < len(self.phases) else math.inf
            taken = int(min(steps, last) - first)
            if taken > 0:
                parts.append(Mechanism(self.mechanism.kind, self.mechanism.sigma, rate, taken,
                                       unit=self.mechanism.unit))
        return compose_phases(parts)

    def epsilon_at(self, steps: int):
        if self.attempts and self.mechanism.strategy.family == "blt":
            return single.resumed_epsilon(self.mechanism, len(self.attempts_at(steps)), self.delta)
        if self.attempts:
            return bandmf.resumed_epsilon(self.mechanism, self.attempts_at(steps), self.delta)
        return epsilon(self.event_at(steps), self.delta, self.accountant)

    def attempts_at(self, steps: int) -> list:
        """The attempts' released rows after ``steps`` ledger steps (each attempt's steps follow the last's)."""
        out, left = [], steps
        for first, end, parent in self.attempts:
            if out and left <= 0:
                break
            taken = min(left, (end - first) if end is not None else left)
            out.append((first, first + taken, parent))
            left -= taken
        return out


def _template(kind: str, rate: float, steps: int, sampling: str, examples: int | None) -> Mechanism:
    """The run's event at sigma 1: Poisson at rate p, or a sampler that needs B and N (B = round(p N))."""

    if not scheme(sampling).needs_sizes:
        return Mechanism(kind, 1.0, rate, steps, sampling)
    return Mechanism(kind, 1.0, rate, steps, sampling, max(1, round(rate * examples)), examples)


def _remove_only_sigma(template: Mechanism, target: float, delta: float) -> float:
    """The planted bug "remove-only": the smallest sigma whose *remove* direction alone meets the target.
    It lies below the correct sigma (max of both directions), so the search starts there and only goes
    down by halves: never near the tiny sigmas whose PLDs would not fit in memory."""
    from scipy import optimize

    def gap(log_sigma: float) -> float:
        res = pld.epsilon(template.with_sigma(math.exp(log_sigma)), delta)
        return res.directions.get("remove", res.epsilon) - target

    hi = math.log(calibrate_sigma(template, target, delta, "pld").sigma)
    if gap(hi) > 0:
        return math.exp(hi)
    lo = hi
    for _ in range(4):
        lo -= math.log(2)
        if gap(lo) > 0:
            return math.exp(optimize.brentq(gap, lo, hi, xtol=1e-4))
    return math.exp(lo)
