"""Is a training run's batch sampler Poisson? Tests on the batches it drew (no torch needed).

Poisson sampling at rate p over N examples and T steps (what the accountants assume) has two
fingerprints, each tested with its own chi-square statistic:

1. Batch sizes. |B_t| ~ Binomial(N, p), independent over t, so S = sum_t (|B_t| - Np)^2 / (Np(1 - p)) is
   approximately chi-square with T degrees of freedom (T - 1 when p is estimated from the batches). Fixed-
   size batches make S ~ 0 (its lower tail); a sampler that varies more than Poisson, its upper tail.
2. Each example's inclusions. c_i = number of steps that include example i ~ Binomial(T, p), independent
   over i, so K = sum_i (c_i - Tp)^2 / (Tp(1 - p)) is approximately chi-square with N (or N - 1) degrees
   of freedom. Shuffled epochs, cyclic passes and balls-in-bins (random allocation) put every example in
   one batch an epoch, which makes c_i nearly constant: K far below its lower tail.

Plus two exact checks: an index twice in one batch (sampling with replacement), and batches that repeat
with a period (a cyclic pass over a fixed order). Each of the four tails (two tests, two sides) gets
alpha / 4 (Bonferroni), so a Poisson sampler is refused with probability at most alpha. The verdict names
what the sampler looks like:

| batch sizes | inclusions per example | looks like                                   |
|---|---|---|
| Binomial    | Binomial               | Poisson (Poisson accounting valid)           |
| constant    | Binomial               | fixed-size batches drawn without replacement |
| constant    | ~constant              | shuffled epochs (cyclic if batches repeat)   |
| Binomial    | ~constant              | balls-in-bins (random allocation)            |

For the non-Poisson ones, see the sampling-aware accounting (fixed-size: replace-one relation; shuffled:
no amplification by sampling): Poisson accounting would understate eps.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpaudit.errors import DPAuditError

MAX_STEPS = 10_000_000
MAX_EXAMPLES = 100_000_000
POISSON = "Poisson"


@dataclass
class SamplerVerdict:
    looks_like: str
    poisson_accounting_valid: bool
    steps: int
    dataset_size: int
    sample_rate: float
    sample_rate_source: str
    alpha: float
    tests: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.poisson_accounting_valid:
            return (f"consistent with Poisson sampling at p = {self.sample_rate:.4g} over {self.steps} steps "
                    f"(alpha = {self.alpha:g})")
        return (f"NOT POISSON: looks like {self.looks_like}; accounting it as Poisson sampling would understate "
                "eps (account it with the sampler it is)")

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "looks_like": self.looks_like,
                "poisson_accounting_valid": self.poisson_accounting_valid, "steps": self.steps,
                "dataset_size": self.dataset_size, "sample_rate": self.sample_rate,
                "sample_rate_source": self.sample_rate_source, "alpha": self.alpha, "tests": self.tests,
                "notes": self.notes}


class _Collector:
    """Streams batches: sizes, per-example counts, in-batch duplicates, and a hash per batch."""

    def __init__(self):
        self.sizes: list[int] = []
        self.counts = np.zeros(0, np.int64)
        self.duplicates = 0
        self.hashes: list[bytes] = []
        self.seen = 0  # largest index + 1

    def add(self, batch) -> None:
        idx = np.asarray(batch, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= MAX_EXAMPLES):
            raise DPAuditError(f"batch {len(self.sizes)} holds an index outside 0..{MAX_EXAMPLES - 1}")
        if len(self.sizes) >= MAX_STEPS:
            raise DPAuditError(f"more than {MAX_STEPS} batches; audit a window of the run")
        unique = np.unique(idx)
        self.duplicates += idx.size - unique.size
        if unique.size:
            self.seen = max(self.seen, int(unique[-1]) + 1)
        if unique.size and unique[-1] >= self.counts.size:
            grown = np.zeros(max(int(unique[-1]) + 1, 2 * self.counts.size), np.int64)
            grown[:self.counts.size] = self.counts
            self.counts = grown
        self.counts[unique] += 1
        self.sizes.append(int(idx.size))
        self.hashes.append(hashlib.blake2b(unique.tobytes(), digest_size=16).digest())


def _period(hashes: list[bytes]) -> int | None:
    """The smallest period > 0 with which the batch sequence repeats (at least twice over), or None."""
    first = hashes[0]
    for k in range(1, len(hashes) // 2 + 1):
        if hashes[k] == first and all(hashes[i] == hashes[i - k] for i in range(k, len(hashes))):
            return k
    return None


def analyse_batches(batches, dataset_size: int | None = None, sample_rate: float | None = None,
                    alpha: float = 0.05) -> SamplerVerdict:
    """The verdict on a sequence of batches (each an iterable of example indices)."""
    from scipy import stats

    if not (0 < alpha < 1):
        raise DPAuditError(f"alpha must be in (0, 1), got {alpha}")
    c = _Collector()
    for batch in batches:
        c.add(batch)
    steps = len(c.sizes)
    if steps < 2:
        raise DPAuditError(f"a sampler audit needs at least 2 batches, got {steps}")
    seen = c.seen
    n = dataset_size if dataset_size is not None else seen
    if n < seen:
        raise DPAuditError(f"an index {seen - 1} is beyond the dataset size {n}")
    if n < 2:
        raise DPAuditError("a sampler audit needs a dataset of at least 2 examples")
    counts = np.zeros(n, np.int64)
    counts[:seen] = c.counts[:seen]
    sizes = np.array(c.sizes, float)
    if sample_rate is None:
        p, source, size_dof, count_dof = sizes.mean() / n, "estimated from the batches", steps - 1, n - 1
    else:
        if not (0 < sample_rate <= 1):
            raise DPAuditError(f"the sample rate must be in (0, 1], got {sample_rate}")
        p, source, size_dof, count_dof = float(sample_rate), "given", steps, n
    notes = []
    if dataset_size is None:
        notes.append(f"dataset size taken as the largest index seen + 1 = {n} (give --dataset-size if larger)")
    share = alpha / 4
    tests = {}
    if not 0 < p < 1:
        raise DPAuditError(f"the sample rate is {p:g}: every step takes {'no' if p <= 0 else 'every'} example")
    s = float(((sizes - n * p) ** 2).sum() / (n * p * (1 - p)))
    k = float(((counts - steps * p) ** 2).sum() / (steps * p * (1 - p)))
    for name, stat, dof in (("batch sizes", s, size_dof), ("inclusions per example", k, count_dof)):
        tests[name] = {"statistic": stat, "degrees_of_freedom": dof,
                       "p_too_uniform": float(stats.chi2.cdf(stat, dof)),
                       "p_too_variable": float(stats.chi2.sf(stat, dof)),
                       "dispersion": stat / dof}
    tests["duplicates within a batch"] = c.duplicates
    period = _period(c.hashes) if steps >= 4 else None
    tests["period of repeating batches"] = period
    sizes_fixed = tests["batch sizes"]["p_too_uniform"] < share
    sizes_wild = tests["batch sizes"]["p_too_variable"] < share
    counts_even = tests["inclusions per example"]["p_too_uniform"] < share
    counts_wild = tests["inclusions per example"]["p_too_variable"] < share
    if steps * p * (1 - p) < 0.05:
        notes.append(f"T p (1 - p) = {steps * p * (1 - p):.3g}: too few steps to see an epoch structure in the "
                     "inclusions; audit more steps")
    if c.duplicates:
        looks = "sampling with replacement (an example twice in one batch)"
    elif period is not None and (sizes_fixed or counts_even):
        looks = f"a cyclic pass (the same {period} batches, in the same order, every epoch)"
    elif sizes_fixed and counts_even:
        looks = "shuffled epochs (fixed-size batches, each example once an epoch)"
    elif sizes_fixed:
        looks = "fixed-size batches drawn without replacement (independent across steps)"
    elif counts_even:
        looks = "balls-in-bins (random allocation: each example in one random step an epoch)"
    elif sizes_wild or counts_wild:
        looks = ("a sampler whose " + " and ".join(w for w, hit in (("batch sizes", sizes_wild),
                                                                   ("inclusions", counts_wild)) if hit)
                 + " vary more than Poisson sampling's")
    else:
        looks = POISSON
    return SamplerVerdict(looks_like=looks, poisson_accounting_valid=looks == POISSON, steps=steps,
                          dataset_size=n, sample_rate=p, sample_rate_source=source, alpha=alpha, tests=tests,
                          notes=notes)


class SamplerAudit:
    """``SamplerAudit(loader_or_sampler, steps=T, dataset_size=N, sample_rate=p).run()``: draws T batches
    from a DataLoader (its batch sampler) or any iterable of index batches, epoch after epoch, and tests
    them (``analyse_batches``). Drawing touches no data: only the indices are taken."""

    def __init__(self, source, *, steps: int, dataset_size: int | None = None, sample_rate: float | None = None,
                 alpha: float = 0.05):
        if steps < 2 or steps > MAX_STEPS:
            raise DPAuditError(f"steps must be in 2..{MAX_STEPS}, got {steps}")
        self.source = getattr(source, "batch_sampler", None) or source
        if dataset_size is None:
            dataset = getattr(source, "dataset", None)
            dataset_size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
        self.steps, self.dataset_size, self.sample_rate, self.alpha = steps, dataset_size, sample_rate, alpha

    def batches(self):
        taken = 0
        while taken < self.steps:
            before = taken
            for batch in self.source:
                yield [int(i) for i in batch]
                taken += 1
                if taken == self.steps:
                    return
            if taken == before:
                raise DPAuditError("the sampler yielded no batch")

    def run(self) -> SamplerVerdict:
        return analyse_batches(self.batches(), self.dataset_size, self.sample_rate, self.alpha)

    def write_log(self, path: Path) -> Path:
        """The batches as a log (``dpaudit audit sampler --log``): one JSON list of indices a line."""
        from dpaudit.atomic import atomic_write_text

        return atomic_write_text(path, "".join(json.dumps(b) + "\n" for b in self.batches()))


def read_log(path: Path):
    """Batches from a log: one batch a line, a JSON list of indices or indices separated by commas or
    spaces (an empty line or [] is an empty batch)."""
    path = Path(path)
    if not path.is_file():
        raise DPAuditError(f"sampler log not found: {path}")
    number = 0
    try:
        fh = open(path, encoding="utf-8", errors="strict")
    except OSError as exc:
        raise DPAuditError(f"cannot read sampler log {path}: {exc.strerror}") from None
    with fh:
        for number, line in enumerate(_lines(fh, path), 1):
            text = line.strip()
            try:
                if text.startswith("["):
                    batch = json.loads(text)
                    if not isinstance(batch, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                              for i in batch):
                        raise ValueError("not a list of integers")
                else:
                    batch = [int(tok) for tok in text.replace(",", " ").split()]
            except (ValueError, RecursionError) as exc:
                raise DPAuditError(f"{path}:{number}: not a batch of example indices ({exc.__class__.__name__})") \
                    from None
            yield batch


def _lines(fh, path: Path):
    try:
        yield from fh
    except UnicodeDecodeError:
        raise DPAuditError(f"{path} is not a text log of batches (not UTF-8)") from None
