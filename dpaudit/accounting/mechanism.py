"""What is being accounted (dp_accounting's DpEvent, in a small closed vocabulary).

* ``Mechanism``: one noise (``noises/``: Gaussian, Laplace, discrete Gaussian) on batches drawn by one scheme
  (``samplers.py``: Poisson, fixed-size without replacement, shuffled epochs), composed T times.
* ``Phases``: several of those composed in sequence (a warm-up at another batch size, a sigma decay, a
  resumed run with more data). Phases that differ only in their step counts are one phase (composition
  is commutative), so a schedule split into parts is accounted exactly as the whole.

Who accounts an event is an ``Accountant`` (``registry.py``); each says which events it supports and why
not the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dpaudit.accounting.matrix.strategy import Strategy, resolve
from dpaudit.accounting.noises import noise
from dpaudit.accounting.samplers import scheme
from dpaudit.accounting.unit import EXAMPLE, Unit
from dpaudit.core.errors import DPAuditError
from dpaudit.core.validate import check_sampling_rate, check_sigma, check_steps

MAX_PHASES = 1000  # a schedule of more distinct phases is refused (each is a PLD of its own)


@dataclass(frozen=True)
class Mechanism:
    """A noise mechanism on sampled batches, composed over ``steps`` steps.

    ``sigma`` is the noise relative to the sensitivity: the Gaussian noise multiplier
    (std = sigma * C) or the Laplace scale (b = sigma * C). ``sampling_rate`` is the Poisson
    rate p = B / N; p = 1 with steps = 1 is a single release of the mechanism. ``sampling`` names the
    batch sampler (``samplers.SCHEMES``); ``fixed`` and ``shuffle`` need ``batch_size`` and
    ``dataset_size`` (then p = B / N). ``unit``: whose privacy is accounted (``unit.py``): one example (the
    default), or one user under ELS (p the records' rate, k records a user: a step is the Binomial(k, p) mixture)
    or ULS (p the users' rate; a user is accounted as an example).
    """

    kind: str
    sigma: float
    sampling_rate: float = 1.0
    steps: int = 1
    sampling: str = "poisson"
    batch_size: int | None = None
    dataset_size: int | None = None
    # correlated noise (accounting/matrix/strategy.py): the matrix the noise goes through; None: independent
    strategy: object = None
    unit: Unit = EXAMPLE

    def __post_init__(self) -> None:
        noise(self.kind)  # refuses an unknown mechanism
        if self.strategy is not None:
            if not isinstance(self.strategy, Strategy):
                raise DPAuditError("strategy must be a matrix.strategy.Strategy (or None: independent noise)")
            if self.kind != "gaussian":
                raise DPAuditError(f"correlated noise ({self.strategy.family}) is accounted for Gaussian noise, "
                                   f"not {self.kind}")
        check_sigma(self.sigma)
        check_sampling_rate(self.sampling_rate)
        check_steps(self.steps)
        facts = scheme(self.sampling)
        self._sizes(facts)
        if not isinstance(self.unit, Unit):
            raise DPAuditError("unit must be an accounting.unit.Unit")
        if self.unit.mixture > 1 and (self.sampling != "poisson" or self.strategy is not None):
            raise DPAuditError("user-level accounting with example-level sampling (ELS) is built for independent "
                               "Poisson sampling of records with independent noise; give --sampling poisson, or "
                               "--user-sampling uls (users sampled, accounted under any sampler)")
        if self.strategy is not None:
            object.__setattr__(self, "strategy", resolve(self))   # blt,buffers=d: searched for this schedule

    def _sizes(self, facts) -> None:
        if facts.needs_sizes:
            b, n = self.batch_size, self.dataset_size
            if b is None or n is None:
                raise DPAuditError(f"{self.sampling} sampling needs the batch size B and the dataset size N "
                                   "(-B/-N, or B=, N= in a phase)")
            if isinstance(b, bool) or isinstance(n, bool) or not (isinstance(b, int) and isinstance(n, int)) \
                    or b < 1 or n < 1:
                raise DPAuditError(f"batch size and dataset size must be integers >= 1, got B={b!r}, N={n!r}")
            if b > n:
                raise DPAuditError(f"batch size B={b} exceeds the dataset size N={n} ({self.sampling} sampling)")
            if abs(self.sampling_rate - b / n) > 1e-12:
                object.__setattr__(self, "sampling_rate", b / n)

    @property
    def phases(self) -> tuple["Mechanism", ...]:
        return (self,)

    @property
    def steps_per_epoch(self) -> int:
        """Complete batches of B in N (shuffled epochs; a last partial batch is not counted, which can only
        put an example in more epochs)."""
        return max(1, (self.dataset_size or 1) // (self.batch_size or 1))

    @property
    def is_single_release(self) -> bool:
        return self.sampling_rate == 1.0 and self.steps == 1

    def with_sigma(self, sigma: float) -> "Mechanism":
        return replace(self, sigma=sigma)

    def with_steps(self, steps: int) -> "Mechanism":
        return replace(self, steps=steps)

    def scaled(self, factor: float) -> "Mechanism":
        return replace(self, sigma=self.sigma * factor)

    def same_but_steps(self, other: "Mechanism") -> bool:
        return replace(self, steps=other.steps) == other

    @property
    def group(self) -> int:
        """How many records of one unit a step may hold, each sampled at the step's rate (ELS: k; else 1)."""
        return self.unit.mixture

    def describe(self) -> str:
        return (f"{self.sampling}-sampled {self.kind} mechanism, {noise(self.kind).axis_label} sigma={self.sigma:g}, "
                f"sampling rate p={self.sampling_rate:g}, T={self.steps} steps"
                + (f", correlated noise {self.strategy.spec()}" if self.strategy is not None else "")
                + (f", privacy unit {self.unit.short()}" if self.unit.user_level else ""))

    def sampling_words(self) -> str:
        return scheme(self.sampling).words.format(p=self.sampling_rate, T=self.steps, B=self.batch_size,
                                                  N=self.dataset_size, t=self.steps_per_epoch)


@dataclass(frozen=True)
class Phases:
    """Mechanisms composed in sequence. Build with ``compose_phases`` (merges phases that differ only in
    their steps, and returns a plain Mechanism when one is left). ``sigma`` here is a multiplier of every
    phase's own sigma (``with_sigma``), which is what calibration searches."""

    parts: tuple[Mechanism, ...]
    sigma: float = 1.0  # the multiplier the parts' sigmas carry (1: as given)

    @property
    def phases(self) -> tuple[Mechanism, ...]:
        return self.parts

    @property
    def kind(self) -> str:
        kinds = {m.kind for m in self.parts}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def sampling(self) -> str:
        samplings = {m.sampling for m in self.parts}
        return samplings.pop() if len(samplings) == 1 else "mixed"

    @property
    def sampling_rate(self) -> float:
        return max(m.sampling_rate for m in self.parts)

    @property
    def steps(self) -> int:
        return sum(m.steps for m in self.parts)

    @property
    def unit(self) -> Unit:
        return self.parts[0].unit  # compose_phases: one unit for all

    @property
    def group(self) -> int:
        return self.unit.mixture

    @property
    def is_single_release(self) -> bool:
        return False

    def with_sigma(self, sigma: float) -> "Phases":
        """Every phase's sigma times ``sigma / self.sigma``: the shared multiplier is ``sigma``."""
        factor = sigma / self.sigma
        return Phases(tuple(m.scaled(factor) for m in self.parts), sigma)

    def with_steps(self, steps: int) -> "Phases":
        raise DPAuditError("max-steps answers for one phase; give one schedule, not phases")

    def describe(self) -> str:
        return "; ".join(f"phase {i + 1}: {m.describe()}" for i, m in enumerate(self.parts))

    def sampling_words(self) -> str:
        return " then ".join(f"[{m.sampling_words()}, sigma={m.sigma:g}]" for m in self.parts)


def resampled(mech: Mechanism | Phases, sampling: str) -> Mechanism | Phases:
    """The same schedule (noise, sigma, B, N, p, T of every phase) with its batches drawn by ``sampling``: what an
    accountant for that sampler would have been given."""
    sizes = scheme(sampling).needs_sizes
    return compose_phases([Mechanism(m.kind, m.sigma, m.sampling_rate, m.steps, sampling,
                                     m.batch_size if sizes else None, m.dataset_size if sizes else None,
                                     unit=m.unit)
                           for m in mech.phases])


def with_unit(mech: Mechanism | Phases, unit: Unit) -> Mechanism | Phases:
    """The same schedule accounted for ``unit`` (every phase: a run has one privacy unit)."""
    if unit == mech.unit:
        return mech
    return compose_phases([replace(m, unit=unit) for m in mech.phases])


def miss_log_probability(mech: Mechanism | Phases) -> float:
    """log P(one given unit is in no batch of the run): T log(1 - p) for Poisson and fixed-size batches
    (each step takes it with probability p, independently; an ELS user's k records: k T log(1 - p)); -inf where
    every epoch takes it (shuffle) or p = 1.
    Every add/remove or replace-one pair is at total variation at most 1 - e^this (coupling)."""
    total = 0.0
    for m in mech.phases:  # ELS: each of a user's k records is missed independently
        if not scheme(m.sampling).independent_steps or m.sampling_rate >= 1:
            return -math.inf
        total += m.group * m.steps * math.log1p(-m.sampling_rate)
    return total


def compose_phases(parts) -> Mechanism | Phases:
    """The event of ``parts`` run in sequence: phases that differ only in steps become one (composition is
    commutative, so a schedule split into parts is the whole), and one phase left is a plain Mechanism.

    Only for samplers whose steps are independent (``Scheme.independent_steps``: Poisson, fixed-size), where
    T1 + T2 steps are exactly the two phases. Shuffled epochs are not additive: the phases touch up to
    ceil(T1 / K) + ceil(T2 / K) epochs (a run restarted mid-epoch starts a fresh permutation), which can be
    one more than ceil((T1 + T2) / K), so merging them would under-count."""
    merged: list[Mechanism] = []
    for m in parts:
        if not isinstance(m, Mechanism):
            raise DPAuditError(f"a phase must be a Mechanism, got {type(m).__name__}")
        for i, seen in enumerate(merged):
            if scheme(m.sampling).independent_steps and seen.same_but_steps(m):
                merged[i] = seen.with_steps(seen.steps + m.steps)
                break
        else:
            merged.append(m)
    if not merged:
        raise DPAuditError("no phases given")
    if len({m.unit for m in merged}) > 1:
        raise DPAuditError("phases of one run share one privacy unit; give every phase the same unit")
    if len(merged) > MAX_PHASES:
        raise DPAuditError(f"{len(merged)} distinct phases; dpaudit accounts up to {MAX_PHASES}")
    samplings = {m.sampling for m in merged}
    if len(samplings) > 1:
        relations = {scheme(x).relation for x in samplings}
        if len(relations) > 1:
            raise DPAuditError(f"phases with different samplers ({', '.join(sorted(samplings))}) are accounted under "
                               "different neighbouring relations; give phases that share one sampler")
        raise DPAuditError(f"phases with different samplers ({', '.join(sorted(samplings))}) share the "
                           f"{relations.pop().value} relation, but no accountant here composes them in one answer "
                           "(each accounts one sampler): account each part on its own and add the eps at the sum of "
                           "the deltas (basic composition, valid but looser)")
    return merged[0] if len(merged) == 1 else Phases(tuple(merged))


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
             dataset_size: int | None = None, steps: int | None = None, epochs: float | None = None,
             sampling: str = "poisson", strategy=None) -> Mechanism:
    """The Mechanism a CLI command or API call describes: p directly or as B / N, T directly or as epochs / p;
    fixed and shuffled batches need B and N; ``strategy``: correlated noise (matrix/strategy.py), None: independent."""
    if scheme(sampling).needs_sizes and (batch_size is None or dataset_size is None):
        raise DPAuditError(f"{sampling} sampling needs the batch size and the dataset size (-B and -N), not p")
    if scheme(sampling).whole_epochs and epochs is not None and epochs != int(epochs):
        raise DPAuditError(f"{sampling} sampling allocates every example once an epoch: --epochs must be a whole "
                           f"number, got {epochs!r}")
    rate = sampling_rate_from(batch_size, dataset_size, p)
    sizes = {"batch_size": batch_size, "dataset_size": dataset_size} if scheme(sampling).needs_sizes else {}
    # Shuffled epochs are N // B batches each (a partial last batch, if kept, adds nothing to the bound)
    per_epoch = 1 / (dataset_size // batch_size) if scheme(sampling).epochs and batch_size <= dataset_size else rate
    return Mechanism(kind, sigma, rate, steps_from(steps, epochs, per_epoch), sampling, **sizes, strategy=strategy)


def event(kind: str, sigma: float | None, p=None, batch_size=None, dataset_size=None, steps=None, epochs=None,
          sampling: str = "poisson", phases=None, words=("sigma", "phases", "p/batch_size/steps/epochs/sampling"),
          strategy=None):
    """What a command or API call describes: one schedule, or ``phases`` (mappings as ``phase_from`` takes them,
    or Mechanisms) composed in sequence, each phase's sigma defaulting to ``sigma``. ``words``: how the caller
    names sigma, the phases and the one-schedule keys, for its refusals."""
    if phases is None:
        if sigma is None:
            raise DPAuditError(f"give {words[0]} (or the schedule as {words[1]})")
        return schedule(kind, sigma, p, batch_size, dataset_size, steps, epochs, sampling, strategy)
    if strategy is not None:
        raise DPAuditError("correlated noise is accounted over one schedule, not phases")
    if any(x is not None for x in (p, batch_size, dataset_size, steps, epochs)) or sampling != "poisson":
        raise DPAuditError(f"give the schedule either as {words[1]} or as {words[2]}, not both")
    if isinstance(phases, (str, bytes)) or not hasattr(phases, "__iter__"):
        raise DPAuditError("phases must be a list of mappings (or Mechanism objects)")
    return compose_phases([x if isinstance(x, Mechanism) else phase_from(dict(x), kind, sigma) for x in phases])


PHASE_KEYS = {"sigma", "p", "steps", "epochs", "sampling", "B", "N", "mech"}


def phase_from(spec: dict, default_kind: str = "gaussian", default_sigma: float | None = None) -> Mechanism:
    """One phase from a mapping (a config's ``phases:`` entry, or a parsed ``--phase``): sigma, p or B and N,
    steps or epochs, optionally sampling and mech."""
    unknown = sorted(set(spec) - PHASE_KEYS)
    if unknown:
        raise DPAuditError(f"unknown phase key(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(PHASE_KEYS))}")
    sigma = spec.get("sigma", default_sigma)
    if sigma is None:
        raise DPAuditError("a phase is missing its sigma (sigma=S)")
    if "steps" not in spec and "epochs" not in spec:
        raise DPAuditError("a phase is missing its length (steps=T or epochs=E)")
    if "p" not in spec and not ("B" in spec and "N" in spec):
        raise DPAuditError("a phase is missing its sampling rate (p=P, or B= and N=)")

    def integer(key):
        value = spec.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise DPAuditError(f"phase key {key} must be an integer, got {value!r}")
        return int(value)

    def number(key):
        value = spec.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DPAuditError(f"phase key {key} must be a number, got {value!r}")
        return float(value)

    kind = spec.get("mech", default_kind)
    return schedule(kind, number("sigma") if "sigma" in spec else float(sigma),
                    number("p"), integer("B"), integer("N"), integer("steps"), number("epochs"),
                    spec.get("sampling", "poisson"))


def parse_phase(text: str) -> dict:
    """``sigma=1.1,p=0.004,steps=1000[,sampling=shuffle,B=256,N=60000]`` as a mapping of numbers and names."""
    if len(text) > 1000:
        raise DPAuditError("a --phase is at most 1000 characters")
    spec: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise DPAuditError(f"--phase takes key=value pairs separated by commas, got {item!r}")
        if key in spec:
            raise DPAuditError(f"--phase gives {key} twice")
        if key in ("sampling", "mech"):
            spec[key] = value
            continue
        try:
            spec[key] = float(value)
        except ValueError:
            raise DPAuditError(f"--phase {key} must be a number, got {value!r}") from None
    return spec


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
