"""The accountant contract, the accountants by name, and which one a query gets by default.

What is accounted (a ``Mechanism``: noise, sampling rate, steps) is separate from who accounts it
(an ``Accountant``), as in dp_accounting's DpEvent / PrivacyAccountant split. Every accountant
answers ``epsilon(mech, delta)`` with an upper bound for a ``NeighboringRelation``; those that can
also answer ``delta(mech, eps)`` or give sigma in closed form say so here. Options are typed (a
dataclass per accountant that takes any). Implementations are imported when first used, so asking
for a closed form never pays for dp-accounting, scipy or prv-accountant.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from dpaudit.accounting import analytic, pure
from dpaudit.accounting.mechanism import Mechanism, check_delta, check_epsilon
from dpaudit.accounting.noise import noise
from dpaudit.accounting.result import DeltaResult, EpsilonResult, NeighboringRelation
from dpaudit.errors import DPAuditError


def _load(path: str) -> Callable:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Accountant:
    name: str
    mechanisms: tuple[str, ...]
    needs_positive_delta: bool
    summary: str
    epsilon_fn: str                      # "module:function" (mech, delta, **options) -> EpsilonResult
    delta_fn: str | None = None          # (mech, eps, **options) -> DeltaResult
    sigma_fn: Callable | None = None     # closed form (mech, eps, delta) -> sigma
    options: str | None = None           # "module:Class" of its typed options
    limitation: Callable[[Mechanism], str | None] | None = None
    relations: tuple[NeighboringRelation, ...] = (NeighboringRelation.ADD_OR_REMOVE_ONE,)

    def supports(self, mech: Mechanism, delta: float,
                 relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE) -> str | None:
        """None when this accountant answers the query, else the reason it does not."""
        if relation not in self.relations:
            return f"{self.name} accounts {', '.join(r.value for r in self.relations)} neighbours, not {relation.value}"
        if mech.kind not in self.mechanisms:
            return f"{self.name} does not cover the {mech.kind} mechanism"
        if self.needs_positive_delta and delta <= 0:
            return f"{self.name} needs delta > 0"
        return self.limitation(mech) if self.limitation else None

    def _require(self, mech: Mechanism, delta: float, relation: NeighboringRelation) -> None:
        reason = self.supports(mech, delta, relation)
        if reason:
            raise DPAuditError(reason)

    def _options(self, options) -> dict:
        if options is None:
            return {}
        if self.options is None:
            raise DPAuditError(f"the {self.name} accountant takes no options")
        cls = _load(self.options)
        if not isinstance(options, cls):
            raise DPAuditError(f"{self.name} options must be a {cls.__name__}, got {type(options).__name__}")
        return {"settings": options}

    def epsilon(self, mech: Mechanism, delta: float, options=None,
                relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE) -> EpsilonResult:
        check_delta(delta, allow_zero=True)
        self._require(mech, delta, relation)
        return _load(self.epsilon_fn)(mech, delta, **self._options(options))

    def delta(self, mech: Mechanism, eps: float, options=None,
              relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE) -> DeltaResult:
        check_epsilon(eps)
        if self.delta_fn is None:
            raise DPAuditError(f"delta(eps) is answered by {', '.join(n for n, a in ACCOUNTANTS.items() if a.delta_fn)},"
                               f" not {self.name}")
        self._require(mech, 1.0 if self.needs_positive_delta else 0.0, relation)
        return _load(self.delta_fn)(mech, eps, **self._options(options))

    def sigma(self, mech: Mechanism, eps: float, delta: float) -> float | None:
        """The smallest sigma meeting eps in closed form, or None when this accountant has none."""
        return None if self.sigma_fn is None else self.sigma_fn(mech, eps, delta)


ACCOUNTANTS: dict[str, Accountant] = {
    a.name: a
    for a in [
        Accountant("pld", ("gaussian", "laplace"), True,
                   "dp-accounting PLD, pessimistic, add/remove max, grid refined until converged",
                   "dpaudit.accounting.pld:epsilon", delta_fn="dpaudit.accounting.pld:delta",
                   options="dpaudit.accounting.pld:PldOptions"),
        Accountant("prv", ("gaussian",), True,
                   "prv-accountant, remove + our add-direction PRV, max of upper bounds",
                   "dpaudit.accounting.prv:epsilon", options="dpaudit.accounting.prv:PrvOptions"),
        Accountant("mc", ("gaussian", "laplace"), True,
                   "Monte-Carlo, both directions, high-probability upper bound",
                   "dpaudit.accounting.montecarlo:epsilon", delta_fn="dpaudit.accounting.montecarlo:delta",
                   options="dpaudit.accounting.montecarlo:MonteCarloSettings"),
        Accountant("pure", ("laplace",), False,
                   "subsampled Laplace as pure eps-DP, basic composition",
                   "dpaudit.accounting.pure:epsilon", sigma_fn=lambda m, e, d: pure.sigma_closed_form(m, e)),
        Accountant("pure-prv", ("laplace",), True,
                   "each step as randomized response with eps_1, composed exactly",
                   "dpaudit.accounting.pure:prv_epsilon"),
        Accountant("rdp", ("gaussian",), True,
                   "Renyi DP (valid at any delta; looser)", "dpaudit.accounting.rdp:epsilon"),
        Accountant("analytic", ("gaussian", "laplace"), False,
                   "exact without subsampling (analytic Gaussian / one Laplace release)",
                   "dpaudit.accounting.analytic:epsilon", sigma_fn=analytic.sigma_closed_form,
                   limitation=analytic.limitation),
    ]
}


def get_accountant(name: str) -> Accountant:
    try:
        return ACCOUNTANTS[name]
    except KeyError:
        raise DPAuditError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}") from None


def default_accountant(mech: Mechanism, delta: float) -> str:
    """Exact formulas where they exist (no subsampling), pure composition for Laplace at
    delta = 0, else PLD."""
    if analytic.limitation(mech) is None:
        return "analytic"
    if noise(mech.kind).pure_dp and delta == 0:
        return "pure"
    return "pld"


def epsilon(mech: Mechanism, delta: float, accountant: str | None = None, options=None,
            relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE) -> EpsilonResult:
    """Upper bound on epsilon at ``delta`` for ``mech`` from the named (or default) accountant."""
    check_delta(delta, allow_zero=True)
    return get_accountant(accountant or default_accountant(mech, delta)).epsilon(mech, delta, options, relation)


def delta(mech: Mechanism, eps: float, accountant: str = "pld", options=None,
          relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE) -> DeltaResult:
    """Upper bound on delta at ``eps`` for ``mech`` (pld, or mc with probability >= 1 - beta)."""
    return get_accountant(accountant).delta(mech, eps, options, relation)
