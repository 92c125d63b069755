"""The ceiling of each probe on the user-bug zoo's schedule (issue 70 item 4): what a perfect canary would read
there, simulated, to set beside each probe's measured bound.

The zoo's schedule: p = 64 / 1000, T = 200, delta 1e-5, sigma from Opacus' PRV calibration to the claim (as the
scripts do). A perfect canary's whole clipped gradient is on its own coordinate (the optimizer probe's: m = 1000,
read in units of C) or on its own row (the pipeline probe's: m = 500, each step standardised by its noise); a
member adds C at each step that samples it. Each simulated run is scored by the probe's own statistics at the
probe's alpha split and read as the probe reads it: the optimizer probe through the run's family (alignment and
likelihood ratio, alpha / 3 each as in its audit); the pipeline probe through G_mu (no batches given) and through
the family (batches given, sampler audit at alpha / 2). Prints the median bound over --runs runs.

    .venv/bin/python benchmarks/user_bugs/ceiling.py [--eps 1 4] [--runs 20]

``--at P,T,SIGMA --claim EPS [--m 5000] [--runs 100] [--seed S]``: the optimizer probe's reading of exact runs at
another schedule, held to a claim: the median, and how many runs read above the claim and above dpaudit's PLD eps
of the schedule (the callback's schedule: --at 0.032,200,0.880126953125 --claim 3.908).
"""

from __future__ import annotations

import argparse

import numpy as np

P, STEPS, DELTA, ALPHA = 0.064, 200, 1e-5, 0.05


def optimizer_probe(rng, sigma: float, eps: float, m: int = 1000) -> float:
    from dpaudit.audit import family
    from dpaudit.audit.analysis import analyse

    members = rng.random(m) < 0.5
    x = ((rng.random((STEPS, m)) < P) & members) + sigma * rng.standard_normal((STEPS, m))
    scale = 1.4826 * float(np.median(np.abs(x - np.median(x))))
    models = {"alignment": family.linear(P, STEPS, scale), "likelihood": family.likelihood_ratio(P, STEPS, scale)}
    return max(analyse(model.step(x).sum(0), members, claimed_epsilon=eps, delta=DELTA, alpha=ALPHA / 3,
                       score="white-box-dp-sgd", model=model).epsilon_lower_bound for model in models.values())


def pipeline_probe(rng, sigma: float, eps: float, batches: bool, m: int = 500) -> float:
    from dpaudit.audit.analysis import analyse
    from dpaudit.audit.whitebox import _pipeline_scores, claim_pull, pipeline_models

    members = rng.random(m) < 0.5
    x = ((rng.random((STEPS, m)) < P) & members) + sigma * rng.standard_normal((STEPS, m))
    kw = dict(claimed_epsilon=eps, delta=DELTA, score="white-box-pipeline")
    if not batches:
        stats = _pipeline_scores(x)[0]
        return max(analyse(v, members, alpha=ALPHA / len(stats), **kw).epsilon_lower_bound for v in stats.values())
    pull = claim_pull(eps, DELTA, P, STEPS)
    stats, models = _pipeline_scores(x, P, pull)[0], pipeline_models(P, STEPS, pull)
    return max(analyse(stats[k], members, alpha=ALPHA / 2 / len(models), model=models[k], **kw).epsilon_lower_bound
               for k in models)


def at(args) -> None:
    from dpaudit.accounting import pld
    from dpaudit.accounting.mechanism import Mechanism

    global P, STEPS
    p, steps, sigma = (float(x) for x in args.at.split(","))
    P, STEPS = p, int(steps)
    truth = pld.epsilon(Mechanism("gaussian", sigma, p, STEPS), DELTA).epsilon
    rng = np.random.default_rng(args.seed)
    got = np.array([optimizer_probe(rng, sigma, args.claim, m=args.m) for _ in range(args.runs)])
    print(f"p {p:g}, T {STEPS}, sigma {sigma:g}, m {args.m}, {args.runs} runs: median {np.median(got):.3f} "
          f"({np.median(got) / args.claim:.0%} of the claim {args.claim:g}); above the claim "
          f"{int((got > args.claim).sum())}, above the PLD eps {truth:.3f} {int((got > truth).sum())}", flush=True)


def main() -> None:
    from opacus.accountants.utils import get_noise_multiplier

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--at", help="P,T,SIGMA: exact runs of the optimizer probe at this schedule")
    ap.add_argument("--claim", type=float)
    ap.add_argument("--m", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=70)
    args = ap.parse_args()
    if args.at:
        at(args)
        return
    print("| claimed eps | sigma | optimizer probe (m 1000) | pipeline probe (m 500) | pipeline probe, batch= given |")
    print("|---|---|---|---|---|")
    for eps in args.eps:
        sigma = get_noise_multiplier(target_epsilon=eps, target_delta=DELTA, sample_rate=P, steps=STEPS,
                                     accountant="prv")
        rng = np.random.default_rng(70)
        got = [np.median([f(rng) for _ in range(args.runs)]) for f in (
            lambda r: optimizer_probe(r, sigma, eps), lambda r: pipeline_probe(r, sigma, eps, False),
            lambda r: pipeline_probe(r, sigma, eps, True))]
        print(f"| {eps:g} | {sigma:.3f} | " + " | ".join(f"{g:.3g}" for g in got) + " |", flush=True)


if __name__ == "__main__":
    main()
