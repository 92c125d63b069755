"""The Gaussian mechanism: noise N(0, sigma^2 C^2), sigma the noise multiplier."""

from __future__ import annotations

import math

from dpaudit.accounting.noises import Noise
from dpaudit.accounting.result import NeighboringRelation
from dpaudit.accounting.samplers import scheme


def dpzero_sigma(steps: int, eps: float, delta: float) -> float:
    """The DPZero paper's closed form (Zhang et al. 2023) for T full-batch steps: 4 sqrt(2 T log(e + eps/delta))
    / eps. A valid but loose calibration; ``compare`` shows it beside the tight sigma."""
    return 4 * math.sqrt(2 * steps * math.log(math.e + eps / delta)) / eps


class Gaussian(Noise):
    kind = "gaussian"
    noun = "noise multiplier sigma"
    axis_label = "sigma (noise multiplier)"
    scale_text = "noise std = sigma x sensitivity (noise multiplier)"
    default_delta = 1e-5
    pure_dp = False
    closed_forms = {"DPZero closed form": dpzero_sigma}

    @staticmethod
    def composed_sigma(sigma: float, steps: int) -> float:
        return sigma / steps ** 0.5  # both privacy losses N(T/2s^2, T/s^2): one step with s / sqrt(T)

    def estimated_sigma(self, mech, eps: float, delta: float) -> float | None:
        """The central limit theorem of Bu, Dong, Long & Su (2020): T Poisson-subsampled Gaussian steps are close
        to mu-GDP with mu = p sqrt(T (e^{1/sigma^2} - 1)) when T is large and p small. mu is solved from
        (eps, delta) (Dong, Roth & Su 2019: delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)) and
        sigma from mu. Only an estimate (a search's start, checked by a bound); None where it does not apply."""
        
        facts = scheme(mech.sampling)  # Poisson-like: each step takes each example independently, add/remove
        if not (facts.independent_steps and facts.relation == NeighboringRelation.ADD_OR_REMOVE_ONE) or not 0 < mech.sampling_rate < 1 \
                or mech.steps < 100 or not 0 < delta < 1:
            return None
        from scipy.special import log_ndtr, ndtr

        def excess(mu: float) -> float:  # delta(eps) of mu-GDP less delta: grows with mu
            # e^eps Phi(b) as exp(eps + log Phi(b)): e^eps alone overflows past eps = 709 (a target of 1e4 was
            # refused as "math range error")
            tail = eps + float(log_ndtr(-eps / mu - mu / 2))
            return float(ndtr(-eps / mu + mu / 2)) - (math.exp(tail) if tail < 700 else math.inf) - delta

        lo, hi = 1e-6, 1.0
        while excess(hi) < 0 and hi < 1e3:
            lo, hi = hi, hi * 2
        if excess(hi) < 0:
            return None
        for _ in range(60):
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
        per_step = (hi / mech.sampling_rate) ** 2 / mech.steps  # e^{1/sigma^2} - 1
        return 1 / math.sqrt(math.log1p(per_step)) if per_step > 0 else None

    def pld_loss(self, mech, adjacency, log_mass_truncation, pessimistic=True):
        from dpaudit.accounting import vectorised_loss

        return vectorised_loss.GaussianLoss(mech.sigma, sensitivity=1.0, pessimistic_estimate=pessimistic,
                                            log_mass_truncation_bound=log_mass_truncation,
                                            sampling_prob=mech.sampling_rate, adjacency_type=adjacency)

    def draw(self, rng, scale: float) -> float:
        return float(rng.normal(0.0, scale))

    def rdp_event(self, sigma: float):
        import dp_accounting

        return dp_accounting.GaussianDpEvent(sigma)


NOISE = Gaussian()
