"""What an accountant answers: an upper bound on epsilon, with what it covers."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

ADD_REMOVE = "add/remove (max of the add and the remove direction after composition)"
SINGLE_RELEASE = "add/remove (one release: both directions coincide)"


@dataclass(frozen=True)
class EpsilonResult:
    """``epsilon`` is an upper bound on the true epsilon at ``delta`` for ``relation``.

    ``directions`` holds the per-direction values where the accountant composes them apart
    (their max is ``epsilon``). ``guarantee`` says in words what kind of bound it is.
    """

    accountant: str
    epsilon: float
    delta: float
    relation: str
    guarantee: str
    directions: dict[str, float] = field(default_factory=dict)
    details: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict:
        out = asdict(self)
        out["epsilon"] = json_float(self.epsilon)
        out["directions"] = {k: json_float(v) for k, v in self.directions.items()}
        return out


def json_float(x: float) -> float | str:
    """JSON has no infinity: write it as the string "inf"."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")
