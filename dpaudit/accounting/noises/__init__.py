"""Per-noise facts, one small class per noise distribution (prv_accountant's style): what sigma means, the
default delta, the privacy loss dp-accounting builds a PLD from, how one draw is made, closed forms, and
which other accountants' hooks the noise has (``rdp_event``, ``composed_sigma``).

Everything that differs between noises lives in its own module here, so the rest of the code asks
``noise(kind).<fact>`` instead of branching on the name. The modules of this package are found at import
(``NOISES``): a new noise is one new module defining ``NOISE`` (or ``register_noise`` from outside code;
tests/training/test_extension.py adds one), and the accountants whose contract it meets (``pld`` for any noise with a privacy loss; ``rdp`` for one with an ``rdp_event``) cover it. Libraries
are imported when a fact is asked for, so reading the table costs nothing at start-up.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from dpaudit.core.errors import DPAuditError


class Noise:
    """The facts every noise states. ``sigma`` is always the noise relative to the sensitivity C."""

    kind: str
    noun: str               # what sigma is, for people
    axis_label: str         # for plots
    scale_text: str         # the assumption line: how sigma maps to the noise
    default_delta: float
    pure_dp: bool           # is one step pure eps-DP (finite eps at delta = 0)?
    connect_dots: bool = True  # dp-accounting builds its pessimistic PMF by connect-the-dots (else privacy buckets)
    std_per_sigma: float = 1.0  # the noise's standard deviation over sigma x C (Laplace: sqrt 2)
    # (sigma, T) -> the sigma of one step equal to T steps without subsampling, where the noise is closed under
    # composition (Gaussian: sigma / sqrt(T)); None where it is not
    composed_sigma: Callable | None = None
    # published closed-form sigmas for (T, eps, delta) without subsampling, shown beside the tight answer
    closed_forms: dict[str, Callable] = {}
    # pld_loss builds an ELS step (``mech.group`` = k > 1 records of one user, Binomial(k, p) of them a step) as
    # the mixture it is (accounting/unit.py); False: such a step is refused, never accounted as one record
    mixture_loss: bool = False

    def estimated_sigma(self, mech, eps: float, delta: float) -> float | None:
        """An *estimate* of the sigma a tight accountant calibrates ``mech`` to (not a bound): a search's start.
        None: no estimate (the search starts from a quick accountant's calibration)."""
        return None

    def pld_loss(self, mech, adjacency, log_mass_truncation: float, pessimistic: bool = True):
        """dp-accounting's privacy-loss object for one direction of ``mech`` (cheap: no grid)."""
        raise NotImplementedError

    def loss_range(self, loss) -> float:
        """Width of one step's privacy-loss range, read from ``loss`` before anything is built."""
        bounds = loss.connect_dots_bounds()
        return bounds.epsilon_upper - bounds.epsilon_lower

    def pld(self, mech, grid: float, pessimistic: bool, log_mass_truncation: float):
        """dp-accounting's single-step PLD of ``mech`` (both add/remove directions). An ELS step's loss is the
        mixture itself (the sampling is in its weights): each direction is built from it, with no subsampling
        on top."""
        from dp_accounting.pld.privacy_loss_mechanism import AdjacencyType

        from dpaudit.accounting import vectorised_loss
        from dpaudit.accounting.pld import kernel

        if mech.group > 1:
            if not self.mixture_loss:
                raise DPAuditError(f"pld does not build the user-level (ELS) mixture step of {self.kind} noise")
            return kernel.from_directions(*(
                kernel.monotone_pmf(self.pld_loss(mech, adjacency, log_mass_truncation, pessimistic), grid,
                                    pessimistic, self.connect_dots)
                for adjacency in (AdjacencyType.REMOVE, AdjacencyType.ADD)))
        return vectorised_loss.subsampled_pld(
            lambda adjacency: self.pld_loss(mech, adjacency, log_mass_truncation, pessimistic),
            mech.sampling_rate, grid, pessimistic, self.connect_dots)

    def draw(self, rng, scale: float) -> float:
        """One draw with scale ``scale`` (sigma x C) from a numpy Generator."""
        raise NotImplementedError

    def rdp_event(self, sigma: float):
        """dp-accounting's DpEvent of one unsampled release, where its RDP accountant covers this noise."""
        return None


def _discover() -> dict[str, Noise]:
    found = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        instance = getattr(importlib.import_module(f"{__name__}.{module.name}"), "NOISE", None)
        if isinstance(instance, Noise):
            found[instance.kind] = instance
    return dict(sorted(found.items(), key=lambda kv: (kv[0] != "gaussian", kv[0] != "laplace", kv[0])))


NOISES: dict[str, Noise] = _discover()


def register_noise(instance: Noise) -> None:
    """Add a noise from outside code. Refuses a kind already taken."""

    if instance.kind in NOISES:
        raise DPAuditError(f"a noise named {instance.kind!r} exists already")
    NOISES[instance.kind] = instance


def resolve_delta(kind: str, delta: float | None) -> float:
    """``delta``, or the mechanism's default when none is given (1e-5 Gaussian, 0 = pure eps-DP Laplace)."""
    return noise(kind).default_delta if delta is None else delta


def noise(kind: str) -> Noise:
    try:
        return NOISES[kind]
    except (KeyError, TypeError):
        raise DPAuditError(f"unknown mechanism {kind!r}; choose one of {', '.join(NOISES)}") from None
