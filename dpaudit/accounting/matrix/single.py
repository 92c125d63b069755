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

RELATION = "add/remove (one Gaussian release at the strategy's sensitivity; no amplification)"


def limitation(mech) -> str | None:
    if not isinstance(mech, Mechanism) or mech.strategy is None:
        return "the matrix accountant accounts one schedule with correlated noise (--noise bandmf,b=B or blt,...)"
    return None


def _details(mech: Mechanism) -> dict:
    from dpaudit.accounting.matrix import strategy

    from dpaudit.accounting.samplers import scheme

    k, sep, words = strategy.participation(mech)
    # a neighbour moves one step's clipped sum by the sampler's sensitivity (replace-one, fixed-size batches: 2C)
    sens2 = strategy.sensitivity_squared(mech) * scheme(mech.sampling).sensitivity ** 2
    return {"sensitivity": math.sqrt(sens2), "participations": k, "min_separation": sep, "participation": words,
            "noise_std_per_unit_clip": mech.sigma * math.sqrt(sens2)}


def _single(mech: Mechanism) -> Mechanism:
    """The release it is accounted as: one Gaussian at sigma (sigma is relative to the sensitivity)."""
    reason = limitation(mech)
    if reason:
        raise DPAuditError(reason)
    return Mechanism("gaussian", mech.sigma)


def epsilon(mech: Mechanism, delta: float) -> EpsilonResult:
    from dpaudit.accounting import analytic

    result = analytic.epsilon(_single(mech), delta)
    details = _details(mech)
    return replace(result, accountant="matrix", relation=RELATION,
                   guarantee=(f"exact for the Gaussian mechanism at the strategy's sensitivity {details['sensitivity']:.4g} "
                              f"under {details['participation']}: noise std sigma x sens = "
                              f"{details['noise_std_per_unit_clip']:.4g} C"),
                   details=details)


def delta(mech: Mechanism, eps: float) -> DeltaResult:
    from dpaudit.accounting import analytic

    result = analytic.delta(_single(mech), eps)
    return replace(result, accountant="matrix", relation=RELATION, details=_details(mech))


def sigma_closed_form(mech: Mechanism, eps: float, delta: float) -> float:
    from dpaudit.accounting import analytic

    return analytic.sigma_closed_form(_single(mech), eps, delta)
