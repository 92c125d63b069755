"""The PipelineProbe read through the run's own family (issue 70 item 2): validity first, then power against the
Gaussian reading, simulated on the pipeline table's schedule (p 0.064, T 200, m 500, sigma 1.273 for claimed eps 4).

Each simulated run moves the canaries' rows as a Poisson-subsampled Gaussian run does: a member sampled at a step
pulls its row by ``pull`` x C (1: its whole clipped gradient in its row, the most it can), noise sigma C, a
background shared by every canary (the tied softmax's push), the scale drifting as a learning-rate schedule makes
it; ``--momentum b`` filters the steps as SGD momentum does. The rows go through the probe's own scoring
(audit/whitebox.py: standardised steps, the statistics at alpha / their number, the larger bound kept):

- "Gaussian": today's reading (the two sums through G_mu), what a probe reads where the family is not the run's;
- "family": the three statistics (sum, clipped sum, likelihood ratio at the claim's sigma) read through the
  Poisson-subsampled Gaussian's own curve, what a probe reads where its canaries' sampler audit passed and its
  steps are independent.

    .venv/bin/python benchmarks/pipeline_family.py [--runs 200] [--power-runs 20]

Validity: at pull 1, each run claimed at its true eps; a bound above it is a violation, at most alpha of the runs
(and the binomial 99.9 % quantile of --runs). Power: the median bound at pulls 0.32 (the probe's canaries on the
embedded model) and 1.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

P, STEPS, M, SIGMA, CLAIM, DELTA, ALPHA = 0.064, 200, 500, 1.273, 4.0, 1e-5, 0.05


def moves(rng, members, pull: float, momentum: float = 0.0, sigma: float = SIGMA):
    """Row movements along each canary's direction (steps x m), as in tests/audit/test_pipeline_scores.py."""
    m = members.size
    scale = np.linspace(1.0, 0.3, STEPS)[:, None]
    release = rng.normal(size=(STEPS, m)) * sigma + rng.normal(size=(STEPS, 1)) \
        + pull * ((rng.random((STEPS, m)) < P) & members)
    if momentum:
        for t in range(1, STEPS):
            release[t] += momentum * release[t - 1]
    return scale * release


def readings(x, members, pull_h) -> dict:
    from dpaudit.audit.analysis import analyse
    from dpaudit.audit.whitebox import INDEPENDENT, _pipeline_scores, pipeline_models

    gaussian, _ = _pipeline_scores(x)
    stats, correlation = _pipeline_scores(x, P, pull_h)
    models = pipeline_models(P, STEPS, pull_h) if abs(correlation) <= INDEPENDENT else {}
    kw = dict(claimed_epsilon=CLAIM, delta=DELTA, score="white-box-pipeline")
    out = {"Gaussian": max(analyse(v, members, alpha=ALPHA / len(gaussian), **kw).epsilon_lower_bound
                           for v in gaussian.values())}
    if models:
        out["family"] = max(analyse(stats[k], members, alpha=ALPHA / len(models), model=models[k],
                                    **kw).epsilon_lower_bound for k in models)
    out["lag-1"] = correlation
    return out


def main() -> None:
    from scipy import stats

    from dpaudit.audit.whitebox import claim_pull

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200, help="validity runs at the true claim")
    ap.add_argument("--power-runs", type=int, default=20)
    ap.add_argument("--momentum", type=float, default=0.0, help="SGD momentum on the validity runs")
    args = ap.parse_args()
    began = time.perf_counter()
    pull_h = claim_pull(CLAIM, DELTA, P, STEPS)
    rng = np.random.default_rng(70)
    over = {"Gaussian": 0, "family": 0}
    read = 0
    for _ in range(args.runs):
        members = rng.random(M) < 0.5
        got = readings(moves(rng, members, 1.0, args.momentum), members, pull_h)
        read += "family" in got
        for k in over:
            over[k] += got.get(k, 0.0) > CLAIM
    most = stats.binom.ppf(0.999, args.runs, ALPHA)
    print(f"validity (pull 1, claimed eps {CLAIM} = the runs' true eps, momentum {args.momentum:g}): "
          f"above the truth, Gaussian {over['Gaussian']}/{args.runs}, family {over['family']}/{read} read through "
          f"the family (alpha {ALPHA}: expected <= {ALPHA * args.runs:.0f}, the test allows {most:.0f})", flush=True)
    for pull in (0.32, 1.0):
        got = {"Gaussian": [], "family": []}
        for _ in range(args.power_runs):
            members = rng.random(M) < 0.5
            one = readings(moves(rng, members, pull), members, pull_h)
            for k in got:
                got[k].append(one.get(k, np.nan))
        print(f"power, pull {pull}: median bound Gaussian {np.median(got['Gaussian']):.3f}, family "
              f"{np.nanmedian(got['family']):.3f} ({args.power_runs} runs)", flush=True)
    print(f"{time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
