"""`mc`: the Monte-Carlo accountant (Wang, Mahloujifar, Wu, Jia & Mittal 2023).

For one direction with dominating pair (P, Q), delta(eps) = E_{L}[(1 - e^{eps - L})_+] where
L = sum_t log(P(x_t)/Q(x_t)), x_t ~ P, is the composed privacy loss. We sample L exactly
(vectorised and chunked), average h(L) = (1 - e^{eps - L})_+ in [0, 1], and turn the average
into a rigorous upper bound with the empirical Bernstein inequality (Maurer & Pontil 2009,
Thm. 4): with probability >= 1 - b,
    E h <= mean + sqrt(2 V log(2/b) / n) + 7 log(2/b) / (3 (n - 1)),
V the unbiased sample variance. The bound is applied on a grid of eps values fixed before
sampling, in both directions (remove: x ~ (1-p)mu_0 + p mu_1 against mu_0; add: the
reverse), with a union bound, so *all* reported bounds hold together with probability
>= 1 - beta. The reported epsilon is the smallest grid eps whose delta bound is <= delta.
``epsilon_estimate`` (plain Monte-Carlo point estimate) is an estimate, not a bound.

No library implements this accountant (dp-accounting and prv-accountant are numerical
composers), hence this module. The Laplace sampler uses an exact shortcut: a Laplace step's
loss depends on x only through clip(x, 0, 1), so the steps falling below 0 / above 1 are
counted with one multinomial draw and only the steps inside (0, 1) are sampled one by one.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from itertools import islice

import numpy as np

from dpaudit.core import limits as budget
from dpaudit.accounting.mechanism import Mechanism
from dpaudit.core.progress import progress_bar
from dpaudit.accounting.result import DeltaResult, EpsilonResult
from dpaudit.accounting.samplers import relation_of
from dpaudit.core.errors import DPAuditError
from dpaudit.accounting.mc_losses import (  # noqa: F401 - shared with mc_torch and montecarlo_tilted
    DIRECTIONS, bernstein_upper as _bernstein_upper, laplace_inside, laplace_regions, log_mix as _log_mix,
)
from dpaudit.accounting import pld
from dpaudit.accounting.mc_torch import composed_losses_torch
from dpaudit.accounting.montecarlo_tilted import delta_for_epsilon_tilted

MAX_ROWS = 16384
# Work budget (per-step loss draws per direction) used when no sample count is given.
DEFAULT_WORK = 2e8


@dataclass(frozen=True)
class MonteCarloSettings:
    samples: int | None = None  # composed samples per direction; None: sized by DEFAULT_WORK
    seed: int = 0
    beta: float = 1e-3  # failure probability of all the bounds together
    grid_size: int = 400
    chunk_elements: int = 1 << 22
    progress: bool = False
    workers: int = 1          # processes for the numpy sampler; 0 = every core
    backend: str = "numpy"    # "torch": sample on a GPU when there is one (accounting/mc_torch.py)
    tilt: bool = False        # delta(eps), Laplace: importance sampling by exponential tilting

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples < 100:
            raise DPAuditError(f"the mc accountant needs at least 100 samples, got {self.samples}")
        if not 0 < self.beta < 1:
            raise DPAuditError(f"mc failure probability beta must be in (0, 1), got {self.beta}")
        if self.backend not in ("numpy", "torch"):
            raise DPAuditError(f"unknown mc backend {self.backend!r}; use numpy or torch")
        if self.workers < 0:
            raise DPAuditError(f"mc workers must be >= 0, got {self.workers}")


def _draws_per_sample(mech: Mechanism) -> float:
    """Expected number of per-step draws that one composed sample costs."""
    if mech.kind == "laplace":
        return 3 + mech.steps * (1 - math.exp(-1 / mech.sigma)) / 2
    return float(mech.steps)


def _gaussian_composed(mech: Mechanism, direction: str, rows: int, rng: np.random.Generator, block: int) -> np.ndarray:
    s, p = mech.sigma, mech.sampling_rate
    total = np.zeros(rows)
    for start in range(0, mech.steps, block):
        cols = min(block, mech.steps - start)
        x = rng.standard_normal((rows, cols)) * s
        if direction == "remove":
            x += (rng.random((rows, cols)) < p) if p < 1 else 1.0
        loss = _log_mix(p, (2 * x - 1) / (2 * s * s))
        total += loss.sum(axis=1) if direction == "remove" else -loss.sum(axis=1)
    return total


def _laplace_composed(mech: Mechanism, direction: str, rows: int, rng: np.random.Generator) -> np.ndarray:
    b, p, steps = mech.sigma, mech.sampling_rate, mech.steps
    low, mid, _ = laplace_regions(mech, direction)
    counts = rng.multinomial(steps, [low, mid, max(0.0, 1 - low - mid)], size=rows)
    n_mid = counts[:, 1]
    u = rng.random(int(n_mid.sum()))
    x = laplace_inside(u, rng.random(u.size) if direction == "remove" and p < 1 else None, mech, direction)
    mid_loss = np.bincount(np.repeat(np.arange(rows), n_mid), weights=_log_mix(p, (2 * x - 1) / b), minlength=rows)
    ends = _log_mix(p, np.array([-1 / b, 1 / b]))
    loss = counts[:, 0] * ends[0] + counts[:, 2] * ends[1] + mid_loss
    return loss if direction == "remove" else -loss


def composed_losses(mech: Mechanism, direction: str, rows: int, rng: np.random.Generator,
                    chunk_elements: int = 1 << 22) -> np.ndarray:
    """``rows`` exact draws of the composed privacy loss of ``direction``."""
    if mech.kind == "laplace":
        return _laplace_composed(mech, direction, rows, rng)
    return _gaussian_composed(mech, direction, rows, rng, max(1, chunk_elements // rows))


@dataclass(frozen=True)
class DeltaCurve:
    """Monte-Carlo delta(eps) on a grid: point estimates and simultaneous upper bounds."""

    eps_grid: np.ndarray
    estimate: dict[str, np.ndarray]
    upper: dict[str, np.ndarray]
    samples: int
    beta: float
    seconds: float = math.nan

    @property
    def samples_per_second(self) -> float:
        """Composed samples (both directions) per second."""
        return len(DIRECTIONS) * self.samples / self.seconds

    def max_over_directions(self, which: str) -> np.ndarray:
        table = self.estimate if which == "estimate" else self.upper
        return np.maximum(*(table[d] for d in DIRECTIONS))


def sample_count(mech: Mechanism, settings: MonteCarloSettings) -> int:
    if settings.samples is not None:
        return settings.samples
    return int(min(1e6, max(1e4, DEFAULT_WORK / _draws_per_sample(mech))))


def delta_curve(mech: Mechanism, eps_grid: np.ndarray, settings: MonteCarloSettings) -> DeltaCurve:
    """Stream samples in chunks (bounded memory) and accumulate sum h and sum h^2 per grid eps."""
    eps_grid = np.asarray(eps_grid, dtype=float)
    n = sample_count(mech, settings)
    rows_per_chunk = int(max(1, min(MAX_ROWS, settings.chunk_elements // max(1.0, _draws_per_sample(mech)))))
    n_chunks = -(-n // rows_per_chunk)
    s1 = {d: np.zeros(eps_grid.size) for d in DIRECTIONS}
    s2 = {d: np.zeros(eps_grid.size) for d in DIRECTIONS}
    # Chunks are described lazily: a billion samples make tens of millions of chunks, whose list alone
    # would outgrow the memory budget.
    tasks = ((d, c, min(rows_per_chunk, n - c * rows_per_chunk))
             for d in range(len(DIRECTIONS)) for c in range(n_chunks))
    total = len(DIRECTIONS) * n_chunks
    began = time.perf_counter()
    with progress_bar(total, "Monte-Carlo accountant", settings.progress) as advance:
        for d_index, a, b in _run_tasks(mech, eps_grid, settings, tasks, total):
            s1[DIRECTIONS[d_index]] += a
            s2[DIRECTIONS[d_index]] += b
            advance(1)
    seconds = time.perf_counter() - began
    fail = settings.beta / (len(DIRECTIONS) * eps_grid.size)
    return DeltaCurve(
        eps_grid=eps_grid,
        estimate={d: s1[d] / n for d in DIRECTIONS},
        upper={d: _bernstein_upper(s1[d], s2[d], n, fail) for d in DIRECTIONS},
        samples=n,
        beta=settings.beta,
        seconds=seconds,
    )


def chunk_sums(mech: Mechanism, eps_grid: np.ndarray, settings: MonteCarloSettings, d_index: int, c_index: int,
               rows: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Sum of h and h^2 over one chunk. Each chunk has its own random stream (seed, direction, chunk),
    so the result does not depend on which process or device ran it, or in which order."""
    direction = DIRECTIONS[d_index]
    if settings.backend == "torch":
        loss = composed_losses_torch(mech, direction, rows, (settings.seed, d_index, c_index))
    else:
        rng = np.random.default_rng(np.random.SeedSequence(settings.seed, spawn_key=(d_index, c_index)))
        loss = composed_losses(mech, direction, rows, rng, settings.chunk_elements)
    tail = loss[loss > eps_grid.min()]
    if not tail.size:
        return d_index, np.zeros(eps_grid.size), np.zeros(eps_grid.size)
    h = np.maximum(0.0, -np.expm1(eps_grid[None, :] - tail[:, None]))
    return d_index, h.sum(axis=0), (h * h).sum(axis=0)


def _chunk_group(mech, eps_grid, settings, group):
    return [chunk_sums(mech, eps_grid, settings, *task) for task in group]


def _run_tasks(mech, eps_grid, settings, tasks, total: int):
    """Yield (direction index, sum h, sum h^2) per chunk: in this process, or over a process pool. The
    time budget is checked between chunks; a pool keeps only a few groups in flight (bounded memory)
    and, stopped by the budget or an interrupt, its workers are ended at once instead of waited for."""

    workers = settings.workers or os.cpu_count() or 1
    if workers == 1 or settings.backend == "torch" or total == 1:
        for task in tasks:
            budget.check_deadline("the Monte-Carlo accountant")
            yield chunk_sums(mech, eps_grid, settings, *task)
        return

    per = max(1, min(total // (8 * workers), 4096))  # a few groups per worker: balance without chatter
    pool = ProcessPoolExecutor(max_workers=workers)
    finished = False
    try:
        pending = deque()
        while group := list(islice(tasks, per)):
            pending.append(pool.submit(_chunk_group, mech, eps_grid, settings, group))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
                budget.check_deadline("the Monte-Carlo accountant")
        while pending:
            yield from pending.popleft().result()
        finished = True
    finally:
        if finished:
            pool.shutdown(wait=True)
        else:  # the executor offers no way to stop running work but ending its processes
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
            _shut_down_within(pool, SHUTDOWN_SECONDS)


SHUTDOWN_SECONDS = 10.0  # a stopped pool's own threads get this long to wind down


def _shut_down_within(pool, seconds: float) -> None:
    """Shut a pool whose workers were ended down, waiting (at most ``seconds``) for its threads: left running,
    the thread that feeds tasks to the workers can write to a pipe the exiting interpreter has closed, and print a
    traceback (errno 9) after the one-line refusal (seen once in CI under load)."""

    waiter = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True)
    waiter.start()
    waiter.join(seconds)


def _grid_top(mech: Mechanism, delta: float) -> float:
    """A data-independent top of the eps grid: 1.25 x a coarse (valid, loose) PLD bound."""

    return 1.25 * pld.epsilon(mech, delta, grid=1e-3).epsilon + 1e-3


def _crossing(grid: np.ndarray, deltas: np.ndarray, delta: float) -> float:
    """Where a decreasing delta(eps) on ``grid`` crosses ``delta``, interpolating log delta."""
    below = np.nonzero(deltas <= delta)[0]
    if not below.size:
        return math.inf
    i = int(below[0])
    if i == 0 or deltas[i] <= 0:
        return float(grid[i])
    a, b = math.log(deltas[i - 1]), math.log(deltas[i])
    return float(grid[i - 1] + (grid[i] - grid[i - 1]) * (a - math.log(delta)) / (a - b))


def epsilon(mech: Mechanism, delta: float, settings: MonteCarloSettings = MonteCarloSettings()) -> EpsilonResult:
    if delta <= 0:
        raise DPAuditError("the mc accountant needs delta > 0")
    top = _grid_top(mech, delta)
    if not math.isfinite(top):
        raise DPAuditError("the mc accountant found no finite epsilon grid for this mechanism (noise too small)")
    grid = np.linspace(top / settings.grid_size, top, settings.grid_size)
    curve = delta_curve(mech, grid, settings)
    per_dir = {}
    for d in DIRECTIONS:
        ok = np.nonzero(curve.upper[d] <= delta)[0]
        per_dir[d] = float(grid[ok[0]]) if ok.size else math.inf
    eps_estimate = _crossing(grid, curve.max_over_directions("estimate"), delta)
    why = ""
    if not all(math.isfinite(v) for v in per_dir.values()):
        # the bound's confidence slack shrinks about as 1 / n: say how far it is, and what would reach delta
        least = float(min(np.min(curve.upper[d]) for d in DIRECTIONS if not math.isfinite(per_dir[d])))
        more = math.ceil(curve.samples * least / delta) if least > delta else None
        why = (f"; inf: no eps up to {top:.4g} (the grid's top) is certified, the upper confidence bound on delta "
               f"stays >= {least:.3g} > delta = {delta:g} with these samples"
               + (f" (about --mc-samples {more} would reach it, or use pld)" if more else ""))
    return EpsilonResult(
        accountant="mc",
        epsilon=max(per_dir.values()),
        delta=delta,
        relation=relation_of(mech),
        guarantee=(f"upper bound holding with probability >= 1 - {settings.beta:g} "
                   f"(Monte-Carlo, empirical Bernstein, {curve.samples} samples per direction){why}"),
        directions=per_dir,
        details={"samples": curve.samples, "beta": settings.beta, "seed": settings.seed,
                 "samples_per_second": curve.samples_per_second,
                 "grid_step": float(grid[1] - grid[0]), "epsilon_estimate": eps_estimate},
    )


def delta_for_epsilon(mech: Mechanism, eps: float, settings: MonteCarloSettings = MonteCarloSettings()) -> dict:
    """delta(eps): point estimate and upper bound (probability >= 1 - beta), per direction and max."""
    curve = delta_curve(mech, np.array([eps]), settings)
    return {
        "estimate": float(curve.max_over_directions("estimate")[0]),
        "upper": float(curve.max_over_directions("upper")[0]),
        "directions": {d: {"estimate": float(curve.estimate[d][0]), "upper": float(curve.upper[d][0])}
                       for d in DIRECTIONS},
        "samples": curve.samples,
        "beta": settings.beta,
        "seconds": curve.seconds,
        "samples_per_second": curve.samples_per_second,
    }


def delta(mech: Mechanism, eps: float, settings: MonteCarloSettings = MonteCarloSettings()) -> DeltaResult:
    """The accountant contract's delta(eps): an upper bound holding with probability >= 1 - beta."""
    if settings.tilt:
        out = delta_for_epsilon_tilted(mech, eps, sample_count(mech, settings), settings.seed, settings.beta)
    else:
        out = delta_for_epsilon(mech, eps, settings)
    return DeltaResult(
        accountant="mc", delta=out["upper"], epsilon=eps, relation=relation_of(mech),
        guarantee=(f"upper bound with probability >= 1 - {settings.beta:g} (Monte-Carlo"
                   f"{', exponential tilting' if settings.tilt else ''}); 'estimate' is an estimate"),
        estimate=out["estimate"], directions={d: v["upper"] for d, v in out["directions"].items()},
        details={k: v for k, v in out.items() if k not in ("upper", "estimate", "directions")})
