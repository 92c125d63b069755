"""Monte-Carlo accountant at scale: process-parallel and torch sampling agree with the serial sampler."""

import numpy as np
import pytest

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.montecarlo import MonteCarloSettings, composed_losses, delta_curve


def test_parallel_workers_give_identical_bounds():
    mech = Mechanism("laplace", 16.3, 0.016, 1000)
    grid = np.array([0.05, 0.1, 0.2])
    serial = delta_curve(mech, grid, MonteCarloSettings(samples=60_000, chunk_elements=1 << 16, workers=1))
    parallel = delta_curve(mech, grid, MonteCarloSettings(samples=60_000, chunk_elements=1 << 16, workers=2))
    for d in ("remove", "add"):
        np.testing.assert_allclose(parallel.upper[d], serial.upper[d], rtol=1e-12)
    assert serial.samples_per_second > 0


@pytest.mark.parametrize("kind,sigma", [("laplace", 16.3), ("gaussian", 3.0)])
def test_torch_sampler_matches_numpy_in_distribution(kind, sigma):
    pytest.importorskip("torch")
    from scipy import stats

    from dpaudit.mc_torch import composed_losses_torch

    mech = Mechanism(kind, sigma, 0.016, 500)
    for direction in ("remove", "add"):
        a = composed_losses(mech, direction, 50_000, np.random.default_rng(0))
        b = composed_losses_torch(mech, direction, 50_000, (0, 0, 0))
        assert stats.ks_2samp(a, b).pvalue > 1e-3
