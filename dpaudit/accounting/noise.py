"""The noise table (``noises/``: one module per noise) and the two questions asked of it by name."""

from __future__ import annotations

from dpaudit.accounting.noises import NOISES, Noise

__all__ = ["NOISES", "Noise", "noise", "resolve_delta"]


def resolve_delta(kind: str, delta: float | None) -> float:
    """``delta``, or the mechanism's default when none is given (1e-5 Gaussian, 0 = pure eps-DP Laplace)."""
    return noise(kind).default_delta if delta is None else delta


def noise(kind: str) -> Noise:
    from dpaudit.core.errors import DPAuditError

    try:
        return NOISES[kind]
    except (KeyError, TypeError):
        raise DPAuditError(f"unknown mechanism {kind!r}; choose one of {', '.join(NOISES)}") from None
