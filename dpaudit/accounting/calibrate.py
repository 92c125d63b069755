"""Calibration: the smallest noise that meets a target, and the reverse questions.

Every answer is checked against the same accountant function that `epsilon` exposes, so a
calibrated sigma always satisfies its own bound, and a sigma smaller by the relative
tolerance is shown (and returned) to exceed the target.

The search is over one scalar of any event (a Mechanism's sigma, or the multiplier of every phase's sigma)
and names no accountant: it uses what the registry says of them, a closed form (``Accountant.sigma``), a
quick accountant to start from and fall back on (``quick``), and an accountant's search hooks (``search``,
``search.SearchHooks``: a fixed resolution, a coarse evaluation, an estimate from below).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from dpaudit.core import limits as budget
from dpaudit.accounting.mechanism import Mechanism, miss_log_probability
from dpaudit.core.validate import check_delta, check_epsilon
from dpaudit.accounting.noises import noise
from dpaudit.accounting.registry import ACCOUNTANTS, default_accountant, epsilon, get_accountant
from dpaudit.accounting import search
from dpaudit.accounting.result import EpsilonResult
from dpaudit.core.errors import DPAuditError

SIGMA, STEPS = search.SIGMA, search.STEPS
SIGMA_MIN = SIGMA.low
SIGMA_MAX = SIGMA.high
MAX_STEPS = int(STEPS.high)
MAX_EVALUATIONS = search.MAX_SEARCH_EVALUATIONS


@dataclass(frozen=True)
class Calibration:
    """``sigma`` meets the target; ``sigma_rejected`` (= sigma * (1 - rtol/2)) does not."""

    sigma: float
    result: EpsilonResult
    sigma_rejected: float
    epsilon_rejected: float
    target_epsilon: float
    evaluations: int
    seconds: float
    converged: bool = True  # False: the time budget stopped the search; the smallest sigma is in [rejected, sigma]

    @property
    def epsilon(self) -> float:
        """The eps the calibrated sigma spends (an upper bound, <= the target)."""
        return self.result.epsilon


class _Evaluator:
    """epsilon(sigma) for a fixed schedule and accountant, memoised, with an evaluation count."""

    def __init__(self, template: Mechanism, delta: float, accountant: str, options, options_for=None) -> None:
        self.template, self.delta, self.accountant, self.options = template, delta, accountant, options
        self.options_for = options_for  # sigma -> options, when they depend on sigma (a fixed resolution)
        self.cache: dict[float, EpsilonResult] = {}
        self.slowest = 0.0  # seconds, the longest evaluation so far

    def __call__(self, sigma: float) -> EpsilonResult:
        if sigma not in self.cache:
            if len(self.cache) >= MAX_EVALUATIONS:
                raise DPAuditError("calibration did not converge (accountant is not monotone here?)")
            options = self.options_for(sigma) if self.options_for else self.options
            began = time.perf_counter()
            self.cache[sigma] = epsilon(self.template.with_sigma(sigma), self.delta, self.accountant, options)
            self.slowest = max(self.slowest, time.perf_counter() - began)
        return self.cache[sigma]

    def out_of_time(self) -> bool:
        """Whether one more round (up to two evaluations) might not fit the time budget: a search then
        stops on the bracket it has, whose upper end is valid, rather than be cut off with nothing."""
        return 3 * self.slowest > budget.current().seconds_left()


class _resolution_rule:
    """The accountant's converged resolution at ``sigma0``, carried to every sigma of the search (``rule``: the
    accountant's own, which may say how much its ladder improved there: ``improvement``)."""

    def __init__(self, hooks, template, delta: float, sigma0: float) -> None:
        self.template, self.rule = template, hooks.resolution(template.with_sigma(sigma0), delta)

    def __call__(self, sigma: float):
        return self.rule(self.template.with_sigma(sigma))


def _coarse_anchor(template, target: float, delta: float, anchor: float, name: str, hooks) -> tuple[float, int]:
    """(a start for the search, evaluations spent). A quick accountant's sigma can be far above the tight one
    (RDP at p = 1e-5, T = 1000, eps = 1, delta = 1e-5: 0.635 against PLD's 0.354), and a converged resolution
    fixed at a sigma whose eps is far below the target is far finer than the answer needs (there ~250x: 33 s an
    evaluation, 490 s a calibration, against 0.2 s). So one coarse evaluation (cheap, valid, loose) checks the
    anchor, and where eps there is below half the target, a search on coarse evaluations moves the anchor to
    where eps is about the target."""
    f = _Evaluator(template, delta, name, None, lambda sigma: hooks.coarse(template.with_sigma(sigma), delta))
    if f(anchor).epsilon >= target / 2:
        return anchor, 1
    return _solve(f, target, anchor, rtol=0.02).value, len(f.cache)


def _quick(template, delta: float, name: str) -> str | None:
    """An accountant that answers in about a second and covers this event (not ``name`` itself)."""
    return next((other for other, acc in ACCOUNTANTS.items()
                 if acc.quick and other != name and acc.supports(template, delta) is None), None)


class _Later:
    """A valid calibration to fall back on, made on first use (and kept): None when it cannot be made."""

    def __init__(self, make) -> None:
        self.make, self.made, self.tried = make, None, False

    def __call__(self) -> Calibration | None:
        if not self.tried:
            self.tried = True
            try:
                self.made = self.make()
            except DPAuditError:
                self.made = None
        return self.made


@dataclass(frozen=True)
class Start:
    """Where a search over sigma starts, a valid calibration to fall back on (``_Later``, or None), and how far
    its first step overshoots (``search.solve``): less from a close estimate."""

    sigma: float
    fallback: "_Later | None" = None
    overshoot: float = 1.1


ESTIMATE_OVERSHOOT = 1.01  # the CLT's sigma lands within ~1 % of PLD's at many steps (16.362 vs 16.369)


def _initial_sigma(template, target: float, delta: float, accountant: str) -> Start:
    """Where the search starts (``Start``)."""
    for other in ACCOUNTANTS.values():  # any closed form that covers the event is a start
        if other.sigma_fn is not None and other.supports(template, delta) is None:
            closed = other.sigma(template, target, delta)
            if closed is not None:
                return Start(closed)
    quick = None if get_accountant(accountant).quick else _quick(template, delta, accountant)
    if quick is not None and delta > 0:
        # Each step's pair is at total variation <= its chance of taking the example, and T steps at
        # <= 1 - (chance of missing it every step) (coupling): at delta at least that, eps = 0 holds with any sigma.
        missed = miss_log_probability(template)
        if missed > -math.inf and delta >= -math.expm1(missed):
            raise DPAuditError(f"target eps={target:g} is met with any sigma: delta={delta:g} is at least "
                               f"1 - (1 - p)^T, so no meaningful noise level to calibrate")
        # A quick accountant (RDP) calibrates in ~0.5 s and lands 0-20 % above the tight sigma: a valid (looser)
        # answer should the search not fit the time budget, made only then (``_Later``), and a start two
        # evaluations away where the noise has no estimate of its own (the Gaussian's CLT: ``estimated_sigma``).
        fallback = _Later(lambda: calibrate_sigma(template, target, delta, quick, rtol=0.02))
        estimate = noise(template.kind).estimated_sigma(template, target, delta) if isinstance(template, Mechanism) \
            else None
        if estimate is not None and SIGMA_MIN < estimate < SIGMA_MAX:
            # No check at SIGMA_MIN here: the estimate exists only for many Poisson-like steps, and with delta
            # below the chance of taking the example (checked above) a step at SIGMA_MIN spends eps of order
            # 1 / (2 SIGMA_MIN^2) = 5e5; the quick accountant's evaluation there cost 0.1 s of a 0.6 s
            # calibration to say so. A target met there still ends the search at SIGMA_MIN, refused as below.
            return Start(estimate, fallback, ESTIMATE_OVERSHOOT)
        if epsilon(template.with_sigma(SIGMA_MIN), delta, quick).epsilon <= target:  # a valid bound says so
            raise DPAuditError(f"target eps={target:g} is met even with sigma={SIGMA_MIN:g}: "
                               f"no meaningful noise level to calibrate")
        if fallback() is not None:
            return Start(0.95 * fallback().sigma, fallback)
    if isinstance(template, Mechanism) and template.group > 1 and delta > 0:  # ELS: no quick accountant covers it
        estimate = noise(template.kind).estimated_sigma(template, target, delta)
        if estimate is not None and SIGMA_MIN < estimate < SIGMA_MAX:
            return Start(estimate)  # the CLT reads 4-10 % low at a few hundred steps: the usual first step
    # Gaussian: the classic sqrt(2 log(1.25/delta)) scaling, with amplification p sqrt(T).
    scale = template.sampling_rate * math.sqrt(template.steps) if template.steps > 1 else 1.0
    return Start(max(0.3, scale * math.sqrt(2 * math.log(1.25 / max(delta, 1e-300))) / target))


def _solve(f: "_Evaluator", target: float, start: float, rtol: float, overshoot: float = 1.1,
           bracket=None) -> search.Found:
    """``search.solve`` over sigma for ``f``, saying what the domain's ends mean for a calibration."""
    try:
        found = search.solve(lambda sigma: f(sigma).epsilon, target, SIGMA, start, rtol=rtol, overshoot=overshoot,
                             out_of_time=f.out_of_time, bracket=bracket)
    except search.Unreachable as exc:
        raise DPAuditError(f"target eps={target:g} is unreachable: even sigma={SIGMA_MAX:g} gives "
                           f"eps={exc.eps:.4g}") from None
    if found.at_end:
        raise DPAuditError(f"target eps={target:g} is met even with sigma={SIGMA_MIN:g}: "
                           f"no meaningful noise level to calibrate")
    return found


def _polish(template, target: float, delta: float, fixed, lo: float, hi: float, width: float, name: str):
    """The search ran at one fixed resolution; the accountant at its own (pld: a full ladder, the smallest
    bound over its grids) can accept the sigma that resolution rejected, where the bound is not monotone in the
    resolution. Then bisect further down that way, while the time budget allows (a ladder costs ~4x)."""
    ladder = _Evaluator(template, delta, name, None)
    began = time.perf_counter()
    if ladder(lo).epsilon > target:
        return _ladder_crossing(fixed, ladder, target, lo, hi)
    cost = time.perf_counter() - began

    def time_left() -> bool:
        return budget.current().seconds_left() > 4 * cost

    accepted, below = lo, lo * math.exp(-8 * width)
    while ladder(below).epsilon <= target:  # walk down until the ladder rejects
        if not time_left():  # no sigma rejected by the ladder yet: keep the fixed grid's bracket
            return fixed, lo, hi, len(ladder.cache)
        accepted, below = below, below * math.exp(-8 * width)
    lo, hi = below, accepted
    while math.log(hi / lo) > width and time_left():
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ladder(mid).epsilon <= target else (mid, hi)
    return ladder, lo, hi, len(ladder.cache)


def _ladder_crossing(fixed, ladder, target: float, lo: float, hi: float):
    """The ladder rejected ``lo`` too, but reads lower than the fixed resolution there by a factor e^g. Taking the
    same factor at every sigma of the bracket, the ladder meets the target where the fixed resolution reads
    target x e^g: one ladder evaluation there (a twentieth of the bracket to the safe side), kept where it meets
    the target (a valid bound), so the answer lands near the ladder's crossing, not anywhere in the fixed
    bracket. Returns ``_polish``'s (evaluator, lo, hi, ladder evaluations)."""
    f_lo, f_hi, l_lo = fixed(lo).epsilon, fixed(hi).epsilon, ladder(lo).epsilon
    if not (0 < f_hi <= target < l_lo <= f_lo < math.inf) or f_lo == f_hi:
        return fixed, lo, hi, 1
    gap = math.log(f_lo) - math.log(l_lo)
    share = (math.log(f_lo) - math.log(target) - gap) / (math.log(f_lo) - math.log(f_hi))
    u = math.log(lo) + (min(1.0, max(0.0, share)) + 1 / 20) * (math.log(hi) - math.log(lo))
    if not math.log(lo) < u < math.log(hi) or budget.current().seconds_left() < 8 * ladder.slowest:
        return fixed, lo, hi, 1
    sigma = math.exp(u)
    if ladder(sigma).epsilon <= target:
        return ladder, lo, sigma, 2
    return fixed, lo, hi, 2


def calibrate_sigma(template: Mechanism, target_eps: float, delta: float, accountant: str | None = None,
                    rtol: float = 1e-3, options=None) -> Calibration:
    """Smallest sigma (to relative tolerance ``rtol``, never on the wrong side) with eps <= target."""
    check_epsilon(target_eps)
    check_delta(delta, allow_zero=True)
    if not 0 < rtol < 0.5:
        raise DPAuditError(f"relative tolerance must be in (0, 0.5), got {rtol}")
    name = accountant or default_accountant(template, delta)
    acc = get_accountant(name)
    reason = acc.supports(template, delta)
    if reason:
        raise DPAuditError(reason)
    start = time.perf_counter()
    exact = acc.sigma(template, target_eps, delta)
    width = math.log1p(rtol / 2)

    if exact is not None:
        f = _Evaluator(template, delta, name, options)
        hi = exact
        bump = 1e-14
        while f(hi).epsilon > target_eps:  # floating-point rounding of the inverse only
            hi *= 1 + bump
            bump *= 10
        lo, converged = hi * (1 - rtol / 2), True
    else:
        hooks = acc.search_hooks() if options is None else None
        if hooks is not None and hooks.start is not None:  # the accountant's own start (allocation: Poisson's)
            begin = Start(hooks.start(template, target_eps, delta), None, hooks.overshoot)
        else:
            begin = _initial_sigma(template, target_eps, delta, name)
        anchor, fallback, evaluations = begin.sigma, begin.fallback, 0
        overshoot = min(begin.overshoot, hooks.overshoot) if hooks is not None else begin.overshoot
        fixed_resolution = hooks is not None
        hint = None  # the last attempt's bracket, a start for the next (checked at the new resolution)
        for attempt in range(3):
            # The resolution is fixed from a converged evaluation at the anchor; if the answer lands far from
            # the anchor, it is re-fixed there and the search repeated from it (the converged resolution can
            # change with sigma, e.g. pld's at p = 1e-5).
            try:
                if fixed_resolution and attempt == 0:
                    anchor, evaluations = _coarse_anchor(template, target_eps, delta, anchor, name, hooks)
                rule = _resolution_rule(hooks, template, delta, anchor) if fixed_resolution else None
                f = _Evaluator(template, delta, name, options, rule)
                found = _solve(f, target_eps, anchor, rtol / 2, overshoot, bracket=hint)
            except budget.OverBudget as exc:
                if fallback is None or not math.isfinite(budget.current().seconds_left()) or fallback() is None:
                    raise
                return _fell_back(fallback(), name, str(exc), time.perf_counter() - start)
            lo, hi = found.rejected, found.value
            evaluations += len(f.cache)
            if not fixed_resolution or abs(math.log(hi / anchor)) < 0.05 or f.out_of_time():
                break
            anchor, hint = hi, (hi, lo)
        per_evaluation = (time.perf_counter() - start) / max(1, evaluations)
        # The accountant's own resolution reads eps lower than the fixed one by about the anchor ladder's last
        # improvement: where the rejected sigma's eps is further above the target than twice that, it would
        # reject it too, and the polish is skipped (it could only ever accept a smaller sigma).
        improvement = getattr(getattr(rule, "rule", None), "improvement", None) if fixed_resolution else None
        hopeless = improvement is not None and f(lo).epsilon > target_eps * (1 + 2 * improvement)
        if fixed_resolution and not hopeless and budget.current().seconds_left() > 8 * per_evaluation:
            f, lo, hi, extra = _polish(template, target_eps, delta, f, lo, hi, width, name)
            evaluations += extra
        converged = _closed(lo, hi, width)
        if fallback is not None and not converged and fallback() is not None and fallback().sigma < hi:
            # Stopped for time on a wide bracket whose valid end is above the quick sigma: the smaller valid one.
            return _fell_back(fallback(), name, f"its search stopped with sigma between {lo:.6g} and {hi:.6g}",
                              time.perf_counter() - start)
    return Calibration(
        sigma=hi, result=f(hi), sigma_rejected=lo, epsilon_rejected=f(lo).epsilon,
        target_epsilon=target_eps, evaluations=evaluations if exact is None else len(f.cache),
        seconds=time.perf_counter() - start, converged=converged,
    )


def _closed(lo: float, hi: float, width: float) -> bool:
    """Whether the bracket is as narrow as asked (a search cut short by the time budget leaves it wider)."""
    return math.log(hi / lo) <= width * (1 + 1e-9)


def _fell_back(quick: Calibration, requested: str, why: str, seconds: float) -> Calibration:
    """The quick accountant's calibration (valid, looser), saying why the requested accountant's is not there."""
    name = quick.result.accountant
    return replace(quick, seconds=seconds, result=quick.result.standing_in_for(
        requested, f"{requested} did not fit the time budget ({why}); this sigma is {name}'s (valid; a {requested} "
                   f"search given more time would find a smaller one: --timeout)"))


@dataclass(frozen=True)
class StepsAnswer:
    steps: int
    at_cap: bool  # True when even MAX_STEPS steps stay within the target
    result: EpsilonResult  # at ``steps``
    epsilon_next: float | None  # epsilon at steps + 1 (exceeds the target), None at the cap

    @property
    def epsilon(self) -> float:
        return self.result.epsilon


def max_steps(template: Mechanism, target_eps: float, delta: float, accountant: str | None = None,
              options=None) -> StepsAnswer:
    """Largest T with eps(T) <= target for the given sigma and p: ``search.solve`` over T. Where the accountant
    offers a curve (pld), every T is read from one composed loss of the step (one transform per window size),
    first at the refinement's first rung, then at the resolution it converges to at the answer."""
    check_epsilon(target_eps)
    check_delta(delta, allow_zero=True)
    name = accountant or default_accountant(template.with_steps(2), delta)
    capped = _quick_at_cap(template, target_eps, delta, name)
    if capped is not None:
        return StepsAnswer(MAX_STEPS, True, capped, None)
    hooks = get_accountant(name).search_hooks()
    if hooks is not None and hooks.curve is not None:
        first = options if options is not None else hooks.first(template, delta)
        found, at = _steps_search(hooks.curve(template, delta, first), target_eps)
        if options is None and not found.at_end:
            converged = hooks.resolution(template.with_steps(int(found.value)), delta)(template)
            if converged.grid != first.grid:
                finer, finer_at = _steps_search(hooks.curve(template, delta, converged), target_eps,
                                                start=found.value)
                if finer.value > found.value:  # both valid: the larger T
                    found, at = finer, finer_at
        return _steps_answer(found, at)
    cache: dict[int, EpsilonResult] = {}
    step_options = options

    def at(steps: int) -> EpsilonResult:
        if steps not in cache:
            cache[steps] = epsilon(template.with_steps(steps), delta, name, step_options)
        return cache[steps]

    bracket = None
    if hooks is not None and hooks.below is not None:
        if at(1).epsilon > target_eps:
            _one_step_over(at(1).epsilon, target_eps)
        try:
            good, bad = _estimated_bracket(template, target_eps, delta, 1, name, hooks)
        except (OverflowError, ValueError, FloatingPointError):
            good, bad = 1, None  # the estimate from below fails on extreme inputs; search from one step
        if options is None:
            step_options = hooks.resolution(template.with_steps(good), delta)(template.with_steps(good))
            cache.clear()
        if at(good).epsilon <= target_eps and (bad is None or at(bad).epsilon > target_eps):
            bracket = (good, bad) if bad is not None else None
    found, _ = _steps_search(at, target_eps, bracket=bracket)
    return _steps_answer(found, at)


def _quick_at_cap(template: Mechanism, target: float, delta: float, name: str) -> EpsilonResult | None:
    """A quick accountant's bound at the cap (T = MAX_STEPS), where it already meets the target: then so does
    every T below it, and the search (whose last evaluations, at 1e7-1e8 steps, each cost seconds in long
    double) is not needed. None otherwise."""
    quick = None if get_accountant(name).quick else _quick(template.with_steps(MAX_STEPS), delta, name)
    if quick is None or delta <= 0:
        return None
    try:
        found = epsilon(template.with_steps(MAX_STEPS), delta, quick)
    except (DPAuditError, OverflowError, ValueError, FloatingPointError):
        return None
    if not found.epsilon <= target:
        return None
    return found.standing_in_for(name, f"{quick}'s bound already meets the target at the cap of {MAX_STEPS:g} "
                                       f"steps (an upper bound there, so at every T below it)")


def _one_step_over(eps: float, target: float):
    raise DPAuditError(f"even one step spends eps={eps:.4g} > target {target:g}; raise sigma")


def _steps_search(at, target: float, start: float = 1, bracket=None):
    """(``search.Found`` over T, T -> EpsilonResult memoised) for ``at`` (T -> EpsilonResult)."""
    cache: dict[int, EpsilonResult] = {}

    def memo(steps: float) -> EpsilonResult:
        steps = int(steps)
        if steps not in cache:
            cache[steps] = at(steps)
        return cache[steps]

    if memo(1).epsilon > target:
        _one_step_over(memo(1).epsilon, target)
    try:
        found = search.solve(lambda t: memo(t).epsilon, target, STEPS, start, bracket=bracket)
    except search.Unreachable as exc:  # not met at T = 1, which was checked: only a non-monotone accountant
        raise DPAuditError(f"even one step spends eps={exc.eps:.4g} > target {target:g}; raise sigma") from None
    return found, memo


def _steps_answer(found: search.Found, at) -> StepsAnswer:
    steps = int(found.value)
    if found.at_end:
        return StepsAnswer(steps, True, at(steps), None)
    return StepsAnswer(steps, False, at(steps), at(int(found.rejected)).epsilon)


def _last_true(ok, good: int, bad: int) -> int:
    """Bisection on integers: the largest t in [good, bad) with ok(t), given ok(good) and not ok(bad)
    (ok is monotone: true up to some t, false after)."""
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


def _estimated_bracket(template: Mechanism, target: float, delta: float, good: int, name: str,
                       hooks) -> tuple[int, int | None]:
    """A narrow bracket for max-steps from cheap evaluations at the accountant's first resolution: the bound is
    valid, so where it meets the target so does the converged one (good); the estimate from below is below the
    true eps, so where it exceeds the target the true eps does too (bad). The converged resolution then bisects
    the gap."""
    coarse = hooks.first(template, delta)  # coarse for this mechanism: cheap, valid above, an estimate below

    def upper(t: int) -> float:
        return epsilon(template.with_steps(t), delta, name, coarse).epsilon

    def lower(t: int) -> float:
        return hooks.below(template.with_steps(t), delta, coarse)

    hi = good
    while not lower(hi) > target:  # NaN (dp-accounting's optimistic PMF can fail at large T) is not "exceeds"
        if hi >= MAX_STEPS:
            return good, None
        hi = min(hi * 2, MAX_STEPS)
    lo = max(1, hi // 2) if hi > 1 else 1
    lo = lo if upper(lo) <= target else good
    a = _last_true(lambda t: upper(t) <= target, lo, hi)  # the largest T the coarse upper bound allows
    d = _last_true(lambda t: lower(t) <= target, a, hi) + 1  # the first T the optimistic estimate exceeds
    return a, d


def epsilons_over_steps(template: Mechanism, steps: list[int], delta: float,
                        accountant: str | None = None) -> list[EpsilonResult]:
    """eps at each T of ``steps`` (a curve of eps against T). Where the accountant offers a curve (pld), the
    resolution it converges to at the largest T is fixed once and every T is read from one composed loss of
    the step; otherwise each T is its own evaluation. Each is a valid bound, as ``epsilon`` is."""
    name = accountant or default_accountant(template.with_steps(max(2, max(steps))), delta)
    hooks = get_accountant(name).search_hooks()
    if hooks is None or hooks.curve is None:
        return [epsilon(template.with_steps(t), delta, name) for t in steps]
    last = template.with_steps(max(steps))
    at = hooks.curve(template, delta, hooks.resolution(last, delta)(template))
    return [at(t) for t in steps]
