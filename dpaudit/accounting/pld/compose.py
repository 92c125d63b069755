"""One step's PLD on a grid, and its T-fold composition (``ComposedPLD``), reused across T (``StepsCurve``).

A step is discretised by dp-accounting (pessimistic: connect-the-dots; optimistic: privacy buckets) on one
grid, with ``noises`` choosing the mechanism; its tail beyond ``_log_mass_truncation`` goes to the infinite
loss. Composition is ``kernel.SelfComposition``: one transform of the step, a power and an inverse per T.

Bounded: before each allocation the step's memory is estimated (``STEP_BYTES`` a grid point per direction) and
the composition's (the FFT length from the Chernoff window, ``kernel.FFT_BYTES`` a point) against the active
``budget.Budget``.
"""

from __future__ import annotations

import math

from dpaudit.accounting.mechanism import Mechanism, Phases
from dpaudit.accounting.noises import noise
from dpaudit.accounting.pld import kernel
from dpaudit.accounting.pld.phases import PhasedPLD
from dpaudit.core import limits as budgets

Event = Mechanism | Phases

STEP_BYTES = 110         # measured: building one direction's single-step PMF, per grid point
CURVE_STEPS = 10**8      # a StepsCurve's step is truncated for this many steps: valid for any T up to it


def _log_mass_truncation(mech: Mechanism, delta: float) -> float:
    """Per-step noise tail truncated into the infinite loss: dp-accounting's e^-50, or less so that
    T steps together stay below 1e-4 delta."""
    return min(-50.0, math.log(max(delta, 1e-300) * 1e-4 / mech.steps))


def _adjacencies(mech: Event):
    from dp_accounting.pld import privacy_loss_mechanism as plm

    kinds = [plm.AdjacencyType.REMOVE]
    return kinds if all(m.sampling_rate == 1.0 for m in mech.phases) else kinds + [plm.AdjacencyType.ADD]


def _as_composed(mech: Mechanism) -> Mechanism:
    """What is discretised and composed: T Gaussian steps at p = 1 are exactly one Gaussian step with
    sigma / sqrt(T) (both privacy loss distributions are N(T / 2 sigma^2, T / sigma^2)), so no FFT is
    needed; composing 1e7 copies of so narrow a step left FFT round-off above delta = 1e-10 (eps = inf).
    An ELS step at p = 1 holds all k records of the user: the example-level step at sensitivity k, sigma / k."""
    if mech.group > 1 and mech.sampling_rate == 1.0:
        mech = Mechanism(mech.kind, mech.sigma / mech.group, 1.0, mech.steps)
    composed = noise(mech.kind).composed_sigma
    if composed is None or mech.sampling_rate < 1.0 or mech.steps == 1:
        return mech
    return Mechanism(mech.kind, composed(mech.sigma, mech.steps), 1.0, 1)


def step_loss_range(mech: Event, delta: float) -> float:
    """Width of one step's discretised privacy-loss range (the widest direction), from dp-accounting's
    connect-the-dots bounds: no grid is built. For phases, the narrowest phase's: the grid must resolve it."""
    return min(_part_loss_range(m, delta) for m in mech.phases)


def _part_loss_range(mech: Mechanism, delta: float) -> float:
    mech = _as_composed(mech)
    facts = noise(mech.kind)
    widths = []
    for adjacency in _adjacencies(mech):
        widths.append(facts.loss_range(facts.pld_loss(mech, adjacency, _log_mass_truncation(mech, delta))))
    return max(widths)


def _step_points(mech: Event, grid: float, delta: float) -> float:
    """Grid points of every phase's one-step PMFs (both directions) on ``grid``."""
    return sum(len(_adjacencies(m)) * (_part_loss_range(m, delta) / grid + 2) for m in mech.phases)


def _step_bytes(mech: Event, grid: float, delta: float) -> float:
    return STEP_BYTES * _step_points(mech, grid, delta)


class ComposedPLD:
    """The two directions' T-fold composed PMFs (one object when p = 1: they coincide), each with the
    estimated L1 size of its FFT round-off (``round_off``), which every answer pays for: a hockey-stick
    delta weighs each loss by at most 1, so it moves by at most that much.

    The float64 FFT raises each Fourier coefficient, exact to ~1e-16, to the power T: at T = 1e7 the
    round-off is ~3e-9 (sigma = 19.45, p = 1e-3), far above delta = 1e-10 (eps read 11.1 where RDP says
    1.0). Where it is not negligible next to the answer (``ROUND_OFF_SHARE``), that direction is composed
    again in long double (x87 80-bit: ~1e-19 a step; 2.5e-12 there) if it fits the memory budget."""

    def __init__(self, single: dict, steps: int, grid: float, compositions: dict | None = None) -> None:
        """``compositions``: a ``kernel.SelfComposition`` per direction of ``single``, shared by every T of a
        search (``StepsCurve``); made here when not given."""
        self.single, self.steps, self.grid = single, steps, grid
        self.compositions = compositions or {d: kernel.SelfComposition(pmf) for d, pmf in single.items()}
        self.bounds = {d: c.bounds(steps) for d, c in self.compositions.items()}  # the Chernoff window per direction
        self._pmfs: dict = {}      # composed on first use (_composed), so a delta known in advance can skip float64
        self.round_off: dict = {}
        self.precise: set[str] = set()  # directions composed in long double (or found not to fit)

    def _key(self, direction: str) -> str:
        return direction if direction in self.single else "remove"

    def _composed(self, key: str, size: float | None = None):
        """``key``'s composed PMF. Composed on first use: straight in long double where the expected float64
        round-off alone (8 T u) is not negligible next to ``size`` (the delta to be read, when known), as
        ``_recomposed`` would otherwise do after a float64 pass (about a fifth of the time at T = 1e7)."""
        if key not in self._pmfs:
            if size is None or not self._recomposed(key, size, expected=True):
                self._pmfs[key] = self.compositions[key].compose(self.steps)
                self.round_off[key] = (kernel.round_off(self._pmfs[key], self.steps)
                                       + kernel.dropped_bound(self.single[key], self.bounds[key]))
        return self._pmfs[key]

    @property
    def pmfs(self) -> dict:
        return {d: self._composed(self._key(d)) for d in ("remove", "add")}

    @property
    def round_offs(self) -> dict:
        self.pmfs  # noqa: B018 - composes what is not yet
        return {d: self.round_off[self._key(d)] for d in ("remove", "add")}

    def _recomposed(self, key: str, size: float, expected: bool = False) -> bool:
        """Compose ``key`` (again) in long double when its round-off is not negligible next to ``size`` (the
        delta asked for or answered) and that fits the budget; whether it did. ``expected``: judged on the
        float64 round-off expected before composing (``round_off``'s floor), not on the one measured."""
        noise = kernel.ROUND_OFF_PER_STEP * self.steps * kernel._UNIT if expected and self.steps > 1 else self.round_off.get(key, 0.0)
        if noise <= kernel.ROUND_OFF_SHARE * size or key in self.precise or not kernel._has_long_double():
            return False
        self.precise.add(key)
        if not budgets.current().fits(kernel._fft_bytes(self.single[key], self.bounds[key], precise=True)):
            return False
        self._pmfs[key] = kernel._self_compose(self.single[key], self.steps, self.bounds[key], precise=True)
        self.round_off[key] = (kernel.round_off(self._pmfs[key], self.steps, precise=True)
                               + kernel.dropped_bound(self.single[key], self.bounds[key]))
        return True

    def _side(self, key: str) -> float:
        """+1 for a pessimistic PMF (an upper bound pays the round-off), -1 for an optimistic one."""
        return 1.0 if kernel.is_pessimistic(self._pmfs[key]) else -1.0

    def settle(self, delta: float) -> None:
        """Compose each direction at the precision reading eps at ``delta`` needs: in long double where the
        float64 round-off, expected or measured, is not negligible next to ``delta`` (and that fits)."""
        for key in self.single:
            self._composed(key, delta)
            self._recomposed(key, delta)

    def epsilons(self, delta: float) -> dict[str, float]:
        """eps per direction, read at delta less the round-off (plus, for an optimistic estimate); where the
        round-off is over half of delta, unresolved: inf (0 for an optimistic estimate)."""
        self.settle(delta)
        found = {}
        for direction in ("remove", "add"):
            key = self._key(direction)
            noise, side = self.round_off[key], self._side(key)
            found[direction] = (kernel.epsilon_for_delta(self._pmfs[key], delta - side * noise) if noise <= delta / 2
                                else math.inf if side > 0 else 0.0)
        return found

    def deltas(self, eps: float) -> dict[str, float]:
        """delta per direction, plus the round-off (less, for an optimistic estimate)."""
        found = {}
        for direction in ("remove", "add"):
            key = self._key(direction)
            value = float(self._composed(key).get_delta_for_epsilon(eps))
            if self._recomposed(key, value):
                value = float(self._pmfs[key].get_delta_for_epsilon(eps))
            found[direction] = max(0.0, value + self._side(key) * self.round_off[key])
        return found

    def get_delta_for_epsilon(self, eps: float) -> float:
        return max(self.deltas(eps).values())


def composed_pld(mech: Event, grid: float, pessimistic: bool = True, delta: float = 1e-5):
    """The T-fold composed PLD on ``grid`` (``ComposedPLD``; for phases a ``PhasedPLD`` of one per phase);
    memory is checked against the budget before each allocation."""
    budget = budgets.current()
    need = _step_bytes(mech, grid, delta)
    budget.require(need, f"one step's PLD at grid {grid:.3g}",
                   f"a grid of {grid * need / max(budget.available, 1):.3g} would fit")
    if isinstance(mech, Phases):
        return PhasedPLD([_composed_part(m, grid, pessimistic, delta) for m in mech.parts])
    return _composed_part(mech, grid, pessimistic, delta)


def _composed_part(mech: Mechanism, grid: float, pessimistic: bool, delta: float) -> ComposedPLD:
    mech = _as_composed(mech)
    composed = ComposedPLD(_single_step(mech, grid, pessimistic, delta), mech.steps, grid)
    _require_composition(composed, grid)
    return composed


def _single_step(mech: Mechanism, grid: float, pessimistic: bool, delta: float) -> dict:
    """One step's dense PMFs by direction, its tail truncated for ``mech.steps`` steps. Dense before composing:
    dp-accounting's sparse self_compose first computes size**T as a Python integer (minutes at T = 1e7)."""
    return kernel.directions(noise(mech.kind).pld(mech, grid, pessimistic, _log_mass_truncation(mech, delta)),
                             pessimistic)


def _require_composition(composed: ComposedPLD, grid: float) -> None:
    if composed.steps > 1:
        need = sum(kernel._fft_bytes(composed.single[d], composed.bounds[d]) for d in composed.single)
        budgets.current().require(need, f"composing {composed.steps} steps at grid {grid:.3g}")


class StepsCurve:
    """One step of ``template`` on ``grid``, composed for any T (a search over T, a curve of eps against T): the
    step is built once, truncated for ``CURVE_STEPS`` steps (``_log_mass_truncation``: valid for every T up to
    it), and each direction's transform is shared (``kernel.SelfComposition``)."""

    def __init__(self, template: Mechanism, grid: float, delta: float, pessimistic: bool = True) -> None:
        self.grid = grid
        widest = template.with_steps(CURVE_STEPS)
        budgets.current().require(_step_bytes(widest, grid, delta), f"one step's PLD at grid {grid:.3g}")
        self.single = _single_step(widest, grid, pessimistic, delta)
        self.compositions = {d: kernel.SelfComposition(pmf) for d, pmf in self.single.items()}

    def at(self, steps: int) -> ComposedPLD:
        composed = ComposedPLD(self.single, steps, self.grid, self.compositions)
        _require_composition(composed, self.grid)
        return composed
