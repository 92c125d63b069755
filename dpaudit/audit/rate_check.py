"""The sample-rate check of a white-box probe: is the rate the claim is accounted with the rate the data is sampled at?

Fact. Under Poisson sampling an example's privacy loss grows with the rate q the data loader samples it at; an
accountant told a rate below q answers an eps below the run's. A probe that drew its canaries at the accountant's
rate would then show a run as private as its claim (the canaries and the claim share the same wrong rate), so the
probe draws them at the loader's own rate (``DPDataLoader.sample_rate``, or batch size / dataset size for a loader of
fixed batches) and sets it beside the lowest rate the accountant counted. A loader rate above it (beyond float
rounding) is a VIOLATION: the claim is accounted for a run that sampled less. Both rates are facts read from the
objects, so the check pays no alpha.
"""

from __future__ import annotations

from dataclasses import dataclass

TOLERANCE = 1e-6  # relative: float rounding of the same rate read in two places


@dataclass(frozen=True)
class RateCheck:
    loader_rate: float | None     # None: no loader was given; the canaries were drawn at the accounted rate
    loader_source: str
    accounted_rate: float | None  # the lowest rate the accountant counted (None: no accountant to read)
    accounted_source: str

    @property
    def refused(self) -> bool:
        return (self.loader_rate is not None and self.accounted_rate is not None
                and self.accounted_rate < self.loader_rate * (1 - TOLERANCE))

    @property
    def reason(self) -> str:
        return (f"the data loader samples at rate {self.loader_rate:.6g} ({self.loader_source}) but the claim is "
                f"accounted at {self.accounted_rate:.6g} ({self.accounted_source}): its eps is that of a run sampling "
                f"{self.loader_rate / self.accounted_rate:.3g}x less often")

    @property
    def verdict(self) -> str:
        if self.refused:
            return f"understated: {self.reason}"
        if self.loader_rate is None:
            return (f"canaries drawn at {self.accounted_rate:.6g} ({self.accounted_source}); not checked against the "
                    "data loader (pass data_loader= to attach, or the callback's trainer, to check it)")
        if self.accounted_rate is None:
            return f"canaries drawn at the data loader's rate {self.loader_rate:.6g} ({self.loader_source})"
        return (f"the data loader's rate {self.loader_rate:.6g} ({self.loader_source}) is the rate accounted "
                f"({self.accounted_source})")

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "refused": self.refused, "loader_rate": self.loader_rate,
                "loader_source": self.loader_source, "accounted_rate": self.accounted_rate,
                "accounted_source": self.accounted_source}

    @classmethod
    def from_spec(cls, spec) -> "RateCheck | None":
        """From a probe's record (core/run_record.ProbeRecord), or None where it wrote no rate."""
        if spec.loader_rate is None and spec.accounted_rate is None:
            return None
        return cls(loader_rate=spec.loader_rate, loader_source=spec.loader_rate_source or "",
                   accounted_rate=spec.accounted_rate, accounted_source=spec.accounted_rate_source or "")
