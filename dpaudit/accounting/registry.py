"""The accountant contract, the accountants by name, and which one a query gets by default.

What is accounted (an event: a ``Mechanism`` — noise, sampler, sampling rate, steps — or ``Phases`` of them)
is separate from who accounts it (an ``Accountant``), as in dp_accounting's DpEvent / PrivacyAccountant split.
Each accountant declares the noises, samplers and phases it covers, and ``supports`` says why not the rest.
Every accountant answers ``epsilon(event, delta)`` with an upper bound for the sampler's
``NeighboringRelation``; those that can also answer ``delta(event, eps)``, give sigma in closed form, start a
search quickly or offer search hooks say so here. Options are typed (a
dataclass per accountant that takes any). Implementations are imported when first used, so asking
for a closed form never pays for dp-accounting, scipy or prv-accountant.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from typing import Callable

from dpaudit.accounting import analytic, pure, rdp
from dpaudit.accounting.mechanism import Mechanism, Phases
from dpaudit.core.validate import check_delta, check_epsilon
from dpaudit.accounting.noises import noise
from dpaudit.accounting.result import DeltaResult, EpsilonResult, NeighboringRelation
from dpaudit.accounting.samplers import scheme
from dpaudit.core.errors import DPAuditError

Event = Mechanism | Phases


def _load(path: str) -> Callable:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Accountant:
    name: str
    mechanisms: tuple[str, ...] | None   # the noises it covers; None: every noise with a privacy loss (noises/)
    needs_positive_delta: bool
    summary: str
    epsilon_fn: str                      # "module:function" (mech, delta, **options) -> EpsilonResult
    delta_fn: str | None = None          # (mech, eps, **options) -> DeltaResult
    sigma_fn: Callable | None = None     # closed form (mech, eps, delta) -> sigma
    options: str | None = None           # "module:Class" of its typed options
    limitation: Callable[[Event], str | None] | None = None
    # the batch samplers it accounts (each under its own relation), beyond those whose record names it
    # (samplers/: Scheme.accountants)
    samplings: tuple[str, ...] = ("poisson",)
    phases: bool = False                        # composes several phases
    quick: bool = False          # answers in about a second at any T: a search's start and its valid fallback
    search: str | None = None    # "module:function" -> search.SearchHooks (calibrate, max-steps)
    # relations its bound also holds under, beyond the sampler's own (wor-pld: add/remove as well as replace-one)
    also_relations: tuple[NeighboringRelation, ...] = ()
    # the correlated-noise families it accounts (matrix/strategy.py); (): independent noise only
    strategies: tuple[str, ...] = ()
    # the noises whose user-level ELS step (k > 1 records of a user, Binomial(k, p) of them a step; unit.py) it
    # accounts (None: every noise); (): one record a step only (a ULS user is one record a step: every accountant
    # covers it)
    users: tuple[str, ...] | None = ()

    def covers(self, sampling: str) -> bool:
        """Whether it accounts ``sampling``: listed here, or among the sampler record's own accountants."""
        return sampling in self.samplings or self.name in scheme(sampling).accountants

    def search_hooks(self):
        return _load(self.search)() if self.search else None

    def supports(self, mech: Event, delta: float, relation: NeighboringRelation | None = None) -> str | None:
        """None when this accountant answers the query, else the reason it does not. ``relation``: the
        neighbouring relation asked for (None: the one the sampler is accounted under)."""
        sampling = mech.sampling
        facts = scheme(sampling)
        if facts.refused:
            return facts.refused
        if relation is not None and relation != facts.relation and relation not in self.also_relations:
            return (f"{sampling} sampling is accounted under {facts.relation.value} neighbours, "
                    f"not {relation.value}")
        if not self.covers(sampling):
            others = [n for n, a in ACCOUNTANTS.items() if a.covers(sampling)]
            return f"{self.name} does not account {sampling} sampling (accounted by {', '.join(others)})"
        if isinstance(mech, Phases) and not self.phases:
            others = [n for n, a in ACCOUNTANTS.items() if a.phases and a.covers(sampling)]
            return f"{self.name} accounts one phase; {', '.join(others)} compose phases"
        families = {m.strategy.family for m in mech.phases if getattr(m, "strategy", None) is not None}
        if families - set(self.strategies):
            others = [n for n, a in ACCOUNTANTS.items() if families <= set(a.strategies)]
            return (f"{self.name} accounts independent noise; correlated noise ({', '.join(sorted(families))}) is "
                    f"accounted by {', '.join(others)}")
        if self.strategies and not families:
            return f"{self.name} accounts correlated noise (--noise {'/'.join(self.strategies)}); this run has none"
        if mech.group > 1 and self.users is not None and any(m.kind not in self.users for m in mech.phases):
            others = [n for n, a in ACCOUNTANTS.items()
                      if a.users is None or {m.kind for m in mech.phases} <= set(a.users)]
            return (f"{self.name} accounts one record a step, not a user-level ELS step of k = {mech.group} records"
                    + (f" (accounted by {', '.join(others)})" if others else
                       f"; no accountant here builds that step for {mech.kind} noise"))
        missing = [] if self.mechanisms is None else sorted({m.kind for m in mech.phases} - set(self.mechanisms))
        if missing:
            return f"{self.name} does not cover the {', '.join(missing)} mechanism"
        if self.needs_positive_delta and delta <= 0:
            return f"{self.name} needs delta > 0"
        return self.limitation(mech) if self.limitation else None

    def _require(self, mech: Event, delta: float, relation: NeighboringRelation | None) -> None:
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

    def epsilon(self, mech: Event, delta: float, options=None,
                relation: NeighboringRelation | None = None) -> EpsilonResult:
        check_delta(delta, allow_zero=True)
        self._require(mech, delta, relation)
        result = _load(self.epsilon_fn)(mech, delta, **self._options(options))
        return _unit_of(replace(result, neighboring=relation or scheme(mech.sampling).relation), mech)

    def delta(self, mech: Event, eps: float, options=None,
              relation: NeighboringRelation | None = None) -> DeltaResult:
        check_epsilon(eps)
        if self.delta_fn is None:
            raise DPAuditError(f"delta(eps) is answered by {', '.join(n for n, a in ACCOUNTANTS.items() if a.delta_fn)},"
                               f" not {self.name}")
        self._require(mech, 1.0 if self.needs_positive_delta else 0.0, relation)
        result = _load(self.delta_fn)(mech, eps, **self._options(options))
        return _unit_of(replace(result, neighboring=scheme(mech.sampling).relation), mech)

    def sigma(self, mech: Event, eps: float, delta: float) -> float | None:
        """The smallest sigma meeting eps in closed form, or None when this accountant has none."""
        return None if self.sigma_fn is None else self.sigma_fn(mech, eps, delta)


ACCOUNTANTS: dict[str, Accountant] = {
    a.name: a
    for a in [
        Accountant("pld", None, True,
                   "dp-accounting PLD, pessimistic, add/remove max, grid refined until converged",
                   "dpaudit.accounting.pld:epsilon", delta_fn="dpaudit.accounting.pld:delta",
                   options="dpaudit.accounting.pld:PldOptions", phases=True,
                   search="dpaudit.accounting.pld:search_hooks", users=("gaussian",)),
        Accountant("prv", ("gaussian",), True,
                   "prv-accountant, remove + our add-direction PRV, max of upper bounds",
                   "dpaudit.accounting.prv:epsilon", options="dpaudit.accounting.prv:PrvOptions"),
        Accountant("mc", ("gaussian", "laplace"), True,
                   "Monte-Carlo, both directions, high-probability upper bound",
                   "dpaudit.accounting.montecarlo:epsilon", delta_fn="dpaudit.accounting.montecarlo:delta",
                   options="dpaudit.accounting.montecarlo:MonteCarloSettings"),
        Accountant("pure", ("laplace",), False,
                   "subsampled Laplace as pure eps-DP, basic composition",
                   "dpaudit.accounting.pure:epsilon", sigma_fn=lambda m, e, d: pure.sigma_closed_form(m, e),
                   phases=True, users=("laplace",)),
        Accountant("pure-prv", ("laplace",), True,
                   "each step as randomized response with eps_1, composed exactly",
                   "dpaudit.accounting.pure:prv_epsilon", users=("laplace",)),
        Accountant("rdp", None, True,
                   "Renyi DP (valid at any delta; looser); fixed-size batches: sampled without replacement, "
                   "replace-one", "dpaudit.accounting.rdp:epsilon", phases=True,
                   quick=True, limitation=rdp.limitation),
        Accountant("analytic", ("gaussian", "laplace"), False,
                   "exact without subsampling (analytic Gaussian / one Laplace release)",
                   "dpaudit.accounting.analytic:epsilon", delta_fn="dpaudit.accounting.analytic:delta",
                   sigma_fn=analytic.sigma_closed_form, limitation=analytic.limitation),
        Accountant("wor-pld", ("gaussian",), True,
                   "fixed-size batches: the symmetrised dominating pair of sampling without replacement (shift 2C, "
                   "both directions) as a PLD (dp-accounting connect-the-dots), composed; replace-one and add/remove "
                   "alike",
                   "dpaudit.accounting.wor:epsilon", samplings=(), phases=True,
                   also_relations=(NeighboringRelation.ADD_OR_REMOVE_ONE,)),
        Accountant("allocation", ("gaussian",), True,
                   "balls-in-bins (random allocation): one epoch's exact dominating pair on a lattice, composed "
                   "over the epochs; upper bound, lower bound beside it", "dpaudit.accounting.allocation:epsilon",
                   options="dpaudit.accounting.allocation:AllocationOptions", samplings=(), phases=True,
                   limitation=lambda m: _load("dpaudit.accounting.allocation:limitation")(m),
                   search="dpaudit.accounting.allocation:search_hooks"),
        Accountant("bandmf", ("gaussian",), True,
                   "banded matrix factorisation under cyclic Poisson sampling: ceil(T/b) rounds of the "
                   "Poisson-subsampled Gaussian at rate p b (Choquette-Choo et al. 2023), as pld",
                   "dpaudit.accounting.matrix.bandmf:epsilon", delta_fn="dpaudit.accounting.matrix.bandmf:delta",
                   options="dpaudit.accounting.pld:PldOptions", strategies=("bandmf",),
                   limitation=lambda m: _load("dpaudit.accounting.matrix.bandmf:limitation")(m),
                   search="dpaudit.accounting.matrix.bandmf:search_hooks"),
        Accountant("matrix", ("gaussian",), True,
                   "a matrix mechanism (bandmf, blt) without amplification: one Gaussian release at the "
                   "strategy's sensitivity under the sampler's participation, exact",
                   "dpaudit.accounting.matrix.single:epsilon", delta_fn="dpaudit.accounting.matrix.single:delta",
                   sigma_fn=lambda m, e, d: _load("dpaudit.accounting.matrix.single:sigma_closed_form")(m, e, d),
                   strategies=("bandmf", "blt"), samplings=("poisson", "fixed", "shuffle", "balls-in-bins"),
                   limitation=lambda m: _load("dpaudit.accounting.matrix.single:limitation")(m)),
        Accountant("group", None, False,
                   "user level by group privacy: the record-level default accountant's bound at delta_1, times k "
                   "(delta_1 (1 + ... + e^((k-1) eps_1)) <= delta); k = 1: the record-level bound", "dpaudit.accounting.user_level:group_epsilon",
                   phases=True, users=None),
        Accountant("shuffle", None, False,
                   "shuffled epochs without amplification: each example in at most one batch an epoch, zero-out",
                   "dpaudit.accounting.shuffle:epsilon", samplings=(), phases=True),
    ]
}


def _unit_of(result, mech: Event):
    """``result`` saying its privacy unit: a user-level answer names the user as the neighbour's unit (unless its
    accountant named it: group privacy)."""
    if not mech.unit.user_level or result.unit != "example":
        return result
    return replace(result, unit=mech.unit.short(),
                   relation=f"one user's records ({mech.unit.algorithm}, k = {mech.unit.records}); {result.relation}")


def get_accountant(name: str) -> Accountant:
    try:
        return ACCOUNTANTS[name]
    except KeyError:
        raise DPAuditError(f"unknown accountant {name!r}; choose one of {', '.join(ACCOUNTANTS)}") from None


def default_accountant(mech: Event, delta: float) -> str:
    """The tightest valid route for the event: the sampler's own accountants (``Scheme.accountants``: the first
    that answers, else the first, which then says why not); for Poisson sampling exact formulas where they exist
    (no subsampling), pure composition for Laplace at delta = 0, else PLD."""
    facts = scheme(mech.sampling)
    if facts.refused:
        raise DPAuditError(facts.refused)
    if any(getattr(m, "strategy", None) is not None for m in mech.phases):
        # correlated noise: BandMF on Poisson batches is amplified (cyclic Poisson; bandmf says why not when p b > 1,
        # rather than a silent switch to the unamplified bound), anything else is one release at the sensitivity
        bandmf = all(m.strategy is not None and m.strategy.family == "bandmf" for m in mech.phases)
        return "bandmf" if bandmf and mech.sampling == "poisson" else "matrix"
    if facts.accountants:
        return next((name for name in facts.accountants if ACCOUNTANTS[name].supports(mech, delta) is None),
                    facts.accountants[0])
    if mech.group > 1 and all(noise(m.kind).pure_dp for m in mech.phases):
        # ELS with Laplace noise: each step is pure (k eps_1)-DP exactly (pure.py); composed exactly at delta > 0
        return "pure-prv" if delta > 0 and isinstance(mech, Mechanism) else "pure"
    if ACCOUNTANTS["analytic"].supports(mech, delta) is None:
        return "analytic"
    if all(noise(m.kind).pure_dp for m in mech.phases) and delta == 0:
        return "pure"
    return "pld"


def epsilon(mech: Event, delta: float, accountant: str | None = None, options=None,
            relation: NeighboringRelation | None = None) -> EpsilonResult:
    """Upper bound on epsilon at ``delta`` for ``mech`` from the named (or default) accountant."""
    check_delta(delta, allow_zero=True)
    return get_accountant(accountant or default_accountant(mech, delta)).epsilon(mech, delta, options, relation)


def default_delta_accountant(mech: Event) -> str:
    """delta(eps): exact where there is no subsampling (analytic), else pld (correlated noise: as for eps)."""
    if any(getattr(m, "strategy", None) is not None for m in mech.phases):
        return default_accountant(mech, 1e-5)
    return "analytic" if ACCOUNTANTS["analytic"].supports(mech, 0.0) is None and analytic.has_delta(mech) else "pld"


def delta(mech: Event, eps: float, accountant: str | None = None, options=None,
          relation: NeighboringRelation | None = None) -> DeltaResult:
    """Upper bound on delta at ``eps`` for ``mech`` (analytic or pld by default; mc with probability
    >= 1 - beta)."""
    return get_accountant(accountant or default_delta_accountant(mech)).delta(mech, eps, options, relation)
