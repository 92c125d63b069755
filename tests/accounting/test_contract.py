"""The accountant contract: one abstract test class every accountant in the registry passes (as dp-accounting's
``privacy_accountant_test.py`` is inherited by each of its accountants).

A subclass per registry entry is made below, so an accountant added to the registry (or registered from outside
code) is held to the same contract without a line here. Each test asks the accountant for the events it says it
covers (``Accountant.supports``, the sampler it accounts, the noises it lists) and checks:
- what it does not cover is refused with a reason (one line, ``DPAuditError``), never answered;
- it is never below the exact answer where one exists: T Gaussian steps that take every example (p = 1, or
  B = N), whose privacy loss is Gaussian with mu = sensitivity x sqrt(T) / sigma (Balle & Wang 2018, written
  out here from first principles), and one Laplace release, eps(delta) = 1/b + 2 log(1 - delta);
- it is monotone: eps falls as sigma grows, grows with T and with p;
- where it reports both directions, its answer is their max;
- where it answers delta(eps) too, the two agree: delta(eps(delta)) <= delta;
- its time budget holds: a query too large for a small budget is refused in about that time (or answered);
- its memory budget holds: under a small one a query is refused, or answered within it (allocations traced).
"""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dpaudit.accounting.matrix.strategy import Strategy
from dpaudit.accounting.mechanism import Mechanism, schedule
from dpaudit.accounting.registry import ACCOUNTANTS
from dpaudit.accounting.samplers import SCHEMES, scheme
from dpaudit.core import limits as budgets
from dpaudit.core.errors import DPAuditError

N = 1000  # dataset size where a sampler needs B and N
DELTA = 1e-5
CONTRACT = settings(max_examples=4, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.differing_executors])  # one subclass per accountant
SLOW_EXAMPLES = 2  # a Monte-Carlo accountant (~5 s an answer) is held to each property at fewer drawn cases


def contract(*strategies):
    """Marks a property of the contract with what it draws; each accountant's subclass gets it as a hypothesis
    test at that accountant's settings (below)."""
    def mark(test):
        test.draws = strategies
        return test
    return mark
SLACK = 1e-9  # float noise allowed on monotonicity (a bound is compared with itself at a neighbouring input)


def _sampling(name: str) -> str:
    """The first sampler (in the schemes' order) this accountant accounts."""
    return next(s for s, facts in SCHEMES.items() if not facts.refused and ACCOUNTANTS[name].covers(s))


def _kind(name: str) -> str:
    covered = ACCOUNTANTS[name].mechanisms
    return "gaussian" if covered is None or "gaussian" in covered else covered[0]


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The eps at ``delta`` of a Gaussian privacy loss with parameter mu (mu-GDP), solved from
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), which falls in eps."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    if excess(0.0) <= 0:
        return 0.0
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return brentq(excess, 0.0, hi, xtol=1e-12, rtol=1e-12)


class AccountantContract:
    """Inherited once per registry entry (``name``); see the module's docstring for what each test holds."""

    name: str

    @property
    def accountant(self):
        return ACCOUNTANTS[self.name]

    def event(self, sigma: float, p: float, steps: int, kind: str | None = None) -> Mechanism:
        """An event of the accountant's first sampler: p directly (Poisson) or as B / N."""
        sampling = _sampling(self.name)
        kind = kind or _kind(self.name)
        # a correlated-noise accountant is asked about BandMF with one band (C = I): DP-SGD's noise through its route
        strategy = Strategy("bandmf", bands=1) if self.accountant.strategies and kind == "gaussian" else None
        if scheme(sampling).needs_sizes:
            batch = max(1, min(N, round(p * N)))
            return schedule(kind, sigma, batch_size=batch, dataset_size=N, steps=steps, sampling=sampling,
                            strategy=strategy)
        return schedule(kind, sigma, p=p, steps=steps, sampling=sampling, strategy=strategy)

    def rate(self) -> float:
        """A sampling rate the accountant answers at: 0.1, or 1 for one that covers no subsampling (analytic)."""
        return 0.1 if self.accountant.supports(self.event(2.0, 0.1, 10), DELTA) is None else 1.0

    def needs(self, kind: str | None = None, p: float | None = None, what: str = "", steps: int = 10) -> None:
        """Skip, saying why, where the accountant does not cover this kind of event at all."""
        mech = self.event(2.0, self.rate() if p is None else p, steps, kind)
        reason = self.accountant.supports(mech, DELTA)
        if reason:
            pytest.skip(f"{self.name} does not cover {what or mech.kind}: {reason}")

    def answer(self, mech: Mechanism, delta: float = DELTA):
        reason = self.accountant.supports(mech, delta)
        assume(reason is None)
        return self.accountant.epsilon(mech, delta)

    # --- refusals ---------------------------------------------------------------------------------------------

    def test_refuses_what_it_does_not_cover_with_a_reason(self):
        acc = self.accountant
        uncovered = []
        if acc.mechanisms is not None:
            from dpaudit.accounting.noises import NOISES

            uncovered += [Mechanism(k, 2.0, 0.1, 10) for k in NOISES if k not in acc.mechanisms]
        uncovered += [schedule(_kind(self.name), 2.0, batch_size=10, dataset_size=N, steps=10, sampling=s)
                      for s, facts in SCHEMES.items() if not facts.refused and not acc.covers(s)]
        if acc.needs_positive_delta:
            uncovered.append((self.event(2.0, 0.1, 10), 0.0))
        assert uncovered or acc.mechanisms is None, "an accountant that covers everything lists no noises"
        for case in uncovered:
            mech, delta = case if isinstance(case, tuple) else (case, DELTA)
            reason = acc.supports(mech, delta)
            assert isinstance(reason, str) and reason, f"{self.name} does not refuse {mech}"
            with pytest.raises(DPAuditError) as refused:
                acc.epsilon(mech, delta)
            assert "\n" not in str(refused.value)

    # --- exact answers ----------------------------------------------------------------------------------------

    @contract(st.floats(0.5, 20.0), st.integers(1, 50), st.sampled_from([1e-3, 1e-5, 1e-8]))
    def test_never_below_the_exact_gaussian_without_subsampling(self, sigma, steps, delta):
        self.needs("gaussian", 1.0, "Gaussian steps without subsampling")
        mech = self.event(sigma, 1.0, steps, "gaussian")
        found = self.answer(mech, delta).epsilon
        # the unamplified matrix route takes sigma relative to the whole run's sensitivity: one release
        releases = 1 if self.accountant.strategies and self.name != "bandmf" else steps
        mu = scheme(mech.sampling).sensitivity * math.sqrt(releases) / sigma
        assert found >= exact_gaussian_epsilon(mu, delta) * (1 - 1e-9) - 1e-12

    @contract(st.floats(0.2, 20.0), st.sampled_from([0.0, 1e-5, 1e-2]))
    def test_never_below_one_exact_laplace_release(self, scale, delta):
        self.needs("laplace", 1.0, "one Laplace release", steps=1)
        mech = self.event(scale, 1.0, 1, "laplace")
        if scheme(mech.sampling).sensitivity != 1.0:
            pytest.skip(f"{mech.sampling} sampling moves a sum by {scheme(mech.sampling).sensitivity:g}: "
                        f"its exact one-release answer is another law")
        assume(delta > 0 or not self.accountant.needs_positive_delta)
        exact = max(0.0, 1 / scale + 2 * math.log1p(-delta))
        assert self.answer(mech, delta).epsilon >= exact * (1 - 1e-9) - 1e-12

    # --- monotone -----------------------------------------------------------------------------------------------

    @contract(st.floats(0.8, 10.0), st.floats(1.05, 2.0), st.floats(0.01, 0.3), st.integers(1, 40))
    def test_monotone_in_sigma(self, sigma, factor, p, steps):
        p = p if self.rate() < 1 else 1.0
        low = self.answer(self.event(sigma, p, steps)).epsilon
        high = self.answer(self.event(sigma * factor, p, steps)).epsilon
        assert high <= low + SLACK

    @contract(st.floats(0.8, 10.0), st.floats(0.01, 0.3), st.integers(1, 30), st.integers(1, 30))
    def test_monotone_in_steps(self, sigma, p, steps, extra):
        p = p if self.rate() < 1 else 1.0
        fewer = self.answer(self.event(sigma, p, steps)).epsilon
        more = self.answer(self.event(sigma, p, steps + extra)).epsilon
        assert more >= fewer - SLACK

    @contract(st.floats(0.8, 10.0), st.floats(0.01, 0.3), st.floats(1.2, 3.0), st.integers(1, 40))
    def test_monotone_in_sampling_rate(self, sigma, p, factor, steps):
        self.needs(p=0.1, what="subsampling")
        small = self.event(sigma, p, steps)
        large = self.event(sigma, min(1.0, p * factor), steps)
        assume(large.sampling_rate > small.sampling_rate)
        assert self.answer(large).epsilon >= self.answer(small).epsilon - SLACK

    # --- directions, delta(eps) ---------------------------------------------------------------------------------

    @contract(st.floats(0.8, 10.0), st.floats(0.01, 0.5), st.integers(1, 40))
    def test_answer_is_the_max_of_the_directions_it_reports(self, sigma, p, steps):
        p = p if self.rate() < 1 else 1.0
        result = self.answer(self.event(sigma, p, steps))
        if result.directions:
            assert result.epsilon == pytest.approx(max(result.directions.values()), rel=1e-12, abs=1e-15)
            assert set(result.directions) <= {"add", "remove"}

    @contract(st.floats(0.8, 10.0), st.floats(0.01, 0.5), st.integers(1, 40), st.sampled_from([1e-3, 1e-5]))
    def test_delta_of_epsilon_and_epsilon_of_delta_agree(self, sigma, p, steps, delta):
        if self.accountant.delta_fn is None:
            pytest.skip(f"{self.name} answers eps(delta) only")
        p = p if self.rate() < 1 else 1.0
        mech = self.event(sigma, p, steps)
        eps = self.answer(mech, delta).epsilon
        assume(math.isfinite(eps) and eps > 0)
        # both are upper bounds from one law: at the eps it answered for delta, its delta is not above delta
        # (a discretised law may differ by its grid; a Monte-Carlo one by its confidence margin: 5 %)
        assert self.accountant.delta(mech, eps).delta <= delta * 1.05

    # --- budgets ------------------------------------------------------------------------------------------------

    def test_time_budget_holds(self):
        mech = self.event(0.9, 0.3, 10**6)
        if self.accountant.supports(mech, DELTA):
            mech = self.event(0.9, 0.3, 2000)
        from dpaudit.accounting.registry import _load

        _load(self.accountant.epsilon_fn)  # imported first: the budget is the answer's time, not the first import's
        began = time.perf_counter()
        try:
            with budgets.limits(timeout=2.0):
                result = self.accountant.epsilon(mech, DELTA)
        except (budgets.OverBudget, DPAuditError) as exc:
            assert "\n" not in str(exc)
        else:
            assert result.epsilon > 0
        assert time.perf_counter() - began < 2.0 + 8.0, f"{self.name} ran {time.perf_counter() - began:.1f} s"

    def test_memory_budget_holds(self):
        """Under a small memory budget a query is refused in one line, or answered with the allocations it made
        (numpy's included: tracemalloc traces them) at most the budget at their peak."""
        import tracemalloc

        mech = self.event(0.9, 0.3, 2000)
        budget = 300 * 2**20
        tracemalloc.start()
        try:
            with budgets.limits(max_memory=budget, timeout=60.0):
                result = self.accountant.epsilon(mech, DELTA)
        except (budgets.OverBudget, DPAuditError) as exc:
            assert "\n" not in str(exc)
        else:
            assert result.epsilon > 0
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak <= budget, f"{self.name} allocated {peak / 2**20:.0f} MiB under a {budget / 2**20:.0f} MiB budget"


SLOW_ACCOUNTANTS = {"mc"}  # Monte-Carlo: ~5 s an answer; its class runs in the slow tier (CI runs both)

def _properties(name: str) -> dict:
    """The contract's drawn properties as hypothesis tests at ``name``'s settings."""
    chosen = settings(CONTRACT, max_examples=SLOW_EXAMPLES) if name in SLOW_ACCOUNTANTS else CONTRACT
    return {key: chosen(given(*test.draws)(test)) for key, test in vars(AccountantContract).items()
            if hasattr(test, "draws")}


for _name in ACCOUNTANTS:
    _cls = type(f"TestContract_{_name.replace('-', '_')}", (AccountantContract,), {"name": _name, **_properties(_name)})
    if _name in SLOW_ACCOUNTANTS:
        _cls = pytest.mark.slow(_cls)
    globals()[_cls.__name__] = _cls
del _name, _cls
