"""Poisson sampling: each example joins each step's batch independently with probability p = B / N.

Add/remove neighbours: the dominating pairs of the add and the remove direction differ, and both are composed.
"""

from dpaudit.accounting.result import NeighboringRelation
from dpaudit.accounting.samplers import Scheme


def _rdp_event(mech, step):
    import dp_accounting

    return dp_accounting.PoissonSampledDpEvent(mech.sampling_rate, step) if mech.sampling_rate < 1 else step


SCHEME = Scheme("poisson", NeighboringRelation.ADD_OR_REMOVE_ONE, False,
                "Poisson sampling with rate p = {p:g}, T = {T} steps", independent_steps=True,
                rdp_event=_rdp_event, looks_like=("Poisson",), rank=0)
