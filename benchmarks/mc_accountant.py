"""Monte-Carlo accountant at scale: throughput against a plain NumPy loop, and the delta upper bound
reached within a time budget, next to the PLD value.

    .venv/bin/python benchmarks/mc_accountant.py [--budget 120] [--workers 0]
Mechanism (issue 5): Laplace, p = 0.016, sigma = 16.3, eps = 1, at T = 1000 and T = 75000.
Throughput counts per-step privacy-loss samples (composed samples x T) per second, both directions.
The sample count for the budget comes from a pilot run on another seed, so n does not depend on the
samples it is used with (the empirical-Bernstein bound needs a fixed n). Plain sampling and
importance sampling by exponential tilting (``montecarlo_tilted``) each get the budget.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.montecarlo import MonteCarloSettings, delta_for_epsilon
from dpaudit.accounting.montecarlo_tilted import delta_for_epsilon_tilted
from dpaudit.accounting.pld import composed_pld

P, SIGMA, EPS = 0.016, 16.3, 1.0


def plain_numpy_loop(mech: Mechanism, rows: int, rng: np.random.Generator) -> np.ndarray:
    """The textbook sampler: one Laplace draw per sample per step, summed step by step (remove direction)."""
    b, p = mech.sigma, mech.sampling_rate
    total = np.zeros(rows)
    for _ in range(mech.steps):
        x = rng.laplace(0.0, b, rows) + (rng.random(rows) < p)
        a = (np.abs(x) - np.abs(x - 1)) / b
        total += np.logaddexp(math.log1p(-p), math.log(p) + a)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per delta bound")
    ap.add_argument("--workers", type=int, default=0, help="processes (0: every core)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"])
    args = ap.parse_args()

    mech = Mechanism("laplace", SIGMA, P, 1000)
    rows = 4000
    start = time.perf_counter()
    plain_numpy_loop(mech, rows, np.random.default_rng(0))
    plain = rows * mech.steps / (time.perf_counter() - start)
    ours = MonteCarloSettings(samples=400_000, seed=1, workers=args.workers, backend=args.backend)
    r = delta_for_epsilon(mech, EPS, ours)
    fast = r["samples_per_second"] * mech.steps
    print(f"throughput, Laplace p={P} sigma={SIGMA} T={mech.steps} (per-step loss samples/s):")
    print(f"  plain NumPy loop       {plain:12.3e}")
    print(f"  dpaudit mc ({args.backend}, workers={args.workers or 'all'}) {fast:12.3e}   ratio {fast / plain:.1f}x "
          f"(target >= 5x)")

    print(f"\ndelta(eps={EPS}) upper bound within {args.budget:.0f} s (probability >= 1 - 1e-3), vs PLD:")
    print(f"{'T':>7} {'sampler':>8} {'samples':>12} {'seconds':>8} {'estimate':>12} {'upper':>12} {'PLD':>12}")
    for steps in (1000, 75000):
        m = mech.with_steps(steps)
        pilot = delta_for_epsilon(m, EPS, MonteCarloSettings(samples=max(20_000, int(2e8 // steps)), seed=99,
                                                              workers=args.workers,
                                                              backend=args.backend))
        n = int(0.85 * args.budget * pilot["samples_per_second"] / 2)
        res = delta_for_epsilon(m, EPS, MonteCarloSettings(samples=n, seed=2, workers=args.workers,
                                                            backend=args.backend))
        pld = composed_pld(m, grid=1e-5).get_delta_for_epsilon(EPS)
        print(f"{steps:>7} {'plain':>8} {n:>12,} {res['seconds']:>8.1f} {res['estimate']:>12.3e} "
              f"{res['upper']:>12.3e} {pld:>12.3e}")
        # Exponential tilting (importance sampling), single process: pilot for its own rate.
        start = time.perf_counter()
        delta_for_epsilon_tilted(m, EPS, 2_000, seed=98)
        rate = 2_000 / (time.perf_counter() - start)
        n_tilt = int(0.85 * args.budget * rate / 2)
        start = time.perf_counter()
        tilt = delta_for_epsilon_tilted(m, EPS, n_tilt, seed=3)
        print(f"{steps:>7} {'tilted':>8} {n_tilt:>12,} {time.perf_counter() - start:>8.1f} "
              f"{tilt['estimate']:>12.3e} {tilt['upper']:>12.3e} {pld:>12.3e}")


if __name__ == "__main__":
    main()
