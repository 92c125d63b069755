"""Why one pipeline-probe run does not give VIOLATION for a batch reused for 4 steps (issue 39), simulated.

The pipeline probe's record is, per step and canary, a standardised row movement: z = mu x [the canary's example
was in the step's batch] + N(0, 1), mu the member's pull in noise units (1/sigma for a gradient of norm C wholly in
the row; less for the probe's canaries, whose gradient is 0.5 to 0.96 in the row and not always at the clip).
Correct run: Poisson inclusions at p every step. The bug: each Poisson batch used for `reuse` consecutive steps.

For each mu this prints the median (over seeds) of the eps lower bound and AUC of:
- the probe's own statistic (the sum of z, "gaussian" headline), on a correct run and on the buggy one;
- the likelihood-ratio score of the bug itself, told the block boundaries, mu and p: per block,
  log(1 - p + p exp(mu S - reuse mu^2 / 2)) with S the block's sum of z (Neyman-Pearson's best per canary,
  which no auditor has: it knows the bug), at alpha / 3 as a third statistic would be.
The schedule is the pipeline table's (docs/auditing.md): T = 200, p = 0.064, m = 500, claimed eps 4 (sigma 1.273).

    .venv/bin/python benchmarks/user_bugs/reuse_limit.py [--seeds 10]

Pure numpy and dpaudit's audit statistics; about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

T, M, P, SIGMA, EPS, DELTA, ALPHA = 200, 500, 0.064, 1.2727, 4.0, 1e-5, 0.05


def record(rng, mu: float, reuse: int):
    members = rng.random(M) < 0.5
    included = np.repeat((rng.random((T // reuse, M)) < P) & members, reuse, axis=0)
    return mu * included + rng.standard_normal((T, M)), members


def block_likelihood_ratio(z, mu: float, reuse: int):
    s = z.reshape(T // reuse, reuse, -1).sum(1)
    return np.logaddexp(np.log1p(-P), np.log(P) + mu * s - reuse * mu * mu / 2).sum(0)


def main() -> None:
    from sklearn.metrics import roc_auc_score

    from dpaudit.audit.analysis import analyse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--reuse", type=int, default=4)
    args = ap.parse_args()
    if args.reuse < 1 or T % args.reuse:
        ap.error(f"--reuse must divide T = {T}")

    def read(scores, members, alpha: float, score: str) -> tuple[float, float]:
        """(eps lower bound, AUC) of one audit."""
        r = analyse(scores, members, claimed_epsilon=EPS, delta=DELTA, alpha=alpha, score=score, mechanism="gaussian")
        return r.epsilon_lower_bound, roc_auc_score(members, scores)

    print(f"T {T}, p {P}, m {M}, claimed eps {EPS} (sigma {SIGMA}), batch reused for {args.reuse} steps; "
          f"median of {args.seeds} seeds: eps lower bound / AUC")
    print("| mu (noise units) | correct run, probe's sum | bug, probe's sum | bug, its own likelihood ratio |")
    print("|---|---|---|---|")
    for mu in (0.25, 0.5, 1 / SIGMA, 1.0):
        cells = {"correct": [], "sum": [], "ratio": []}
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            z, members = record(rng, mu, 1)
            cells["correct"].append(read(z.sum(0), members, ALPHA / 2, "white-box-pipeline"))
            z, members = record(rng, mu, args.reuse)  # the bug: both scores read this run
            cells["sum"].append(read(z.sum(0), members, ALPHA / 2, "white-box-pipeline"))
            cells["ratio"].append(read(block_likelihood_ratio(z, mu, args.reuse), members, ALPHA / 3, "unnamed"))
        row = [f"{statistics.median(b for b, _ in v):.2f} / {statistics.median(a for _, a in v):.3f}"
               for v in cells.values()]
        print(f"| {mu:.3g}{' (1/sigma)' if abs(mu - 1 / SIGMA) < 1e-9 else ''} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
