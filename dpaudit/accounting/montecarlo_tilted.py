"""Importance sampling for the Monte-Carlo accountant: exponential tilting of the composed privacy loss
(Laplace mechanism, Poisson-subsampled), so that the rare event L > eps is sampled often.

For one direction, L = sum_t g(x_t) with i.i.d. x_t. Under the tilted law dP_theta/dP = e^{theta L} / M(theta),
M(theta) = m(theta)^T with m the per-step moment generating function,
    delta(eps) = E_P[(1 - e^{eps - L})_+] = E_theta[Y],   Y = M(theta) e^{-theta L} (1 - e^{eps - L})_+.
For theta >= 0, 0 <= Y <= M(theta) e^{-theta eps} =: B, so Y / B lies in [0, 1] and the empirical
Bernstein bound of ``montecarlo`` applies to it unchanged: the result is still an upper bound holding
with probability >= 1 - beta, with a variance that is far smaller when delta is small.
theta is chosen before sampling (a saddle point: the tilted mean of L equals eps).

Sampling is exact: a step's loss depends on x only through clip(x, 0, 1); the tilted weights of the
two end regions are closed-form, and inside (0, 1) the tilted law is drawn by rejection from the
untilted one (acceptance e^{theta (g(x) - max g)}; refused when it would fall below 1e-3).
Written here because no library offers it (Wang et al. 2023 describe the method, without code).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import integrate, optimize

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.mc_losses import DIRECTIONS, laplace_inside, laplace_regions
from dpaudit.accounting.mc_losses import bernstein_upper as _bernstein_upper, log_mix as _log_mix
from dpaudit.core.errors import DPAuditError

MIN_ACCEPTANCE = 1e-3


class _StepLaw:
    """One step of one direction: P(x <= 0), P(x >= 1), the density on (0, 1), and the loss g."""

    def __init__(self, mech: Mechanism, direction: str) -> None:
        if mech.kind != "laplace":
            raise DPAuditError("importance sampling is implemented for the Laplace mechanism only")
        b, p = mech.sigma, mech.sampling_rate
        self.mech, self.b, self.p, self.direction = mech, b, p, direction
        self.low, _, self.high = laplace_regions(mech, direction)
        self.sign = 1.0 if direction == "remove" else -1.0
        ends = _log_mix(p, np.array([-1 / b, 1 / b]))
        self.g_low, self.g_high = self.sign * ends[0], self.sign * ends[1]
        self.g_max = max(self.g_low, self.g_high)
        self.mid_range = abs(self.g_high - self.g_low)  # g is monotone on (0, 1)

    def g(self, x):
        return self.sign * _log_mix(self.p, (2 * np.asarray(x, dtype=float) - 1) / self.b)

    def density(self, x: float) -> float:
        b, p = self.b, self.p
        lap0 = math.exp(-x / b) / (2 * b)
        return (1 - p) * lap0 + p * math.exp(-(1 - x) / b) / (2 * b) if self.direction == "remove" else lap0

    def log_mgf(self, theta: float) -> float:
        """log m(theta), computed relative to e^{theta g_max} for stability."""
        mid = integrate.quad(lambda x: self.density(x) * math.exp(theta * (float(self.g(x)) - self.g_max)), 0, 1,
                             epsabs=0, epsrel=1e-12)[0]
        rest = self.low * math.exp(theta * (self.g_low - self.g_max)) + \
            self.high * math.exp(theta * (self.g_high - self.g_max))
        return theta * self.g_max + math.log(mid + rest)

    def tilted_mean(self, theta: float, h: float = 1e-5) -> float:
        return (self.log_mgf(theta + h) - self.log_mgf(theta - h)) / (2 * h)

    def sample(self, theta: float, steps: int, rows: int, rng: np.random.Generator) -> np.ndarray:
        """``rows`` composed losses under the tilted law."""
        lm = self.log_mgf(theta)
        w_low = self.low * math.exp(theta * self.g_low - lm)
        w_high = self.high * math.exp(theta * self.g_high - lm)
        w_mid = max(0.0, 1 - w_low - w_high)
        counts = rng.multinomial(steps, [w_low, w_mid, w_high], size=rows)
        need = int(counts[:, 1].sum())
        x = self._tilted_mid(theta, need, rng)
        owner = np.repeat(np.arange(rows), counts[:, 1])
        mid = np.bincount(owner, weights=self.g(x), minlength=rows)
        return counts[:, 0] * self.g_low + counts[:, 2] * self.g_high + mid

    def _tilted_mid(self, theta: float, n: int, rng: np.random.Generator) -> np.ndarray:
        g_top = float(self.g(1.0 if self.sign > 0 else 0.0))
        worst = math.exp(-theta * self.mid_range)  # >= MIN_ACCEPTANCE by the cap in saddle_theta
        out = np.empty(0)
        while out.size < n:
            m = int((n - out.size) / max(worst, 0.05)) + 16
            x = laplace_inside(rng.random(m), rng.random(m) if self.direction == "remove" else None,
                               self.mech, self.direction)
            keep = rng.random(m) < np.exp(theta * (self.g(x) - g_top))
            out = np.concatenate([out, x[keep]])
        return out[:n]


def saddle_theta(law: _StepLaw, steps: int, eps: float) -> float:
    """theta >= 0 with tilted mean of L equal to eps (0 if eps is already below the mean), capped where
    rejection sampling would accept less than MIN_ACCEPTANCE. Any theta >= 0 keeps the estimator
    unbiased and the bound valid; the saddle point only makes it efficient."""
    if steps * law.tilted_mean(0.0) >= eps:
        return 0.0
    cap = math.log(1 / MIN_ACCEPTANCE) / law.mid_range
    if steps * law.tilted_mean(cap) <= eps:
        return cap
    return float(optimize.brentq(lambda t: steps * law.tilted_mean(t) - eps, 0.0, cap, xtol=1e-10))


def delta_for_epsilon_tilted(mech: Mechanism, eps: float, samples: int, seed: int = 0, beta: float = 1e-3,
                             chunk_rows: int = 16384) -> dict:
    """delta(eps) upper bound (probability >= 1 - beta, both directions) and estimate, by tilted sampling."""
    result = {"directions": {}, "samples": samples, "beta": beta}
    fail = beta / len(DIRECTIONS)
    for d_index, direction in enumerate(DIRECTIONS):
        law = _StepLaw(mech, direction)
        if eps >= mech.steps * law.g_max:  # the loss can never exceed eps: delta is exactly 0
            result["directions"][direction] = {"estimate": 0.0, "upper": 0.0, "theta": None}
            continue
        theta = saddle_theta(law, mech.steps, eps)
        log_m = mech.steps * law.log_mgf(theta)
        log_bound = log_m - theta * eps  # Y <= e^{log_bound}
        s1 = s2 = 0.0
        for c_index, start in enumerate(range(0, samples, chunk_rows)):
            rows = min(chunk_rows, samples - start)
            rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(7, d_index, c_index)))
            loss = law.sample(theta, mech.steps, rows, rng)
            y = np.exp(-theta * (loss - eps)) * np.maximum(0.0, -np.expm1(eps - loss))  # Y / B
            s1 += float(y.sum())
            s2 += float((y * y).sum())
        scale = math.exp(log_bound)
        upper = float(_bernstein_upper(np.array([s1]), np.array([s2]), samples, fail)[0]) * scale
        result["directions"][direction] = {"estimate": s1 / samples * scale, "upper": min(1.0, upper),
                                           "theta": theta}
    result["estimate"] = max(v["estimate"] for v in result["directions"].values())
    result["upper"] = max(v["upper"] for v in result["directions"].values())
    return result
