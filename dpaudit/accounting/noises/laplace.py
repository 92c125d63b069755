"""The Laplace mechanism: noise Lap(0, sigma C), sigma the scale relative to the (L1) sensitivity."""

from __future__ import annotations

import math

from dpaudit.accounting.noises import Noise


class Laplace(Noise):
    kind = "laplace"
    noun = "Laplace scale b / sensitivity"
    axis_label = "Laplace scale / sensitivity"
    scale_text = "Laplace scale b = sigma x sensitivity"
    default_delta = 0.0
    pure_dp = True
    std_per_sigma = math.sqrt(2)  # Lap(0, b) has variance 2 b^2

    def pld_loss(self, mech, adjacency, log_mass_truncation, pessimistic=True):
        from dpaudit.accounting import vectorised_loss

        return vectorised_loss.LaplaceLoss(mech.sigma, sensitivity=1.0, sampling_prob=mech.sampling_rate,
                                           adjacency_type=adjacency)

    def draw(self, rng, scale: float) -> float:
        return float(rng.laplace(0.0, scale))


NOISE = Laplace()
