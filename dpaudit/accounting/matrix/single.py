"""`matrix`: a matrix mechanism without amplification, as one Gaussian release at the strategy's sensitivity.

Theorem (Denisov, McMahan, Rush, Smith & Thakurta 2022; Choquette-Choo et al. 2023, adaptive streams): releasing
C x + z, z ~ N(0, (sigma C sens)^2 I), where sens bounds ||C u|| over every participation pattern u one example
can have, is (eps, delta)-DP (add/remove) exactly as the Gaussian mechanism with noise multiplier sigma, also when
the rows are computed adaptively. So eps is the analytic Gaussian's at sigma (Balle & Wang 2018), whatever the
strategy; the strategy and the sampler set the noise actually added (sigma C sens) through sens, which is computed
from the participation the sampler allows (``strategy.participation``: epochs once each, Poisson or fixed-size
batches at any step, since no amplification is claimed).

This is the route for BLT strategies (their amplification is not analysed anywhere we could check; jax_privacy
accounts them this way too) and for BandMF when the batches are not cyclic Poisson.
"""

from __future__ import annotations

import math
from dataclasses import replace

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.result import DeltaResult, EpsilonResult
from dpaudit.core.errors import DPAuditError
from dpaudit.accounting import analytic
from dpaudit.accounting.matrix import strategy
from dpaudit.accounting.samplers import scheme

RELATION = "add/remove (one Gaussian release at the strategy's sensitivity; no amplification)"


def relation(mech: Mechanism) -> str:
    """The sampler's own relation (fixed-size batches: replace-one, shuffled epochs: zero-out), as the sensitivity
    is computed under it: add/remove for Poisson and balls-in-bins."""

    words = scheme(mech.sampling).relation_words
    return RELATION if words is None else f"{words}; one Gaussian release at the strategy's sensitivity, no amplification"


def limitation(mech) -> str | None:
    if not isinstance(mech, Mechanism) or mech.strategy is None:
        return "the matrix accountant accounts one schedule with correlated noise (--noise bandmf,b=B or blt,...)"
    return None


def sensitivity(mech: Mechanism) -> float:
    """The strategy's L2 sensitivity per unit clip norm under the sampler's participation: the noise added per step
    is sigma x this x C."""

    # a neighbour moves one step's clipped sum by the sampler's sensitivity (replace-one, fixed-size batches: 2C)
    return math.sqrt(strategy.sensitivity_squared(mech)) * scheme(mech.sampling).sensitivity


def _details(mech: Mechanism) -> dict:
    k, sep, words = strategy.participation(mech)
    sens = sensitivity(mech)
    return {"sensitivity": sens, "participations": k, "min_separation": sep, "participation": words,
            "noise_std_per_unit_clip": mech.sigma * sens}


def _single(mech: Mechanism) -> Mechanism:
    """The release it is accounted as: one Gaussian at sigma (sigma is relative to the sensitivity)."""
    reason = limitation(mech)
    if reason:
        raise DPAuditError(reason)
    return Mechanism("gaussian", mech.sigma)


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    result = analytic.epsilon(_single(mech), delta)
    details = _details(mech)
    return replace(result, accountant="matrix", relation=relation(mech),
                   guarantee=(f"exact for the Gaussian mechanism at the strategy's sensitivity {details['sensitivity']:.4g} "
                              f"under {details['participation']}: noise std sigma x sens = "
                              f"{details['noise_std_per_unit_clip']:.4g} C"),
                   details=details)


def delta(mech: Mechanism, eps: float) -> DeltaResult:
    result = analytic.delta(_single(mech), eps)
    return replace(result, accountant="matrix", relation=relation(mech), details=_details(mech))


def sigma_closed_form(mech: Mechanism, eps: float, delta: float) -> float:
    return analytic.sigma_closed_form(_single(mech), eps, delta)


# Resumed runs. A run killed after a checkpoint at step s and resumed from it releases rows s.. again: the resumed
# attempt continues its parent's noise state (BLT's buffers) with fresh draws z', so, given the parent's released
# rows before s (public), its rows are the post-processing of (C x')_t + z'_t for t >= s, where x' is its own
# gradient sums (equal to the parent's before s). One example moves that by ||(C u')_{t >= s}|| <= ||C u'|| <= sens
# (u' its participations along the attempt's lineage: the parent's before s, the attempt's after, a pattern the
# sampler allows, since a balls-in-bins resume keeps the epoch's allocation or starts at an epoch's end), and the
# noise is sigma x sens: a Gaussian mechanism at sigma, chosen adaptively. n attempts are n adaptively composed
# Gaussian mechanisms at sigma: exactly one at sigma / sqrt(n) (mu-GDP composes in squares; Dong, Roth & Su 2022).


def resumed_epsilon(mech: Mechanism, attempts: int, delta: float) -> EpsilonResult:
    """eps of a matrix-route run whose rows ``attempts`` attempts released (the theorem above); 1: ``epsilon``."""

    if attempts < 1:
        raise DPAuditError("a run has at least one attempt")
    result = analytic.epsilon(Mechanism("gaussian", _single(mech).sigma / math.sqrt(attempts)), delta)
    details = {**_details(mech), "attempts": attempts}
    return replace(result, accountant="matrix", relation=relation(mech), details=details,
                   guarantee=(f"exact for {attempts} attempts (a run resumed {attempts - 1} times), each a Gaussian "
                              f"release at the strategy's sensitivity {details['sensitivity']:.4g} under "
                              f"{details['participation']}, composed: noise multiplier sigma / sqrt({attempts})"))
