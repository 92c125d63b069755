"""`pld`: Google's dp-accounting privacy loss distributions, add/remove, pessimistic.

Every number returned here is an upper bound: dp-accounting's pessimistic (connect-the-dots)
discretisation dominates the true privacy loss distribution on any grid and moves truncated
tail mass to an infinite loss. A coarse grid therefore gives a valid, looser bound.

Choosing the grid so that the answer has converged. How close the bound is to the true epsilon
depends on how finely the grid resolves *one step's* privacy loss, not on epsilon (at p = 1e-3,
T = 1e6 a step's loss spans ~0.1, at p = 1e-4 ~0.01). So the first grid puts ``POINTS_PER_STEP``
points on one step's loss range (dp-accounting's own connect-the-dots bounds, read before
anything is allocated) and the grid is refined by ``REFINE`` while the bound improves by more
than ``CONVERGED`` (relative). The error shrinks about tenfold per rung, so the last improvement
bounds what is left. Should a finer rung ever give a larger bound, the refinement stops there too,
and the smallest bound seen is reported (each is valid).

Mass. Before composing, each step's PMF is normalised to total mass exactly 1 (``_normalised``):
dp-accounting clamps the float noise of its lowest losses to >= 0, a surplus of ~1e-16/grid^2 that
T-fold composition raises to the power T (at T = 1e7 the composed mass was 1.06-2.36 and eps *grew*
with finer grids). The surplus is taken from the lowest losses, so mass only moves up; a deficit
(float rounding, ~1 ulp) is added at the lowest loss, where it raises delta least.

Bounded: before each allocation the rung's memory is estimated (one step: ``STEP_BYTES`` a grid
point per direction; composition: the FFT length dp-accounting will use, from its own Chernoff
truncation, ``FFT_BYTES`` a point) against the active ``budget.Budget``, and its time from the
previous rung. A first rung that does not fit is coarsened until it does; a later one that does
not fit ends the refinement. Both are reported in ``details`` (``limited_by``).

Round-off. The float64 FFT that composes T steps errs by ~T x 1e-16 in L1 (3e-9 at T = 1e7). Every
answer pays for it (``round_off``: the larger of what the negative masses show and 8 T u), and where
it is not negligible next to delta that direction is composed again in long double.

Phases (``mechanism.Phases``): each phase is discretised on the one grid and composed T_i-fold as above
(``ComposedPLD``), and the phases' composed PMFs are then multiplied, direction by direction (``PhasedPLD``):
the composition of pessimistic PMFs on one grid is pessimistic. The grid comes from the same ladder, its first
rung resolving the *narrowest* phase's step loss range with ``POINTS_PER_STEP`` points, refined until the
bound has converged; so mixed phases are as tight as one (before: one fixed grid, 6-8 % loose). Each phase's
round-off is paid, and each multiplication's (``_cross_round_off``).

Tails: dp-accounting truncates e^-50 of each step's noise and 1e-15 of the composed mass into the
infinite loss, so delta below ``MIN_DELTA`` is not resolved
(it used to answer eps = inf). There the answer comes from a method valid at any delta: Renyi DP
for the Gaussian (dp-accounting), the exact randomized-response composition (or plain composition)
of the pure-DP step for Laplace; ``details['fallback']`` says which and why.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

from dpaudit.core import limits as budgets
from dpaudit.accounting.mechanism import Mechanism, Phases
from dpaudit.accounting.noises import noise
from dpaudit.accounting.result import DeltaResult, EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core.errors import DPAuditError

Event = Mechanism | Phases

POINTS_PER_STEP = 1000   # first grid: one step's loss range / this
REFINE = 3.0             # each rung divides the grid by this
CONVERGED = 3e-4         # stop refining when the bound improves by less than this (relative)
MAX_RUNGS = 8
MIN_DELTA = 1e-12        # below: the composed truncation (1e-15) and FFT round-off are not negligible
TAIL_MASS_TRUNCATION = 1e-15  # dp-accounting's default for self-composition
STEP_BYTES = 110         # measured: building one direction's single-step PMF, per grid point
STEP_SECONDS = 1e-6      # building one direction's single-step PMF, per grid point (measured 4.5e-7 on 2 cores, vectorised)
FFT_BYTES = 72           # self_convolve: complex FFT, its power, inverse, real part, roll; per point
FFT_PRECISE_BYTES = 100  # the same in long double (complex 32 B), power and inverse in place
ROUND_OFF_SHARE = 1e-3   # FFT round-off above this share of delta: compose again in long double
ROUND_OFF_PER_STEP = 8   # expected FFT round-off: this x T x the unit round-off (L1), see round_off
_UNIT = 2.0 ** -53        # float64's unit round-off
SCAN_BYTES = 64          # per composed point: the kept PMF and epsilon_for_delta's running sums
DROPPED = 1e-30          # long double: a Fourier coefficient whose T-th power is below this is set to 0 (_power)
_POWER_CHUNK = 1 << 20    # coefficients a _power pass takes at a time (its masks and copies stay small)
COARSE_GRID = 1e-3       # for cheap *bracketing* bounds only (valid, loose)
RR_MAX_STEPS = 10**6     # Laplace fallback: exact randomized-response composition up to here, T * eps_1 beyond
MAX_GRID = 100.0         # connect-the-dots needs expm1(grid) finite (grid < 709); eps ~ 1e6 needs no finer start


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
    needed; composing 1e7 copies of so narrow a step left FFT round-off above delta = 1e-10 (eps = inf)."""
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


@dataclass(frozen=True)
class PldOptions:
    """``grid``: one fixed discretisation (a valid bound at any grid) instead of refining until converged;
    searches (calibrate, max-steps) fix it once from a converged ladder and reuse it."""

    grid: float | None = None


def converged_grid(mech: Event, delta: float, result: EpsilonResult | None = None) -> float:
    """The grid the refinement ladder settles on for ``mech``: its coarsest rung within ``CONVERGED``
    (relative) of the smallest bound. Where the ladder improves steadily the smallest is its last rung, the
    one that only shows convergence and costs ~3x the one before (p = 1e-3, T = 1e7, eps = 50, delta = 1e-10:
    8.4 s against 2.6 s an evaluation, for 2e-4 relative)."""
    result = result if result is not None else epsilon(mech, delta)
    rungs = result.details.get("grids") or []
    finite = [r for r in rungs if math.isfinite(r["epsilon"])]
    if not finite:
        return first_grid(mech, delta)
    best = min(r["epsilon"] for r in finite)
    return float(max(r["grid"] for r in finite if r["epsilon"] <= best * (1 + CONVERGED)))


def first_grid(mech: Mechanism, delta: float) -> float:
    width = step_loss_range(mech, delta)
    return min(MAX_GRID, width / POINTS_PER_STEP) if math.isfinite(width) and width > 0 else COARSE_GRID


class ComposedPLD:
    """The two directions' T-fold composed PMFs (one object when p = 1: they coincide), each with the
    estimated L1 size of its FFT round-off (``round_off``), which every answer pays for: a hockey-stick
    delta weighs each loss by at most 1, so it moves by at most that much.

    The float64 FFT raises each Fourier coefficient, exact to ~1e-16, to the power T: at T = 1e7 the
    round-off is ~3e-9 (sigma = 19.45, p = 1e-3), far above delta = 1e-10 (eps read 11.1 where RDP says
    1.0). Where it is not negligible next to the answer (``ROUND_OFF_SHARE``), that direction is composed
    again in long double (x87 80-bit: ~1e-19 a step; 2.5e-12 there) if it fits the memory budget."""

    def __init__(self, single: dict, steps: int, grid: float, bounds: dict) -> None:
        self.single, self.steps, self.grid, self.bounds = single, steps, grid, bounds  # bounds: _convolve_bounds per direction
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
                self._pmfs[key] = _self_compose(self.single[key], self.steps, self.bounds[key])
                self.round_off[key] = round_off(self._pmfs[key], self.steps)
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
        noise = ROUND_OFF_PER_STEP * self.steps * _UNIT if expected and self.steps > 1 else self.round_off.get(key, 0.0)
        if noise <= ROUND_OFF_SHARE * size or key in self.precise or not _has_long_double():
            return False
        self.precise.add(key)
        if not budgets.current().fits(_fft_bytes(self.single[key], self.bounds[key], precise=True)):
            return False
        self._pmfs[key] = _self_compose(self.single[key], self.steps, self.bounds[key], precise=True)
        self.round_off[key] = (round_off(self._pmfs[key], self.steps, precise=True)
                               + dropped_bound(self.single[key], self.bounds[key]))
        return True

    def _side(self, key: str) -> float:
        """+1 for a pessimistic PMF (an upper bound pays the round-off), -1 for an optimistic one."""
        return 1.0 if self._pmfs[key]._pessimistic_estimate else -1.0  # noqa: SLF001

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
            found[direction] = (epsilon_for_delta(self._pmfs[key], delta - side * noise) if noise <= delta / 2
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


class PhasedPLD:
    """Phases composed in sequence: each phase's T-fold PMFs (a ``ComposedPLD`` each, at the precision reading
    the answer needs), multiplied direction by direction on the common grid. Every phase's round-off is paid,
    and every multiplication's (``_cross_round_off``)."""

    def __init__(self, parts: list[ComposedPLD]) -> None:
        self.parts = parts
        self._totals: dict = {}

    def _compose_parts(self, delta: float | None = None) -> None:
        """Every phase's composed PMFs (at the precision reading eps at ``delta`` needs, when given), the ones
        composed so far counted against the memory budget before the next one composes: they stay held."""
        held = 0.0
        for i, part in enumerate(self.parts, 1):
            for key in part.single:
                if key not in part._pmfs:  # noqa: SLF001
                    budgets.current().require(held + _fft_bytes(part.single[key], part.bounds[key]),
                                              f"composing phase {i} of {len(self.parts)}")
                part._composed(key, delta)  # noqa: SLF001
                if delta is not None:
                    part._recomposed(key, delta)  # noqa: SLF001
                held += 8.0 * len(part._pmfs[key]._probs)  # noqa: SLF001

    def _total(self, direction: str):
        if direction not in self._totals:
            self._compose_parts()
            pmfs = [part.pmfs[direction] for part in self.parts]
            total, noise = pmfs[0], sum(part.round_offs[direction] for part in self.parts)
            for other in pmfs[1:]:
                budgets.current().require(FFT_BYTES * (len(total._probs) + len(other._probs)),  # noqa: SLF001
                                          "composing the phases")
                total = total.compose(other, tail_mass_truncation=TAIL_MASS_TRUNCATION)
                noise += _cross_round_off(total)
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
            found[direction] = epsilon_for_delta(total, delta - noise) if noise <= delta / 2 else math.inf
        return found

    def deltas(self, eps: float) -> dict[str, float]:
        found = {}
        for direction in ("remove", "add"):
            total, noise = self._total(direction)
            value = float(total.get_delta_for_epsilon(eps))
            if noise > ROUND_OFF_SHARE * value:  # the round-off matters next to this delta: long double parts
                self.settle(max(value, MIN_DELTA))
                total, noise = self._total(direction)
                value = float(total.get_delta_for_epsilon(eps))
            found[direction] = max(0.0, value + noise)
        return found


def _cross_round_off(pmf) -> float:
    """L1 size of one float64 FFT convolution's round-off: what negative masses show, or at least u log2(n)
    sqrt(n) times ``ROUND_OFF_PER_STEP`` (each output point errs by ~u log n times the inputs' 2-norms, which
    are at most 1)."""
    n = max(2, len(pmf._probs))  # noqa: SLF001
    return max(_seen_round_off(pmf), ROUND_OFF_PER_STEP * _UNIT * math.log2(n) * math.sqrt(n))


def _seen_round_off(pmf) -> float:
    """The round-off a composed PMF shows: where the true mass is below the error, about half the points come
    out negative, so the mean |error| is the mean of the negative values, times the number of points."""
    import numpy as np

    probs = pmf._probs  # noqa: SLF001
    negative = probs < 0
    count = int(np.count_nonzero(negative))
    return 0.0 if not count else float(-np.sum(probs, where=negative)) * len(probs) / count


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
    budget = budgets.current()
    single = noise(mech.kind).pld(mech, grid, pessimistic, _log_mass_truncation(mech, delta))
    # Dense before composing: dp-accounting's sparse self_compose first computes size**T as a Python
    # integer, which alone takes minutes at T = 1e7.
    pmfs = {"remove": _normalised(single._pmf_remove.to_dense_pmf(), pessimistic)}  # noqa: SLF001
    if not single._symmetric:  # noqa: SLF001
        pmfs["add"] = _normalised(single._pmf_add.to_dense_pmf(), pessimistic)  # noqa: SLF001
    bounds = {d: _convolve_bounds(pmf, mech.steps) for d, pmf in pmfs.items()}
    if mech.steps > 1:
        need = sum(_fft_bytes(pmfs[d], bounds[d]) for d in pmfs)
        budget.require(need, f"composing {mech.steps} steps at grid {grid:.3g}")
    return ComposedPLD(pmfs, mech.steps, grid, bounds)


def round_off(pmf, steps: int, precise: bool = False) -> float:
    """Estimated L1 size of a ``steps``-fold composed PMF's FFT round-off: the larger of two estimates.

    Seen: where the true mass is below the error, about half the points come out negative, so the mean
    |error| is the mean of the negative values, times the number of points.
    Expected: each Fourier coefficient is exact to about the unit round-off u and the power multiplies that
    relative error by T, so the L1 error is ~T u. Measured against long double it was 0.9-5.5 T u
    (p = 1e-3, T = 1e7, 157k-470k points); ``ROUND_OFF_PER_STEP`` = 8 covers that. The error is smooth
    (low frequencies carry it), so it can be positive over every low-mass region at once and leave no
    negative point: at p = 1e-2, T = 1e6 a float64 PMF with none was 1.9e-10 off in L1 and read eps 47.81
    where long double reads 47.61.
    One step is not composed: no round-off."""
    import numpy as np

    if steps == 1:
        return 0.0
    unit = float(np.finfo(np.longdouble).eps / 2) if precise else _UNIT
    return max(_seen_round_off(pmf), ROUND_OFF_PER_STEP * steps * unit)


def _convolve_bounds(pmf, steps: int) -> tuple[int, int]:
    """dp-accounting's Chernoff truncation of the ``steps``-fold composition (indices lo..hi kept), the same
    bound as ``common.compute_self_convolve_bounds``: for orders k/n, k = +-1..20 (n points), index bound
    (T log E[e^{k i/n}] + log(2/tail)) / (k/n). Computed once per PMF, shared by the memory estimate and the
    composition, and by hand: dp-accounting's 40 scipy log-sum-exps took 0.44 s a PMF at 2e6 points, 37 % of
    a p = 1e-5 calibration. Here each block of the PMF (cache-sized) builds e^{k i/n} by repeated
    multiplication, k = 1..20 either way: the same moments to ~1e-15 relative (tested against dp-accounting's)."""
    import numpy as np

    probs = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    n = len(probs)
    lower, upper = 0, (n - 1) * steps
    if steps == 1 or n == 0:
        return lower, upper
    moments = np.zeros((2, 20))  # [sign][k - 1]: sum p_i e^{+-k i / n}
    for start in range(0, n, 1 << 15):
        chunk = probs[start:start + (1 << 15)]
        where = np.arange(start, start + len(chunk)) / n
        for side, base in enumerate((np.exp(where), np.exp(-where))):
            power = base.copy()
            for k in range(20):
                moments[side, k] += chunk @ power
                power *= base
    log_two_over_tail = math.log(2 / TAIL_MASS_TRUNCATION)
    with np.errstate(divide="ignore"):
        log_moments = np.log(moments)
    for k in range(1, 21):
        for sign, log_moment in ((1, log_moments[0, k - 1]), (-1, log_moments[1, k - 1])):
            bound = (steps * log_moment + log_two_over_tail) / (sign * k / n)
            if not math.isfinite(bound):
                continue
            if sign > 0:
                upper = min(upper, math.ceil(bound))
            else:
                lower = max(lower, math.floor(bound))
    return lower, upper


def _self_compose(pmf, steps: int, bounds: tuple[int, int], precise: bool = False):
    """dp-accounting's DensePLDPmf.self_compose (the same truncation ``bounds``, FFT, roll and infinity mass;
    bit for bit in float64), in long double when ``precise``: dp-accounting's FFT is float64 only."""
    if steps == 1:
        return pmf
    import numpy as np
    from scipy import fft

    lo, hi = bounds
    if precise:
        x = np.asarray(pmf._probs, dtype=np.longdouble)  # noqa: SLF001
        x *= (1 - np.longdouble(pmf._infinity_mass)) / x.sum()  # noqa: SLF001 - mass 1 at this precision too
    else:
        x = pmf._probs  # noqa: SLF001
    spectrum = fft.fft(x, _fft_length(pmf, bounds))
    del x
    if precise:
        _power(spectrum, steps)  # in place: long double is the memory-tight case
    else:
        spectrum = spectrum ** steps  # as dp-accounting writes it (numpy squares, not powers, at 2)
    probs = np.roll(fft.ifft(spectrum, overwrite_x=True).real, -lo)[:hi - lo + 1].astype(float)
    infinity = TAIL_MASS_TRUNCATION - math.expm1(steps * math.log1p(-pmf._infinity_mass))  # noqa: SLF001
    return type(pmf)(pmf._discretization, pmf._lower_loss * steps + lo, probs, infinity,  # noqa: SLF001
                     pmf._pessimistic_estimate)  # noqa: SLF001


def _power(spectrum, steps: int) -> None:
    """spectrum <- spectrum ** steps in place (long double), computing only the coefficients whose power is
    at least ``DROPPED`` (|c|^2 >= DROPPED^(2/T)) and setting the others to 0. numpy's complex long double
    power takes ~0.6 us a coefficient (log, exp and sincos on the x87: 4.6 s for one direction at
    p = 1e-3, T = 1e7), and at large T almost every coefficient's power is far below 1e-30: the composed
    distribution is smooth, so its spectrum is narrow. A dropped coefficient moves each output point by at
    most DROPPED / length, so the PMF moves by at most DROPPED x length in L1 (``dropped_bound``, paid
    with the round-off). The test is made against DROPPED / 2, so that the rounding of |c|^2 and of the
    threshold (relative ~1e-19, raised to the power T: ~1e-12 at T = 1e7) cannot let a dropped power
    reach DROPPED."""
    import numpy as np

    threshold = np.exp(2 * np.log(np.longdouble(DROPPED) / 2) / steps)
    for a in range(0, len(spectrum), _POWER_CHUNK):
        part = spectrum[a:a + _POWER_CHUNK]
        keep = np.square(part.real) + np.square(part.imag) >= threshold
        part[~keep] = 0
        part[keep] = np.power(part[keep], steps)


def dropped_bound(pmf, bounds: tuple[int, int]) -> float:
    """L1 bound on what ``_power``'s dropped coefficients move in a long double composition of ``pmf``."""
    return DROPPED * _fft_length(pmf, bounds)


def _normalised(pmf, pessimistic: bool = True):
    """``pmf`` with its finite mass set to exactly 1 - infinity mass. A surplus is taken from the side the
    estimate errs on (from the lowest losses when pessimistic: mass only moves up; from the highest when
    optimistic); a deficit is added at the lowest loss either way.

    Why: connect-the-dots masses are second differences of hockey-stick deltas; in exact arithmetic they
    telescope to 1 - delta_n, but in floats the lowest losses come out as +-1e-16/grid noise, and
    dp-accounting clamps the negative ones to 0. That surplus (4.5e-10 at grid 1.2e-6, 6e-9 at 4.2e-7
    for sigma = 186.56, p = 1e-3) is raised to the power T by self-composition: at T = 1e7 the composed
    "distribution" had mass 1.06-2.36 and eps grew as the grid was refined. Taking the surplus back from
    the bottom makes every cumulative mass no larger than the unclamped one's (mass only moves up), so the
    composed delta(eps) stays an upper bound, and it cancels the surplus to first order because one
    step's loss range is narrow.

    A deficit (the float sum one ulp or so short of 1) is *added*: every composed mass is a polynomial
    with non-negative coefficients in the step's masses and delta(eps) = sum p (1 - e^(eps - L))_+ is
    non-decreasing in each, so adding mass anywhere keeps an upper bound. At the lowest loss it costs
    delta only ~T x deficit *relative*; at the highest loss (as before) it cost T x deficit *absolute*:
    3.3e-11 at p = 1e-5, T = 1e5, a third of delta = 1e-10, present on some grids and not others, so eps
    jumped by up to 7 % between grids 0.1 % apart and calibrations landed 0.13 % above the smallest sigma."""
    import numpy as np

    probs = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    if not len(probs):
        return pmf
    surplus = probs.sum() + pmf._infinity_mass - 1.0  # noqa: SLF001
    if surplus > 0:
        order = slice(None) if pessimistic else slice(None, None, -1)  # where mass is taken from first
        ordered = probs[order]
        taken = np.minimum(np.cumsum(ordered), surplus)
        probs = (ordered - np.diff(taken, prepend=0.0))[order]
    else:
        probs = probs.copy()
        probs[0] -= surplus
    pmf._probs = np.maximum(probs, 0.0)  # noqa: SLF001
    return pmf


def epsilon_for_delta(pmf, delta: float) -> float:
    """dp-accounting's ``DensePLDPmf.get_epsilon_for_delta``, vectorised (its Python loop over the PMF
    takes ~10 s at 1e7 points). The same rule and sums: walking down from the largest loss L_k, stop
    at the first k where log((U_k - delta) / W_k) >= L_k, with U_k = inf mass + mass above,
    W_k = sum of p e^{-L} above; or where W is still 0 once U >= delta. Losses are index x grid here
    (dp-accounting subtracts the grid step repeatedly), so the two agree to ~1e-10 relative (tested)."""
    import numpy as np

    inf_mass = pmf._infinity_mass  # noqa: SLF001
    if inf_mass > delta:
        return math.inf
    probs = np.flip(np.asarray(pmf._probs, dtype=float))  # noqa: SLF001
    losses = (pmf._lower_loss + len(probs) - 1 - np.arange(len(probs))) * pmf._discretization  # noqa: SLF001
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        weighted = np.exp(-losses) * probs
        upper_after = inf_mass + np.cumsum(probs)     # U after adding entry k
        lower_after = np.cumsum(weighted)             # W after adding entry k
        upper_before = np.concatenate(([inf_mass], upper_after[:-1]))
        lower_before = np.concatenate(([0.0], lower_after[:-1]))
        stop = (upper_before > delta) & (lower_before > 0) & (np.log((upper_before - delta) / lower_before) >= losses)
        zero = (upper_after >= delta) & (lower_after == 0)
    k_stop = int(np.argmax(stop)) if stop.any() else len(probs)
    k_zero = int(np.argmax(zero)) if zero.any() else len(probs)
    if k_zero < k_stop:
        return max(0.0, float(losses[k_zero]))
    if k_stop < len(probs):
        u, w = upper_before[k_stop], lower_before[k_stop]
    else:
        u = upper_after[-1] if len(probs) else inf_mass
        w = lower_after[-1] if len(probs) else 0.0
    if u <= w + delta:
        return 0.0
    # As a difference of logs: (u - delta) / w overflows a float when w is subnormal (seen at p = 1e-5).
    return math.log(float(u) - delta) - math.log(float(w)) if w > 0 else math.inf


def _fft_length(pmf, bounds: tuple[int, int]) -> int:
    """The FFT length of composing ``pmf``: the Chernoff-truncated output length ``bounds``, rounded up as
    dp-accounting rounds it."""
    from scipy import fft

    lo, hi = bounds
    return fft.next_fast_len(max(hi - lo + 1, len(pmf._probs)))  # noqa: SLF001


def _fft_bytes(pmf, bounds: tuple[int, int], precise: bool = False) -> float:
    """Memory of composing ``pmf`` (dp-accounting's self-convolution, or ours in long double)."""
    lo, hi = bounds
    return (FFT_PRECISE_BYTES if precise else FFT_BYTES) * _fft_length(pmf, bounds) + SCAN_BYTES * (hi - lo + 1)


def epsilon_estimate_below(mech: Mechanism, delta: float, grid: float = COARSE_GRID) -> float:
    """A *lower* estimate of eps (dp-accounting's optimistic discretisation rounds losses down): never
    reported as a guarantee, only used to bracket searches (the true eps is at least this)."""
    return max(_fitted(mech, delta, grid, pessimistic=False)[0].values())


def _fitted(mech: Mechanism, delta: float, grid: float, pessimistic: bool = True, measure=None) -> tuple[dict, float]:
    """Both directions' eps on ``grid``, or on the finest coarser grid that fits the memory budget
    (a coarser pessimistic grid is still a valid bound). Returns (directions, grid used)."""
    cap = budgets.current().available
    measure = measure or (lambda pld: pld.epsilons(delta))
    for _ in range(8):
        try:
            return measure(composed_pld(mech, grid, pessimistic, delta)), grid
        except budgets.OverBudget as exc:
            if not math.isfinite(exc.needed):
                raise
            if grid >= MAX_GRID:
                break
            grid = min(MAX_GRID, grid * max(1.5, 1.1 * exc.needed / cap))
    raise budgets.OverBudget(f"no PLD grid fits the memory budget of {budgets.human_bytes(cap)} (--max-memory)")


def epsilon(mech: Mechanism, delta: float, grid: float | None = None,
            settings: PldOptions = PldOptions()) -> EpsilonResult:
    """Upper bound on eps at ``delta``: on ``grid`` when given, else on a grid refined until converged."""
    grid = grid if grid is not None else settings.grid
    if delta < MIN_DELTA:
        return _fallback(mech, delta, f"pld does not resolve delta < {MIN_DELTA:g} "
                                      f"(composed tail truncation {TAIL_MASS_TRUNCATION:g})")
    try:
        best, rungs, rung_eps, limited = _measured(mech, delta, grid)
    except budgets.OverBudget as exc:
        return _fallback(mech, delta, f"pld does not fit the budget ({exc})")
    except OverflowError:  # dp-accounting evaluates e^{1/sigma} in floats: Laplace with sigma < ~1/700
        return _fallback(mech, delta, f"dp-accounting's PLD overflows at sigma = {mech.sigma:g}")
    eps = max(best.values())
    if all(noise(m.kind).pure_dp for m in mech.phases):
        # A Laplace run is also pure (T * eps_1)-DP; pessimistic rounding can put PLD a grid step
        # above that, and the smaller of two valid upper bounds is still valid.
        from dpaudit.accounting.pure import step_epsilon

        cap = sum(m.steps * step_epsilon(m.sigma, m.sampling_rate) for m in mech.phases)
        best = {k: min(v, cap) for k, v in best.items()}
        eps = max(best.values())
    details = {"discretisation": rungs[int(min(range(len(rung_eps)), key=rung_eps.__getitem__))],
               "grids": [{"grid": g, "epsilon": e} for g, e in zip(rungs, rung_eps)],
               # whether this evaluation refined its grid to convergence (False on a fixed grid, as a
               # calibration's search uses): not the calibration's own `converged`
               "grid_refined_to_convergence": limited is None and (grid is None), "limited_by": limited}
    if not math.isfinite(eps) or limited is not None:
        alt = _alternative(mech, delta)
        if alt is not None and alt.epsilon < eps:
            why = "pld found no finite epsilon" if not math.isfinite(eps) else f"pld grid limited by {limited}"
            return alt.standing_in_for("pld", f"{why}; this bound is {alt.accountant} (smaller, also valid)",
                                       pld_epsilon=eps)
    return EpsilonResult(
        accountant="pld", epsilon=eps, delta=delta, relation=relation_of(mech),
        guarantee="upper bound (dp-accounting PLD, pessimistic discretisation"
                  + (", grid limited by the " + limited + " budget)" if limited else ")"),
        directions=best, details=details,
    )


def _measured(mech: Mechanism, delta: float, grid: float | None, measure=None):
    """(per-direction values, grids, each grid's max, limited_by) on ``grid`` when given (coarsened if it
    does not fit), else on the refinement ladder. ``measure``: composed PLD -> per-direction values
    (default: eps at ``delta``; smaller is tighter)."""
    measure = measure or (lambda pld: pld.epsilons(delta))
    if grid is None:
        return _refine(mech, delta, measure)
    found, used = _fitted(mech, delta, grid, measure=measure)
    return found, [used], [max(found.values())], "memory" if used != grid else None


def _refine(mech: Mechanism, delta: float, measure):
    """Rungs of ever finer grids until the bound stops improving, the budget is reached, or MAX_RUNGS."""
    budget = budgets.current()
    grid = first_grid(mech, delta)
    first = STEP_SECONDS * _step_points(mech, grid, delta)
    if first > budget.seconds_left():
        raise budgets.OverBudget(f"one step's PLD alone would take about {first:.0f} s, over the time budget")
    best, best_eps, rungs, rung_eps, limited = None, math.inf, [], [], None
    last_seconds = 0.0
    for rung in range(MAX_RUNGS):
        if rung and (not budget.fits(_step_bytes(mech, grid, delta))):
            limited = "memory"
            break
        if rung and last_seconds * (REFINE + 0.5) > budget.seconds_left():
            limited = "time"
            break
        began = time.perf_counter()
        if not rung:
            found, used = _fitted(mech, delta, grid, measure=measure)
            limited, grid = ("memory" if used != grid else None), used
        else:
            try:
                found = measure(composed_pld(mech, grid, delta=delta))
            except budgets.OverBudget:
                limited = "memory"
                break
        last_seconds = time.perf_counter() - began
        eps = max(found.values())
        rungs.append(grid)
        rung_eps.append(eps)
        improved = best_eps - eps
        if best is None or eps < best_eps:  # every rung may read inf (round-off over delta): keep the first
            best, best_eps = found, eps
        if limited or (rung and not improved > CONVERGED * eps):
            break  # converged, round-off now outweighs resolution, or the first grid was already coarsened
        grid /= REFINE
    return best, rungs, rung_eps, limited


def delta(mech: Mechanism, eps: float, settings: PldOptions = PldOptions()) -> DeltaResult:
    """Upper bound on delta at ``eps`` (max of both directions), on a grid refined until converged."""
    best, rungs, values, limited = _measured(mech, MIN_DELTA, settings.grid, lambda pld: pld.deltas(eps))
    best = {k: min(1.0, v) for k, v in best.items()}  # delta <= 1 always; FFT round-off can overshoot it
    upper = max(best.values())
    return DeltaResult(
        accountant="pld", delta=upper, epsilon=eps, relation=relation_of(mech),
        guarantee="upper bound (pessimistic PLD, max of add and remove"
                  + (f", grid limited by the {limited} budget)" if limited else ")")
                  + (f"; below {TAIL_MASS_TRUNCATION:g} it is the truncated tail, not resolved" if upper < 1e-14
                     else ""),
        directions=best, details={"grids": [{"grid": g, "delta": v} for g, v in zip(rungs, values)],
                                  "limited_by": limited})


def _alternative(mech: Event, delta: float) -> EpsilonResult | None:
    """A bound valid at any delta, chosen by the noise records: RDP where every phase's noise has an RDP event
    (the Gaussian's), randomized-response composition or pure composition where every phase is pure DP (Laplace);
    None otherwise (phases that mix the two)."""
    from dpaudit.accounting import pure, rdp
    from dpaudit.accounting.noises import noise

    if rdp.limitation(mech) is None:
        return rdp.epsilon(mech, delta)
    if not all(noise(part.kind).pure_dp for part in mech.phases):
        return None

    if delta > 0 and isinstance(mech, Mechanism) and mech.steps <= RR_MAX_STEPS:
        return pure.prv_epsilon(mech, delta)
    return pure.epsilon(mech, delta)


def _fallback(mech: Event, delta: float, why: str) -> EpsilonResult:
    alternative = _alternative(mech, delta)
    if alternative is None:
        raise DPAuditError(f"{why}, and no other accountant here covers {mech.kind} noise")
    return alternative.standing_in_for("pld", why)


def _coarse_options(mech: Event, delta: float) -> PldOptions:
    return PldOptions(grid=max(COARSE_GRID, first_grid(mech, delta)))


def _first_options(mech: Event, delta: float) -> PldOptions:
    return PldOptions(grid=first_grid(mech, delta))


def _resolution(anchor: Event, delta: float):
    """One refinement ladder at ``anchor`` fixes the grid relative to one step's loss range; every other event
    of the schedule is then evaluated on a single grid at that resolution (the ladder's last rung, the one that
    shows it has converged, alone costs ~3x the converged one)."""
    ratio = converged_grid(anchor, delta) / step_loss_range(anchor, delta)
    return lambda mech: PldOptions(grid=min(MAX_GRID, ratio * step_loss_range(mech, delta)))


def _below(mech: Event, delta: float, options: PldOptions) -> float:
    return epsilon_estimate_below(mech, delta, options.grid)


def search_hooks():
    from dpaudit.accounting.search import SearchHooks

    return SearchHooks(coarse=_coarse_options, first=_first_options, resolution=_resolution, below=_below)


@functools.cache
def _has_long_double() -> bool:
    """x86's 80-bit long double; on platforms where it is float64 there is nothing to gain."""
    import numpy as np

    return bool(np.finfo(np.longdouble).eps < np.finfo(float).eps)
