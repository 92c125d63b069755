"""`bandmf`: banded matrix factorisation under cyclic Poisson sampling, amplified.

Theorem (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, arXiv:2306.08153, Thm. 4): split the
data into b groups; at step t draw a Poisson sample, rate q, from group t mod b; release C x + z with C lower
triangular, b-banded, columns of norm at most 1, and z ~ N(0, sigma^2 C^2 I). Then an example takes part only at
steps b apart, where C's columns have disjoint supports, and the run is dominated (add/remove) by ceil(T / b)
compositions of the Poisson-subsampled Gaussian mechanism with noise multiplier sigma and rate q. With b = 1 (C = I)
that is DP-SGD exactly.

Here the batch the user asks for is the expected one: q = p b (each example of the visited group is taken with
probability p b; the expected batch is p N either way). p b > 1 is refused: the groups would be smaller than a
batch. The composed event is accounted by our ``pld`` (pessimistic, max of both directions, grid refined until
converged), so this answer is what pld answers for that event; jax_privacy's ``amplified_bandmf_event`` builds the
same event (``benchmarks/matrix_oracle.py`` compares the two).
"""

from __future__ import annotations

import math
from dataclasses import replace

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.core.errors import DPAuditError


def limitation(mech) -> str | None:
    if not isinstance(mech, Mechanism) or mech.strategy is None or mech.strategy.family != "bandmf":
        return "bandmf accounts one schedule with --noise bandmf,b=B"
    if mech.sampling != "poisson":
        return (f"bandmf's amplification needs cyclic Poisson sampling (--sampling poisson), not {mech.sampling}; "
                "the matrix accountant covers it without amplification")
    if mech.sampling_rate * mech.strategy.bands > 1 + 1e-12:
        return (f"cyclic Poisson sampling with b = {mech.strategy.bands} groups needs p b <= 1 (a group of N / b "
                f"examples must hold the expected batch), got p b = {mech.sampling_rate * mech.strategy.bands:g}")
    return None


def equivalent(mech: Mechanism) -> Mechanism:
    """The independent-noise event that dominates ``mech``: ceil(T / b) Poisson-subsampled Gaussian rounds at
    rate p b."""
    reason = limitation(mech)
    if reason:
        raise DPAuditError(reason)
    b = mech.strategy.bands
    return replace(mech, sampling_rate=min(1.0, mech.sampling_rate * b), steps=math.ceil(mech.steps / b),
                   strategy=None)


def _answer(result, mech: Mechanism):
    b = mech.strategy.bands
    eq = equivalent(mech)
    return replace(result, accountant="bandmf",
                   relation=("add/remove (cyclic Poisson sampling in b groups: max of the add and remove direction "
                             "after composition)"),
                   guarantee=(f"{result.guarantee}; banded MF (b = {b}) under cyclic Poisson sampling as "
                              f"{eq.steps} rounds of the Poisson-subsampled Gaussian at rate {eq.sampling_rate:g} "
                              "(Choquette-Choo et al. 2023, Thm. 4)"),
                   details={**result.details, "rounds": eq.steps, "group_rate": eq.sampling_rate, "bands": b})


def epsilon(mech: Mechanism, delta: float, settings=None):
    from dpaudit.accounting import pld

    return _answer(pld.epsilon(equivalent(mech), delta, settings=settings or pld.PldOptions()), mech)


def delta(mech: Mechanism, eps: float, settings=None):
    from dpaudit.accounting import pld

    return _answer(pld.delta(equivalent(mech), eps, settings=settings or pld.PldOptions()), mech)


def search_hooks():
    """pld's hooks read through ``equivalent`` (calibrate and max-steps search this accountant as they search
    pld). No steps curve: T maps to ceil(T / b) rounds."""
    from dpaudit.accounting import pld
    from dpaudit.accounting.search import SearchHooks

    def resolution(anchor, d):
        rule = pld._resolution(equivalent(anchor), d)

        class _Rule:
            improvement = rule.improvement

            def __call__(self, mech):
                return rule(equivalent(mech))

        return _Rule()

    return SearchHooks(coarse=lambda m, d: pld._coarse_options(equivalent(m), d),
                       first=lambda m, d: pld._first_options(equivalent(m), d), resolution=resolution)
