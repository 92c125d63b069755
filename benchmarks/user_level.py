"""User-level DP, side by side (docs/accounting.md, "The privacy unit"): for a schedule and k records a user, the
sigma each way to a user-level eps needs (ELS, ULS at the same records a step, group privacy), and each one's
noise per unit of signal relative to ELS's (accounting/user_level.py). Every sigma is a calibration against the
accountant, so each row meets the target; the ratios are what to compare.

    .venv/bin/python benchmarks/user_level.py [--eps 8] [--delta 1e-6] [--k 1 4 16 64]
"""

from __future__ import annotations

import argparse
import time

from dpaudit.accounting.mechanism import schedule
from dpaudit.accounting.user_level import rows

SCHEDULES = {
    # the embedded model's `dpaudit train` defaults: B 64 of 1,000 examples, 300 steps
    "embedded (B 64, N 1,000, T 300)": dict(batch_size=64, dataset_size=1000, steps=300, epochs=None),
    # the issue's: 100,000 records (5,000 users), B 1,024, 3 epochs
    "100,000 records (B 1,024, 3 epochs)": dict(batch_size=1024, dataset_size=100_000, steps=None, epochs=3),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 16, 64])
    args = ap.parse_args()
    print(f"user-level eps {args.eps:g}, delta {args.delta:g}: sigma (noise / signal vs ELS)")
    print("| schedule | k | ELS sigma | group privacy sigma (vs ELS) | ULS sigma (noise / signal vs ELS) | s |")
    print("|---|---|---|---|---|---|")
    for name, spec in SCHEDULES.items():
        records = schedule("gaussian", 1.0, None, spec["batch_size"], spec["dataset_size"], spec["steps"],
                           spec["epochs"])
        for k in args.k:
            began = time.perf_counter()
            found = {r.name: r for r in rows(records, k, args.delta, args.eps)}
            els, group, uls = found["ELS"], found["group privacy"], found["ULS"]
            print(f"| {name} | {k} | {els.sigma:.4g} | {_shown(group)} | {_shown(uls)} | "
                  f"{time.perf_counter() - began:.1f} |", flush=True)


def _shown(row) -> str:
    """sigma and its noise per signal against ELS's, or why there is none."""
    if row.sigma is None:
        return f"none ({row.why[:60]})"
    return f"{row.sigma:.4g} ({row.noise_per_signal:.3g}x)"


if __name__ == "__main__":
    main()
