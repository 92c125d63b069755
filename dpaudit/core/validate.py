"""Checks of the arguments many commands and calls share (epsilon, delta, alpha, m, bounded numbers), each raising
DPAuditError with one line that names the argument and the allowed range. One module, so every caller refuses the
same values with the same words, and the CLI can keep exit 2 for these refusals alone (any other exception is a
dpaudit bug: exit 3)."""

from __future__ import annotations

import math
import numbers

from dpaudit.core.errors import DPAuditError


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_number(what: str, x, *, above: float, at_most: float = math.inf) -> None:
    """``x`` a finite real in (above, at_most]."""
    if not _real(x) or not (above < x <= at_most):
        bounds = f"in ({above:g}, {at_most:g}]" if math.isfinite(at_most) else f"a finite number > {above:g}"
        raise DPAuditError(f"the {what} must be {bounds}, got {x!r}")


def check_epsilon(eps) -> None:
    if not (_real(eps) and eps > 0):
        raise DPAuditError(f"epsilon must be a finite number > 0, got {eps!r}")


def check_claimed_epsilon(eps) -> None:
    """A claim an audit tests: None (no claim) or a finite number >= 0."""
    if eps is not None and not (_real(eps) and eps >= 0):
        raise DPAuditError(f"claimed eps must be a finite number >= 0, got {eps!r}")


MAX_SIGMA = 1e100  # sigma^2 must stay a float (the RDP accountant squares it); eps at 1e100 is 0 to any digit


def check_sigma(sigma) -> None:
    if not (_real(sigma) and 0 < sigma <= MAX_SIGMA):
        raise DPAuditError(f"sigma must be a finite number in (0, {MAX_SIGMA:g}], got {sigma!r}")


def check_sampling_rate(p) -> None:
    if not (_real(p) and 0 < p <= 1):
        raise DPAuditError(f"sampling rate p must be in (0, 1], got {p!r}")


def check_steps(steps) -> None:
    check_count("steps", steps, 1)


def check_delta(delta, allow_zero: bool = False) -> None:
    low_ok = _real(delta) and (delta >= 0 if allow_zero else delta > 0)
    if not (low_ok and delta < 1):
        raise DPAuditError(f"delta must be in {'[0, 1)' if allow_zero else '(0, 1)'}, got {delta!r}")


def check_alpha(alpha) -> None:
    if not (_real(alpha) and 0 < alpha < 1):
        raise DPAuditError(f"alpha must be in (0, 1), got {alpha!r}")


def check_count(what: str, n, least: int) -> int:
    """``n`` an integer >= ``least`` (numpy integers too); returns it as an int."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < least:
        raise DPAuditError(f"{what} must be an integer >= {least}, got {n!r}")
    return int(n)


def check_canaries(m, least: int = 2) -> int:
    """m, the number of canaries."""
    return check_count("m (the number of canaries)", m, least)
