"""User-level answers side by side: ELS, ULS and group privacy for one schedule (``compare --unit user``).

Group privacy, the baseline (Dwork & Roth 2014, Thm 2.2, applied one member at a time): a mechanism that is
(eps, delta)-DP for one record is (k eps, delta (1 + e^eps + ... + e^{(k-1) eps}))-DP for k records; the sum is
at most the k e^{(k-1) eps} delta people usually quote. For a user-level delta, the record-level delta_1 is searched
so that delta_1 (1 + ... + e^{(k-1) eps(delta_1)}) <= delta, and every answer is checked on that inequality: any
delta_1 it holds at gives a valid bound, the search only makes it small.

ELS and ULS are accounted by the registry (``unit.py`` has their theorems). For the three to be compared at the
same data, ``rows`` takes the schedule as records are sampled (p = B / N records, T steps, k records a user, every
user holding k): ULS then samples users at the same rate p (the same expected records a step, B), and its user's
contribution is clipped as one, so a step carries B / k clipped units where ELS's carries B. ``noise_per_signal``
says what that costs: the noise std over the expected clipped units a step, relative to ELS's (sigma_ULS k /
sigma_ELS; group privacy and ELS train the same way, so theirs is sigma / sigma_ELS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dpaudit.accounting.calibrate import calibrate_sigma
from dpaudit.accounting.mechanism import Mechanism, Phases, with_unit
from dpaudit.accounting.pld import composed_pld, converged_grid
from dpaudit.accounting.registry import default_accountant, epsilon
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.unit import EXAMPLE, Unit
from dpaudit.core.errors import DPAuditError
from dpaudit.core.validate import check_delta

Event = Mechanism | Phases
SEARCH_STEPS = 30   # bisection steps over log delta_1 (each a record-level eps at delta_1)
SPAN = 25.0         # delta_1 searched in [delta / k e^-25, delta / k]: below, the factor's growth has long won
TOLERANCE = 0.01    # the bisection stops with delta_1 within 1 % of the largest that holds


def group_factor(eps: float, k: int) -> float:
    """1 + e^eps + ... + e^{(k-1) eps}: what a record-level delta is multiplied by for a group of k."""
    if eps == 0:
        return float(k)
    return math.expm1(k * eps) / math.expm1(eps) if k * eps < 700 else math.inf


def group_privacy(mech: Event, k: int, delta: float, accountant: str | None = None) -> EpsilonResult:
    """User-level eps at ``delta`` of ``mech`` (its record-level schedule) by group privacy over k records: an
    upper bound (the record-level accountant's bound at delta_1, carried to k records)."""
    check_delta(delta, allow_zero=True)
    record = with_unit(mech, EXAMPLE)
    if delta == 0:
        return _grouped(epsilon(record, 0.0, accountant), k, 0.0, 0.0)
    base = epsilon(record, delta / k, accountant)  # delta_1 <= delta / k: the factor is at least k
    if delta / k * group_factor(base.epsilon, k) <= delta:  # k = 1, or eps_1 = 0 there: nothing to search
        return _grouped(base, k, delta / k, delta)
    eps_of = _record_epsilons(record, delta, k, base, accountant)
    # the largest delta_1 that holds gives the smallest eps: bisect log delta_1 (the product falls with it)
    hi, lo = math.log(delta / k), math.log(delta / k) - SPAN
    good = None
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        eps = eps_of(math.exp(mid))
        if math.exp(mid) * group_factor(eps, k) <= delta:
            lo, good = mid, eps
        else:
            hi = mid
        if hi - lo < TOLERANCE:
            break
    if good is None:  # not even at the low end: no finite bound this way
        return _grouped(replace(base, epsilon=math.inf), k, math.exp(lo), delta)
    return _grouped(replace(base, epsilon=good), k, math.exp(lo), delta)


def group_epsilon(mech: Event, delta: float) -> EpsilonResult:
    """The ``group`` accountant (registry.py): an ELS event's k records by group privacy."""
    return group_privacy(mech, mech.group, delta)


def _record_epsilons(record: Event, delta: float, k: int, base: EpsilonResult, accountant: str | None):
    """delta_1 -> the record-level eps at delta_1 (an upper bound): where pld answered, read from one composed
    PLD at its converged grid (a scan a query), else (and where that PLD does not resolve delta_1: below ~1e-12
    its round-off reads inf) the accountant asked, which falls back on a bound valid at any delta (pld.py)."""
    asked = lambda d: epsilon(record, d, accountant).epsilon  # noqa: E731
    if base.accountant != "pld" or "fallback" in base.details:
        return asked
    composed = composed_pld(record, converged_grid(record, delta / k, base), True, delta * math.exp(-SPAN) / k)

    def eps_of(d: float) -> float:
        found = max(composed.epsilons(d).values())
        return found if math.isfinite(found) else asked(d)

    return eps_of


def _grouped(base: EpsilonResult, k: int, delta_1: float, delta: float) -> EpsilonResult:
    eps = k * base.epsilon
    return EpsilonResult(
        accountant="group", epsilon=eps, delta=delta,
        relation=f"one user (group privacy over k = {k} records: any k records, however sampled); {base.relation}",
        guarantee=f"upper bound (group privacy: the record-level {base.accountant} bound eps_1 = {base.epsilon:.6g} "
                  f"at delta_1 = {delta_1:.3g}, times k; delta_1 (1 + ... + e^((k-1) eps_1)) <= delta)",
        details={"record_epsilon": base.epsilon, "record_delta": delta_1, "record_accountant": base.accountant},
        neighboring=base.neighboring, unit=f"user (group privacy, k = {k})")


@dataclass(frozen=True)
class Row:
    """One way to make the run user-level: its sigma and eps, and its noise per unit of signal next to ELS's."""
    name: str                  # "ELS", "ULS" or "group privacy"
    sigma: float | None
    result: EpsilonResult | None
    why: str = ""              # when there is no answer
    noise_per_signal: float | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "sigma": self.sigma, "why": self.why or None,
                "noise_per_signal_vs_els": self.noise_per_signal,
                **({"result": self.result.to_json()} if self.result is not None else {})}


def rows(mech: Event, k: int, delta: float, target: float | None = None) -> list[Row]:
    """ELS, ULS (users at the same rate) and group privacy (the ``group`` accountant on the ELS event) for ``mech``
    (the records' schedule; its sigma is used when ``target`` is None, else each is calibrated to eps ``target``
    at ``delta``)."""
    els, uls = with_unit(mech, Unit("user", k, "example")), with_unit(mech, Unit("user", k, "user"))
    out = []
    for name, event, accountant in (("ELS", els, None), ("ULS", uls, None), ("group privacy", els, "group")):
        try:
            if target is None:
                out.append(Row(name, event.sigma, epsilon(event, delta, accountant)))
            else:
                cal = calibrate_sigma(event, target, delta, accountant or default_accountant(event, delta))
                out.append(Row(name, cal.sigma, cal.result))
        except DPAuditError as exc:
            out.append(Row(name, None, None, str(exc)))
    base = out[0].sigma
    if base:
        out = [replace(r, noise_per_signal=None if r.sigma is None else
                       r.sigma * (k if r.name == "ULS" else 1) / base) for r in out]
    return out
