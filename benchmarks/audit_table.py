"""The empirical-privacy table of docs/trainers.md: `audit run` on the embedded default for
DP-SGD and DP-ZO at eps in {1, 8, inf} (and optionally more), one folder per cell.

    .venv/bin/python benchmarks/audit_table.py [--eps 1 8 inf] [--methods dp-sgd dp-zo] [--out /tmp/audit-table]
    # DP-ZO's small-data, long-run setting of docs/trainers.md:
    .venv/bin/python benchmarks/audit_table.py --methods dp-zo --canaries 400 --examples 100 -B 16 --steps 40000
Prints a Markdown table of AUC, TPR@1%FPR, the one-run eps lower bound, sigma and wall time, next to
the DP-ZO paper's AUCs from ../shared/reference/auditing.md (OPT-13B; the shape, not the values, is
what a tiny CPU model can be compared on).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from dpaudit.workflows.audit_run import AuditRunSettings, run_audit
from dpaudit.training.runner import TrainConfig

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", nargs="+", default=["1", "8", "inf"])
    ap.add_argument("--methods", nargs="+", default=["dp-sgd", "dp-zo"])
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--examples", type=int, default=1000, help="synthetic public sentences")
    ap.add_argument("--steps", type=int, default=None, help="default: per method (dp-sgd 300, dp-zo 3000)")
    ap.add_argument("--batch-size", "-B", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--secret-seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("/tmp/audit-table"))
    args = ap.parse_args()
    print("| method | eps (claimed) | sigma | AUC | TPR@1%FPR | headline eps LB | verdict | steps | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        for eps in args.eps:
            cfg = TrainConfig(method=method, target_epsilon=float(eps), secret_seed=args.secret_seed,
                              steps=args.steps, batch_size=args.batch_size, lr=args.lr)
            start = time.perf_counter()
            audit, result, _ = run_audit(args.out / f"{method}-eps{eps}", cfg,
                                         AuditRunSettings(canaries=args.canaries, examples=args.examples), force=True, show_progress=False)
            wall = time.perf_counter() - start
            claimed = f"{result.epsilon:.3f}" if math.isfinite(result.epsilon) else "inf"
            sigma = f"{result.sigma:.3f}" if result.sigma else "-"
            print(f"| {method} | {claimed} | {sigma} | {audit.roc.auc:.3f} | {audit.roc.tpr_at_fpr[0.01]:.3f} | "
                  f"{audit.epsilon_lower_bound:.3f} ({audit.headline}) | "
                  f"{'VIOLATION' if audit.violation else 'consistent'} | {result.steps} | {wall:.0f} |", flush=True)


if __name__ == "__main__":
    main()
