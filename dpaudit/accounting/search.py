"""What an accountant offers a search over sigma or T, so that calibration and max-steps know no accountant
by name (the registry hands each accountant's hooks to them).

An accountant whose answer depends on a resolution it refines itself (``pld``: a grid refined until the bound
converges) can make a search far cheaper by fixing that resolution once and evaluating every candidate at it:
any resolution gives a valid bound, so the search stays on the right side, and a final check at the
accountant's own converged resolution can only accept a smaller sigma. Accountants without hooks are
searched as they answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dpaudit.core import limits as budget
from dpaudit.core.errors import DPAuditError


@dataclass(frozen=True)
class SearchHooks:
    # (event, delta) -> options: the cheapest valid evaluation (loose), to move a start near the answer
    coarse: Callable
    # (event, delta) -> options: the refinement's first rung (valid; what brackets in T are read on)
    first: Callable
    # (anchor event, delta) -> (event -> options): the resolution the accountant converges to at the anchor,
    # carried to other events of the same schedule
    resolution: Callable
    # (event, delta, options) -> float: an estimate *below* the true eps on those options (brackets only)
    below: Callable | None = None
    # (template, target eps, delta) -> sigma: a start near the answer (e.g. a cheaper sampler's calibration)
    start: Callable | None = None
    overshoot: float = 1.1   # the bracket's first step past the target: less where the start is known to be close
    # (template, delta, options or None) -> (T -> EpsilonResult): eps against T for one sigma and p at one
    # resolution (the first rung when None), one composed loss reused across T (pld: ``pld.StepsCurve``)
    curve: Callable | None = None


# --- the one search ------------------------------------------------------------------------------------------
# Modelled on dp-accounting's mechanism_calibration.calibrate_dp_mechanism (one search, generic over "build the
# event from this parameter", with a flag for whole numbers); by hand because it also brackets from a start
# using the local slope of log eps in log x, stops for time on a valid end, and reports the rejected neighbour.

MAX_SEARCH_EVALUATIONS = 80
MAX_STEP = math.log(16.0)   # a bracketing step moves the parameter by at most 16x
CLOSER_STEPS = 3            # interpolated evaluations once the bracket is as narrow as asked (``_closer``)


@dataclass(frozen=True)
class Parameter:
    """What a search is over: ``name``, its domain [low, high], whether eps grows with it (steps, sampling rate,
    batch size) or falls (sigma), and whether it is a whole number."""

    name: str
    low: float
    high: float
    eps_grows: bool
    integer: bool = False


SIGMA = Parameter("sigma", 1e-3, 1e6, eps_grows=False)
STEPS = Parameter("steps", 1, 10**8, eps_grows=True, integer=True)
SAMPLING_RATE = Parameter("sampling rate", 1e-12, 1.0, eps_grows=True)


class Unreachable(Exception):
    """The target is not met anywhere in the domain (``at`` is the domain's safest end)."""

    def __init__(self, at: float, eps: float) -> None:
        super().__init__(f"not met even at {at:g} (eps {eps:.4g})")
        self.at, self.eps = at, eps


@dataclass(frozen=True)
class Found:
    """``value`` meets the target (its eps, read from the same function, is <= target: checked); ``rejected`` is
    the neighbour that does not, None where ``value`` is the domain's end (``at_end``). ``converged``: the two are
    as close as asked (False: the time budget stopped the search; ``value`` is still valid)."""

    value: float
    rejected: float | None
    evaluations: int
    converged: bool

    @property
    def at_end(self) -> bool:
        return self.rejected is None


def solve(eps_at: Callable[[float], float], target: float, parameter: Parameter, start: float, *,
          rtol: float = 1e-3, overshoot: float = 1.1, out_of_time: Callable[[], bool] = lambda: False,
          bracket: tuple[float, float | None] | None = None) -> Found:
    """The extreme value of ``parameter`` whose eps meets ``target``: the smallest sigma, the largest T or p.

    ``eps_at`` must be non-decreasing in the parameter where ``eps_grows`` (non-increasing otherwise) and is
    called at most ``MAX_SEARCH_EVALUATIONS`` times (memoise it: ends are read again). Reals are searched to
    relative width ``rtol`` (log-space), whole numbers to neighbours. ``bracket``: (a value known to meet the
    target, one known not to or None) to start from instead of bracketing from ``start``."""
    grows = 1.0 if parameter.eps_grows else -1.0
    width = math.log1p(rtol) if not parameter.integer else 0.0  # the bracket's relative width at the end
    seen: dict[float, float] = {}

    def f(x: float) -> float:
        if x not in seen:
            if len(seen) >= MAX_SEARCH_EVALUATIONS:
                raise DPAuditError(f"the search over {parameter.name} did not converge (eps not monotone here?)")
            seen[x] = eps_at(x)
        return seen[x]

    def clamp(u: float) -> float:
        x = min(max(math.exp(u), parameter.low), parameter.high)
        return float(round(x)) if parameter.integer else x

    if bracket is not None and not (f(bracket[0]) <= target and (bracket[1] is None or f(bracket[1]) > target)):
        start, bracket = bracket[0], None  # a hint that does not hold here: bracket from its good end
    good, bad = bracket if bracket is not None else _bracket(f, target, parameter, start, grows, overshoot,
                                                             out_of_time, clamp)
    if good is None:
        end = parameter.high if grows < 0 else parameter.low
        raise Unreachable(end, f(end))
    if bad is not None:
        good, bad = _narrow(f, target, parameter, good, bad, grows, width, out_of_time)
        for _ in range(CLOSER_STEPS):  # reals: land near the crossing, not anywhere in the last bracket
            if parameter.integer or out_of_time() or abs(math.log(bad / good)) <= width / 50:
                break
            good, bad = _closer(f, target, good, bad)
    if not f(good) <= target:  # the safe-side check: the answer's own evaluation meets the target
        raise DPAuditError(f"internal error: the search's answer {parameter.name} = {good:g} reads eps "
                           f"{f(good):.6g} > {target:g}")
    converged = bad is None or _close(good, bad, parameter, width)
    return Found(good, bad, len(seen), converged)


def _closer(f, target: float, good: float, bad: float) -> tuple[float, float]:
    """One more evaluation once the bracket is as narrow as asked: where log eps, interpolated linearly in
    log x between the ends, meets the target, moved a twentieth of the bracket to the safe side. The bracket
    only shrinks (the point is kept on whichever side it falls), and the answer lands near the crossing
    rather than anywhere in the last bracket (up to ``width`` above it)."""
    e_good, e_bad = f(good), f(bad)
    if not (0 < e_good < target < e_bad < math.inf):
        return good, bad
    u_good, u_bad = math.log(good), math.log(bad)
    share = (math.log(target) - math.log(e_good)) / (math.log(e_bad) - math.log(e_good))
    u = u_good + share * (u_bad - u_good) - (u_bad - u_good) / 20
    if not min(u_good, u_bad) < u < max(u_good, u_bad) or math.exp(u) in (good, bad):
        return good, bad
    x = math.exp(u)
    return (x, bad) if f(x) <= target else (good, x)


def _close(good: float, bad: float, parameter: Parameter, width: float) -> bool:
    if parameter.integer:
        return abs(bad - good) <= 1
    return abs(math.log(bad / good)) <= width * (1 + 1e-9)


def _bracket(f, target, parameter, start, grows, overshoot, out_of_time, clamp):
    """(good, bad): eps(good) <= target < eps(bad), stepping in log space by the local slope of log eps
    (1 until two points are seen), overshooting a little so one step usually brackets; (good, None) when the
    domain's end still meets the target, (None, bad) when its other end does not."""
    least = math.log(min(1.05, overshoot))
    good = bad = None
    x = clamp(math.log(start))
    points: list[tuple[float, float]] = []
    while good is None or bad is None:
        if out_of_time():
            raise budget.OverBudget(f"the search over {parameter.name} ran out of its time budget while bracketing")
        eps = f(x)
        if math.isfinite(eps) and eps > 0:
            points.append((math.log(x), math.log(eps)))
        slope = 1.0
        if len(points) >= 2 and points[-1][0] != points[-2][0]:
            slope = min(8.0, max(0.25, abs((points[-1][1] - points[-2][1]) / (points[-1][0] - points[-2][0]))))
        if eps <= target:
            good = x if good is None or (x - good) * grows > 0 else good
            toward = grows  # more eps: up in T, down in sigma
            if x == (parameter.high if grows > 0 else parameter.low):
                return good, None
        else:
            bad = x if bad is None or (x - bad) * grows < 0 else bad
            toward = -grows
            if x == (parameter.low if grows > 0 else parameter.high):
                return None, bad
        if good is not None and bad is not None:
            break
        gap = abs(math.log(target / eps)) if math.isfinite(eps) and eps > 0 else MAX_STEP
        step = min(MAX_STEP, max(least, math.log(overshoot) + gap / slope))
        nxt = clamp(math.log(x) + toward * step)
        if nxt == x:  # a whole number that rounds back: one unit on
            nxt = min(max(x + toward, parameter.low), parameter.high)
        x = nxt
    return good, bad


def _narrow(f, target, parameter, good, bad, grows, width, out_of_time):
    """Shrink (good, bad) to neighbours (whole numbers) or relative width ``width``: secant on (log x, log eps),
    then evaluations just either side of the estimate so one pass usually closes it; bisection once narrow.
    Illinois rule: when the same end moves twice running, the other end's weight is halved, so a curved eps
    cannot stall the secant on one side (regula falsi's failure mode)."""
    log_t = math.log(target)

    def g(x: float) -> float:
        eps = f(x)
        return (math.log(eps) if eps > 0 else -math.inf) - log_t if math.isfinite(eps) else math.inf

    def inside(u: float) -> float | None:
        """A point strictly between the ends at log-position u (None when there is none)."""
        lo, hi = sorted((good, bad))
        if parameter.integer:
            if hi - lo <= 1:
                return None
            return float(min(max(round(math.exp(u)), lo + 1), hi - 1))
        return min(max(math.exp(u), lo * math.exp(width / 2)), hi * math.exp(-width / 2))

    w_good = w_bad = 1.0
    last = None
    for _ in range(MAX_SEARCH_EVALUATIONS):
        if _close(good, bad, parameter, width) or out_of_time():
            break
        u_good, u_bad = math.log(good), math.log(bad)
        narrow = (bad - good) * grows <= 8 if parameter.integer else abs(u_bad - u_good) <= 4 * width
        g_good, g_bad = g(good) * w_good, g(bad) * w_bad
        if narrow or not (math.isfinite(g_good) and math.isfinite(g_bad)) or g_good == g_bad:
            u = (u_good + u_bad) / 2 if not parameter.integer else math.log((good + bad) / 2)
        else:
            u = u_good + g_good * (u_bad - u_good) / (g_good - g_bad)
        if narrow:
            mid = inside(u)
            if mid is None:
                break
            if f(mid) <= target:
                good = mid
            else:
                bad = mid
            continue
        # either side of the estimate, the good side's point first
        near, far = inside(u - grows * width / 2), inside(u + grows * width / 2)
        if parameter.integer:
            near, far = inside(u), inside(math.log(max(1.0, math.exp(u) + grows)))
        moved = None
        for x in (near, far):
            if x is None or x in (good, bad):
                continue
            if f(x) <= target:
                good, moved = x, ("good" if moved is None else moved)
            else:
                bad, moved = x, ("bad" if moved is None else "both")
                break
        if moved is None:
            mid = inside((u_good + u_bad) / 2)
            if mid is None:
                break
            good, bad = (mid, bad) if f(mid) <= target else (good, mid)
            moved = "both"
        w_good = w_good / 2 if moved == last == "bad" else (1.0 if moved != "bad" else w_good)
        w_bad = w_bad / 2 if moved == last == "good" else (1.0 if moved != "good" else w_bad)
        last = moved
    return good, bad
