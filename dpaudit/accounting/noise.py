"""Per-noise facts in one table: what the noise is called, its default delta, how dp-accounting
builds its PLD, how the Monte-Carlo accountant samples it, how a trainer draws it.

Everything that differs between the Gaussian and the Laplace mechanism is here, so the rest of
the code asks ``noise(kind).<fact>`` instead of branching on the name. Constructors import their
libraries when called, so reading the table costs nothing at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Noise:
    kind: str
    noun: str            # what sigma is, for people
    axis_label: str      # for plots
    scale_text: str      # the assumption line: how sigma maps to the noise
    default_delta: float
    pure_dp: bool        # is one step pure eps-DP (finite eps at delta = 0)?
    _pld: Callable
    _pld_loss: Callable
    _numpy_draw: Callable  # (numpy Generator, scale) -> float
    # (sigma, T) -> the sigma of one step exactly equal to T steps without subsampling, where the noise is
    # closed under composition (Gaussian: sigma / sqrt(T)); None where it is not (Laplace)
    composed_sigma: Callable | None = None

    def pld(self, mech, grid: float, pessimistic: bool, log_mass_truncation: float):
        """dp-accounting's single-step PLD of ``mech`` (both add/remove directions)."""
        return self._pld(mech, grid, pessimistic, log_mass_truncation)

    def pld_loss(self, mech, adjacency, log_mass_truncation: float):
        """dp-accounting's privacy-loss object for one direction (cheap: no grid)."""
        return self._pld_loss(mech, adjacency, log_mass_truncation)

    def draw(self, rng, scale: float) -> float:
        return self._numpy_draw(rng, scale)


def _gaussian_pld(mech, grid, pessimistic, log_mass_truncation):
    from dpaudit.accounting import vectorised_loss

    return vectorised_loss.subsampled_pld(lambda adjacency: _gaussian_loss(mech, adjacency, log_mass_truncation,
                                                                           pessimistic),
                                          mech.sampling_rate, grid, pessimistic)


def _laplace_pld(mech, grid, pessimistic, log_mass_truncation):
    from dpaudit.accounting import vectorised_loss

    return vectorised_loss.subsampled_pld(lambda adjacency: _laplace_loss(mech, adjacency, log_mass_truncation),
                                          mech.sampling_rate, grid, pessimistic)


def _gaussian_loss(mech, adjacency, log_mass_truncation, pessimistic=True):
    from dpaudit.accounting import vectorised_loss

    return vectorised_loss.GaussianLoss(mech.sigma, sensitivity=1.0, pessimistic_estimate=pessimistic,
                                        log_mass_truncation_bound=log_mass_truncation,
                                        sampling_prob=mech.sampling_rate, adjacency_type=adjacency)


def _laplace_loss(mech, adjacency, log_mass_truncation):
    from dpaudit.accounting import vectorised_loss

    return vectorised_loss.LaplaceLoss(mech.sigma, sensitivity=1.0, sampling_prob=mech.sampling_rate,
                                       adjacency_type=adjacency)


NOISES: dict[str, Noise] = {
    "gaussian": Noise(
        "gaussian", "noise multiplier sigma", "sigma (noise multiplier)",
        "noise std = sigma x sensitivity (noise multiplier)", 1e-5, False,
        _gaussian_pld, _gaussian_loss, lambda rng, scale: float(rng.normal(0.0, scale)),
        composed_sigma=lambda sigma, steps: sigma / steps ** 0.5),
    "laplace": Noise(
        "laplace", "Laplace scale b / sensitivity", "Laplace scale / sensitivity",
        "Laplace scale b = sigma x sensitivity", 0.0, True,
        _laplace_pld, _laplace_loss, lambda rng, scale: float(rng.laplace(0.0, scale))),
}


def resolve_delta(kind: str, delta: float | None) -> float:
    """``delta``, or the mechanism's default when none is given (1e-5 Gaussian, 0 = pure eps-DP Laplace)."""
    return noise(kind).default_delta if delta is None else delta


def noise(kind: str) -> Noise:
    from dpaudit.errors import DPAuditError

    try:
        return NOISES[kind]
    except KeyError:
        raise DPAuditError(f"unknown mechanism {kind!r}; choose one of {', '.join(NOISES)}") from None
