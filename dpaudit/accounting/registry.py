"""The accountants by name, what each covers, and which one a query gets by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dpaudit.accounting import analytic, montecarlo, pld, prv, pure, rdp
from dpaudit.accounting.mechanism import Mechanism, check_delta
from dpaudit.accounting.result import EpsilonResult
from dpaudit.errors import DPAuditError


@dataclass(frozen=True)
class Accountant:
    name: str
    mechanisms: tuple[str, ...]
    needs_positive_delta: bool
    summary: str
    compute: Callable[..., EpsilonResult]
    limitation: Callable[[Mechanism], str | None] | None = None

    def supports(self, mech: Mechanism, delta: float) -> str | None:
        """None when this accountant answers the query, else the reason it does not."""
        if mech.kind not in self.mechanisms:
            return f"{self.name} does not cover the {mech.kind} mechanism"
        if self.needs_positive_delta and delta <= 0:
            return f"{self.name} needs delta > 0"
        return self.limitation(mech) if self.limitation else None


ACCOUNTANTS: dict[str, Accountant] = {
    a.name: a
    for a in [
        Accountant("pld", ("gaussian", "laplace"), True,
                   "dp-accounting PLD, pessimistic, add/remove max", pld.epsilon),
        Accountant("prv", ("gaussian",), True,
                   "prv-accountant, remove + our add-direction PRV, max of upper bounds", prv.epsilon),
        Accountant("mc", ("gaussian", "laplace"), True,
                   "Monte-Carlo, both directions, high-probability upper bound", montecarlo.epsilon),
        Accountant("pure", ("laplace",), False,
                   "subsampled Laplace as pure eps-DP, basic composition", pure.epsilon),
        Accountant("pure-prv", ("laplace",), True,
                   "each step as randomized response with eps_1, composed by prv-accountant", pure.prv_epsilon),
        Accountant("rdp", ("gaussian",), True,
                   "Renyi DP (comparison only)", rdp.epsilon),
        Accountant("analytic", ("gaussian", "laplace"), False,
                   "exact without subsampling (analytic Gaussian / one Laplace release)", analytic.epsilon,
                   analytic.limitation),
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
    if mech.kind == "laplace" and delta == 0:
        return "pure"
    return "pld"


def epsilon(mech: Mechanism, delta: float, accountant: str | None = None, **options) -> EpsilonResult:
    """Upper bound on epsilon at ``delta`` for ``mech`` from the named (or default) accountant."""
    check_delta(delta, allow_zero=True)
    name = accountant or default_accountant(mech, delta)
    acc = get_accountant(name)
    reason = acc.supports(mech, delta)
    if reason:
        raise DPAuditError(reason)
    return acc.compute(mech, delta, **options)
