"""What the Monte-Carlo accountants share (``montecarlo``: numpy, ``mc_torch``: torch, ``montecarlo_tilted``:
importance-sampled): the subsampled step's loss, the Laplace step's draws and regions, and the empirical
Bernstein upper bound (Maurer & Pontil 2009, Thm. 4). A module of its own so that the three import it, not each
other (they had formed an import cycle)."""

from __future__ import annotations

import math

import numpy as np

from dpaudit.accounting.mechanism import Mechanism

DIRECTIONS = ("remove", "add")


def log_mix(p: float, a, xp=np):
    """log(1 - p + p e^a), the loss of the subsampled step as a function of a = log(mu_1/mu_0).
    ``xp``: the array module (numpy here, torch in mc_torch)."""
    if p == 1.0:
        return a
    return xp.logaddexp(xp.full_like(a, math.log1p(-p)), math.log(p) + a)


def laplace_inside(u, mirror_u, mech: Mechanism, direction: str, xp=np):
    """One Laplace step's draws x in (0, 1) from uniforms ``u`` (and ``mirror_u`` for remove), for the numpy,
    torch and tilted samplers alike: Lap(0, b) restricted to (0, 1) has density prop. to e^{-x/b}, so
    x = -b log(1 - u (1 - e^{-1/b})); in the remove direction the draw is Lap(1, b)'s mirror 1 - x with
    probability p."""
    b, p = mech.sigma, mech.sampling_rate
    x = -b * xp.log1p(-u * (1 - math.exp(-1 / b)))
    if direction == "remove":
        x = xp.where(mirror_u < p, 1 - x, x) if p < 1 else 1 - x
    return x


def laplace_regions(mech: Mechanism, direction: str) -> tuple[float, float, float]:
    """P(x <= 0), P(0 < x < 1), P(x >= 1) for one step's draw x in ``direction``: a Laplace step's loss
    is constant outside (0, 1)."""
    b, p = mech.sigma, mech.sampling_rate
    q = math.exp(-1 / b)
    if direction == "remove":  # x ~ (1-p) Lap(0,b) + p Lap(1,b)
        return (1 - p) / 2 + p * q / 2, (1 - q) / 2, (1 - p) * q / 2 + p / 2
    return 0.5, (1 - q) / 2, q / 2  # add: x ~ Lap(0,b)


def bernstein_upper(s1: np.ndarray, s2: np.ndarray, n: int, fail: float) -> np.ndarray:
    mean = s1 / n
    var = np.maximum(0.0, (s2 - n * mean * mean) / (n - 1))
    log_term = math.log(2 / fail)
    return np.minimum(1.0, mean + np.sqrt(2 * var * log_term / n) + 7 * log_term / (3 * (n - 1)))
