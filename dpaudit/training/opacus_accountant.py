"""dpaudit's accounting as an Opacus accountant: ``PrivacyEngine(accountant="dpaudit-pld")``.

Opacus' own accountants ("rdp", "gdp", "prv") take the Poisson-subsampled Gaussian's remove
direction or an asymptotic approximation; this one answers with dpaudit's `pld` accountant: the
max of the add and the remove direction after composition, on a grid refined until converged
(an upper bound for add/remove neighbours). ``make_private_with_epsilon`` calibrates through it
too, because Opacus looks accountants up by this name.

History is kept as Opacus keeps it: (noise_multiplier, sample_rate, steps) entries, merged when
consecutive steps repeat the same pair. A history with several different pairs is composed
direction by direction on one common grid (dp-accounting's PMF composition).
"""

from __future__ import annotations

import math

from opacus.accountants.accountant import IAccountant
from opacus.accountants.registry import register_accountant

from dpaudit.accounting import Mechanism, pld
from dpaudit.accounting.registry import epsilon as account

MECHANISM = "dpaudit-pld"


class DpauditAccountant(IAccountant):
    """Opacus ``IAccountant`` backed by dpaudit's add/remove PLD accounting."""

    def __init__(self) -> None:
        self.history: list[tuple[float, float, int]] = []

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, p, steps = self.history[-1]
            self.history[-1] = (sigma, p, steps + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    def get_epsilon(self, delta: float, **kwargs) -> float:
        if not self.history:
            return 0.0
        merged: dict[tuple[float, float], int] = {}
        for sigma, p, steps in self.history:
            merged[(sigma, p)] = merged.get((sigma, p), 0) + steps
        if len(merged) == 1:
            (sigma, p), steps = next(iter(merged.items()))
            return account(Mechanism("gaussian", float(sigma), float(p), int(steps)), delta, "pld").epsilon
        return _heterogeneous_epsilon(merged, delta)

    def __len__(self) -> int:
        return sum(steps for _, _, steps in self.history)

    @classmethod
    def mechanism(cls) -> str:
        return MECHANISM


def _heterogeneous_epsilon(parts: dict[tuple[float, float], int], delta: float) -> float:
    """Different (sigma, p) phases: each direction's composed PMFs multiplied together on one grid (the
    finest any phase's first refinement rung would use), then eps at delta; pessimistic throughout."""
    mechs = [Mechanism("gaussian", float(s), float(p), int(t)) for (s, p), t in parts.items()]
    grid = min(min(pld.MAX_GRID, pld.step_loss_range(m, delta) / pld.POINTS_PER_STEP) for m in mechs) / pld.REFINE
    composed = [pld.composed_pld(m, grid, delta=delta) for m in mechs]
    for part in composed:
        part.settle(delta)  # in long double where a part's FFT round-off matters at delta
    worst = 0.0
    for direction in ("remove", "add"):
        total = composed[0].pmfs[direction]
        for other in composed[1:]:
            total = total.compose(other.pmfs[direction], tail_mass_truncation=pld.TAIL_MASS_TRUNCATION)
        noise = sum(part.round_offs[direction] for part in composed)  # each part's round-off, paid for
        worst = max(worst, math.inf if noise > delta / 2 else pld.epsilon_for_delta(total, delta - noise))
    return worst


register_accountant(MECHANISM, DpauditAccountant, force=True)  # idempotent: importing twice re-registers
