"""Batches: Poisson sampling with rate p for the private runs, shuffled fixed-size batches otherwise."""

from __future__ import annotations

import numpy as np


def poisson_batch(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Each of the n examples joins independently with probability ``rate`` (the accountant's assumption)."""
    return np.flatnonzero(rng.random(n) < rate)


def shuffled_batches(n: int, batch_size: int, rng: np.random.Generator):
    """Endless epochs of a random permutation cut into batches (the non-private baselines)."""
    while True:
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]
