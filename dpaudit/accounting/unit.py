"""The privacy unit: whose privacy a bound protects, and how a user-level run is accounted.

An example-level epsilon protects one record. Where people own many records (chats, emails, tickets), the unit
that matters is the user: neighbouring datasets differ by all of one user's records. With each user's records
capped at k (``records``), two algorithms make a run user-level DP (Chua et al., "Mind the privacy unit!", 2024;
Charles et al., "Fine-tuning large language models with user-level differential privacy", SaTML 2025):

* **ELS, example-level sampling** (``sampling="example"``): records are Poisson-sampled at rate p and clipped per
  example to C, as in any DP-SGD run. Adding or removing one user adds J ~ Binomial(k, p) of its records to a
  step, each of norm <= C, so their sum has norm <= J C. Theorem (Choquette-Choo, Ganesh, Steinke & Thakurta
  2023, Corollary 4.7; monotone in each sensitivity): the step is dominated by the scalar mixture of Gaussians
  sum_j Bin(j; k, p) N(j C, sigma^2 C^2) against N(0, sigma^2 C^2) (dp-accounting's ``MixtureOfGaussiansDpEvent``),
  in both directions (remove: the mixture is P; add: it is Q). Both are composed over the steps and the larger is
  the answer. For Laplace noise the step is pure DP with exactly k eps_1, eps_1 = log(1 + p (e^{1/sigma} - 1)):
  sup_x P(x) / Q(x) = E[e^{J / sigma}] = (1 - p + p e^{1/sigma})^k (the add direction is smaller). At k = 1 ELS is
  the example-level mechanism.
* **ULS, user-level sampling** (``sampling="user"``): users are Poisson-sampled at rate q and each sampled user's
  contribution (the sum or mean of its records' gradients) is clipped to C: the example-level mechanism with the
  user as the example, at the user rate q.
* **Group privacy**, the baseline people compute by hand: an (eps, delta)-DP mechanism is
  (k eps, delta (1 + e^eps + ... + e^{(k-1) eps}))-DP for groups of k (Dwork & Roth 2014, Thm 2.2 chained one
  member at a time; the sum is at most the k e^{(k-1) eps} delta usually quoted). ``accounting/user_level.py``.

This module imports nothing of the accounting package (``mechanism.py`` carries a ``Unit``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpaudit.core.errors import DPAuditError

MAX_RECORDS = 10_000     # records a user: beyond, the Binomial mixture's support is refused (a step's PLD grows with k)
SAMPLINGS = {"example": "ELS", "user": "ULS"}


@dataclass(frozen=True)
class Unit:
    """Whose privacy is accounted. ``kind`` "example" (the default: one record) or "user" (all of one user's
    records, at most ``records`` = k of them, sampled by ``sampling``: "example" = ELS, "user" = ULS)."""

    kind: str = "example"
    records: int = 1
    sampling: str = "example"

    def __post_init__(self) -> None:
        if self.kind not in ("example", "user"):
            raise DPAuditError(f"the privacy unit is example or user, got {self.kind!r}")
        if self.sampling not in SAMPLINGS:
            raise DPAuditError(f"a user-level run samples examples (ELS) or users (ULS), got {self.sampling!r}")
        if isinstance(self.records, bool) or not isinstance(self.records, int) or not 1 <= self.records <= MAX_RECORDS:
            raise DPAuditError(f"records per user must be an integer in [1, {MAX_RECORDS}], got {self.records!r}")
        if self.kind == "example" and (self.records != 1 or self.sampling != "example"):
            raise DPAuditError("records per user and the user sampling apply to --unit user only")

    @property
    def user_level(self) -> bool:
        return self.kind == "user"

    @property
    def mixture(self) -> int:
        """How many records of one unit a step may hold, each sampled at the step's rate: k under ELS, else 1
        (an example; a ULS user, clipped as one)."""
        return self.records if self.kind == "user" and self.sampling == "example" else 1

    @property
    def algorithm(self) -> str | None:
        """"ELS" or "ULS" for a user-level unit, None for an example."""
        return SAMPLINGS[self.sampling] if self.user_level else None

    def words(self) -> str:
        """The neighbouring relation's unit, for people."""
        if not self.user_level:
            return "one example"
        if self.sampling == "user":
            return (f"one user (ULS: users sampled, each user's contribution clipped to C as one; "
                    f"k = {self.records} records a user at most)")
        return (f"one user (ELS: up to k = {self.records} records a user, each sampled and clipped as an example; "
                f"a step holds Binomial(k, p) of them)")

    def short(self) -> str:
        return "example" if not self.user_level else f"user ({self.algorithm}, k = {self.records})"

    def to_json(self) -> dict:
        return {"kind": self.kind, "records": self.records, "sampling": self.sampling}


EXAMPLE = Unit()


def unit_from(kind: str | None, records: int | None = None, sampling: str | None = None) -> Unit:
    """The unit a command's flags or a config's keys name: ``--unit user --records-per-user k
    [--user-sampling els|uls]``; records and sampling are refused without ``--unit user``."""
    kind = kind or "example"
    if kind not in ("example", "user"):
        raise DPAuditError(f"--unit is example or user, got {kind!r}")
    if kind == "example":
        if records not in (None, 1) or sampling is not None:
            raise DPAuditError("--records-per-user and --user-sampling need --unit user")
        return EXAMPLE
    if records is None:
        raise DPAuditError("--unit user needs the contribution bound --records-per-user k (each user's records are "
                           "capped at k)")
    names = {"els": "example", "uls": "user", "example": "example", "user": "user"}
    if sampling is not None and str(sampling).lower() not in names:
        raise DPAuditError(f"--user-sampling is els (records sampled) or uls (users sampled), got {sampling!r}")
    return Unit("user", records, names[str(sampling).lower()] if sampling is not None else "example")
