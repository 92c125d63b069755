"""`shuffle`: shuffled epochs of fixed-size batches, an upper bound without amplification, the Chua et al.
lower bound beside it, and the Poisson figure a user would otherwise quote.

The scheme. Each epoch draws a fresh uniformly random permutation of the N examples and cuts it into
batches of B; step t releases the clipped batch sum plus noise (Gaussian N(0, sigma^2 C^2 I) or Laplace with
scale sigma C). The permutations never depend on the data.

Neighbouring relation: zero-out (dp_accounting's REPLACE_SPECIAL): D' is D with one example x replaced by a
null example whose clipped contribution is 0. This is the relation under which Chua et al. (ICML 2024,
"How private are DP-SGD implementations?") compare shuffling with Poisson sampling, and under Poisson sampling
it gives the same privacy loss as add/remove (a null example in a batch adds nothing to its sum).

Theorem (upper bound, no amplification). Let E = ceil(T / floor(N / B)) be the number of epochs a run of T
steps touches. Then the run is (eps, delta)-DP under zero-out for eps the epsilon of E full-batch releases
of the same noise (Gaussian: the analytic Gaussian mechanism with sigma / sqrt(E); Laplace: E releases of
Lap(sigma), pure E / sigma, or its PLD at delta > 0); for phases, the phases' full-batch releases composed.

Proof. Fix the permutations pi (independent of the data). Given pi, x sits in exactly one slot of each
epoch, so in at most one batch of each epoch (at most one per epoch also when a partial last batch is dropped
or kept, and a partial epoch at the end is at most one more epoch: floor(N / B) batches an epoch can only
overcount). Every other batch's sum is identical under D and D'. The batch holding x moves by
clip(x) - 0, of norm <= C. So given pi the transcript is an adaptive composition of at most E mechanisms, each
the noise mechanism with sensitivity C, and the privacy loss of the others is 0; adaptive composition of
E such mechanisms is dominated by E non-adaptive full-batch releases (Gaussian: they compose exactly to one
with sigma / sqrt(E); Laplace: the PLD of E releases). The hockey-stick divergence is jointly convex, so
mixing over pi (the same distribution under D and D') cannot increase it: the bound holds for the shuffled
run. QED. It is what Chua et al. call the deterministic batch sampler's guarantee, eps_D >= eps_S.

Lower bound (Chua et al. 2024, their shuffle construction). Let every other example have clipped
contribution -C and x have +C (norm C, allowed). In each epoch of K = floor(N / B) batches, after subtracting
the known sum -B C from every batch and dividing by C, the epoch's output is P = (1/K) sum_t N(2 e_t,
sigma^2 I_K) under D and Q = (1/K) sum_t N(e_t, sigma^2 I_K) under D' (the batch that held x sums
-(B - 1) C). Any test is a post-processing, so the hockey-stick divergence of the statistic M = max_t y_t
(their "cube" test), binned into slices, bounds the run's from below; epochs are independent, so the pair for
E full epochs is the E-fold product, and rounding each binned loss *down* before composing (an optimistic PMF)
and truncating tails only lowers delta(eps). The eps read from that delta(eps) at delta is therefore <= the
true eps: a lower bound, never an accountant's answer. Computed here from first principles (the CDF of M
under the mixture is Phi((c - m)/sigma) Phi(c/sigma)^(K - 1)); for phases, the largest phase's bound (each
phase alone is a post-processing of the run). For the Gaussian only.

The same proof holds for balls-in-bins (samplers/balls_in_bins.py) under add/remove: an added example sits in
exactly one batch an epoch and moves its sum by at most C. It is that sampler's bound for noises the allocation
accountant does not cover.

The Poisson figure: the same sigma, p = B / N and T accounted as if the batches were Poisson sampled (pld),
which is what a user who shuffles but quotes a Poisson accountant reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpaudit.accounting.mechanism import Mechanism, Phases, compose_phases, resampled
from dpaudit.accounting.result import EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core import limits as budget

LOWER_GRID = 1e-3          # the lower bound's loss discretisation at most (rounded down: a finer grid is tighter)
LOWER_SLACK = 1e-2         # ... and finer with many epochs: E epochs lose at most E x grid <= this of the loss
LOWER_TAIL = 1e-12         # mass of M left outside the slices (lumped into one bin each side: still valid)
LOWER_MAX_SLICES = 200_000  # slices of M an epoch; coarser slices (still a valid lower bound) beyond
LOWER_MAX_EPOCHS = 10_000


def epochs_touched(mech: Mechanism) -> int:
    """E = ceil(T / floor(N / B)): the epochs (each a batch at most) a run of T steps can put one example in."""
    return math.ceil(mech.steps / mech.steps_per_epoch)


def full_batch_equivalent(mech: Mechanism | Phases) -> Mechanism | Phases:
    """Each phase as its E full-batch releases (p = 1): the event the theorem above reduces shuffling to."""
    return compose_phases([Mechanism(m.kind, m.sigma, 1.0, epochs_touched(m)) for m in mech.phases])


def epsilon(mech: Mechanism | Phases, delta: float) -> EpsilonResult:
    """Upper bound on eps under zero-out neighbours (the theorem in the module docstring)."""
    from dpaudit.accounting.registry import epsilon as account

    equivalent = full_batch_equivalent(mech)
    inner = account(equivalent, delta)
    touched = [epochs_touched(m) for m in mech.phases]
    return EpsilonResult(
        accountant="shuffle", epsilon=inner.epsilon, delta=delta, relation=relation_of(mech),
        guarantee=f"upper bound without amplification: each example in at most {'/'.join(map(str, touched))} "
                  f"batch(es) (one an epoch), accounted as that many full-batch releases ({inner.accountant})",
        details={"epochs_touched": touched, "steps_per_epoch": [m.steps_per_epoch for m in mech.phases],
                 "full_batch_accountant": inner.accountant, "full_batch_guarantee": inner.guarantee})


@dataclass(frozen=True)
class ShuffleContext:
    """What a shuffled (or balls-in-bins) run's report shows beside its upper bound."""

    lower_bound: float | None      # the true eps is at least this (Chua et al.'s construction; allocation's own)
    lower_bound_note: str
    poisson_epsilon: float         # the same sigma, p, T accounted as Poisson (add/remove, pld)
    poisson_accountant: str
    lower_bound_words: str = "Chua et al. shuffle construction"

    def to_json(self, upper: float) -> dict:
        from dpaudit.accounting.result import json_float

        lower = None if self.lower_bound is None else json_float(self.lower_bound)
        return {"lower_bound": lower, "lower_bound_words": self.lower_bound_words,
                **({"lower_bound_chua": lower} if self.lower_bound_words.startswith("Chua") else {}),
                "lower_bound_note": self.lower_bound_note, "poisson_epsilon": json_float(self.poisson_epsilon),
                "poisson_accountant": self.poisson_accountant,
                "poisson_understates_upper_by": json_float(upper / self.poisson_epsilon)
                if self.poisson_epsilon > 0 else None,
                "poisson_understates_lower_by": json_float(self.lower_bound / self.poisson_epsilon)
                if self.lower_bound is not None and self.poisson_epsilon > 0 else None}


def context_for(event, delta: float, result: EpsilonResult) -> ShuffleContext | None:
    """The context of a shuffled schedule's answer from this accountant, or of a balls-in-bins one from the
    allocation accountant (its own lower bound); None for anything else."""
    if event.sampling == "shuffle" and result.accountant == "shuffle":
        return context(event, delta)
    if result.accountant == "allocation":
        from dpaudit.accounting import allocation
        from dpaudit.accounting.registry import epsilon as account

        poisson = account(resampled(event, "poisson"), delta)
        lower = result.details.get("lower_bound")
        if lower is None:
            lower = allocation.lower_bound(event, delta, result.details["lattice"],
                                           result.details.get("lattice_seconds"))
        return ShuffleContext(lower, allocation.LOWER_NOTE if lower is not None else "not computed: it would not "
                              "fit what is left of the time or memory budget", poisson.epsilon, poisson.accountant,
                              "the allocation pair's loss rounded down")
    return None


def context(mech: Mechanism | Phases, delta: float) -> ShuffleContext:
    from dpaudit.accounting.registry import epsilon as account

    poisson = account(resampled(mech, "poisson"), delta)  # p = B / N: what a Poisson accountant is given
    lower, note = None, "the Chua et al. construction is for Gaussian noise"
    if all(m.kind == "gaussian" for m in mech.phases) and delta > 0:
        bounds = [lower_bound(m.sigma, m.steps_per_epoch, m.steps // m.steps_per_epoch, delta)
                  for m in mech.phases]
        found = [b for b in bounds if b is not None]
        lower = max(found) if found else None
        note = ("Chua et al. (2024) shuffle construction: the true eps is at least this" if found
                else "no lower bound computed: no phase runs a full epoch, or its composition does not fit the "
                     "memory budget (--max-memory)")
    return ShuffleContext(lower, note, poisson.epsilon, poisson.accountant)


def lower_bound(sigma: float, per_epoch: int, epochs: int, delta: float, grid: float | None = None) -> float | None:
    """A lower bound on eps at ``delta`` for ``epochs`` full shuffled epochs of ``per_epoch`` batches (Gaussian
    noise multiplier ``sigma``, zero-out): the module docstring's construction. None for no full epoch. The loss
    grid is ``LOWER_GRID``, or finer with many epochs (each rounds its loss down by up to one grid step, so
    E epochs lose up to E x grid: kept at ``LOWER_SLACK``; at sigma = 16.4 and 1209 epochs a 1e-3 grid read 0)."""
    import numpy as np
    from dp_accounting.pld import pld_pmf

    if epochs < 1:
        return None
    from dpaudit.accounting import pld

    epochs = min(epochs, LOWER_MAX_EPOCHS)  # fewer epochs: a smaller, still valid, lower bound
    grid = grid if grid is not None else min(LOWER_GRID, LOWER_SLACK / epochs)
    for _ in range(6):  # a coarser grid is a valid, weaker lower bound: coarsen until the composition fits
        losses, masses = _binned_epoch(sigma, per_epoch, grid)
        pmf = pld_pmf.SparsePLDPmf(dict(zip(losses.tolist(), masses.tolist())), grid, 0.0, False).to_dense_pmf()
        if epochs == 1 or budget.current().fits(pld._fft_bytes(pmf, pld._convolve_bounds(pmf, epochs))):  # noqa: SLF001
            break
        grid *= 4
    else:
        return None
    composed = pmf.self_compose(epochs) if epochs > 1 else pmf
    # Below the float noise of the masses (~1e-16 each) the optimistic delta(eps) is read at a slightly larger
    # delta, which can only lower eps.
    eps = float(composed.get_epsilon_for_delta(delta + 1e-13 * max(1, len(masses))))
    return max(0.0, eps) if np.isfinite(eps) else None


def _binned_epoch(sigma: float, per_epoch: int, grid: float):
    """One epoch's binned pair (P, Q) of M = max_t y_t: each slice's loss floor(log(P_i / Q_i) / grid) and its
    P mass, on slices narrow enough that the loss varies by about ``grid`` within one."""
    import numpy as np
    from scipy.special import log_ndtr
    from scipy.stats import norm

    k = per_epoch

    def log_cdf(c, m):  # log P(M <= c) under the mixture with shift m (c finite)
        return log_ndtr((c - m) / sigma) + (k - 1) * log_ndtr(c / sigma)

    def masses(edges, m):  # P(edges[i] < M <= edges[i + 1]), from whichever side is exact
        log_f = np.concatenate(([-np.inf], log_cdf(edges[1:-1], m), [0.0]))
        f = np.exp(log_f)
        s = -np.expm1(log_f)
        upper_side = f[1:] > 0.5
        return np.where(upper_side, s[:-1] - s[1:], f[1:] - f[:-1])

    low = sigma * norm.ppf(math.exp(math.log(LOWER_TAIL) / k))   # P(M <= low) ~ LOWER_TAIL under Q and P
    high = 2.0 + sigma * norm.isf(LOWER_TAIL / (2 * k))          # P(M > high) <= LOWER_TAIL under P
    width = grid * sigma ** 2  # the loss of a slice near c moves by about (c - 1.5) / sigma^2 across it
    count = min(LOWER_MAX_SLICES, max(16, math.ceil((high - low) / width)))
    edges = np.concatenate(([-np.inf], np.linspace(low, high, count + 1), [np.inf]))
    p, q = masses(edges, 2.0), masses(edges, 1.0)
    keep = (p > 0) & (q > 0)
    with np.errstate(divide="ignore"):
        loss = np.log(p[keep]) - np.log(q[keep])
    # Every slice with P mass and no Q mass would be an infinite loss; the slices are wide enough that none is
    # (both mixtures have full support): mass without a finite loss is dropped, which only lowers delta.
    rounded = np.floor(loss / grid).astype(np.int64)
    order = np.unique(rounded, return_inverse=True)
    summed = np.bincount(order[1], weights=p[keep])
    return order[0], summed
