"""`allocation`: balls-in-bins (random allocation) with Gaussian noise, an upper bound and a lower bound on eps,
each valid, from one epoch's privacy loss composed over the epochs.

The scheme. An epoch is t = floor(N / B) steps. Each example is put in one of the t steps uniformly at random,
independently of the other examples and of the data (so a batch holds about N / t examples, not exactly B);
step i releases its clipped batch sum plus N(0, sigma^2 C^2 I). Epochs draw afresh.

Neighbouring relation: add/remove one example (the sizes of the batches are not fixed, so adding or removing an
example changes nothing else), both directions, the larger eps reported.

Theorem (Feldman & Shenfeld, "Privacy amplification by random allocation", ICML 2026; the dominating pair of an
epoch). One epoch of adaptive steps is dominated, in the remove direction, by the pair (P, Q) on R^t with
Q = N(0, sigma^2 I_t) and P = (1/t) sum_i N(e_i, sigma^2 I_t) (C = 1), and in the add direction by (Q, P). Epochs
are independent draws, so E epochs are dominated by the E-fold products (adaptive composition of dominating
pairs). The privacy loss of y is L(y) = log(P / Q)(y) = log(S / t), S = sum_i W_i, W_i = exp(y_i / sigma^2 -
1 / (2 sigma^2)). Under Q the W_i are i.i.d. log-normal (log W ~ N(-1/(2 sigma^2), 1/sigma^2), E[W] = 1); under
P one of them (by symmetry the first) is e^{1/sigma^2} W_1. So
    remove: L = log(S_P / t) with S_P = e^{1/sigma^2} W_1 + W_2 + ... + W_t, the loss drawn under P;
    add:    L = -log(S_Q / t) with S_Q = W_1 + ... + W_t, under Q.

Computation (why by hand): ``pld-accounting`` (Feldman & Shenfeld's code) computes this law on a geometric grid
whose convolutions cost O(n^2): one epoch of t = 234 steps took 3.5 s at its default accuracy and 49 s / 397 s at
3x / 10x finer (measured here, numba on), and 60 such epochs at the default accuracy 180 s; an upper bound within
1 % of the converged one for the MNIST-like schedule needs the finer ones. Here each W is put on a *linear*
lattice of step h (in units of E[W] = 1), so the t-fold sum is one FFT power, O(n log n), and the epochs are one
dp-accounting self-composition. ``pld-accounting`` is the cross-check (tests/accounting/test_allocation.py).

Validity of the discretisation. For an upper bound each loss is replaced by one at least as large on the same
outcome (a pointwise coupling; delta(eps) = E_P[(1 - e^{eps - L})_+] is increasing in L, and composition keeps
the coupling): the remove direction rounds every W *up* to the lattice (so S and L can only grow), the add
direction rounds every W *down* (S shrinks, -log S grows), and the loss is then rounded up to the loss grid.
Mass a term or the sum puts outside the computed window goes to the infinite loss (remove) or to the window's
edge loss, which is above every loss beyond it (add); a term below the window's floor is raised to it (remove)
or sent to the infinite loss (add). The lower bound does the opposite roundings and drops the mass outside.
The FFT is cyclic: mass of the sum beyond its length wraps into the window; it is at most a Chernoff bound read
from the lattice itself, and that, the FFT's round-off (the negative masses it leaves) and dp-accounting's
truncation are paid for by reading eps at delta minus (upper) or plus (lower) their total over the epochs.

Refinement: h runs down ``LADDER`` until the projected remaining error of the upper bound (the error is about
linear in h, read from the last two rungs) is below ``CONVERGED`` of it, or the next rung would not fit the memory
or time budget; the answer says which (``converged``, ``limited_by``). A partial last epoch is accounted as a
whole one: the run is a post-processing of the epoch's full allocation (valid, said in the guarantee).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np

from dpaudit.accounting.mechanism import Mechanism, Phases, compose_phases
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core import limits as budgets
from dpaudit.core.errors import DPAuditError
from dpaudit.accounting import calibrate
from dpaudit.accounting.pld import kernel
from dpaudit.accounting.registry import epsilon as account
from dpaudit.accounting.search import SearchHooks

LADDER = (4e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5, 3e-6)  # lattice steps h, in units of E[W] = 1
CONVERGED = 5e-3         # stop when the projected remaining error of the upper bound is below this share of it
LOSS_GRID = 1 / 8        # the loss grid, as a share of h (it adds about half of it an epoch, the lattice h / 2)
TAIL_SHARE = 1e-3        # of delta: what the window's truncations may send to the infinite loss over the run
BYTES_PER_POINT = 56     # measured: FFT buffers per point of the cyclic length (rfft, its power, product, inverse)
SECONDS_PER_POINT = 4e-7  # measured on 2 loaded cores, per point of the cyclic length, both directions
_UNIT = 2.0 ** -53
MAX_EPOCHS = 10**6
MIN_SIGMA = 0.1          # below: e^{1/sigma^2} overflows the lattice's range (the shuffle bound answers instead)


@dataclass(frozen=True)
class AllocationOptions:
    """``lattice``: the step h (None: refine ``LADDER`` until converged); ``lower``: compute the lower bound too
    (it costs as much again; a report asks for it through ``lower_bound``, searches never)."""

    lattice: float | None = None
    lower: bool = False

    def __post_init__(self) -> None:
        if self.lattice is not None and not (isinstance(self.lattice, float) and 1e-7 <= self.lattice <= 0.1):
            raise DPAuditError(f"lattice must be a float in [1e-7, 0.1], got {self.lattice!r}")


def epochs_of(mech: Mechanism) -> int:
    """E = ceil(T / t): whole epochs (a partial last one is accounted as whole)."""
    return math.ceil(mech.steps / mech.steps_per_epoch)


def limitation(mech: Mechanism | Phases) -> str | None:
    for m in mech.phases:
        if m.sigma < MIN_SIGMA:
            return (f"allocation accounting takes sigma >= {MIN_SIGMA:g} (below it one step's loss spans more than "
                    "the lattice can hold; the shuffle bound answers)")
        if m.steps_per_epoch < 2:
            return "balls-in-bins needs at least 2 steps an epoch (N >= 2B); with one step an epoch it is full batch"
        if epochs_of(m) > MAX_EPOCHS:
            return f"balls-in-bins accounting composes at most {MAX_EPOCHS} epochs"
    return None


def epsilon(mech: Mechanism | Phases, delta: float, settings: AllocationOptions | None = None) -> EpsilonResult:
    """Upper bound on eps at ``delta`` (add/remove), with the lower bound in ``details``."""
    settings = settings or AllocationOptions()
    if delta <= 0:
        raise DPAuditError("allocation needs delta > 0")
    began = time.perf_counter()
    given, mech = mech, _whole_epochs(mech)  # what is accounted (and cached: max-steps tries many T an epoch)
    ladder = (settings.lattice,) if settings.lattice is not None else LADDER
    seen: list[tuple[float, float, dict]] = []  # (h, upper, per-direction)
    limited_by, converged = None, settings.lattice is not None
    spent: dict[float, float] = {}  # seconds each rung took (the lower bound costs about as much as its rung)
    for h in ladder:
        need = _cost(mech, h, delta)
        if not budgets.current().fits(need[0]) or need[1] > budgets.current().seconds_left():
            limited_by = "memory" if not budgets.current().fits(need[0]) else "time"
            if not seen:
                return _without_amplification(mech, delta, f"balls-in-bins accounting at lattice {h:g} needs about "
                                              f"{budgets.human_bytes(need[0])} and {need[1]:.0f} s, over the "
                                              f"budget ({limited_by})")
            break
        rung_began = time.perf_counter()
        upper, directions = _bound(mech, delta, h, pessimistic=True)
        seen.append((h, upper, directions))
        spent[h] = time.perf_counter() - rung_began
        if len(seen) >= 2:
            (h0, u0, _), (h1, u1, _) = seen[-2], seen[-1]
            remaining = max(0.0, u0 - u1) * h1 / (h0 - h1)
            if remaining <= CONVERGED * u1:
                converged = True
                break
    h, upper, directions = min(seen, key=lambda s: s[1])
    fallback = _without_amplification(mech, delta, f"the allocation bound at lattice {h:g} reads eps <= {upper:.6g} "
                                      f"({limited_by or 'ladder end'}), above this valid bound")
    if not math.isfinite(upper) or fallback.epsilon < upper:
        # both are upper bounds for balls-in-bins; the smaller answers (an infinite one never does: at sigma 0.8,
        # B 1, N 2, 5 epochs, delta 1e-8 the coarse lattice's add direction put more than delta at infinity)
        return fallback
    lower = _bound(mech, delta, h, pessimistic=False)[0] if settings.lower else None
    epochs = [epochs_of(m) for m in mech.phases]
    partial = any(m.steps % m.steps_per_epoch for m in given.phases)
    details = {"lattice": h, "lattice_seconds": spent[h], "converged": converged, "epochs": epochs,
               "steps_per_epoch": [m.steps_per_epoch for m in mech.phases],
               "rungs": [{"lattice": s[0], "epsilon": s[1]} for s in seen],
               "seconds": round(time.perf_counter() - began, 3)}
    if lower is not None:
        details["lower_bound"] = lower
    if limited_by:
        details["limited_by"] = limited_by
    return EpsilonResult(
        accountant="allocation", epsilon=upper, delta=delta, relation=relation_of(mech),
        guarantee=("upper bound: the random-allocation dominating pair (Feldman & Shenfeld 2026), one epoch's loss "
                   f"on a lattice of {h:g} rounded up, composed over {'/'.join(map(str, epochs))} epoch(s)"
                   + ("" if converged else f"; not converged ({limited_by or 'ladder end'}): a valid, looser bound")
                   + ("; a partial last epoch is accounted as whole" if partial else "")),
        directions=directions, details=details)


LOWER_NOTE = ("the same epochs' loss rounded the other way on the answer's lattice: the true eps of the "
              "random-allocation pair (Feldman & Shenfeld) is at least this")


def lower_bound(mech: Mechanism | Phases, delta: float, lattice: float, seconds: float | None = None) -> float | None:
    """A lower bound on the true eps at ``delta`` (each rounding the other way, the truncated mass dropped);
    None when it would not fit what is left of the budget: it costs about what the upper bound's rung at this
    lattice did (``seconds``, measured; else estimated), so 1.5 times that must be left. Only complete epochs
    count (their outputs are part of the run's, so their eps is at most the run's); none complete: None."""
    parts = tuple(m.with_steps((m.steps // m.steps_per_epoch) * m.steps_per_epoch) for m in mech.phases
                  if m.steps >= m.steps_per_epoch)
    if not parts:
        return None
    mech = parts[0] if len(parts) == 1 else Phases(parts, getattr(mech, "sigma", 1.0))
    need = _cost(mech, lattice, delta)
    if not budgets.current().fits(need[0]) or 1.5 * (seconds or need[1]) > budgets.current().seconds_left():
        return None
    return _bound(mech, delta, lattice, pessimistic=False)[0]


def no_lower_bound_why(mech: Mechanism | Phases) -> str:
    """Why ``lower_bound`` gave None, in words for a table row."""
    if not any(m.steps >= m.steps_per_epoch for m in mech.phases):
        return "not computed: no complete epoch (the lower bound counts complete epochs only)"
    return ("not computed: it costs about 1.5 times the upper bound's last rung, more than the time or memory "
            "budget has left (raise --timeout)")


def _without_amplification(mech, delta: float, why: str) -> EpsilonResult:
    """The shuffle bound (each example in one batch an epoch: E full-batch releases), valid for balls-in-bins
    under add/remove (accounting/shuffle.py), answering for allocation when its first rung does not fit."""

    return account(mech, delta, "shuffle").standing_in_for("allocation", why)


def _whole_epochs(mech: Mechanism | Phases) -> Mechanism | Phases:
    """Each phase's steps rounded up to whole epochs: the event the bound is computed for."""
    parts = tuple(m.with_steps(epochs_of(m) * m.steps_per_epoch) for m in mech.phases)
    return parts[0] if isinstance(mech, Mechanism) else Phases(parts, mech.sigma)


def _cost(mech, h: float, delta: float) -> tuple[float, float]:
    """(bytes, seconds) the largest phase's epoch at lattice h needs."""
    points = max(_window(m.sigma, m.steps_per_epoch, h, _eta(mech, delta), remove=True)[2] for m in mech.phases)
    length = 2 * points
    return BYTES_PER_POINT * length, SECONDS_PER_POINT * length * len(mech.phases)


def _eta(mech, delta: float) -> float:
    """What one epoch's window may truncate, on each side of each direction: the run's share over its epochs,
    counted up to a power of two so that schedules of similar length share their epochs' PLDs (max-steps)."""
    epochs = sum(epochs_of(m) for m in mech.phases)
    # only the window's size depends on it (what falls outside is accounted either way), so it is kept finite
    return max(1e-250, TAIL_SHARE * delta / (4 * 2 ** math.ceil(math.log2(epochs))))


@functools.lru_cache(maxsize=64)
def _bound(mech, delta: float, h: float, pessimistic: bool) -> tuple[float, dict]:
    """(eps, per direction) from the epochs of every phase composed, rounded up (pessimistic) or down. Cached: a
    calibration asks the ladder and its fixed lattice for the same sigma."""
    out = {}
    for remove in (True, False):
        composed, slack = None, 0.0
        for m in mech.phases:
            pmf, epoch_slack = _epoch(m.sigma, m.steps_per_epoch, h, _eta(mech, delta), pessimistic, remove)
            epochs = epochs_of(m)
            part = pmf.self_compose(epochs) if epochs > 1 else pmf
            slack += epochs * epoch_slack + 1e-15 + 8 * epochs * _UNIT
            composed = part if composed is None else composed.compose(part)
        target = delta - slack if pessimistic else delta + slack
        if target <= 0:
            raise DPAuditError(f"delta={delta:g} is below what balls-in-bins accounting resolves here ({slack:.2g})")
        out["remove" if remove else "add"] = max(0.0, float(composed.get_epsilon_for_delta(target)))
    return max(out.values()), out


def _window(sigma: float, t: int, h: float, eta: float, remove: bool) -> tuple[int, int, int]:
    """(floor index a of one term, of the scaled term, window length M): each term's lattice starts at a (W < a h
    with probability <= eta / t), the sum's window spans M lattice steps above the sum of the floors."""
    from scipy.stats import norm

    m, s = -0.5 / sigma ** 2, 1 / sigma
    z = float(norm.isf(eta / (2 * t)))
    a = int(math.floor(math.exp(m - z * s) / h))
    scale = math.exp(1 / sigma ** 2) if remove else 1.0
    a1 = int(math.floor(scale * math.exp(m - z * s) / h))
    top = scale * math.exp(m + z * s) + (t - 1) + z * math.sqrt(t * math.expm1(s * s))  # above the sum w.p. >= 1-eta
    floor = ((t - 1) * a + a1) * h
    # + t + 1: rounding each of the t terms up moves the sum up to t lattice steps above the sum itself
    return a, a1, max(16, int(math.ceil((top - floor) / h)) + t + 1)


def _lattice(sigma: float, h: float, a: int, size: int, up: bool, scale: float = 1.0):
    """One term (scale x W) on lattice indices a .. a + size - 1, rounded up (ceil(X / h)) or down (floor), and
    the masses that fall below index a and above the last. Rounded up, a term below the floor is raised to it
    (raising is what rounding up does anyway), so nothing falls below."""
    from scipy.special import log_ndtr

    m, s = -0.5 / sigma ** 2, 1 / sigma
    edges = (a - 1 + np.arange(size + 2, dtype=np.float64)) * h  # (a - 1) h .. (a + size) h
    with np.errstate(divide="ignore"):
        z = (np.log(np.maximum(edges, 0.0) / scale) - m) / s
    below, above = np.exp(log_ndtr(z)), np.exp(log_ndtr(-z))  # P(X <= edge), P(X > edge), each side exact
    cells = np.maximum(np.where(below[1:] > 0.5, above[:-1] - above[1:], below[1:] - below[:-1]), 0.0)
    # cells[k] = P((a - 1 + k) h < X <= (a + k) h): rounded up it sits at index a + k, rounded down at a + k - 1
    if up:
        pmf = cells[:size].copy()
        pmf[0] += float(below[0])
        return pmf, 0.0, float(above[size])
    return cells[1:size + 1].copy(), float(below[1]), float(above[size + 1])


@functools.lru_cache(maxsize=16)
def _epoch(sigma: float, t: int, h: float, eta: float, pessimistic: bool, remove: bool):
    """One epoch's PLD of one direction (a dp-accounting DensePLDPmf), and the slack its FFT leaves (mass that
    may sit at the wrong loss: the cyclic wrap's Chernoff bound and the round-off). Cached: max-steps composes
    the same epoch for every T it tries."""
    from scipy import fft

    a, a1, size = _window(sigma, t, h, eta, remove)
    up = pessimistic == remove  # remove + upper, or add + lower: the sum is rounded up
    pieces = [(*_lattice(sigma, h, a, size, up), t - 1 if remove else t)]
    if remove:
        pieces.append((*_lattice(sigma, h, a1, size, up, math.exp(1 / sigma ** 2)), 1))
    length = fft.next_fast_len(2 * size, real=True)
    spectrum = None
    for pmf, _, _, k in pieces:
        part = fft.rfft(pmf, length) ** k
        spectrum = part if spectrum is None else spectrum * part
    sums = fft.irfft(spectrum, length)
    del spectrum
    negative = float(-sums[sums < 0].sum())
    window = np.maximum(sums[:size], 0.0)
    del sums
    inside = math.prod(float(pmf.sum()) ** k for pmf, _, _, k in pieces)  # every term within its lattice
    beyond = max(0.0, inside - float(window.sum()))                      # ... and their sum above the window
    fell_below = -math.expm1(sum(k * math.log1p(-low) for _, low, _, k in pieces))
    fell_above = -math.expm1(sum(k * math.log1p(-high) for _, _, high, k in pieces))
    slack = _wrap_bound(pieces, length) + 4 * negative + 8 * t * _UNIT

    base = ((t - 1) * a + a1) if remove else t * a
    grid = LOSS_GRID * h
    with np.errstate(divide="ignore"):
        loss = np.log((base + np.arange(size, dtype=np.float64)) * h / t)
    if not remove:
        loss = -loss
    finite = np.isfinite(loss)  # S = 0: loss -inf (remove: no delta) or +inf (add)
    rounded = (np.ceil if pessimistic else np.floor)(loss[finite] / grid).astype(np.int64)
    masses = window[finite]
    infinite = 0.0
    if pessimistic and remove:    # a term or the sum above the window: a loss above every one in it
        infinite = beyond + fell_above
    elif pessimistic:             # add: S = 0 or a term below its floor: infinite; above the window: edge loss
        infinite = float(window[~finite].sum()) + fell_below
        rounded = np.append(rounded, math.ceil(-math.log((base + size) * h / t) / grid))
        masses = np.append(masses, beyond + fell_above)
    # the lower bound drops everything outside the window (dropping mass only lowers delta)
    lowest = int(rounded.min())
    probs = np.bincount(rounded - lowest, weights=masses)
    return kernel.dense(grid, lowest, probs, min(1.0, infinite), pessimistic), slack


def _wrap_bound(pieces, length: int) -> float:
    """Chernoff: P(sum of the in-window lattice offsets >= length), the mass the cyclic FFT can wrap."""
    from scipy.special import logsumexp

    best = 0.0
    for lam_scale in (2, 4, 8, 16, 32, 64):
        lam = lam_scale / length
        log_mgf = 0.0
        for pmf, _, _, k in pieces:
            idx = np.arange(pmf.size, dtype=np.float64)
            with np.errstate(divide="ignore"):
                log_mgf += k * float(logsumexp(np.log(pmf) + lam * idx))
        best = min(best, log_mgf - lam * length)
    return math.exp(best)


def search_hooks():
    """Calibration and max-steps evaluate every candidate at one lattice (each valid): the coarsest rung to move
    a start, the second to bracket (max-steps brackets T between its upper and its lower bound there), and the one
    the ladder converges to at the anchor."""

    def resolution(anchor, delta: float):
        h = epsilon(anchor, delta).details.get("lattice")
        if h is None:   # the anchor was answered by the shuffle bound (its lattice over budget): each candidate's own
            return lambda mech: AllocationOptions()   # ladder decides, and falls back the same valid way
        return lambda mech: AllocationOptions(lattice=h)

    def start(template, target: float, delta: float) -> float:
        """The Poisson calibration at p = 1 / t (about a second): random allocation's sigma is within a few per
        cent of it (Feldman & Shenfeld bound it by Poisson at (1 + o(1)) / t)."""

        poisson = compose_phases([Mechanism(m.kind, m.sigma, 1 / m.steps_per_epoch, m.steps)
                                  for m in template.phases])
        sigma = calibrate.calibrate_sigma(poisson, target, delta, rtol=0.01).sigma
        # phases: the answer multiplies the parts as given, and the template's multiplier is already in them
        return sigma * template.sigma if isinstance(poisson, Phases) else sigma

    def below(mech, delta: float, options: AllocationOptions) -> float:
        """The lower bound at the options' lattice (0 where no epoch is complete, or it would not fit)."""
        return lower_bound(mech, delta, options.lattice) or 0.0

    return SearchHooks(start=start, overshoot=1.01, below=below, coarse=lambda mech, delta: AllocationOptions(lattice=LADDER[0]),
                       first=lambda mech, delta: AllocationOptions(lattice=LADDER[1]),
                       resolution=resolution)
