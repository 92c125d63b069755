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
    mixture_loss = True

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
        mu = _gdp_mu(eps, delta)
        if mu is None:
            return None
        if mech.group > 1:  # ELS: the same CLT, with the mixture's chi-square (_mixture_chi_square)
            return _sigma_for_chi_square(mu * mu / mech.steps, mech.group, mech.sampling_rate)
        per_step = (mu / mech.sampling_rate) ** 2 / mech.steps  # e^{1/sigma^2} - 1
        return 1 / math.sqrt(math.log1p(per_step)) if per_step > 0 else None

    def pld_loss(self, mech, adjacency, log_mass_truncation, pessimistic=True):
        from dpaudit.accounting import vectorised_loss

        if mech.group > 1:  # ELS (accounting/unit.py): sensitivity j C with probability Binomial(j; k, p)
            k = mech.group
            return vectorised_loss.MixtureLoss(mech.sigma, list(range(k + 1)), binomial_weights(k, mech.sampling_rate),
                                              pessimistic_estimate=pessimistic,
                                              log_mass_truncation_bound=log_mass_truncation, adjacency_type=adjacency)
        return vectorised_loss.GaussianLoss(mech.sigma, sensitivity=1.0, pessimistic_estimate=pessimistic,
                                            log_mass_truncation_bound=log_mass_truncation,
                                            sampling_prob=mech.sampling_rate, adjacency_type=adjacency)

    def draw(self, rng, scale: float) -> float:
        return float(rng.normal(0.0, scale))

    def rdp_event(self, sigma: float):
        import dp_accounting

        return dp_accounting.GaussianDpEvent(sigma)


def _gdp_mu(eps: float, delta: float) -> float | None:
    """The mu of mu-GDP whose delta at ``eps`` is ``delta`` (Dong, Roth & Su 2019), or None past mu = 1e3."""
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
    return hi


def binomial_weights(k: int, p: float) -> list[float]:
    """P(J = j) for J ~ Binomial(k, p), j = 0..k (in plain floats: the closed forms stay free of numpy)."""
    if p >= 1.0:
        return [0.0] * k + [1.0]
    return [math.exp(_log_binomial(j, k, p)) for j in range(k + 1)]


def _log_binomial(j: int, k: int, p: float) -> float:
    return math.lgamma(k + 1) - math.lgamma(j + 1) - math.lgamma(k - j + 1) + j * math.log(p) + (k - j) * math.log1p(-p)


def _mixture_chi_square(sigma: float, k: int, p: float) -> float:
    """chi^2 of one ELS step, E_Q[(P/Q)^2] - 1 with P = sum_j w_j N(j, sigma^2), Q = N(0, sigma^2), w = Binomial(k, p):
    sum_{j,l} w_j w_l e^{j l / sigma^2} - 1 = sum_j w_j (1 - p + p e^{j / sigma^2})^k - 1 (the inner sum is the
    binomial's moment generating function; at k = 1: p^2 (e^{1/sigma^2} - 1), the CLT's own term)."""
    logs = [_log_binomial(j, k, p) + k * _log_1p_expm1(j / sigma ** 2, p) for j in range(k + 1)]
    top = max(logs)
    total = top + math.log(sum(math.exp(x - top) for x in logs))
    return math.expm1(min(700.0, total))


def _log_1p_expm1(t: float, p: float) -> float:
    """log(1 - p + p e^t) for t >= 0, without overflow."""
    return t + math.log(p + (1 - p) * math.exp(-t)) if t > 30 else math.log1p(p * math.expm1(t))


def _sigma_for_chi_square(target: float, k: int, p: float) -> float | None:
    """The sigma whose ELS step has chi^2 ``target`` (chi^2 falls as sigma grows), or None out of (1e-3, 1e4)."""
    lo, hi = 1e-3, 1e4
    if not _mixture_chi_square(hi, k, p) <= target <= _mixture_chi_square(lo, k, p):
        return None
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _mixture_chi_square(mid, k, p) > target else (lo, mid)
    return hi


NOISE = Gaussian()
