"""One schedule under every sampler: the table a user reads to choose one (``dpaudit compare --sampling all``,
benchmarks/sampling.py).

Rows, each an eps at delta for the same noise, B, N and T: Poisson at p = B / N (add/remove: what users quote);
Poisson under replace-one (dp-accounting's PLD: the peer of the fixed row under its relation); fixed-size
batches (replace-one, and add/remove alike: the wor-pld PLD; and RDP, dp-accounting's sampled-without-replacement
event, the looser fallback); shuffled epochs (zero-out: the
upper bound without amplification, Chua et al.'s lower bound); balls-in-bins (add/remove: the allocation
accountant's upper bound and its lower bound). Each row has its time and its ratio to the Poisson row.
"""

from __future__ import annotations

import time

from dpaudit.accounting.mechanism import schedule
from dpaudit.accounting import allocation, shuffle
from dpaudit.accounting.registry import epsilon
from dpaudit.core.errors import DPAuditError


def _timed(fn):
    began = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - a row that cannot be computed says why; the others still stand
        if not isinstance(exc, DPAuditError):
            raise
        value = exc
    return value, time.perf_counter() - began


def _or_why(value, why: str):
    """A bound, or (None: not computed) the reason as the row's error."""

    return DPAuditError(why) if value is None else value


def poisson_replace_one(sigma: float, p: float, steps: int, delta: float) -> float:
    """Poisson sampling under replace-one (dp-accounting's PLD, pessimistic, grid 1e-3)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE,
                                               value_discretization_interval=1e-3)
    acc.compose(dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def rows(sigma: float, batch_size: int, dataset_size: int, steps: int, delta: float) -> list[dict]:
    """The table's rows for a Gaussian schedule (eps None and ``why`` where a row could not be computed)."""

    b, n = batch_size, dataset_size

    def event(sampling):
        return schedule("gaussian", sigma, None, b, n, steps, None, sampling)

    poisson, t_p = _timed(lambda: epsilon(event("poisson"), delta))
    # (sampler, bound, relation, accountant for a bare number (a result names its own), value, seconds)
    out = [("poisson", "upper", "add/remove", None, poisson, t_p),
           ("poisson", "upper", "replace-one", "dp-accounting pld",
            *_timed(lambda: poisson_replace_one(sigma, b / n, steps, delta))),
           ("fixed", "upper", "replace-one", None, *_timed(lambda: epsilon(event("fixed"), delta, "wor-pld"))),
           ("fixed", "upper (RDP)", "replace-one", None, *_timed(lambda: epsilon(event("fixed"), delta, "rdp")))]
    shuffled = event("shuffle")
    out.append(("shuffle", "upper", "zero-out", None, *_timed(lambda: epsilon(shuffled, delta))))
    out.append(("shuffle", "lower (Chua et al.)", "zero-out", "-", *_timed(lambda: _or_why(shuffle.lower_bound(
        sigma, shuffled.steps_per_epoch, steps // shuffled.steps_per_epoch, delta),
        "not computed: no complete epoch" if steps < shuffled.steps_per_epoch else
        "not computed: its composition would pass the memory budget"))))
    balls = event("balls-in-bins")
    upper, t_u = _timed(lambda: epsilon(balls, delta))
    out.append(("balls-in-bins", "upper", "add/remove", None, upper, t_u))
    if not isinstance(upper, Exception) and upper.accountant == "allocation":
        out.append(("balls-in-bins", "lower", "add/remove", "-", *_timed(
            lambda: _or_why(allocation.lower_bound(balls, delta, upper.details["lattice"],
                                                   upper.details["lattice_seconds"]),
                            allocation.no_lower_bound_why(balls)))))
    elif not isinstance(upper, Exception):
        out.append(("balls-in-bins", "lower", "add/remove", "-",
                    DPAuditError(f"not computed: the upper bound came from the {upper.accountant} fallback, not the "
                                 "allocation lattice the lower bound reuses"), 0.0))
    base = poisson.epsilon
    table = []
    for sampler, bound, relation, accountant, value, seconds in out:
        row = {"sampler": sampler, "bound": bound, "relation": relation, "seconds": seconds, "steps": steps}
        if isinstance(value, Exception):
            row.update(epsilon=None, accountant="-", why=str(value))
        elif isinstance(value, (int, float)) or value is None:
            row.update(epsilon=value, accountant=accountant)
        else:
            row.update(epsilon=value.epsilon, accountant=value.accountant,
                       converged=value.details.get("converged", True))
        row["vs_poisson"] = None if row["epsilon"] is None else row["epsilon"] / base
        table.append(row)
    return table
