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

import numpy as np

from dpaudit.accounting.mechanism import Mechanism, compose_phases
from dpaudit.core.errors import DPAuditError
from dpaudit.accounting import pld
from dpaudit.accounting.matrix.strategy import banded_coefs
from dpaudit.accounting.search import SearchHooks


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
    return _answer(pld.epsilon(equivalent(mech), delta, settings=settings or pld.PldOptions()), mech)


def delta(mech: Mechanism, eps: float, settings=None):
    return _answer(pld.delta(equivalent(mech), eps, settings=settings or pld.PldOptions()), mech)


def search_hooks():
    """pld's hooks read through ``equivalent`` (calibrate and max-steps search this accountant as they search
    pld). No steps curve: T maps to ceil(T / b) rounds."""

    def resolution(anchor, d):
        rule = pld._resolution(equivalent(anchor), d)

        class _Rule:
            improvement = rule.improvement

            def __call__(self, mech):
                return rule(equivalent(mech))

        return _Rule()

    return SearchHooks(coarse=lambda m, d: pld._coarse_options(equivalent(m), d),
                       first=lambda m, d: pld._first_options(equivalent(m), d), resolution=resolution)


# --- a run resumed from checkpoints ---------------------------------------------------------------------------------
#
# Theorem (ours; the argument of Thm. 4 above, per coin). A run killed after releasing rows [s_0, e_0) and resumed
# from a checkpoint at step s_1 (written by an earlier attempt, which holds the weights and the last b - 1 noises)
# releases rows s_1, s_1 + 1, ... again, with fresh draws z' and fresh Poisson coins; the attempts form a tree (each
# resumes from its parent's checkpoint). Multiplying an attempt's releases by C (the earlier releases it continues
# are public), its row t is (C x)_t + z'_t, where x_j for j < s_1 is the gradient of the step its parent's lineage
# took at j. So the example's coin at step j (one draw, by the attempt that ran step j) moves the rows [j, j + b) of
# every attempt that continues it, and no other row. In one group, the coins' row sets are disjoint and the noise on
# them independent, so the likelihood ratio is a product over coins, each a Poisson-subsampled Gaussian at rate p b
# with sensitivity s_j: s_j^2 = the sum, over the attempts continuing coin j, of C's squared column j over that
# attempt's rows (at most 1 for the attempt that drew it; a coin drawn within b - 1 steps before a resume point is
# continued by the resumed attempt too: up to 1 + the column's tail). Adaptivity is covered as in Thm. 4: the mean a
# coin adds is fixed before its first row. The run is dominated by the composition, over one group's coins, of those
# mechanisms; rounding each s_j^2 up (to 1 at least, else a multiple of 1 / LEVELS: noise multiplier sigma / s) and
# taking the largest answer over the b groups covers every example. Without a resume this is ceil(T / b) rounds
# at sigma, the equivalent above. A coin continued by two attempts is NOT two independent rounds (one coin moving
# both is a subsampled Gaussian at sqrt(2) the sensitivity, which amplifies less), hence the per-coin sensitivities.

def coin_sensitivities(coefs, attempts) -> dict:
    """{(attempt that drew it, step): squared sensitivity} of every coin the released rows of ``attempts`` depend on.
    ``attempts``: (first step, end step, parent) each, in the order they ran: the first starts at 0 with parent None;
    a resumed one starts at its checkpoint's step, inside its parent's released rows (first < step <= end)."""

    coefs = np.asarray(coefs, dtype=float)
    b = coefs.size
    tail = np.concatenate([[0.0], np.cumsum(coefs ** 2)])  # tail[k] = sum of c_0^2 .. c_{k-1}^2
    checked = check_attempts(attempts)

    def owner(a: int, j: int) -> int:
        while j < checked[a][0]:
            a = checked[a][2]
        return a

    s2: dict = {}
    for a, (first, end, _) in enumerate(checked):
        for j in range(max(0, first - b + 1), end):
            lo, hi = max(j, first) - j, min(j + b, end) - j
            if hi > lo:
                key = (owner(a, j), j)
                s2[key] = s2.get(key, 0.0) + float(tail[hi] - tail[lo])
    return s2


def check_attempts(attempts) -> list:
    """``attempts`` as a list, refused in one line unless it is a tree that can have run: the first from step 0,
    each resumed one from a checkpoint inside its parent's released rows."""
    checked = []
    for a, (first, end, parent) in enumerate(attempts):
        if not (isinstance(first, int) and isinstance(end, int) and 0 <= first <= end):
            raise DPAuditError(f"attempt {a} of the run does not say which steps it released")
        if parent is None:
            if first:
                raise DPAuditError(f"attempt {a} resumed at step {first} from no earlier attempt's checkpoint")
        elif not (isinstance(parent, int) and 0 <= parent < a
                  and checked[parent][0] < first <= checked[parent][1]):
            raise DPAuditError(f"attempt {a} resumed at step {first} from a checkpoint its parent never wrote")
        checked.append((first, end, parent))
    return checked


LEVELS = 4  # each coin's squared sensitivity is rounded up to a multiple of 1 / LEVELS (fewer distinct phases)


def group_rounds(mech: Mechanism, attempts) -> list[dict]:
    """For each group whose coins no other group's dominate: {squared sensitivity (rounded up): coins}."""

    equivalent(mech)   # refuses what bandmf does not cover
    b = mech.strategy.bands
    groups: dict = {}
    for (_, j), s2 in coin_sensitivities(banded_coefs(mech.steps, b), attempts).items():
        if s2 > 0:
            # at least 1: a run never resumed is the plain answer (ceil(T / b) rounds at sigma), its last
            # coins' truncated columns not credited
            level = max(1.0, math.ceil(s2 * LEVELS - 1e-9) / LEVELS)
            counts = groups.setdefault(j % b, {})
            counts[level] = counts.get(level, 0) + 1
    if not groups:
        raise DPAuditError("the resumed run released no step")

    distinct = [dict(c) for c in sorted({tuple(sorted(c.items())) for c in groups.values()})]
    levels = sorted({level for counts in distinct for level in counts})
    # coins at or above each level: a group with no more of them at any level than another's is dominated by it
    above = [[sum(n for s, n in counts.items() if s >= level) for level in levels] for counts in distinct]
    return [counts for counts, mine in zip(distinct, above)
            if not any(other != mine and all(a <= b for a, b in zip(mine, other)) for other in above)]


def resumed_epsilon(mech: Mechanism, attempts, delta: float, settings=None):
    """eps at ``delta`` of ``mech`` (planned T, sigma, p, b) released along ``attempts`` (resumes included): the
    largest, over the groups, of the composition of its coins' subsampled Gaussians (the theorem above)."""

    eq, b = equivalent(mech), mech.strategy.bands
    best = None
    for counts in group_rounds(mech, attempts):
        event = compose_phases([replace(eq, sigma=mech.sigma / math.sqrt(s2), steps=n)
                                for s2, n in sorted(counts.items())])
        result = pld.epsilon(event, delta, settings=settings or pld.PldOptions())
        if best is None or result.epsilon > best[0].epsilon:
            best = result, counts
    result, counts = best
    spread = ", ".join(f"{n} at squared sensitivity {s2:g}" for s2, n in sorted(counts.items()))
    return replace(result, accountant="bandmf",
                   relation=("add/remove (cyclic Poisson sampling in b groups: max of the add and remove direction "
                             "after composition)"),
                   guarantee=(f"{result.guarantee}; banded MF (b = {b}) under cyclic Poisson sampling, released in "
                              f"{len(attempts)} attempt(s) (resumed from checkpoints), as the worst group's rounds "
                              f"of the Poisson-subsampled Gaussian at rate {eq.sampling_rate:g}: {spread} "
                              "(Choquette-Choo et al. 2023, Thm. 4, per coin across the attempts)"),
                   details={**result.details, "rounds": sum(counts.values()), "group_rate": eq.sampling_rate,
                            "bands": b, "attempts": len(attempts),
                            "rounds_by_squared_sensitivity": {f"{k:g}": n for k, n in sorted(counts.items())}})
