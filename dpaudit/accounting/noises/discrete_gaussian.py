"""The discrete Gaussian mechanism (Canonne, Kamath & Steinke 2020): integer noise with P(x) proportional to
exp(-x^2 / (2 sigma^2)), added to a sum quantised so that one example moves it by at most 1 (sigma is relative
to that sensitivity, as everywhere here; it is the distribution's parameter, a little above its standard
deviation for small sigma). Used by secure-aggregation and integer pipelines.

Accounted by `pld` through dp-accounting's ``DiscreteGaussianPrivacyLoss`` (Poisson subsampling, both
directions; noise truncated where its mass beyond is below 1e-30, dp-accounting's default). dp-accounting gives
this loss no connect-the-dots bounds, so its pessimistic PMF is built by privacy buckets (losses rounded up:
also an upper bound). This module is the whole of the noise: nothing else names it.
"""

from __future__ import annotations

import math

from dpaudit.accounting.noises import Noise


class DiscreteGaussian(Noise):
    kind = "discrete-gaussian"
    noun = "discrete Gaussian parameter sigma (integer noise, sensitivity 1 unit)"
    axis_label = "sigma (discrete Gaussian parameter)"
    scale_text = "integer noise with P(x) ~ exp(-x^2 / 2 sigma^2) on a sum quantised to sensitivity 1"
    default_delta = 1e-5
    pure_dp = False
    connect_dots = False

    def pld_loss(self, mech, adjacency, log_mass_truncation, pessimistic=True):
        from dp_accounting.pld import privacy_loss_mechanism as plm

        return plm.DiscreteGaussianPrivacyLoss(mech.sigma, sensitivity=1, sampling_prob=mech.sampling_rate,
                                               adjacency_type=adjacency)

    def loss_range(self, loss) -> float:
        bounds = loss.connect_dots_bounds()  # only the support is given for this loss
        return float(loss.privacy_loss(bounds.lower_x) - loss.privacy_loss(bounds.upper_x))

    def draw(self, rng, scale: float) -> float:
        """Exact sampling by rejection from a discrete Laplace (Canonne, Kamath & Steinke 2020, Alg. 3), in
        floats: for auditing and tests, not for a deployment that needs exactness."""
        t = math.floor(scale) + 1
        while True:
            magnitude = rng.geometric(1 - math.exp(-1 / t)) - 1
            y = magnitude if rng.random() < 0.5 else -magnitude
            if y == 0 and rng.random() < 0.5:
                continue  # the discrete Laplace puts mass 1 on 0 once, not twice
            if rng.random() < math.exp(-((abs(y) - scale ** 2 / t) ** 2) / (2 * scale ** 2)):
                return float(y)


NOISE = DiscreteGaussian()
