"""The planted-bug zoo of docs/auditing.md: one white-box `audit run` per (method, bug, claimed eps), and
whether it ends in VIOLATION. Correct runs are in the table too ("none"); their false-alarm rate over
many seeds is measured by `benchmarks/whitebox_table.py --seeds`.

    DPAUDIT_ALLOW_BUGS=1 .venv/bin/python benchmarks/bug_zoo.py [--eps 1 4] [--zo-steps 1000] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from whitebox_table import cell


def main() -> None:
    from dpaudit.training.bugs import BUGS
    from dpaudit.training.methods import METHODS

    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", nargs="+", type=float, default=[1, 4])
    ap.add_argument("--methods", nargs="+", default=["dp-sgd", "dp-zo"])
    ap.add_argument("--bugs", nargs="+", default=["none", *BUGS])
    ap.add_argument("--sgd-steps", type=int, default=300)
    ap.add_argument("--zo-steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch-size", "-B", type=int, default=0, help="0: full batches (p = 1), the white-box default")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bug-zoo"))
    ap.add_argument("--records", type=int, default=4,
                    help="user-level rows (correct ELS and ULS runs, example-level-claim, uls-example-clipping): k, "
                         "and each canary user's records")
    args = ap.parse_args()
    os.environ["DPAUDIT_ALLOW_BUGS"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a user-level bug runs at the user level, with a correct row beside it: ELS (records sampled) or ULS (users)
    user_rows = {"example-level-claim": "els", "none-els": "els", "uls-example-clipping": "uls", "none-uls": "uls"}
    correct = {"example-level-claim": "none-els", "uls-example-clipping": "none-uls"}
    bugs = [*args.bugs, *(correct[b] for b in args.bugs if b in correct)]
    jobs = [(method, eps, args.sgd_steps if method == "dp-sgd" else args.zo_steps, args.seed,
             str(args.out / f"{method}-{bug}-eps{eps:g}-B{args.batch_size}"),
             None if bug.startswith("none") else bug, args.batch_size,
             args.records if bug in user_rows else 1, user_rows.get(bug, "els"))
            for method in args.methods for bug in bugs for eps in args.eps
            if bug.startswith("none") or METHODS[method].release in BUGS[bug].releases]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(cell, jobs))
    print("| method | bug | claimed eps | p | sigma | headline bound (mu) | statistic | verdict | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['bug']} | {r['claimed']:.3f} | {r['p']:.3f} | {r['sigma']:.3f} | {r['bound']:.3f} "
              f"({r['mu']:.3f}) | {r['statistic']} | {'VIOLATION' if r['violation'] else 'consistent'} | "
              f"{r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
