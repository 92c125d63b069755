"""How often the default stop rule stops a correct run: simulated exact mechanisms (a plain DP-SGD loop whose canaries
are examples clipped at C, Gaussian noise sigma C, Poisson rate p), watched as the Hugging Face callback watches
(looks at 16, 32, 64, ... and the planned last step, at the default level STOP_ALPHA over the run, on_violation
"stop"), held to the exact claim of the steps run. Prints the stops, their rate with a 95 % Clopper-Pearson interval,
and the same count at the old level alpha = 0.05 over the same runs.

    .venv/bin/python benchmarks/false_stops.py [--runs 200] [--steps 128]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import beta

from dpaudit.accounting import pld
from dpaudit.accounting.mechanism import Mechanism
from dpaudit.probes.probe import RUNNING, STOP_ALPHA, WhiteBoxProbe

C, SIGMA, N_PARAMS, RATE, DELTA = 1.0, 1.0, 400, 0.3, 1e-5


def run(out: Path, seed: int, steps: int, claim: float, alpha: float) -> bool:
    probe = WhiteBoxProbe([torch.zeros(N_PARAMS, requires_grad=True)], m=200, clip=C, sample_rate=RATE, out=out,
                          secret_seed=seed)
    probe.watch(delta=DELTA, claimed_eps=claim, alpha=alpha, on_violation="stop", planned_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if probe.stop_requested:
            break
        (canaries,) = probe.canary_examples(step)
        data = torch.randn(20, N_PARAMS, generator=gen)
        rows = torch.cat([3 * C * data / data.norm(dim=1, keepdim=True), canaries])
        factor = (C / rows.norm(dim=1, keepdim=True)).clamp(max=1.0)
        probe.observe(step, [(rows * factor).sum(0) + SIGMA * C * torch.randn(N_PARAMS, generator=gen)])
    probe.close()
    looks = [json.loads(x) for x in (out / RUNNING).read_text().splitlines()] if (out / RUNNING).is_file() else []
    return any(x.get("violation") for x in looks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    claim = pld.epsilon(Mechanism("gaussian", SIGMA, RATE, args.steps), DELTA).epsilon
    root = Path(tempfile.mkdtemp(prefix="false-stops-"))
    began = time.perf_counter()
    for alpha in (STOP_ALPHA, 0.05):
        stops = sum(run(root / f"{alpha}-{s}", 1000 + s, args.steps, claim, alpha) for s in range(args.runs))
        lo = beta.ppf(0.025, stops, args.runs - stops + 1) if stops else 0.0
        hi = beta.ppf(0.975, stops + 1, args.runs - stops)
        print(f"alpha {alpha:g} over the looks: {stops} of {args.runs} correct runs stopped "
              f"({stops / args.runs:.1%}, 95 % interval {lo:.1%} to {hi:.1%}); claim eps {claim:.3f} "
              f"(sigma {SIGMA}, p {RATE}, T {args.steps}), {time.perf_counter() - began:.0f} s so far", flush=True)


if __name__ == "__main__":
    main()
