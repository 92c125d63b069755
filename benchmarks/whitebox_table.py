"""White-box audit table of docs/auditing.md: `audit run --white-box` on the embedded default for DP-SGD and
DP-ZO at claimed eps in {1, 2, 4, 8}, the headline bound and seconds per cell, next to the idealised limit
(the same audit on scores simulated from the exact mechanism at the same m, T, sigma and p).
With --seeds K it instead repeats each cell with K secret seeds and counts violations (validity).

    .venv/bin/python benchmarks/whitebox_table.py [--eps 1 2 4 8] [--methods dp-sgd dp-zo] [--zo-steps 3000]
    .venv/bin/python benchmarks/whitebox_table.py --eps 4 --seeds 20 --workers 2
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np


def simulated_scores(method: str, m: int, steps: int, sigma: float, rate: float, members: np.ndarray, seed: int,
                     mech: str = "gaussian") -> np.ndarray:
    """Scores of the exact mechanism (no model, no data): clipped canaries at +-C plus the noise."""
    rng = np.random.default_rng(seed)
    noise = (lambda size: rng.normal(0, sigma, size)) if mech == "gaussian" else (lambda size: rng.laplace(0, sigma, size))
    if method == "dp-sgd":  # one coordinate a canary: a member adds +1 (in units of C) each step it is sampled
        return rng.binomial(steps, rate, size=m) * members + noise((steps, m)).sum(0)
    signs = rng.choice([-1.0, 1.0], size=(steps, m))
    inc = (rng.random((steps, m)) < rate) & members
    return signs.T @ ((signs * inc).sum(1) + noise(steps))


def cell(args: tuple) -> dict:
    """One white-box audit run. ``args``: (method, eps, steps, seed, out, bug, batch[, records[, sampling]]);
    records > 1: a user-level run (--unit user, k = records) whose canaries are users of that many records,
    sampling "els" (records sampled) or "uls" (users sampled, each clipped as one)."""
    method, eps, steps, seed, out, bug, batch, records, sampling = (*args, *(1, "els")[len(args) - 7:])
    import torch

    torch.set_num_threads(1)
    from dpaudit.audit.analysis import analyse
    from dpaudit.workflows.audit_run import AuditRunSettings, run_audit, white_box_canaries
    from dpaudit.training.runner import TrainConfig

    user = dict(unit="user", records_per_user=records, canary_records=records,
                user_sampling=sampling) if records > 1 else {}
    cfg = TrainConfig(method=method, target_epsilon=eps, secret_seed=seed, steps=steps, batch_size=batch,
                      plant_bug=bug, white_box=1, **user)
    cfg.white_box = white_box_canaries(cfg)
    start = time.perf_counter()
    audit, result, summary = run_audit(Path(out), cfg, AuditRunSettings(examples=64), force=True, show_progress=False)
    wall = time.perf_counter() - start
    members = np.array([c for c in audit_members(Path(out) / "run")])
    ideal = analyse(simulated_scores(method, cfg.white_box, result.steps, result.sigma, result.sampling_rate, members,
                                     seed + 10_000), members, delta=cfg.delta, score=f"white-box-{method}") \
        if records == 1 else None  # the simulation plants one record a canary
    return {"method": method, "eps": eps, "claimed": result.epsilon, "sigma": result.sigma, "m": cfg.white_box,
            "steps": result.steps, "bound": audit.epsilon_lower_bound, "mu": audit.headline_bound.mu,
            "violation": audit.violation, "ideal": ideal.epsilon_lower_bound if ideal else None, "seconds": wall,
            "seed": seed, "bug": (bug or "none") + (f" ({sampling.upper()}, users of {records}, k = {records})" if records > 1 else ""), "statistic": summary["context"].get("statistic"), "p": result.sampling_rate,
            "all": {k: b.epsilon for k, b in audit.bounds.items()}}


def audit_members(run_dir: Path):
    from dpaudit.audit.whitebox_canaries import WhiteBoxCanaries

    return WhiteBoxCanaries.load(run_dir).members


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", nargs="+", type=float, default=[1, 2, 4, 8])
    ap.add_argument("--methods", nargs="+", default=["dp-sgd", "dp-zo"])
    ap.add_argument("--sgd-steps", type=int, default=300)
    ap.add_argument("--zo-steps", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=0, help="repeat each cell with this many secret seeds")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("/tmp/whitebox-table"))
    ap.add_argument("--records", type=int, default=1,
                    help="> 1: user-level runs (--unit user, k = this) whose canaries are users of this many records")
    ap.add_argument("--user-sampling", choices=["els", "uls"], default="els", help="with --records: the runs' sampling")
    ap.add_argument("--batch-size", "-B", type=int, default=0, help="0: full batches (p = 1), the white-box default")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    jobs = []
    for method in args.methods:
        steps = args.sgd_steps if method == "dp-sgd" else args.zo_steps
        for eps in args.eps:
            for seed in (range(1, args.seeds + 1) if args.seeds else [1]):
                jobs.append((method, eps, steps, seed, str(args.out / f"{method}-eps{eps:g}-s{seed}"), None,
                             args.batch_size, args.records, args.user_sampling))
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(cell, jobs))
    if args.seeds:
        print("| method | claimed eps | seeds | violations | mean bound | max bound | mean s |")
        print("|---|---|---|---|---|---|---|")
        for method in args.methods:
            for eps in args.eps:
                rs = [r for r in rows if r["method"] == method and r["eps"] == eps]
                print(f"| {method} | {eps:g} | {len(rs)} | {sum(r['violation'] for r in rs)} | "
                      f"{np.mean([r['bound'] for r in rs]):.3f} | {max(r['bound'] for r in rs):.3f} | "
                      f"{np.mean([r['seconds'] for r in rs]):.0f} |", flush=True)
        return
    print("| method | claimed eps | sigma | m | T | headline bound (mu) | idealised limit | verdict | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['claimed']:.3f} | {r['sigma']:.3f} | {r['m']} | {r['steps']} | "
              f"{r['bound']:.3f} ({r['mu']:.3f}) | {'—' if r['ideal'] is None else format(r['ideal'], '.3f')} | "
              f"{'VIOLATION' if r['violation'] else 'consistent'} | {r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
