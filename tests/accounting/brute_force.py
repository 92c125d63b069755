"""A brute-force floor for accountants: enumerate a tiny 1-D clipped-sum mechanism exactly and bound its delta from
below, so that an accountant's eps can be checked never to fall under the truth.

The mechanism: a dataset of per-example gradients in {-1, +1} (C = 1, the worst case of a 1-D clipped sum), a
batch sampler enumerated exactly (every B-subset of a fixed-size draw; every inclusion pattern of a Poisson
draw), the batch's sum plus N(0, sigma^2), T independent steps (a non-adaptive run: a valid lower bound on the
adaptive worst case). One step's output law is then a finite mixture of N(s, sigma^2) over the batch sums s.

The floor (why it is a lower bound, not an estimate): the real line is cut into cells of width
``sigma / CELLS_PER_SIGMA`` (plus two infinite tails) and each cell's exact mass is taken under P and Q (normal CDF
differences). Merging outcomes is post-processing, so the cells' hockey-stick divergence is at most the true
one. Each cell's loss log(P/Q) is then rounded down to a multiple k h of ``LOSS_BIN``, and the T-fold product is
grouped by the sum of the k: in a group with index K every tuple has loss >= K h, so its Q mass is at most
e^{-K h} times its P mass, and sum_K P_K (1 - e^{eps - K h})_+ <= sum_K (P_K - e^eps Q_K)_+ <= delta(eps).
Only P masses are composed (FFT convolution): a Q mass of 1e-19 against e^eps = 1e17 would be lost in the
FFT's round-off, a P mass is not. The round-off left (~1e-16 per point, clipped) is below ``ROUNDING``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
from scipy.signal import fftconvolve
from scipy.special import ndtr

CELLS_PER_SIGMA = 400
LOSS_BIN = 2e-3
SPAN = 14.0          # cells cover the means +- SPAN sigma; the tails are two more cells
ROUNDING = 1e-9      # float slack when comparing a floor with delta (FFT round-off of the P masses)


def fixed_size_law(data: tuple[int, ...], batch: int) -> dict[int, float]:
    """Law of one step's clipped sum: every ``batch``-subset of ``data`` equally likely."""
    sums = Counter(sum(c) for c in itertools.combinations(data, batch))
    total = sum(sums.values())
    return {s: n / total for s, n in sums.items()}


def poisson_law(data: tuple[int, ...], rate: float) -> dict[int, float]:
    """Law of one step's clipped sum: each example in the batch independently with probability ``rate``."""
    law: Counter = Counter()
    for mask in itertools.product((0, 1), repeat=len(data)):
        k = sum(mask)
        law[sum(g for g, m in zip(data, mask) if m)] += rate ** k * (1 - rate) ** (len(data) - k)
    return dict(law)


def _laplace_lower(z):
    """P(L <= z) for z <= 0, standard Laplace (scale 1)."""
    return 0.5 * np.exp(np.minimum(z, 0.0))


NOISES = {"gaussian": (ndtr, SPAN), "laplace": (_laplace_lower, 4 * SPAN)}  # lower-tail CDF, span in scales


def _cells(means: np.ndarray, sigma: float, noise: str = "gaussian") -> np.ndarray:
    span = NOISES[noise][1]
    lo, hi = means.min() - span * sigma, means.max() + span * sigma
    edges = np.arange(lo, hi + sigma / CELLS_PER_SIGMA, sigma / CELLS_PER_SIGMA)
    return np.concatenate([[-np.inf], edges, [np.inf]])


def _cell_masses(law: dict[int, float], edges: np.ndarray, sigma: float, noise: str = "gaussian") -> np.ndarray:
    """Each cell's mass under the law's mixture: noise of scale ``sigma`` (a symmetric noise's lower-tail CDF)."""
    lower = NOISES[noise][0]
    mass = np.zeros(len(edges) - 1)
    for s, w in law.items():
        z = (edges - s) / sigma
        # lower half by the CDF, upper half by the survival function: no cancellation in either tail
        cdf = np.where(z < 0, lower(np.minimum(z, 0.0)), 1 - lower(-np.maximum(z, 0.0)))
        upper = np.where(z < 0, 1 - lower(np.minimum(z, 0.0)), lower(-np.maximum(z, 0.0)))
        mass += w * np.where(z[1:] <= 0, np.diff(cdf), -np.diff(upper))
    return np.maximum(mass, 0.0)


def step_bins(p_law: dict[int, float], q_law: dict[int, float], sigma: float, noise: str = "gaussian"):
    """One step as (lowest loss index, P masses by loss index): each cell's loss rounded down to the bin grid."""
    means = np.array(sorted(set(p_law) | set(q_law)), dtype=float)
    edges = _cells(means, sigma, noise)
    p, q = _cell_masses(p_law, edges, sigma, noise), _cell_masses(q_law, edges, sigma, noise)
    return _binned(p, q)


def _binned(p: np.ndarray, q: np.ndarray):
    """(lowest loss index, P masses by loss index) of a discrete pair: each outcome's loss rounded down."""
    both = (p > 0) & (q > 0)
    index = np.floor((np.log(p[both]) - np.log(q[both])) / LOSS_BIN).astype(np.int64)
    only_p = (p > 0) & (q == 0)   # Q's mass underflowed: a loss above every finite one, rounded down to the top
    index = np.concatenate([index, np.full(int(only_p.sum()), index.max())])
    weights = np.concatenate([p[both], p[only_p]])
    low = int(index.min())
    return low, np.bincount(index - low, weights=weights)


def delta_floor(p_law: dict[int, float], q_law: dict[int, float], sigma: float, steps: int,
                epsilons, noise: str = "gaussian") -> np.ndarray:
    """A lower bound on delta(eps) of ``steps`` independent steps of P = p_law + noise against Q = q_law + noise,
    at each of ``epsilons``."""
    return composed_floor(step_bins(p_law, q_law, sigma, noise), steps, epsilons)


def composed_floor(bins, steps: int, epsilons) -> np.ndarray:
    """The floor of ``steps`` independent repetitions of one step given as ``bins`` (``step_bins``)."""
    low, p1 = bins
    p = p1
    for _ in range(steps - 1):
        p = fftconvolve(p, p1)
    p = np.maximum(p, 0.0)
    losses = (steps * low + np.arange(len(p))) * LOSS_BIN
    eps = np.atleast_1d(np.asarray(epsilons, dtype=float))
    return np.array([float(np.sum(p * -np.expm1(np.minimum(e - losses, 0.0)))) for e in eps])


def signed_datasets(n: int):
    """Every +-1 dataset of size n up to order: k copies of -1, the rest +1."""
    return [tuple([-1] * k + [1] * (n - k)) for k in range(n + 1)]


def replace_one_pairs(n: int):
    """Every ordered replace-one pair of +-1 datasets of size n (one -1 turned into +1, and the swap)."""
    for k in range(1, n + 1):
        d = tuple([-1] * k + [1] * (n - k))
        d2 = tuple([-1] * (k - 1) + [1] * (n - k + 1))
        yield d, d2
        yield d2, d


def add_remove_pairs(n: int):
    """Every ordered add/remove pair with the larger dataset of size n (a -1 or a +1 removed, and the swap)."""
    for d in signed_datasets(n):
        for drop in set(d):
            smaller = list(d)
            smaller.remove(drop)
            yield d, tuple(smaller)
            yield tuple(smaller), d


def zero_out_pairs(n: int):
    """Every ordered zero-out pair of +-1 datasets of size n (one example's gradient replaced by 0, and the swap)."""
    for d in signed_datasets(n):
        for drop in set(d):
            zeroed = list(d)
            zeroed[zeroed.index(drop)] = 0
            yield d, tuple(zeroed)
            yield tuple(zeroed), d


def allocation_bins(data: tuple[int, ...], other: tuple[int, ...], sigma: float, cells_per_sigma: int = 40):
    """One epoch of balls-in-bins with t = 2 steps (each example in one of the two, uniformly and independently),
    data against other, as (lowest loss index, P masses by loss index): the plane cut into square cells (exact
    masses: products of normal CDF differences, summed over every allocation), each cell's loss rounded down."""
    def law(d):
        out: Counter = Counter()
        for choice in itertools.product((0, 1), repeat=len(d)):
            out[(sum(g for g, c in zip(d, choice) if c == 0), sum(g for g, c in zip(d, choice) if c == 1))] += 0.5 ** len(d)
        return out

    return _plane_bins(law(data), law(other), sigma, cells_per_sigma)


def shuffle_bins(data: tuple[int, ...], other: tuple[int, ...], sigma: float, cells_per_sigma: int = 40):
    """One shuffled epoch of t = 2 fixed-size batches of N / 2 (a uniformly random permutation, cut in two), data
    against other: as ``allocation_bins``, summed over every permutation."""
    def law(d):
        out: Counter = Counter()
        orders = list(itertools.permutations(range(len(d))))
        for order in orders:
            half = len(d) // 2
            out[(sum(d[i] for i in order[:half]), sum(d[i] for i in order[half:]))] += 1 / len(orders)
        return out

    return _plane_bins(law(data), law(other), sigma, cells_per_sigma)


def _plane_bins(p_law: Counter, q_law: Counter, sigma: float, cells_per_sigma: int):
    """Two steps' outputs (the batch sums plus independent N(0, sigma^2) each) under two laws of the sums, binned."""
    means = np.array([m for key in set(p_law) | set(q_law) for m in key], dtype=float)
    lo, hi = means.min() - SPAN * sigma, means.max() + SPAN * sigma
    edges = np.concatenate([[-np.inf], np.arange(lo, hi + sigma / cells_per_sigma, sigma / cells_per_sigma), [np.inf]])

    def masses(lw):
        total = 0.0
        for (a, b), w in lw.items():
            total = total + w * np.outer(_cell_masses({a: 1.0}, edges, sigma), _cell_masses({b: 1.0}, edges, sigma))
        return total.ravel()

    return _binned(masses(p_law), masses(q_law))
