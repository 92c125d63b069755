"""`rdp`: dp-accounting's Renyi-DP accountant, for comparison (looser than pld / prv)."""

from __future__ import annotations

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import ADD_REMOVE, SINGLE_RELEASE, EpsilonResult
from dpaudit.errors import DPAuditError


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    if mech.kind != "gaussian":
        raise DPAuditError("the rdp accountant here covers the subsampled Gaussian only; for Laplace use pld or mc")
    event = dp_accounting.GaussianDpEvent(mech.sigma)
    if mech.sampling_rate < 1:
        event = dp_accounting.PoissonSampledDpEvent(mech.sampling_rate, event)
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(event, mech.steps)
    return EpsilonResult(
        accountant="rdp",
        epsilon=float(accountant.get_epsilon(delta)),
        delta=delta,
        relation=SINGLE_RELEASE if mech.is_single_release else ADD_REMOVE,
        guarantee="upper bound (Renyi DP conversion; comparison only, looser than pld)",
    )
