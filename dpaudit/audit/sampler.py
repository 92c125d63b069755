"""Is a training run's batch sampler Poisson? Tests on the batches it drew (no torch needed).

Poisson sampling at rate p over N examples and T steps (what the accountants assume) leaves three
fingerprints in the batches, each tested against its exact null distribution:

1. Batch sizes. |B_t| ~ Binomial(N, p), independent over t; S = sum_t (|B_t| - Np)^2 / (Np(1 - p)). Fixed-
   size batches make S ~ 0 (its lower tail); a sampler that varies more than Poisson, its upper tail.
2. Each example's inclusions. c_i = number of steps that include example i ~ Binomial(T, p), independent
   over i; K = sum_i (c_i - Tp)^2 / (Tp(1 - p)). Shuffled epochs, cyclic passes and balls-in-bins (random
   allocation) put every example in one batch an epoch, which makes c_i nearly constant: K far below its
   lower tail.
3. The most inclusions of one example, max_i c_i: P(max >= c) = 1 - F(c - 1)^N with F the Binomial(T, p)
   CDF, exact. One example drawn at 10x p (a bug that oversamples it) moves K by little among N but the
   maximum by many standard deviations (N = 60,000, T = 2,000, 92 inclusions where 8.5 are
   expected passed the dispersion tests 6 times in 10).

The null distributions of S and K. Each is a sum of iid terms (X - np)^2 / (np(1 - p)), X ~ Binomial(n, p),
whose variance is 2 + (1 - 6p(1 - p)) / (np(1 - p)), not the chi-square's 2: at small np (T p of 0.1-0.3
for the inclusions) it is about 1 / (np) and a chi-square tail raised 22-50 % false alarms at alpha = 0.05.
So the null is simulated exactly instead: the histogram of m iid Binomial(n, p) values is
Multinomial(m, pmf), one draw per replicate whatever m, the statistic recomputed from it (with p estimated
again from each replicate when the audit estimates it: a parametric bootstrap), and the tail p-value is the
Monte-Carlo one, (1 + #{replicates at least as extreme}) / (1 + R), valid at any R. The pmf is cut where its
tails hold 1e-15 (m x that is the probability any value falls outside). Where np(1 - p) is so large that the
pmf spans more than MAX_SUPPORT values, the terms are nearly chi-square and the chi-square tail is used.
The simulation's generator is seeded (the verdict is a function of the log alone).

Plus two exact checks: an index twice in one batch (sampling with replacement), and batches that repeat
with a period (a cyclic pass over a fixed order; found in O(T) with the prefix function). And an order test: the
rank correlation between an example's index and the step it is first drawn in, exact under any sampler that
draws without looking at the index (a loader that walks the dataset in order reads "a fixed order", which gets
no amplification by sampling). The six tails (two tests two-sided, the maximum one-sided, the order test)
get alpha / 6 each (Bonferroni), so a Poisson sampler is refused with probability at most alpha. The verdict
names what the sampler looks like:

| batch sizes | inclusions per example | looks like                                   |
|---|---|---|
| Binomial    | Binomial               | Poisson (Poisson accounting valid)           |
| constant    | Binomial               | fixed-size batches drawn without replacement |
| constant    | ~constant              | shuffled epochs (cyclic if batches repeat)   |
| Binomial    | ~constant              | balls-in-bins (random allocation)            |
| Binomial    | Binomial, one far above | a sampler that oversamples some examples    |

What one log cannot tell apart: the tests see the marginal fingerprints (sizes, counts per example, their
maximum). A sampler whose sizes are Binomial and whose counts are Binomial but whose steps depend on each other
(an example kept out of the step after the one it was in, fixed-size batches whose sizes jitter like
Binomial ones while the draws avoid repeats) can pass. The audit refutes Poisson sampling; it never proves it.

For the non-Poisson ones, see the sampling-aware accounting (fixed-size: replace-one relation; shuffled:
no amplification by sampling): Poisson accounting would understate eps.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from array import array

import numpy as np

from dpaudit.core.errors import DPAuditError
from dpaudit.core.validate import check_alpha, check_number
from dpaudit.accounting.samplers import observed_as, scheme
from dpaudit.core import limits as budget
from dpaudit.core.atomic import atomic_write_text

MAX_STEPS = 10_000_000
MAX_EXAMPLES = 100_000_000
POISSON = "Poisson"
REPLICATES = 4000      # Monte-Carlo replicates of each null (p-values resolve down to 1 / 4001)
MAX_SUPPORT = 4000     # values of the Binomial pmf simulated; wider: the chi-square tail
TAIL = 1e-15           # pmf mass left outside the simulated support, each side
TAILS = 6              # alpha is split over this many tails (Bonferroni)
ORDER_EXACT_UP_TO = 2000  # examples: the order test's permutation null by Monte Carlo; above, its normal limit
ALPHA = 0.05           # the gate's level: a correct sampler is flagged at most this often


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
                    f"(alpha = {self.alpha:g}: a correct Poisson sampler is flagged at most {self.alpha:.0%} of the "
                    "time; passing refutes none of the samplers that share its fingerprints)")
        return (f"NOT POISSON: looks like {self.looks_like}; accounting it as Poisson sampling would understate eps: "
                f"{self.advice['words']}. A correct Poisson sampler reads so at most {self.alpha:.0%} of the time")

    @property
    def advice(self) -> dict:
        """The accounting this log supports, as words and as a schedule to follow (``sampling``, ``p``, ``steps``;
        ``dpaudit epsilon --sigma S --sampling X --p P -T T``). Only what the log can vouch for: a fingerprint that
        shows amplification by sampling (Poisson, fixed-size batches drawn independently) is named as that sampler;
        every other one gets no amplification, which holds for any data-independent order: no example is in more
        than c batches (c counted in the log), so the run is at most c full-batch releases (add/remove, sensitivity
        C each; where every batch has one size, the sampler's relation is replace-one and each release moves by 2C:
        ``sensitivity`` 2, sigma / 2 to account). Balls-in-bins' amplification needs each epoch's allocation drawn
        at random from a secret, which no log can show, so it is offered only on that condition, never as the
        figure."""
        c = int(self.tests["most inclusions of one example"]["count"])
        releases = {"sampling": "poisson", "p": 1.0, "steps": c, "sensitivity": 1.0,
                    "words": f"no amplification by sampling: account it as {c} full-batch release(s) (`--p 1 -T {c}`: "
                             f"no example is in more than {c} batch(es) of this log)"}
        if self.tests["batch sizes"]["dispersion"] == 0:  # every batch of one size: replace-one, a release moves by 2C
            releases = {**releases, "sensitivity": 2.0,
                        "words": f"no amplification by sampling: account it as {c} full-batch release(s) at "
                                 "sensitivity 2C (every batch has one size, so its neighbours replace an example: "
                                 f"`--sigma S/2 --p 1 -T {c}` for noise multiplier S; no example is in more than {c} "
                                 "batch(es) of this log)"}
        if self.poisson_accounting_valid:
            return {"sampling": "poisson", "p": self.sample_rate, "steps": self.steps,
                    "words": f"Poisson accounting at p = {self.sample_rate:.4g}"}
        if self.looks_like.startswith("fixed-size"):
            return {"sampling": "fixed", "p": self.sample_rate, "steps": self.steps,
                    "words": "account it as fixed-size batches (`--sampling fixed -B B -N N`: replace-one, a drawn "
                             "example displaces another)"}
        if self.looks_like.startswith("shuffled epochs"):
            return {**releases, "words": releases["words"] + "; that is `--sampling shuffle`'s upper bound, with Chua "
                                                             "et al.'s lower bound beside it"}
        if self.looks_like.startswith("balls-in-bins"):
            return {**releases, "words": releases["words"] + "; `--sampling balls-in-bins` (close to Poisson's eps) "
                                                             "only if each epoch's steps are drawn at random from a "
                                                             "secret seed (dpaudit.samplers.BallsInBinsSampler), which "
                                                             "a log cannot show"}
        return releases

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "looks_like": self.looks_like, "advice": self.advice,
                "poisson_accounting_valid": self.poisson_accounting_valid, "steps": self.steps,
                "dataset_size": self.dataset_size, "sample_rate": self.sample_rate,
                "sample_rate_source": self.sample_rate_source, "alpha": self.alpha, "tests": self.tests,
                "notes": self.notes}


class _Collector:
    """Streams batches: sizes, per-example counts, in-batch duplicates, and a hash per batch."""

    HASH = 16  # bytes of a batch's hash

    def __init__(self):
        self.sizes = array("q")      # 8 bytes a step
        self.counts = np.zeros(0, np.int64)
        self.first = np.zeros(0, np.int64)   # the step an example is first in (-1: not yet)
        self.duplicates = 0
        self.hashes = bytearray()   # HASH bytes a step, one buffer (a list of bytes objects costs ~50 more)
        self.seen = 0  # largest index + 1

    def _fits(self, examples: int) -> None:
        """The memory what is held will need (8 bytes a step's size, HASH its hash, twice 8 an example's count
        while its array grows, and the analysis's copies of both), against --max-memory."""

        steps = len(self.sizes) + 4096
        budget.current().require(steps * (8 + self.HASH + 2 * 8 + 8 * self.HASH) + examples * 8 * 8,
                                 "the sampler audit", "audit a window of the run (fewer batches); every example "
                                 "index up to the largest costs 16 bytes")

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
        if len(self.sizes) % 4096 == 0:
            self._fits(self.counts.size)
        if unique.size and unique[-1] >= self.counts.size:
            size = max(int(unique[-1]) + 1, 2 * self.counts.size)
            self._fits(size)
            grown = np.zeros(size, np.int64)
            grown[:self.counts.size] = self.counts
            first = np.full(size, -1, np.int64)
            first[:self.first.size] = self.first
            self.counts, self.first = grown, first
        new = unique[self.first[unique] < 0]
        self.first[new] = len(self.sizes)
        self.counts[unique] += 1
        self.sizes.append(int(idx.size))
        self.hashes += hashlib.blake2b(unique.tobytes(), digest_size=self.HASH).digest()


def _period(hashes: bytes, width: int = _Collector.HASH) -> int | None:
    """The smallest period k > 0 with which the batch sequence repeats at least twice over (batch i equals
    batch i - k for every i >= k), or None: T minus the longest proper border, from the prefix function
    (Knuth-Morris-Pratt), in O(T) comparisons (a search over k was O(T^2): 90 s on a crafted 40k-line log)."""
    seq = [hashes[i:i + width] for i in range(0, len(hashes), width)]
    n = len(seq)
    border = [0] * n
    k = 0
    for i in range(1, n):
        while k and seq[i] != seq[k]:
            k = border[k - 1]
        if seq[i] == seq[k]:
            k += 1
        border[i] = k
    period = n - border[-1] if n else 0
    return period if 0 < period <= n // 2 else None


def _binomial_dispersion(x: np.ndarray, n: int, p: float | None) -> float:
    """sum (x - n q)^2 / (n q (1 - q)), q = p or the values' own mean / n (0 when q is 0 or 1)."""
    q = float(x.mean()) / n if p is None else p
    var = n * q * (1 - q)
    return float(((x - n * q) ** 2).sum() / var) if var > 0 else 0.0


def _dispersion_p_values(stat: float, m: int, n: int, p: float, estimated: bool, seed: int) -> tuple[float, float, str]:
    """(P(S <= stat), P(S >= stat), how) under the null: S the dispersion of m iid Binomial(n, p) values, p
    re-estimated in each replicate when ``estimated`` (module docstring: simulated exactly, chi-square only where
    the pmf is too wide to simulate)."""
    from scipy import stats

    lo, hi = int(stats.binom.ppf(TAIL, n, p)), int(stats.binom.isf(TAIL, n, p)) + 1
    if hi - lo + 1 > MAX_SUPPORT:
        dof = m - 1 if estimated else m
        return float(stats.chi2.cdf(stat, dof)), float(stats.chi2.sf(stat, dof)), f"chi-square, {dof} dof"
    support = np.arange(lo, hi + 1)
    pmf = stats.binom.pmf(support, n, p)
    hist = np.random.default_rng(seed).multinomial(m, pmf / pmf.sum(), size=REPLICATES)
    q = (hist @ support) / (m * n) if estimated else np.full(REPLICATES, p)
    var = n * q * (1 - q)
    # sum_k h_k (k - n q)^2 = sum h k^2 - 2 n q sum h k + m (n q)^2
    num = hist @ (support ** 2).astype(float) - 2 * n * q * (hist @ support) + m * (n * q) ** 2
    sim = np.where(var > 0, num / np.where(var > 0, var, 1), 0.0)
    tol = 1e-9 * max(1.0, abs(stat))  # the observed statistic counts as its own replicate's tie
    return (float((1 + (sim <= stat + tol).sum()) / (1 + REPLICATES)),
            float((1 + (sim >= stat - tol).sum()) / (1 + REPLICATES)), f"exact null, {REPLICATES} replicates")


def _max_p_value(largest: int, n_examples: int, steps: int, p: float) -> float:
    """P(max of n_examples iid Binomial(steps, p) >= largest), exact: 1 - F(largest - 1)^N."""
    from scipy import stats

    above = float(stats.binom.sf(largest - 1, steps, p))
    return float(-np.expm1(n_examples * np.log1p(-above))) if above < 1 else 1.0


def _order_p_value(first: np.ndarray, steps: int, seed: int) -> tuple[float, float]:
    """(Spearman's r between an example's index and the step it is first drawn in, two-sided p-value).

    Every sampler here draws without looking at the index (Poisson, fixed-size, shuffled, balls-in-bins, with
    replacement): its draws are exchangeable in the examples' labels, so given the multiset of first steps every
    labelling is equally likely and the permutation test is exact (Monte Carlo, seeded; above
    ``ORDER_EXACT_UP_TO`` examples its normal limit: r has mean 0 and variance 1 / (n - 1) under permutation). A
    loader that walks the dataset in order has r near 1. An example never drawn counts as first after the end."""
    from scipy import stats

    n = first.size
    ranks = stats.rankdata(np.where(first < 0, steps, first))
    centred = ranks - ranks.mean()
    index = np.arange(n) - (n - 1) / 2
    scale = float(np.sqrt((centred ** 2).sum() * (index ** 2).sum()))
    if scale == 0:
        return 0.0, 1.0
    r = float(centred @ index / scale)
    if n > ORDER_EXACT_UP_TO:
        return r, float(2 * stats.norm.sf(abs(r) * np.sqrt(n - 1)))
    rng = np.random.default_rng(seed)
    extreme = 0
    for start in range(0, REPLICATES, 250):
        shuffled = np.array([rng.permutation(centred) for _ in range(min(250, REPLICATES - start))])
        extreme += int(np.count_nonzero(np.abs(shuffled @ index / scale) >= abs(r) - 1e-12))
    return r, (1 + extreme) / (1 + REPLICATES)


def analyse_batches(batches, dataset_size: int | None = None, sample_rate: float | None = None,
                    alpha: float = 0.05) -> SamplerVerdict:
    """The verdict on a sequence of batches (each an iterable of example indices)."""
    check_alpha(alpha)
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
    sizes = np.frombuffer(c.sizes, dtype=np.int64).astype(float)
    if sample_rate is None:
        p, source, estimated = sizes.mean() / n, "estimated from the batches", True
    else:
        check_number("sample rate", sample_rate, above=0, at_most=1)
        p, source, estimated = float(sample_rate), "given", False
    notes = []
    if dataset_size is None:
        notes.append(f"dataset size taken as the largest index seen + 1 = {n} (give --dataset-size if larger)")
    share = alpha / TAILS
    tests = {}
    if not 0 < p < 1:
        raise DPAuditError(f"the sample rate is {p:g}: every step takes {'no' if p <= 0 else 'every'} example")
    for seed, (name, values, trials, m) in enumerate((("batch sizes", sizes, n, steps),
                                                      ("inclusions per example", counts, steps, n))):
        stat = _binomial_dispersion(values, trials, None if estimated else p)
        low, high, how = _dispersion_p_values(stat, m, trials, p, estimated, seed)
        tests[name] = {"statistic": stat, "null": how, "p_too_uniform": low, "p_too_variable": high,
                       "dispersion": stat / m}
    largest = int(counts.max())
    tests["most inclusions of one example"] = {
        "count": largest, "example": int(counts.argmax()), "expected": steps * p,
        "p_value": _max_p_value(largest, n, steps, p)}
    tests["duplicates within a batch"] = c.duplicates
    first = np.full(n, -1, np.int64)
    first[:seen] = c.first[:seen]
    r, order_p = _order_p_value(first, steps, seed=2)
    tests["order of examples"] = {"spearman_r": r, "p_value": order_p}
    period = _period(bytes(c.hashes)) if steps >= 4 else None
    tests["period of repeating batches"] = period
    sizes_fixed = tests["batch sizes"]["p_too_uniform"] < share
    sizes_wild = tests["batch sizes"]["p_too_variable"] < share
    counts_even = tests["inclusions per example"]["p_too_uniform"] < share
    counts_wild = tests["inclusions per example"]["p_too_variable"] < share
    oversampled = tests["most inclusions of one example"]["p_value"] < share
    if steps * p * (1 - p) < 0.05:
        notes.append(f"T p (1 - p) = {steps * p * (1 - p):.3g}: too few steps to see an epoch structure in the "
                     "inclusions; audit more steps")
    if c.duplicates:
        looks = "sampling with replacement (an example twice in one batch)"
    elif period is not None and (sizes_fixed or counts_even):
        looks = f"a cyclic pass (the same {period} batches, in the same order, every epoch)"
    elif order_p < share:
        looks = (f"a fixed order (batches follow the dataset's order: an example's index and the step it is first "
                 f"drawn in correlate, Spearman r = {r:.3g}, p = {order_p:.2g})")
    elif sizes_fixed and counts_even:
        looks = "shuffled epochs (fixed-size batches, each example once an epoch)"
    elif sizes_fixed:
        looks = "fixed-size batches drawn without replacement (independent across steps)"
    elif counts_even:
        looks = "balls-in-bins (random allocation: each example in one random step an epoch)"
    elif oversampled and not sizes_wild:  # batch sizes as Poisson's, but one example far too often
        t = tests["most inclusions of one example"]
        looks = (f"a sampler that oversamples some examples (example {t['example']} is in {largest} batches, "
                 f"{steps * p:.3g} expected)")
    elif sizes_wild or counts_wild or oversampled:
        looks = ("a sampler whose " + " and ".join(w for w, hit in (("batch sizes", sizes_wild),
                                                                   ("inclusions", counts_wild)) if hit)
                 + " vary more than Poisson sampling's")
    else:
        looks = POISSON
    return SamplerVerdict(looks_like=looks, poisson_accounting_valid=looks == POISSON, steps=steps,
                          dataset_size=n, sample_rate=p, sample_rate_source=source, alpha=alpha, tests=tests,
                          notes=notes)


def analyse_as(batches, sampling: str, dataset_size: int | None = None, sample_rate: float | None = None,
               batch_size: int | None = None, alpha: float = ALPHA) -> tuple[SamplerVerdict, bool, str | None]:
    """A log tested against the named sampler: (the verdict, whether the log matches it, the sampler it is
    accounted as). The fingerprint tests name what the log looks like (``analyse_batches``); it matches when that
    is ``sampling`` (the scheme records' ``looks_like``). A scheme with ``whole_epochs`` (balls-in-bins) is checked
    exactly too: with t = N // B steps an epoch, no example twice in an epoch (a log that has one is not that
    sampler: refused) and every example once in each complete epoch."""

    facts = scheme(sampling)  # refuses an unknown name
    if facts.whole_epochs:  # every example exactly once in each epoch of N // B steps: checked exactly
        if dataset_size is None or batch_size is None:
            raise DPAuditError(f"testing a log against {sampling} needs the dataset size and the batch size "
                               "(-N and -B: t = N // B steps an epoch)")
        per_epoch = dataset_size // batch_size
        placements: list = []
        tracked = np.sort(np.random.default_rng(4).permutation(dataset_size)[:PLACEMENT_EXAMPLES])
        batches = _epochs_checked(batches, dataset_size, per_epoch, placements, tracked)
        sample_rate = 1 / per_epoch if sample_rate is None else sample_rate
        # alpha in halves: the fingerprints' six tails, and the placement's four (a correct sampler: <= alpha)
        verdict = analyse_batches(batches, dataset_size, sample_rate, alpha / 2)
        verdict.alpha = alpha
        placement = _placement_tests(np.array(placements, dtype=np.int64), per_epoch, alpha / 2, seed=3)
        verdict.tests["placement of examples in steps"] = placement
        if placement.get("refuted") and observed_as(verdict.looks_like) == sampling:
            verdict.looks_like = ("an allocation that is not uniformly random (each example once an epoch, but "
                                  f"{placement['refuted']})")
    else:
        verdict = analyse_batches(batches, dataset_size, sample_rate, alpha)
    observed = observed_as(verdict.looks_like)
    return verdict, observed == sampling, observed


PLACEMENT_REPLICATES = 999  # Monte-Carlo replicates of the placement null (p-values resolve down to 1 / 1000)
PLACEMENT_EXAMPLES = 100_000  # examples whose steps are kept (a seeded random subset: the same null, bounded memory)
PLACEMENT_CELLS = 200_000     # epochs x examples tested (the simulation's size: about a second)


def _placement_statistics(steps: np.ndarray, t: int) -> tuple[float, float]:
    """(sum over examples and steps of n_is^2, n_is the epochs example i is in step s; sum over consecutive epochs
    e, e + 1 of the squared counts of examples per (step in e, step in e + 1)): how often an example returns to
    the same step, and how often two examples that shared a step share one again."""
    epochs, n = steps.shape
    own = np.bincount((np.arange(n) * t + steps).ravel(), minlength=n * t).astype(float)
    cells = (steps[:-1] * t + steps[1:]).astype(np.int64)  # (step in e, step in e + 1) of each example
    per = max(1, int(1e7) // (t * t))  # epoch pairs counted in one bincount (its memory: at most 1e7 counts)
    pairs = 0.0
    for lo in range(0, epochs - 1, per):
        block = cells[lo:lo + per] + (np.arange(min(per, epochs - 1 - lo)) * t * t)[:, None]
        pairs += float(np.square(np.bincount(block.ravel()).astype(float)).sum())
    return float(np.square(own).sum()), pairs


def _placement_tests(steps: np.ndarray, t: int, alpha: float, seed: int) -> dict:
    """Balls-in-bins puts each example in a uniformly random step of each epoch, independently of every other
    example and epoch. ``steps`` (epochs x N: each complete epoch's step of each example) is tested against that
    null with the two statistics of ``_placement_statistics``, both tails of each (alpha / 4 a tail, Bonferroni),
    the null simulated exactly (seeded Monte Carlo: the verdict is a function of the log). A keyed permutation over a
    domain too small to be random (N = 6, B = 2) returns examples to the same steps, or moves pairs
    together; a rotation (example i in step (i + e) mod t) places them too evenly. Needs two complete epochs."""
    epochs = steps.shape[0] if steps.ndim == 2 else 0
    if epochs < 2 or t < 2:
        return {"epochs": epochs, "note": "fewer than two complete epochs (or one step an epoch): placement not tested"}
    steps = steps[:, :max(1, PLACEMENT_CELLS // epochs)]  # the tracked examples are a random subset already
    observed = _placement_statistics(steps, t)
    rng = np.random.default_rng(seed)
    null = np.array([_placement_statistics(rng.integers(0, t, size=steps.shape), t)
                     for _ in range(PLACEMENT_REPLICATES)])
    out, refuted = {"epochs": epochs, "examples": int(steps.shape[1]), "replicates": PLACEMENT_REPLICATES}, []
    for k, (name, what) in enumerate((("same step again", "examples return to the same step"),
                                      ("pairs together again", "pairs of examples share a step"))):
        low = (1 + int(np.count_nonzero(null[:, k] <= observed[k]))) / (1 + PLACEMENT_REPLICATES)
        high = (1 + int(np.count_nonzero(null[:, k] >= observed[k]))) / (1 + PLACEMENT_REPLICATES)
        out[name] = {"statistic": observed[k], "null_mean": float(null[:, k].mean()), "p_too_even": low,
                     "p_too_often": high}
        if min(low, high) < alpha / 4:
            refuted.append(f"{what} {'too often' if high < low else 'too evenly'} (p = {min(low, high):.2g})")
    if refuted:
        out["refuted"] = "; ".join(refuted)
    return out


def _epochs_checked(batches, n: int, per_epoch: int, placements: list | None = None, tracked=None):
    """The batches, passed through, with each epoch of ``per_epoch`` steps checked for balls-in-bins' structure;
    each complete epoch's step of the ``tracked`` examples is appended to ``placements``."""
    seen = np.zeros(n, dtype=bool)
    where = np.zeros(n, dtype=np.int32)
    step = 0
    for batch in batches:
        idx = np.asarray(batch, dtype=np.int64)
        outside = idx[(idx < 0) | (idx >= n)]
        if outside.size:
            raise DPAuditError(f"step {step + 1}: index {int(outside[0])} is outside the dataset of {n}")
        values, counts = np.unique(idx, return_counts=True)
        again = values[(counts > 1) | seen[values]]
        if again.size:
            raise DPAuditError(f"step {step + 1}: example {int(again[0])} is drawn twice in epoch "
                               f"{step // per_epoch + 1}: not balls-in-bins (each example once an epoch)")
        seen[values] = True
        where[values] = step % per_epoch
        step += 1
        if step % per_epoch == 0:
            if not seen.all():
                missing = int(np.flatnonzero(~seen)[0])
                raise DPAuditError(f"epoch {step // per_epoch}: example {missing} is in none of its {per_epoch} "
                                   "steps: not balls-in-bins (each example once an epoch)")
            seen[:] = False
            if placements is not None:
                placements.append(where[tracked].copy())
        yield batch


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
