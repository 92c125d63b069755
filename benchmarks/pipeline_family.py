"""Would the run's-family audit (issue 55 item 1: the Poisson-subsampled Gaussian's own curve, linear or
likelihood-ratio score) raise a PipelineProbe's bound? Simulated on the probe's schedule (the pipeline table's: p
0.064, T 200, m 500, sigma 1.273 for claimed eps 4), with the model that family audit needs: a member's row moves
by c (in units of C) at each step that samples it, plus N(0, sigma^2). c = 0.32 is the probe's canaries (a pull of
0.25 noise sd a step: 0.5 to 0.96 of their clipped gradient in their row, read along a direction refreshed on a
budget); c = 1 a canary whose whole clipped gradient is on its coordinate (the optimizer probe's). Prints the median
bound of each reading over the seeds.

    .venv/bin/python benchmarks/pipeline_family.py [--seeds 10]
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    from dpaudit.audit import family
    from dpaudit.audit.analysis import analyse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    args = ap.parse_args()
    p, steps, m, sigma = 0.064, 200, 500, 1.273
    kw = dict(claimed_epsilon=4.0, delta=1e-5, alpha=0.05, score="white-box-dp-sgd")
    for c in (0.32, 1.0):
        got = {"G_mu (the probe's reading today)": [], "family, linear": [], "family, likelihood ratio": []}
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            members = rng.random(m) < 0.5
            x = c * ((rng.random((steps, m)) < p) & members) + sigma * rng.standard_normal((steps, m))
            scale = 1.4826 * np.median(np.abs(x - np.median(x)))  # blind to membership, as the transcripts' s_h
            linear = x.sum(0)
            ratio = family.likelihood_ratio_step(x, p, scale).sum(0)
            got["G_mu (the probe's reading today)"].append(analyse(linear, members, **kw).epsilon_lower_bound)
            got["family, linear"].append(analyse(linear, members, headline="gaussian-run",
                                                 model=family.linear(p, steps, scale), **kw).epsilon_lower_bound)
            got["family, likelihood ratio"].append(analyse(ratio, members, headline="gaussian-run",
                                                           model=family.likelihood_ratio(p, steps, scale),
                                                           **kw).epsilon_lower_bound)
        print(f"c {c}: " + "; ".join(f"{k} {np.median(v):.3f}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
