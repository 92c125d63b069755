"""Batches: the private runs draw by their sampler (``SOURCES``: one ``BatchSource`` record per sampler the
trainers can draw, keyed by the sampler's name in accounting/samplers/, which says how it is accounted), the
non-private baselines take shuffled fixed-size batches. Code outside asks a source's facts, never its name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dpaudit.training.samplers import AllocationSchedule


def poisson_batch(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Each of the n examples joins independently with probability ``rate`` (the accountant's assumption)."""
    return np.flatnonzero(rng.random(n) < rate)


def shuffled_batches(n: int, batch_size: int, rng: np.random.Generator):
    """Endless epochs of a random permutation cut into batches (the non-private baselines)."""
    while True:
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            yield order[start:start + batch_size]


def _poisson_source(n: int, batch_size: int, secret: int, rng: np.random.Generator):
    return lambda step: poisson_batch(n, batch_size / n, rng)


def _balls_in_bins_source(n: int, batch_size: int, secret: int, rng: np.random.Generator):
    return AllocationSchedule(n, batch_size, secret)


def cyclic_source(bands: int, groups: np.ndarray | None = None):
    """Cyclic Poisson batches for BandMF (accounting/matrix/bandmf.py): the examples in b fixed groups (``groups``,
    by default index mod b; public: the accounting holds for any fixed partition), step t a Poisson sample of group
    t mod b at rate p b, so an example can take part only at steps b apart. The expected batch is p N, as with
    plain Poisson."""

    def source(n: int, batch_size: int, secret: int, rng: np.random.Generator):
        rate = min(1.0, batch_size / n * bands)
        assigned = np.arange(n) % bands if groups is None else np.asarray(groups)
        members = [np.flatnonzero(assigned == g) for g in range(bands)]

        def draw(step: int) -> np.ndarray:
            group = members[step % bands]
            return group[rng.random(group.size) < rate]

        return draw

    return source


def user_source(owners: np.ndarray):
    """ULS batches (accounting/unit.py): each user joins a step independently with probability ``rate``, bringing
    all its (capped) records; ``owners`` [N] is each record's user index. The step's record indices come grouped by
    user, so a chunk of whole users can be cut from them (data.split_users). With q = B / N, a step holds B records
    in expectation, as under record sampling, and the accountant's rate is q: a user is accounted as an example."""

    owners = np.asarray(owners)
    order = np.argsort(owners, kind="stable")
    users, starts = np.unique(owners[order], return_index=True)
    bounds = np.append(starts, owners.size)

    def source(n: int, batch_size: int, secret: int, rng: np.random.Generator):
        if n != owners.size:
            raise ValueError(f"{owners.size} owners for {n} records")
        rate = batch_size / n

        def draw(step: int) -> np.ndarray:
            chosen = np.flatnonzero(rng.random(users.size) < rate)
            return np.concatenate([order[bounds[u]:bounds[u + 1]] for u in chosen]) if chosen.size else order[:0]

        return draw

    return source


def fixed_order_source(n: int, batch_size: int, secret: int, rng: np.random.Generator):
    """Epochs in one fixed order, for BLT's ``order=fixed`` (accounting/matrix/strategy.py: participation): a
    permutation of the N examples drawn once from the run's allocation secret (kept across resumes: a new order
    would put an example in adjacent steps), cut into N // B batches of exactly B and passed in the same order every
    epoch, so each example takes part exactly N // B steps apart (the last N mod B of the permutation never do).
    Accounted as shuffled epochs (zero-out) at that separation."""
    order = np.random.default_rng([secret, 0x0F1ED]).permutation(n)
    per_epoch = max(1, n // batch_size)

    def draw(step: int) -> np.ndarray:
        at = (step % per_epoch) * batch_size
        return order[at:at + batch_size]

    return draw


@dataclass(frozen=True)
class BatchSource:
    """How the trainers draw one sampler's batches, and what a run drawn so needs."""
    draw: Callable        # (n, B, secret, rng) -> (step -> the step's example indices)
    pattern: str          # "independent" (each step samples every example on its own: white-box canaries and
    #                       BandMF's cyclic groups need it), "epochs" (each example once an epoch, drawn afresh each
    #                       epoch) or "fixed-order" (one order every epoch: BLT's order=fixed)
    keeps_secret: bool    # the secret that draws the batches must survive a resume (run_folder.ALLOCATION_SECRET)
    words: str            # for refusals


# --sampling NAME -> its source. A sampler the trainers can draw is one entry here; how it is accounted is its
# Scheme record (accounting/samplers/). The trainers draw "shuffle" only as one fixed order (BLT's order=fixed),
# which its accounting (shuffle's zero-out relation at a separation of N // B steps) covers.
SOURCES = {
    "poisson": BatchSource(_poisson_source, "independent", False, "Poisson batches"),
    "balls-in-bins": BatchSource(_balls_in_bins_source, "epochs", True, "balls-in-bins epochs"),
    "shuffle": BatchSource(fixed_order_source, "fixed-order", True, "one fixed order"),
}


def source(sampling: str) -> BatchSource | None:
    return SOURCES.get(sampling)
