"""Lower-triangular Toeplitz strategies for the matrix mechanism: coefficients, inverse, error, sensitivity, and
the optimal banded strategy.

The matrix mechanism releases the prefix sums A x of the clipped gradient sums x through a factorisation A = B C:
it adds Gaussian noise to C x and returns B (C x + z) = A x + B z. The strategy C here is lower-triangular Toeplitz,
given by its generating function c(x) = num(x) / den(x) (a banded strategy: num = its b coefficients, den = 1;
a buffered-linear-Toeplitz (BLT) one: both of degree = its buffers). Then

* C^-1 is Toeplitz with the series of den / num (one IIR filter: ``scipy.signal.lfilter``, O(n x degree));
* B = A C^-1 is Toeplitz with the prefix sums of those coefficients, so the expected squared error of query i
  (noise std 1) is the prefix sum of their squares, largest at the last query (Toeplitz; A x is a running sum);
* under one participation the sensitivity is the largest column norm, the norm of the coefficients; under k
  participations at least ``min_sep`` apart it is attained by participating at 0, sep, 2 sep, ... when the
  coefficients are non-negative and non-increasing (McKenna 2024, arXiv:2405.13763, Theorem 2), and a banded
  strategy with b <= sep has orthogonal columns there (Choquette-Choo et al. 2023, arXiv:2306.08153).

The optimal max-error BLT with d buffers (``optimal_blt``) minimises the same objective under the run's
participation (k participations at least sep apart) over theta in (0, 1), omega > 0 with sum(omega) < 1, the
region where the coefficients are non-negative and non-increasing, so that the sensitivity above is exact (the
parametrisation cannot leave it). The objective of 2d + 1 parameters is evaluated in O(T) and its gradient taken by
finite differences (L-BFGS, three starts); any theta, omega it returns is accounted at its own exact sensitivity, so
the search decides the error, never the privacy.

The optimal max-error banded strategy (b coefficients, T queries) minimises error(T) x sensitivity^2 (scale-free);
its gradient is taken by the adjoint of the series inversion (below), so L-BFGS needs one forward and one backward
filter per step. Written here because jax_privacy, which has these, is JAX-only, and no numpy library has them;
``tests/accounting/test_matrix.py`` checks each formula against the dense matrices.
"""

from __future__ import annotations

import math

import numpy as np

MAX_QUERIES = 1_000_000      # T beyond this is refused before any array is made (8 MB per vector at 10^6)
MAX_OPTIMISE = 20_000        # the banded optimisation's largest T (a few seconds on 2 cores at b = 64, T = 2000)


def _impulse(n: int) -> np.ndarray:
    x = np.zeros(n)
    x[0] = 1.0
    return x


def series(num, den, n: int) -> np.ndarray:
    """The first n coefficients of the power series num(x) / den(x)."""
    from scipy.signal import lfilter

    return lfilter(np.asarray(num, float), np.asarray(den, float), _impulse(n))


def sqrt_coefs(n: int) -> np.ndarray:
    """The coefficients of (1 - x)^(-1/2): C = sqrt(A), the optimal Toeplitz strategy for max error under one
    participation (Fichtenberger, Henzinger & Upadhyay 2023; Dvijotham et al. 2024)."""
    k = np.arange(n, dtype=float)
    ratio = np.ones(n)
    ratio[1:] = (2 * k[1:] - 1) / (2 * k[1:])
    return np.cumprod(ratio)


def per_query_error(num, den, n: int) -> np.ndarray:
    """E ||(A C^-1 z)_i||^2 / coordinate for z ~ N(0, I), i = 0..n-1 (noise std 1, before sensitivity)."""
    inverse = series(den, num, n)
    b_coefs = np.cumsum(inverse)
    return np.cumsum(b_coefs ** 2)


def max_error(num, den, n: int) -> float:
    """The largest per-query error: the last query's (Toeplitz prefix sums)."""
    b_coefs = np.cumsum(series(den, num, n))
    return float(b_coefs @ b_coefs)


def minsep_sensitivity_squared(coefs: np.ndarray, min_sep: int, participations: int | None = None) -> float:
    """max ||C u||^2 over u with at most ``participations`` ones at least ``min_sep`` apart (C: n x n, n =
    len(coefs)). Exact for non-negative non-increasing coefficients (the worst pattern is 0, sep, 2 sep, ...);
    otherwise the triangle inequality's k^2 ||c||^2, an upper bound that can be loose."""
    c = np.asarray(coefs, float)
    n = c.size
    k = math.ceil(n / min_sep) if participations is None else min(participations, math.ceil(n / min_sep))
    if np.all(c >= 0) and np.all(np.diff(c) <= 1e-15 * max(1.0, abs(c[0]))):
        pad = (-n) % min_sep
        vector = np.pad(c, (0, pad)).reshape(-1, min_sep).cumsum(axis=0).ravel()
        if min_sep * k < vector.size:
            vector[min_sep * k:] = vector[min_sep * k:] - vector[:-min_sep * k]
        return float(vector[:n] @ vector[:n])
    return float(k * k * (c @ c))


def _max_error_loss(coefs: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """error(T) x ||c||^2 of a banded strategy and its gradient in c.

    d = series(1, c) solves c * d = delta; differentiating, c * dd = -(dc * d), so for f(d) with w = df/dd,
    df/dc_k = -sum_i u_i d_{i-k} with u = C^-T w, which is the same filter run on the reversed w.
    f = sum_i B_i^2 with B = cumsum(d): df/dd_j = 2 sum_{i >= j} B_i.
    """
    from scipy.signal import lfilter

    c = np.asarray(coefs, float)
    d = lfilter([1.0], c, _impulse(n))
    big_b = np.cumsum(d)
    f = float(big_b @ big_b)
    w = 2.0 * np.cumsum(big_b[::-1])[::-1]
    u = lfilter([1.0], c, w[::-1])[::-1]
    grad_f = np.array([-(u[k:] @ d[:n - k]) for k in range(c.size)])
    norm2 = float(c @ c)
    return f * norm2, grad_f * norm2 + 2.0 * f * c


def optimal_banded(n: int, bands: int, max_iterations: int = 500) -> np.ndarray:
    """The b coefficients of the banded Toeplitz strategy with the least max error on T = n prefix queries per
    unit sensitivity (column norm 1), started from the first b coefficients of sqrt(A). Normalised to norm 1."""
    from scipy.optimize import minimize

    if not 1 <= bands <= n:
        raise ValueError(f"bands must be in [1, T], got b={bands}, T={n}")
    start = sqrt_coefs(bands)
    if bands == 1:
        return np.ones(1)
    found = minimize(_max_error_loss, start, args=(n,), jac=True, method="L-BFGS-B",
                     options={"maxiter": max_iterations, "ftol": 1e-12, "gtol": 1e-10})
    best = found.x if found.fun <= _max_error_loss(start, n)[0] else start
    return best / np.linalg.norm(best)


def blt_rational(theta, omega) -> tuple[np.ndarray, np.ndarray]:
    """num, den of a BLT's generating function 1 + sum_j omega_j x / (1 - theta_j x)."""
    den = np.ones(1)
    for t in theta:
        den = np.convolve(den, [1.0, -t])
    num = den.copy()
    for j, w in enumerate(omega):
        part = np.array([0.0, w])
        for i, t in enumerate(theta):
            if i != j:
                part = np.convolve(part, [1.0, -t])
        num = num + np.pad(part, (0, num.size - part.size))
    return num, den


MAX_BLT_OPTIMISE = 20_000   # T of the BLT search (0.15-0.3 s at T = 2,000 and d = 2-4 on 2 cores; ~10x at the cap)
MAX_BLT_BUFFERS = 8


def _blt_parameters(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(theta, omega) from the unconstrained search variables: theta = logistic(a), omega = s softmax(b) with
    s = logistic(c) < 1."""
    theta = 1.0 / (1.0 + np.exp(-x[:d]))
    share = np.exp(x[d:2 * d] - x[d:2 * d].max())
    return theta, share / share.sum() / (1.0 + np.exp(-x[2 * d]))


def blt_loss(theta, omega, n: int, min_sep: int = 1, participations: int | None = 1) -> float:
    """error(T) x sensitivity^2 of a BLT under the participation (the objective ``optimal_blt`` minimises)."""
    num, den = blt_rational(theta, omega)
    return max_error(num, den, n) * minsep_sensitivity_squared(series(num, den, n), min_sep, participations)


def optimal_blt(n: int, buffers: int, min_sep: int = 1, participations: int | None = 1) -> tuple[tuple, tuple]:
    """(theta, omega) of the d-buffer BLT with the least max error on T = n prefix queries per unit sensitivity
    under ``participations`` participations at least ``min_sep`` apart. Deterministic (fixed starts)."""
    from scipy.optimize import minimize

    if not 1 <= buffers <= MAX_BLT_BUFFERS or not 1 <= n <= MAX_BLT_OPTIMISE:
        raise ValueError(f"optimal_blt takes 1 <= d <= {MAX_BLT_BUFFERS} buffers and T <= {MAX_BLT_OPTIMISE}, got d={buffers}, T={n}")

    def objective(x: np.ndarray) -> float:
        with np.errstate(all="ignore"):
            value = blt_loss(*_blt_parameters(x, buffers), n, min_sep, participations)
        return math.log(value) if math.isfinite(value) and value > 0 else 1e6

    theta = 1.0 - np.geomspace(1.0 / max(n, 2), 0.5, buffers)   # decay rates spread from 1 / T to 1 / 2
    first = np.concatenate([np.log(theta / (1.0 - theta)), np.zeros(buffers), [0.0]])
    rng = np.random.default_rng(0)
    best = None
    for start in (first, first + rng.normal(scale=0.5, size=first.size), first + rng.normal(scale=0.5, size=first.size)):
        found = minimize(objective, start, method="L-BFGS-B", options={"maxiter": 500})
        if best is None or found.fun < best.fun:
            best = found
    theta, omega = _blt_parameters(best.x, buffers)
    theta = np.clip(theta, 1e-12, 1.0 - 1e-12)   # strictly inside (0, 1), as a spec must be
    return tuple(float(t) for t in theta), tuple(float(w) for w in omega)
