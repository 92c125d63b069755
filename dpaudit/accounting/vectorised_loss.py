"""dp-accounting's Gaussian and Laplace privacy losses, with one step's hockey-stick deltas computed on arrays.

Theorem (dp-accounting, `MonotonePrivacyLoss.get_delta_for_epsilon`): for a privacy loss that is
non-increasing in the output x, delta(eps) = mu_upper_cdf(x_eps) - e^eps mu_lower_cdf(x_eps) with
x_eps = inverse_privacy_loss(eps). Under Poisson subsampling with rate q the inverse is the
unsubsampled one taken at log(1 + (e^eps - 1)/q) (remove) or -log(1 + (e^-eps - 1)/q) (add).

Why by hand: dp-accounting evaluates x_eps with one Python call per grid point (~4 us each). The
connect-the-dots PMF of one step at the converged grid has 1e5-1e7 points, so at p = 1e-5 these
calls were 46 of a calibration's 62 s. Here the same formulas (the same branches, the same
``log_a_times_exp_b_plus_c`` arithmetic, the same ``math.isclose`` rule at the ends of the range)
run on numpy arrays; everything else (the CDFs, the connect-the-dots PMF, the tails) is still
dp-accounting's. Tested equal to dp-accounting's deltas to 1e-12 relative.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from dp_accounting.pld import privacy_loss_mechanism as plm

from dpaudit.accounting.pld import kernel

_ISCLOSE = 1e-9  # math.isclose's default relative tolerance, which dp-accounting's scalar code uses


def _log_a_exp_b_plus_c(a: float, b: np.ndarray, c: float) -> np.ndarray:
    """dp-accounting's ``common.log_a_times_exp_b_plus_c`` for a = 1/q > 0 and c = 1 - 1/q < 0 (q < 1), on arrays:
    log(a e^b + c). NaN where a e^b + c <= 0 (the library raises there; those points are never asked)."""
    d = b + math.log(a)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = d + np.log1p(-np.exp(math.log(-c) - d))
    return np.where(b == 0, math.log(a + c), np.where(math.log(-c) < d, out, np.nan))


def _isclose(values: np.ndarray, point: float) -> np.ndarray:
    return np.abs(values - point) <= _ISCLOSE * np.maximum(np.abs(values), abs(point))


class _ArrayDeltas:
    """Mixin: ``get_delta_for_epsilon`` on arrays. Subclasses give ``_inverse_remove_array`` (the loss
    without subsampling, remove direction, on arrays)."""

    def _inverse_array(self, losses: np.ndarray) -> np.ndarray:
        """dp-accounting's ``_inverse_privacy_loss_add`` / ``_remove``: add is remove mirrored (the loss taken at
        -eps and negated, the range's end at -log(1 - q) mapping to +inf), then shifted by the sensitivity."""
        q = self.sampling_prob
        add = self.adjacency_type == plm.AdjacencyType.ADD
        unsampled = losses
        if q < 1.0:
            sign = -1.0 if add else 1.0
            unsampled = sign * _log_a_exp_b_plus_c(1 / q, sign * losses, 1 - 1 / q)
            unsampled = np.where(_isclose(losses, sign * math.log(1 - q)), -sign * math.inf, unsampled)
        x = self._inverse_remove_array(unsampled)
        return self.sensitivity + x if add else x

    def get_delta_for_epsilon(self, epsilon):
        if isinstance(epsilon, numbers.Number) or self.adjacency_type == plm.AdjacencyType.REPLACE:
            return super().get_delta_for_epsilon(epsilon)  # scalars: the library's own code
        epsilons = np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(epsilons)
        q = self.sampling_prob
        if q == 1.0:
            inverse = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == plm.AdjacencyType.ADD:
            inverse = epsilons < -math.log1p(-q)  # above: delta is 0
        else:
            inverse = epsilons > math.log1p(-q)  # at or below: delta is 1 - e^eps
            deltas[~inverse] = -np.expm1(epsilons[~inverse])
        x = self._inverse_array(epsilons[inverse])
        if np.isnan(x).any():
            return super().get_delta_for_epsilon(epsilon)  # outside the formulas' range: the library decides
        deltas[inverse] = self.mu_upper_cdf(x) - np.exp(epsilons[inverse] + self.mu_lower_log_cdf(x))
        return np.clip(deltas, 0, 1)


class GaussianLoss(_ArrayDeltas, plm.GaussianPrivacyLoss):
    def _inverse_remove_array(self, losses: np.ndarray) -> np.ndarray:
        # GaussianPrivacyLoss._inverse_privacy_loss_without_subsampling_remove, which is linear.
        return -0.5 * self.sensitivity - losses * (self._standard_deviation ** 2) / self.sensitivity


class LaplaceLoss(_ArrayDeltas, plm.LaplacePrivacyLoss):
    def _inverse_remove_array(self, losses: np.ndarray) -> np.ndarray:
        # LaplacePrivacyLoss._inverse_privacy_loss_without_subsampling_remove, branch by branch.
        threshold = losses * self._parameter
        middle = 0.5 * (-self.sensitivity - threshold)
        return np.where(threshold > self.sensitivity, -math.inf,
                        np.where(threshold <= -self.sensitivity, math.inf, middle))


class MixtureLoss(plm.MixtureGaussianPrivacyLoss):
    """dp-accounting's mixture of Gaussians (an ELS step: accounting/unit.py) with its inverse privacy loss on arrays.

    dp-accounting inverts the mixture's loss (no closed form) by one recursive bisection shared by all the losses
    asked, calling the scalar ``privacy_loss`` at every node: 4.8 million Python calls, 39 of a 41 s calibration
    at k = 4. Here the same bisection runs for every loss at once: every loss starts in the same range and each
    step halves it, so each follows the path the recursion would (the same midpoints, the same comparison
    ``loss < privacy_loss(mid)``) and stops at the same depth, answering ``floor(hi / precision) precision``.
    Tested equal to dp-accounting's answers."""

    CHUNK = 1 << 15  # losses bisected at a time: CHUNK x (k + 1) doubles for the mixture's terms

    def _losses_at(self, x: np.ndarray) -> np.ndarray:
        """``privacy_loss`` at every point of ``x`` (the library's formula, one row a point)."""
        x_loss = np.multiply.outer(x, self.sensitivities) / self._variance
        if self.adjacency_type == plm.AdjacencyType.ADD:
            return -np.logaddexp.reduce(self._precompute_privacy_loss_constants + x_loss, axis=1)
        return np.logaddexp.reduce(self._precompute_privacy_loss_constants - x_loss, axis=1)

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
        losses = np.asarray(privacy_losses, dtype=float)
        if len(losses) == 0:
            return []
        out = np.empty_like(losses)
        for start in range(0, len(losses), self.CHUNK):
            part = losses[start:start + self.CHUNK]
            lo, hi = np.full_like(part, bounds[0]), np.full_like(part, bounds[1])
            width = bounds[1] - bounds[0]
            while width > precision:
                mid = (lo + hi) / 2
                up = part < self._losses_at(mid)  # the loss falls in x: the answer lies above mid
                lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
                width /= 2
            out[start:start + self.CHUNK] = np.floor(hi / precision) * precision
        return out


def subsampled_pld(loss_for, sampling_prob: float, grid: float, pessimistic: bool, connect_dots: bool = True):
    """dp-accounting's ``from_gaussian_mechanism`` / ``from_laplace_mechanism`` (add/remove, connect-the-dots
    when pessimistic and the loss has its bounds, privacy buckets otherwise) built on ``loss_for(adjacency)``."""

    def single(adjacency):
        return kernel.monotone_pmf(loss_for(adjacency), grid, pessimistic, connect_dots)

    return kernel.subsampled(single, sampling_prob)
