"""The kernel: everything dpaudit reads or rebuilds of dp-accounting's PLD internals, in one place.

Mirrors dp-accounting 0.6.0 (pyproject pins ``>=0.6,<0.7``; ``tests/accounting/test_upstream.py`` fails, naming
the field, when an internal read here moves):
- ``pld/pld_pmf.py``: ``DensePLDPmf`` (its fields ``_discretization``, ``_lower_loss``, ``_probs``,
  ``_infinity_mass``, ``_pessimistic_estimate``; its constructor), ``self_compose`` and ``get_epsilon_for_delta``;
- ``pld/common.py``: ``self_convolve`` and ``compute_self_convolve_bounds`` (the Chernoff truncation);
- ``pld/privacy_loss_distribution.py``: a PLD's ``_pmf_remove``, ``_pmf_add`` and ``_symmetric``; the private
  constructors ``_create_pld_pmf_from_monotone_privacy_loss`` and ``_pld_for_subsampled_mechanism``;
- ``pld/privacy_loss_mechanism.py``: ``GaussianPrivacyLoss._standard_deviation`` and
  ``LaplacePrivacyLoss._parameter``, read by ``vectorised_loss.py`` (the losses' deltas on arrays).
No other module of dpaudit touches those names; they go through the accessors below.

Composition (``SelfComposition``): the T-fold PMF of one step is one FFT power, ``ifft(fft(x, L) ** T)``, rolled
to the Chernoff window, as dp-accounting's ``self_convolve`` computes it. Here (why by hand: dp-accounting
recomputes the transform for every T, powers every coefficient and takes the complex FFT of a real PMF):
- the transform of one step is kept and reused for every T whose window fits its length (a search over T pays
  one transform, then a power and an inverse transform per T);
- the transform is the real one (half the coefficients);
- a coefficient whose T-th power is below ``DROPPED`` is set to 0 instead of powered (at large T almost all
  are: the composed law is smooth). Each output point moves by at most DROPPED / length, so the PMF by at most
  DROPPED x length in L1 (``dropped_bound``), which every answer pays with the round-off.
A longer cyclic length than the window only aliases less mass, so reuse keeps dp-accounting's truncation bound.

Mass. Before composing, each step's PMF is normalised to total mass exactly 1 (``_normalised``):
dp-accounting clamps the float noise of its lowest losses to >= 0, a surplus of ~1e-16/grid^2 that
T-fold composition raises to the power T (at T = 1e7 the composed mass was 1.06-2.36 and eps *grew*
with finer grids). The surplus is taken from the lowest losses, so mass only moves up; a deficit
(float rounding, ~1 ulp) is added at the lowest loss, where it raises delta least.

Round-off. The float64 FFT that composes T steps errs by ~T x 1e-16 in L1 (3e-9 at T = 1e7). Every
answer pays for it (``round_off``: the larger of what the negative masses show and 8 T u), and where
it is not negligible next to delta that direction is composed again in long double (``compose.py``).
"""

from __future__ import annotations

import functools
import math

import numpy as np

UPSTREAM = "0.6"           # the dp-accounting minor release this kernel mirrors
TAIL_MASS_TRUNCATION = 1e-15  # dp-accounting's default for self-composition
MIN_DELTA = 1e-12        # below: the composed truncation (1e-15) and FFT round-off are not negligible
ROUND_OFF_SHARE = 1e-3   # FFT round-off above this share of delta: compose again in long double
FFT_BYTES = 72           # self-composition: FFT, its power, inverse, real part, roll; per point
FFT_PRECISE_BYTES = 100  # the same in long double (complex 32 B), power and inverse in place
ROUND_OFF_PER_STEP = 8   # expected FFT round-off: this x T x the unit round-off (L1), see round_off
_UNIT = 2.0 ** -53        # float64's unit round-off
SCAN_BYTES = 64          # per composed point: the kept PMF and epsilon_for_delta's running sums
DROPPED = 1e-30          # a Fourier coefficient whose T-th power is below this is set to 0 (_power)
_POWER_CHUNK = 1 << 20    # coefficients a _power pass takes at a time (its masks and copies stay small)
SPECTRA_KEPT = 2          # transforms a SelfComposition keeps (the longest ones)
REUSE_SLACK = 1.3         # a kept transform is reused for a window up to this many times shorter


# --- dp-accounting's fields, read and written here only -------------------------------------------------------

def probs(pmf):
    return pmf._probs  # noqa: SLF001


def infinity_mass(pmf) -> float:
    return pmf._infinity_mass  # noqa: SLF001


def lower_index(pmf) -> int:
    return pmf._lower_loss  # noqa: SLF001


def grid_of(pmf) -> float:
    return pmf._discretization  # noqa: SLF001


def is_pessimistic(pmf) -> bool:
    return pmf._pessimistic_estimate  # noqa: SLF001


def set_probs(pmf, values) -> None:
    pmf._probs = values  # noqa: SLF001


def dense(grid: float, lower: int, values, infinity: float, pessimistic: bool):
    """A ``DensePLDPmf`` (losses ``(lower + i) x grid``)."""
    from dp_accounting.pld import pld_pmf

    return pld_pmf.DensePLDPmf(grid, lower, values, infinity, pessimistic)


def directions(pld, pessimistic: bool) -> dict:
    """A ``PrivacyLossDistribution``'s dense, normalised PMFs: {"remove"} when symmetric, else both."""
    pmfs = {"remove": _normalised(pld._pmf_remove.to_dense_pmf(), pessimistic)}  # noqa: SLF001
    if not pld._symmetric:  # noqa: SLF001
        pmfs["add"] = _normalised(pld._pmf_add.to_dense_pmf(), pessimistic)  # noqa: SLF001
    return pmfs


def monotone_pmf(loss, grid: float, pessimistic: bool = True, connect_dots: bool = True):
    """One step's PMF of a ``MonotonePrivacyLoss`` on ``grid`` (dp-accounting's private constructor; connect-the-dots
    when pessimistic and asked, privacy buckets otherwise)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    return pld_lib._create_pld_pmf_from_monotone_privacy_loss(  # noqa: SLF001
        loss, pessimistic_estimate=pessimistic, value_discretization_interval=grid,
        use_connect_dots=pessimistic and connect_dots)


def subsampled(single, sampling_prob: float):
    """A PLD from ``single(adjacency) -> PMF`` under Poisson subsampling (dp-accounting's private combinator)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    return pld_lib._pld_for_subsampled_mechanism(single, sampling_prob)  # noqa: SLF001


def from_directions(pmf_remove, pmf_add):
    """A ``PrivacyLossDistribution`` of its two directions' PMFs (dp-accounting's public constructor)."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    return pld_lib.PrivacyLossDistribution(pmf_remove, pmf_add)


def raw_directions(pld) -> dict:
    """Both directions' PMFs as dp-accounting built them (sparse or dense)."""
    return {"remove": pld._pmf_remove, "add": pld._pmf_add}  # noqa: SLF001


def _cross_round_off(pmf) -> float:
    """L1 size of one float64 FFT convolution's round-off: what negative masses show, or at least u log2(n)
    sqrt(n) times ``ROUND_OFF_PER_STEP`` (each output point errs by ~u log n times the inputs' 2-norms, which
    are at most 1)."""
    n = max(2, len(pmf._probs))  # noqa: SLF001
    return max(_seen_round_off(pmf), ROUND_OFF_PER_STEP * _UNIT * math.log2(n) * math.sqrt(n))


def _seen_round_off(pmf) -> float:
    """The round-off a composed PMF shows: where the true mass is below the error, about half the points come
    out negative, so the mean |error| is the mean of the negative values, times the number of points."""

    probs = pmf._probs  # noqa: SLF001
    negative = probs < 0
    count = int(np.count_nonzero(negative))
    return 0.0 if not count else float(-np.sum(probs, where=negative)) * len(probs) / count


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
    return _bounds_from(_moments(pmf), len(pmf._probs), steps)  # noqa: SLF001


def _moments(pmf):
    """[sign][k - 1]: sum_i p_i e^{+-k i / n}, k = 1..20 (``_convolve_bounds``); they do not depend on T."""

    probs = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    n = len(probs)
    moments = np.zeros((2, 20))
    for start in range(0, n, 1 << 15):
        chunk = probs[start:start + (1 << 15)]
        where = np.arange(start, start + len(chunk)) / max(n, 1)
        for side, base in enumerate((np.exp(where), np.exp(-where))):
            power = base.copy()
            for k in range(20):
                moments[side, k] += chunk @ power
                power *= base
    return moments


def _bounds_from(moments, n: int, steps: int) -> tuple[int, int]:
    """The Chernoff window of the ``steps``-fold composition from one step's ``_moments`` (n points)."""

    lower, upper = 0, (n - 1) * steps
    if steps == 1 or n == 0:
        return lower, upper
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


def _self_compose(pmf, steps: int, bounds: tuple[int, int], precise: bool = False, spectrum=None):
    """dp-accounting's DensePLDPmf.self_compose: the same truncation ``bounds``, roll and infinity mass; the
    transform as the module says (real, powered where it matters, ``spectrum``: one step's transform to reuse,
    as ``SelfComposition`` keeps it, of any length at least the window's); in long double when ``precise``
    (dp-accounting's FFT is float64 only)."""
    if steps == 1:
        return pmf
    from scipy import fft

    lo, hi = bounds
    length, coefficients = spectrum if spectrum is not None else _spectrum(pmf, _fft_length(pmf, bounds), precise)
    if length < hi - lo + 1:
        raise ValueError(f"a transform of length {length} cannot hold a window of {hi - lo + 1} points")
    powered = coefficients.copy()
    _power(powered, steps)
    composed = fft.irfft(powered, length, overwrite_x=True)
    del powered
    probs = np.roll(composed, -lo)[:hi - lo + 1].astype(float)
    infinity = TAIL_MASS_TRUNCATION - math.expm1(steps * math.log1p(-pmf._infinity_mass))  # noqa: SLF001
    return type(pmf)(pmf._discretization, pmf._lower_loss * steps + lo, probs, infinity,  # noqa: SLF001
                     pmf._pessimistic_estimate)  # noqa: SLF001


def _spectrum(pmf, length: int, precise: bool = False):
    """(length, the real FFT of one step's PMF at that length), in long double when ``precise`` (its mass set to
    exactly 1 - infinity mass at that precision too)."""
    from scipy import fft

    if precise:
        x = np.asarray(pmf._probs, dtype=np.longdouble)  # noqa: SLF001
        x *= (1 - np.longdouble(pmf._infinity_mass)) / x.sum()  # noqa: SLF001
    else:
        x = np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    return length, fft.rfft(x, length)


class SelfComposition:
    """One step's PMF, composed T-fold for any T: its ``_moments`` (the Chernoff window of any T) once, and its
    transforms, each reused for every T whose window fits it (up to ``REUSE_SLACK`` times longer than the
    window: longer would cost more than a fresh one). A search over T pays one transform per window size."""

    def __init__(self, pmf, precise: bool = False) -> None:
        self.pmf, self.precise = pmf, precise
        self._moments = None
        self._spectra: dict[int, tuple] = {}

    def bounds(self, steps: int) -> tuple[int, int]:
        if self._moments is None:
            self._moments = _moments(self.pmf)
        return _bounds_from(self._moments, len(self.pmf._probs), steps)  # noqa: SLF001

    def length(self, steps: int) -> int:
        return _fft_length(self.pmf, self.bounds(steps))

    def spectrum(self, steps: int):
        need = self.length(steps)
        fits = [n for n in self._spectra if need <= n <= REUSE_SLACK * need]
        if fits:
            return self._spectra[min(fits)]
        made = _spectrum(self.pmf, need, self.precise)
        self._spectra[need] = made
        while len(self._spectra) > SPECTRA_KEPT:
            del self._spectra[min(self._spectra)]
        return made

    def compose(self, steps: int):
        return _self_compose(self.pmf, steps, self.bounds(steps), precise=self.precise, spectrum=self.spectrum(steps))


def _power(spectrum, steps: int) -> None:
    """spectrum <- spectrum ** steps in place (float64 or long double), computing only the coefficients whose power is
    at least ``DROPPED`` (|c|^2 >= DROPPED^(2/T)) and setting the others to 0. numpy's complex long double
    power takes ~0.6 us a coefficient (log, exp and sincos on the x87: 4.6 s for one direction at
    p = 1e-3, T = 1e7), and at large T almost every coefficient's power is far below 1e-30: the composed
    distribution is smooth, so its spectrum is narrow. A dropped coefficient moves each output point by at
    most DROPPED / length, so the PMF moves by at most DROPPED x length in L1 (``dropped_bound``, paid
    with the round-off). The test is made against DROPPED / 2, so that the rounding of |c|^2 and of the
    threshold (relative ~1e-19, raised to the power T: ~1e-12 at T = 1e7) cannot let a dropped power
    reach DROPPED."""

    threshold = np.exp(2 * np.log(np.longdouble(DROPPED) / 2) / steps)
    for a in range(0, len(spectrum), _POWER_CHUNK):
        part = spectrum[a:a + _POWER_CHUNK]
        keep = np.square(part.real) + np.square(part.imag) >= threshold
        part[~keep] = 0
        part[keep] = np.power(part[keep], steps)


def dropped_bound(pmf, bounds: tuple[int, int]) -> float:
    """L1 bound on what ``_power``'s dropped coefficients move in a composition of ``pmf``: each dropped
    coefficient of the real transform stands for itself and its conjugate (2 DROPPED / length a point), on a
    transform up to ``REUSE_SLACK`` times the window's length (``SelfComposition``)."""
    return 2 * REUSE_SLACK * DROPPED * _fft_length(pmf, bounds)


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


@functools.cache
def _has_long_double() -> bool:
    """x86's 80-bit long double; on platforms where it is float64 there is nothing to gain."""

    return bool(np.finfo(np.longdouble).eps < np.finfo(float).eps)


def connect_dots_pmf(grid: float, lower: int, upper: int, deltas):
    """The pessimistic connect-the-dots PMF on losses ``lower..upper`` x ``grid`` from delta(eps) at those losses
    (dp-accounting's ``create_pmf_pessimistic_connect_dots_fixed_gap``: an upper bound for any pair whose
    hockey-stick curve takes these values), dense."""
    from dp_accounting.pld import pld_pmf

    return pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(grid, lower, upper, deltas).to_dense_pmf()
