"""dpaudit's accounting as an Opacus accountant: ``PrivacyEngine(accountant="dpaudit-pld")``.

Opacus' own accountants ("rdp", "gdp", "prv") take the Poisson-subsampled Gaussian's remove
direction or an asymptotic approximation; this one answers with dpaudit's `pld` accountant: the
max of the add and the remove direction after composition, on a grid refined until converged
(an upper bound for add/remove neighbours). ``make_private_with_epsilon`` calibrates through it
too, because Opacus looks accountants up by this name.

History is kept as Opacus keeps it: (noise_multiplier, sample_rate, steps) entries, merged when
consecutive steps repeat the same pair. The adapter only turns that history into dpaudit's event (phases in
sequence, ``compose_phases``) and asks the registry: phases are accounted by `pld` on one grid refined until
converged, as tight as one phase, and below delta = 1e-12 by `rdp`, as one phase is.

Opacus' ``get_noise_multiplier`` (behind ``make_private_with_epsilon``) bisects sigma on one accountant,
resetting its history to one phase each time. The first such evaluation runs the full refinement ladder;
later ones with the same (p, T, delta) and a sigma within ``REUSE`` of a laddered one reuse its converged
resolution (the grid as a fraction of one step's loss range) on a single grid, as ``calibrate`` does: every
evaluation is still an upper bound, and as tight as the ladder's (far from the laddered sigma the resolution
the ladder found is not the one needed, so a new ladder runs there).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from opacus.accountants.accountant import IAccountant
from opacus.accountants.registry import register_accountant

from dpaudit.accounting import Mechanism, pld
from dpaudit.accounting.mechanism import MAX_PHASES, compose_phases
from dpaudit.accounting.registry import epsilon as account
from dpaudit.accounting.unit import EXAMPLE, Unit

MECHANISM = "dpaudit-pld"
REUSE = 1.1  # a laddered resolution serves sigmas within this factor


class DpauditAccountant(IAccountant):
    """Opacus ``IAccountant`` backed by dpaudit's add/remove PLD accounting. ``unit``: whose privacy (accounting/
    unit.py; default one example): a user-level unit accounts each step for a user's k records (ELS: the Binomial
    mixture; ULS: the history's rate is the users')."""

    def __init__(self, unit: Unit = EXAMPLE) -> None:
        self.unit = unit
        self.history: list[tuple[float, float, int]] = []
        self._resolution: dict = {}  # (p, T, delta) -> {sigma: converged grid / step loss range}, from ladders

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        if self.history and tuple(self.history[-1][:2]) == (noise_multiplier, sample_rate):
            sigma, p, steps = self.history[-1]
            self.history[-1] = (sigma, p, steps + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    def get_epsilon(self, delta: float, **kwargs) -> float:
        if not self.history:
            return 0.0
        event = compose_phases([replace(m, unit=self.unit) for m in _at_most_max_phases(self.history)])
        if not isinstance(event, Mechanism) or delta < pld.MIN_DELTA:
            return account(event, delta, "pld").epsilon
        laddered = self._resolution.setdefault((event.sampling_rate, event.steps, delta), {})
        near = [s for s in laddered if max(s, event.sigma) / min(s, event.sigma) <= REUSE]
        if near:
            ratio = laddered[min(near, key=lambda s: abs(s - event.sigma))]
            grid = min(pld.MAX_GRID, ratio * pld.step_loss_range(event, delta))
            return account(event, delta, "pld", pld.PldOptions(grid=grid)).epsilon
        result = account(event, delta, "pld")
        if result.accountant == "pld":
            laddered[event.sigma] = pld.converged_grid(event, delta, result) / pld.step_loss_range(event, delta)
        return result.epsilon

    def __len__(self) -> int:
        return sum(steps for _, _, steps in self.history)

    @classmethod
    def mechanism(cls) -> str:
        return MECHANISM


def _at_most_max_phases(history) -> list[Mechanism]:
    """The history as phases, at most MAX_PHASES distinct ones: a per-step noise schedule (refused past
    1000) has each step's sigma rounded down and p rounded up to a geometric grid, coarser until the distinct
    pairs fit. Rounding that way only adds privacy loss (a smaller sigma is the larger one's output plus
    noise removed; a larger Poisson rate q' subsampled again at q / q' is the rate q), so eps stays an upper
    bound; with at most MAX_PHASES distinct pairs nothing is rounded."""

    merged: Counter = Counter()
    for s, p, t in history:
        merged[(float(s), float(p))] += int(t)
    ratio = 1.001
    while len(merged) > MAX_PHASES:
        down = lambda x: ratio ** math.floor(math.log(x, ratio))  # noqa: E731
        up = lambda x: min(1.0, ratio ** math.ceil(math.log(x, ratio)))  # noqa: E731
        coarse: Counter = Counter()
        for (s, p), t in merged.items():
            coarse[(min(s, down(s)), max(p, up(p)))] += t
        merged, ratio = coarse, ratio ** 2
    return [Mechanism("gaussian", s, p, t) for (s, p), t in merged.items()]


register_accountant(MECHANISM, DpauditAccountant, force=True)  # idempotent: importing twice re-registers
