"""The Gaussian mechanism: noise N(0, sigma^2 C^2), sigma the noise multiplier."""

from __future__ import annotations

import math

from dpaudit.accounting.noises import Noise


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
