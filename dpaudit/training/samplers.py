"""Batch samplers that draw what dpaudit accounts: ``PoissonSampler`` (accounted as ``--sampling poisson``) and
``BallsInBinsSampler`` (``--sampling balls-in-bins``). Each is a PyTorch batch sampler: ``DataLoader(dataset,
batch_sampler=sampler)``, and so into Opacus with ``make_private(..., poisson_sampling=False)`` (Opacus then keeps
the loader, and its accountant reads the rate as 1 / len(loader): 1 / t for balls-in-bins, p for Poisson).

Memory: a batch's own indices only. Neither sampler draws an epoch-sized array, and neither samples with
replacement.
- Poisson: the batch size is Binomial(N, p) and the batch a uniformly random subset of that size (numpy's
  ``choice`` without replacement: Floyd's algorithm for small batches). Given its size, a Poisson batch is exactly
  such a subset, so this is Poisson sampling.
- Balls-in-bins: an epoch of t = N // B steps. The batch sizes are drawn in turn, each Binomial(remaining
  examples, 1 / remaining steps): that is the multinomial law of t bins. Batch i is the examples at positions
  [offset_i, offset_i + size_i) of a permutation of [0, N), so each example lands in exactly one step an epoch,
  and with a uniformly random permutation each in a uniformly random step independently: random allocation. Up to
  ``EXACT_PERMUTATION`` examples the permutation is drawn whole from the seeded generator (Fisher-Yates: uniform
  up to the generator; 8 bytes an example, held for the epoch). Above, where an epoch-sized array would cost too
  much, it is a keyed 4-round Feistel network on the next power of four above N, cycle-walked into [0, N)
  (Black & Rogaway 2002), evaluated on the batch's positions only: pseudorandom, not uniform, the same
  computational assumption every seeded sampler makes. (Over a tiny domain 4 rounds are far from uniform: at
  N = 6, B = 2 the Feistel allocation's per-example step counts had a chi-square p of 1.3e-7, hence the exact
  permutation below the limit.) ``dpaudit audit sampler --sampling balls-in-bins`` tests the log it writes.

``.log(path)`` records every batch drawn from then on, one JSON list of indices a line: the format ``dpaudit
audit sampler --log`` and ``dpaudit check --sampler-log`` read. The file is created anew (an existing one is
refused, never overwritten), mode 0600, flushed after every epoch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from dpaudit.core.errors import DPAuditError

_MASK64 = (1 << 64) - 1
EXACT_PERMUTATION = 1 << 22   # examples: up to this many, each epoch's permutation is drawn whole (32 MiB at most)


def _check_size(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise DPAuditError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class _Logged:
    """What both samplers share: the seeded generator and the log."""

    def __init__(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)
        self._log = None
        self._yielded = 0   # batches drawn so far (a log opened after them would miss them)

    def log(self, path) -> "_Logged":
        """Record every batch drawn from now on in ``path`` (created anew, 0600); returns the sampler."""
        if self._log is not None:
            raise DPAuditError("this sampler already logs its batches")
        if self._yielded:
            raise DPAuditError(f"this sampler has drawn {self._yielded} batch(es) already: call .log(path) before "
                               "drawing, so the log holds every batch the run took (an audit of part of a run "
                               "vouches for none of the rest)")
        path = Path(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise DPAuditError(f"{path} exists: a sampler log is never overwritten") from None
        except OSError as exc:
            raise DPAuditError(f"cannot create sampler log {path}: {exc.strerror}") from None
        self._log = os.fdopen(fd, "w", encoding="utf-8")
        return self

    def _record(self, batch: list[int]) -> list[int]:
        self._yielded += 1
        if self._log is not None:
            self._log.write(json.dumps(batch) + "\n")
        return batch

    def _flush(self) -> None:
        if self._log is not None:
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def epoch_draw(rng: np.random.Generator, n: int, per_epoch: int) -> tuple[np.ndarray, list[int] | np.ndarray]:
    """One balls-in-bins epoch's randomness: the t batch sizes (multinomial, drawn as successive binomials) and
    the permutation: drawn whole up to ``EXACT_PERMUTATION`` examples, else the Feistel network's four round keys."""
    keys = [int(k) for k in rng.integers(0, 2 ** 63, size=4)]
    if n <= EXACT_PERMUTATION:
        keys = rng.permutation(n)
    sizes = np.empty(per_epoch, dtype=np.int64)
    left = n
    for step in range(per_epoch):
        remaining = per_epoch - step
        sizes[step] = left if remaining == 1 else int(rng.binomial(left, 1 / remaining))
        left -= sizes[step]
    return sizes, keys


def allocated(n: int, sizes: np.ndarray, keys: list[int] | np.ndarray, step: int) -> np.ndarray:
    """Batch ``step`` of an epoch drawn by ``epoch_draw``: the permutation of its positions, sorted."""
    offset = int(sizes[:step].sum())
    if isinstance(keys, np.ndarray):
        return np.sort(keys[offset:offset + int(sizes[step])]).astype(np.int64)
    positions = np.arange(offset, offset + int(sizes[step]), dtype=np.uint64)
    return np.sort(_permute(positions, keys, n)).astype(np.int64)


class AllocationSchedule:
    """The bundled trainers' balls-in-bins batches: step s's batch from (secret, epoch) alone, so a resumed run
    draws the batches the killed one would have (Poisson batches need no such care: each step is fresh)."""

    def __init__(self, n: int, batch_size: int, secret: int) -> None:
        self.n, self.per_epoch, self.secret = n, max(1, n // batch_size), int(secret)
        self._epoch, self._draw = -1, None

    def __call__(self, step: int) -> np.ndarray:
        epoch, within = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._draw = epoch_draw(np.random.default_rng([self.secret, 0xB1B5, epoch]), self.n, self.per_epoch)
        return allocated(self.n, *self._draw, within)


class PoissonSampler(_Logged):
    """Each example joins each step's batch independently with probability ``sample_rate``. One iteration
    yields ``steps`` batches (default round(1 / p), an epoch's worth, as Opacus' UniformWithReplacementSampler).
    A batch can be empty."""

    def __init__(self, dataset_size: int, sample_rate: float, steps: int | None = None, seed: int | None = None):
        super().__init__(seed)
        self.dataset_size = _check_size("dataset size", dataset_size)
        if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
            raise DPAuditError(f"sampling rate must be in (0, 1], got {sample_rate!r}")
        self.sample_rate = float(sample_rate)
        self.steps = _check_size("steps", steps) if steps is not None else max(1, round(1 / self.sample_rate))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            size = int(self._rng.binomial(self.dataset_size, self.sample_rate))
            chosen = self._rng.choice(self.dataset_size, size, replace=False) if size else np.empty(0, np.int64)
            yield self._record(sorted(int(i) for i in chosen))
        self._flush()


class BallsInBinsSampler(_Logged):
    """Each epoch of t = N // batch_size steps puts every example in one uniformly random step (batches of
    N / t examples on average). One iteration is one epoch; ``epochs`` iterations are allowed (the schedule
    that is accounted: ``--sampling balls-in-bins -B batch_size -N N --epochs E``), a further one is refused."""

    def __init__(self, dataset_size: int, batch_size: int, epochs: int, seed: int | None = None):
        super().__init__(seed)
        self.dataset_size = _check_size("dataset size", dataset_size)
        self.batch_size = _check_size("batch size", batch_size)
        self.epochs = _check_size("epochs", epochs)
        if self.batch_size > self.dataset_size:
            raise DPAuditError(f"batch size B={self.batch_size} exceeds the dataset size N={self.dataset_size}")
        self.steps_per_epoch = self.dataset_size // self.batch_size
        self._drawn = 0

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self):
        if self._drawn >= self.epochs:
            raise DPAuditError(f"this sampler was made for {self.epochs} epoch(s), all drawn: account more epochs "
                               "and make a new sampler")
        self._drawn += 1
        sizes, keys = epoch_draw(self._rng, self.dataset_size, self.steps_per_epoch)
        for step in range(self.steps_per_epoch):
            yield self._record(allocated(self.dataset_size, sizes, keys, step).tolist())
        self._flush()


def _permute(x: np.ndarray, keys: list[int], n: int) -> np.ndarray:
    """The keyed permutation of [0, n) at positions ``x``: Feistel on 2 x half bits (4^half >= n), cycle-walked
    below n."""
    half = max(1, math.ceil(math.log2(max(n, 2)) / 2))
    out = _feistel(x, keys, half)
    outside = out >= n
    while outside.any():  # each walk lands in [0, n) with probability n / 4^half >= 1/4
        out[outside] = _feistel(out[outside], keys, half)
        outside = out >= n
    return out


def _feistel(x: np.ndarray, keys: list[int], half: int) -> np.ndarray:
    bits, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> bits, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << bits) | right


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """splitmix64's finaliser of x + key (wrapping uint64 arithmetic): the Feistel round function."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(key & _MASK64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
