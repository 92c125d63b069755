"""Phases (``mechanism.Phases``) composed in sequence on one grid.

Each phase is discretised on the one grid and composed T_i-fold (``compose.ComposedPLD``), and the phases'
composed PMFs are then multiplied, direction by direction: the composition of pessimistic PMFs on one grid is
pessimistic. The grid comes from the ladder (``ladder.py``), its first rung resolving the *narrowest* phase's
step loss range, refined until the bound has converged; so mixed phases are as tight as one (before: one fixed
grid, 6-8 % loose). Each phase's round-off is paid, and each multiplication's (``kernel._cross_round_off``).
"""

from __future__ import annotations

import math

from dpaudit.accounting.pld import kernel
from dpaudit.core import limits as budgets

class PhasedPLD:
    """Phases composed in sequence: each phase's T-fold PMFs (a ``ComposedPLD`` each, at the precision reading
    the answer needs), multiplied direction by direction on the common grid. Every phase's round-off is paid,
    and every multiplication's (``_cross_round_off``)."""

    def __init__(self, parts: list) -> None:  # compose.ComposedPLD each
        self.parts = parts
        self._totals: dict = {}

    def _compose_parts(self, delta: float | None = None) -> None:
        """Every phase's composed PMFs (at the precision reading eps at ``delta`` needs, when given), the ones
        composed so far counted against the memory budget before the next one composes: they stay held."""
        held = 0.0
        for i, part in enumerate(self.parts, 1):
            for key in part.single:
                if key not in part._pmfs:  # noqa: SLF001
                    budgets.current().require(held + kernel._fft_bytes(part.single[key], part.bounds[key]),
                                              f"composing phase {i} of {len(self.parts)}")
                part._composed(key, delta)  # noqa: SLF001
                if delta is not None:
                    part._recomposed(key, delta)  # noqa: SLF001
                held += 8.0 * len(kernel.probs(part._pmfs[key]))  # noqa: SLF001

    def _total(self, direction: str):
        if direction not in self._totals:
            self._compose_parts()
            pmfs = [part.pmfs[direction] for part in self.parts]
            total, noise = pmfs[0], sum(part.round_offs[direction] for part in self.parts)
            for other in pmfs[1:]:
                budgets.current().require(kernel.FFT_BYTES * (len(kernel.probs(total)) + len(kernel.probs(other))),
                                          "composing the phases")
                total = total.compose(other, tail_mass_truncation=kernel.TAIL_MASS_TRUNCATION)
                noise += kernel._cross_round_off(total)
            self._totals[direction] = (total, noise)
        return self._totals[direction]

    def settle(self, delta: float) -> None:
        """``ComposedPLD.settle`` for every phase, under the memory budget of all phases held together."""
        self._compose_parts(delta)
        self._totals.clear()

    def epsilons(self, delta: float) -> dict[str, float]:
        self.settle(delta)
        found = {}
        for direction in ("remove", "add"):
            total, noise = self._total(direction)
            found[direction] = kernel.epsilon_for_delta(total, delta - noise) if noise <= delta / 2 else math.inf
        return found

    def deltas(self, eps: float) -> dict[str, float]:
        found = {}
        for direction in ("remove", "add"):
            total, noise = self._total(direction)
            value = float(total.get_delta_for_epsilon(eps))
            if noise > kernel.ROUND_OFF_SHARE * value:  # the round-off matters next to this delta: long double parts
                self.settle(max(value, kernel.MIN_DELTA))
                total, noise = self._total(direction)
                value = float(total.get_delta_for_epsilon(eps))
            found[direction] = max(0.0, value + noise)
        return found
