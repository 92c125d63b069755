"""What is being accounted: a noise mechanism run T times on Poisson-sampled batches."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dpaudit.accounting.noise import NOISES, noise
from dpaudit.errors import DPAuditError

MECHANISMS = tuple(NOISES)


@dataclass(frozen=True)
class Mechanism:
    """A Poisson-subsampled noise mechanism composed over ``steps`` steps.

    ``sigma`` is the noise relative to the sensitivity: the Gaussian noise multiplier
    (std = sigma * C) or the Laplace scale (b = sigma * C). ``sampling_rate`` is the Poisson
    rate p = B / N; p = 1 with steps = 1 is a single release of the mechanism.
    """

    kind: str
    sigma: float
    sampling_rate: float = 1.0
    steps: int = 1

    def __post_init__(self) -> None:
        noise(self.kind)  # refuses an unknown mechanism
        check_sigma(self.sigma)
        check_sampling_rate(self.sampling_rate)
        check_steps(self.steps)

    @property
    def is_single_release(self) -> bool:
        return self.sampling_rate == 1.0 and self.steps == 1

    def with_sigma(self, sigma: float) -> "Mechanism":
        return replace(self, sigma=sigma)

    def with_steps(self, steps: int) -> "Mechanism":
        return replace(self, steps=steps)

    def describe(self) -> str:
        return (f"Poisson-subsampled {self.kind} mechanism, {noise(self.kind).axis_label} sigma={self.sigma:g}, "
                f"sampling rate p={self.sampling_rate:g}, T={self.steps} steps")


def check_sigma(sigma: float) -> None:
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise DPAuditError(f"sigma must be a finite number > 0, got {sigma!r}")


def check_sampling_rate(p: float) -> None:
    if not (isinstance(p, (int, float)) and math.isfinite(p) and 0 < p <= 1):
        raise DPAuditError(f"sampling rate p must be in (0, 1], got {p!r}")


def check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise DPAuditError(f"steps must be an integer >= 1, got {steps!r}")


def check_epsilon(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise DPAuditError(f"epsilon must be a finite number > 0, got {eps!r}")


def check_delta(delta: float, allow_zero: bool = False) -> None:
    low_ok = delta >= 0 if allow_zero else delta > 0
    if not (isinstance(delta, (int, float)) and math.isfinite(delta) and low_ok and delta < 1):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise DPAuditError(f"delta must be in {interval}, got {delta!r}")


def sampling_rate_from(batch_size: int | None, dataset_size: int | None, p: float | None) -> float:
    """p given directly, or as B / N; exactly one of the two ways."""
    if p is not None:
        if batch_size is not None or dataset_size is not None:
            raise DPAuditError("give either the sampling rate p or batch size and dataset size, not both")
        check_sampling_rate(p)
        return float(p)
    if batch_size is None and dataset_size is None:
        return 1.0
    if batch_size is None or dataset_size is None:
        raise DPAuditError("batch size and dataset size must be given together (p = B / N)")
    if batch_size < 1 or dataset_size < 1:
        raise DPAuditError(f"batch size and dataset size must be >= 1, got B={batch_size}, N={dataset_size}")
    if batch_size > dataset_size:
        raise DPAuditError(f"batch size {batch_size} exceeds dataset size {dataset_size}")
    return batch_size / dataset_size


def schedule(kind: str, sigma: float, p: float | None = None, batch_size: int | None = None,
             dataset_size: int | None = None, steps: int | None = None, epochs: float | None = None) -> Mechanism:
    """The Mechanism a CLI command or API call describes: p directly or as B / N, T directly or as epochs / p."""
    rate = sampling_rate_from(batch_size, dataset_size, p)
    return Mechanism(kind, sigma, rate, steps_from(steps, epochs, rate))


def steps_from(steps: int | None, epochs: float | None, p: float) -> int:
    """T given directly, or as epochs / p (rounded up); one step when neither is given."""
    if steps is not None and epochs is not None:
        raise DPAuditError("give either steps or epochs, not both")
    if epochs is not None:
        if not (math.isfinite(epochs) and epochs > 0):
            raise DPAuditError(f"epochs must be > 0, got {epochs!r}")
        return max(1, math.ceil(epochs / p - 1e-9))
    if steps is None:
        return 1
    check_steps(steps)
    return steps
