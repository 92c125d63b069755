"""What an accountant answers: an upper bound on epsilon, with the neighbouring relation it covers."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from enum import Enum


class NeighboringRelation(str, Enum):
    """Which datasets are neighbours (dp_accounting's enum, same names). Each batch sampler has its own
    (``samplers.Scheme.relation``): Poisson sampling add/remove, fixed-size batches replace-one, shuffled
    epochs zero-out (REPLACE_SPECIAL: one example replaced by a null one). A relation an accountant does not
    cover is refused with a reason rather than answered wrongly."""

    ADD_OR_REMOVE_ONE = "add/remove"
    REPLACE_ONE = "replace-one"
    REPLACE_SPECIAL = "zero-out"


ADD_REMOVE = "add/remove (max of the add and the remove direction after composition)"
SINGLE_RELEASE = "add/remove (one release: both directions coincide)"
NO_SUBSAMPLING = "add/remove (no subsampling: both directions coincide)"


REPLACE_ONE_WORDS = "replace-one (N public; a clipped sum moves by up to 2C)"
ZERO_OUT_WORDS = "zero-out (one example replaced by a null one; each example meets at most one batch an epoch)"


@dataclass(frozen=True)
class EpsilonResult:
    """``epsilon`` is an upper bound on the true epsilon at ``delta`` for ``neighboring``.

    ``relation`` says in words how both directions are covered; ``directions`` holds the
    per-direction values where the accountant composes them apart (their max is ``epsilon``).
    ``guarantee`` says in words what kind of bound it is.
    """

    accountant: str
    epsilon: float
    delta: float
    relation: str
    guarantee: str
    directions: dict[str, float] = field(default_factory=dict)
    details: dict[str, object] = field(default_factory=dict)
    neighboring: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE
    mechanism: object = None  # the Mechanism accounted, when the caller attached it (the Python API does)
    unit: str = "example"     # whose privacy: "example", or "user (ELS, k = 4)" (accounting/unit.py)

    @property
    def sigma(self) -> float | None:
        return None if self.mechanism is None else self.mechanism.sigma

    def standing_in_for(self, requested: str, why: str, **details) -> EpsilonResult:
        """This result answering for the ``requested`` accountant, which could not: the guarantee says
        why, and ``details`` name the fallback, the accountant asked for and the reason."""
        return replace(self, guarantee=self.guarantee + f" — {why}", details=dict(
            self.details, fallback=self.accountant, requested=requested, reason=why, **details))

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("mechanism")
        out["epsilon"] = json_float(self.epsilon)
        out["directions"] = {k: json_float(v) for k, v in self.directions.items()}
        out["neighboring"] = self.neighboring.value
        return out


def json_float(x: float) -> float | str:
    """JSON has no infinity: write it as the string "inf"."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


@dataclass(frozen=True)
class DeltaResult:
    """``delta`` is an upper bound on the true delta at ``epsilon`` (with probability >= 1 - beta for
    Monte-Carlo, said in ``guarantee``); ``estimate`` is a point estimate where the accountant has one."""

    accountant: str
    delta: float
    epsilon: float
    relation: str
    guarantee: str
    estimate: float | None = None
    directions: dict[str, float] = field(default_factory=dict)
    details: dict[str, object] = field(default_factory=dict)
    neighboring: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE
    unit: str = "example"

    def to_json(self) -> dict:
        out = asdict(self)
        out["neighboring"] = self.neighboring.value
        return out
