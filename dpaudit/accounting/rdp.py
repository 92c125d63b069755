"""`rdp`: dp-accounting's Renyi-DP accountant (looser than pld / prv, but valid at any delta).

Used for comparison, and by `pld` where the PLD cannot resolve delta (below 1e-12). For the
Poisson-subsampled Gaussian, dp-accounting's RDP is that of the remove direction, which bounds the
add direction too for every order alpha >= 1 (Mironov, Talwar & Zhang 2019, Thm. 5): a valid
add/remove bound. Orders go past dp-accounting's default 256 so that tiny delta (large log 1/delta)
still finds its best order.

Fixed-size batches (``sampling="fixed"``): dp-accounting's ``SampledWithoutReplacementDpEvent`` under the
replace-one relation (Wang, Balle & Kasiviswanathan 2019, Thm. 27, as dp-accounting implements it). Its noise
multiplier is relative to the replace-one sensitivity, and replacing one example moves a clipped sum by up to
2C: the event is built with sigma / 2. Phases are composed as dp-accounting composes events (RDP adds up).
"""

from __future__ import annotations

import logging

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.noises import noise
from dpaudit.accounting.samplers import relation_of, scheme
from dpaudit.core.errors import DPAuditError

ORDERS = ([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [64, 80, 96, 128, 192, 256, 384, 512,
                                                                         768, 1024, 2048, 4096, 8192])


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    if limitation(mech):
        raise DPAuditError(limitation(mech))
    if delta <= 0:
        raise DPAuditError("the Gaussian mechanism has no finite epsilon at delta = 0; give delta > 0")
    facts = scheme(mech.sampling)
    relation = dp_accounting.NeighboringRelation[facts.relation.name]
    accountant = rdp_privacy_accountant.RdpAccountant(orders=ORDERS, neighboring_relation=relation)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # "failed to converge ... excluding this order": fewer orders, still a bound
    try:
        for part in mech.phases:
            accountant.compose(_event(part), part.steps)
        eps = float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)
    return EpsilonResult(
        accountant="rdp",
        epsilon=eps,
        delta=delta,
        relation=relation_of(mech),
        guarantee="upper bound (Renyi DP conversion; looser than pld)" + (f"; {facts.rdp_note}" if facts.rdp_note else ""),
    )


def _event(mech: Mechanism):
    facts = scheme(mech.sampling)  # replace-one moves a clipped sum by up to 2C: multiplier sigma / 2
    if facts.rdp_event is None:
        raise DPAuditError(f"the rdp accountant has no event for {mech.sampling} sampling")
    return facts.rdp_event(mech, noise(mech.kind).rdp_event(mech.sigma / facts.sensitivity))


def limitation(mech) -> str | None:
    """None when every phase's noise has an RDP event (noises/: ``Noise.rdp_event``; the Gaussian's), else why not."""
    missing = sorted({part.kind for part in mech.phases if noise(part.kind).rdp_event(1.0) is None})
    if missing:
        return f"rdp does not cover the {', '.join(missing)} mechanism"
    return "rdp accounts one record a step, not a user-level (ELS) step of k records" if mech.group > 1 else None
