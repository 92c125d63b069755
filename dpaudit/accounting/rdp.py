"""`rdp`: dp-accounting's Renyi-DP accountant (looser than pld / prv, but valid at any delta).

Used for comparison, and by `pld` where the PLD cannot resolve delta (below 1e-12). For the
Poisson-subsampled Gaussian, dp-accounting's RDP is that of the remove direction, which bounds the
add direction too for every order alpha >= 1 (Mironov, Talwar & Zhang 2019, Thm. 5): a valid
add/remove bound. Orders go past dp-accounting's default 256 so that tiny delta (large log 1/delta)
still finds its best order.
"""

from __future__ import annotations

import logging

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import EpsilonResult, relation_of
from dpaudit.errors import DPAuditError

ORDERS = ([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [64, 80, 96, 128, 192, 256, 384, 512,
                                                                         768, 1024, 2048, 4096, 8192])


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    if mech.kind != "gaussian":
        raise DPAuditError("the rdp accountant here covers the subsampled Gaussian only; for Laplace use pld or mc")
    if delta <= 0:
        raise DPAuditError("the Gaussian mechanism has no finite epsilon at delta = 0; give delta > 0")
    event = dp_accounting.GaussianDpEvent(mech.sigma)
    if mech.sampling_rate < 1:
        event = dp_accounting.PoissonSampledDpEvent(mech.sampling_rate, event)
    accountant = rdp_privacy_accountant.RdpAccountant(orders=ORDERS)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # "failed to converge ... excluding this order": fewer orders, still a bound
    try:
        accountant.compose(event, mech.steps)
        eps = float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)
    return EpsilonResult(
        accountant="rdp",
        epsilon=eps,
        delta=delta,
        relation=relation_of(mech),
        guarantee="upper bound (Renyi DP conversion; looser than pld)",
    )
