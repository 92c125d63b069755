"""Issue 55 item 2: a watched probe's looks on correct runs, over seeds: false alarms over every look, and the
planned run's final look (``watch(planned_steps=T)``, at alpha / 2) against the end-of-run ``audit()`` (at alpha).

A plain DP-SGD loop on synthetic per-example rows (the white-box audit reads only the released sums, so a model
adds nothing to these figures): p = B / N, T steps, sigma calibrated to the claim by our accountant, m gradient
canaries as per-example rows clipped by the loop. Prints one JSON line per seed and a summary line.

    .venv/bin/python benchmarks/watch_final_look.py --seeds 20
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def run(seed: int, args, sigma: float, claim: float, folder: Path) -> dict:
    import torch

    from dpaudit.probes.probe import RUNNING, WhiteBoxProbe

    C, p = 1.0, args.p
    param = torch.zeros(args.dim, requires_grad=True)
    probe = WhiteBoxProbe([param], m=args.m, clip=C, sample_rate=p,
                          out=folder, secret_seed=10_000 + seed)
    probe.watch(delta=args.delta, claimed_eps=claim, planned_steps=args.steps, on_violation="warn")
    gen = torch.Generator().manual_seed(seed)
    batch = max(1, round(p * args.n))
    began = time.perf_counter()
    for step in range(args.steps):
        (canaries,) = probe.canary_examples(step)
        data = torch.randn(batch, args.dim, generator=gen)
        rows = torch.cat([3 * C * data / data.norm(dim=1, keepdim=True), canaries])
        rows = rows * (C / rows.norm(dim=1, keepdim=True)).clamp(max=1.0)
        released = rows.sum(0) + sigma * C * torch.randn(args.dim, generator=gen)
        probe.observe(step, [released])
        with torch.no_grad():
            param -= 0.01 * released / batch
    looks = [json.loads(x) for x in (folder / RUNNING).read_text().splitlines()]
    end = probe.audit(claimed_eps=claim, delta=args.delta, alpha=args.alpha, report=False)
    probe.close()
    final = [x for x in looks if x.get("final")]
    return {"seed": seed, "looks": [x["step"] for x in looks], "alarm": any(x.get("violation") for x in looks),
            "final_look": final[0]["epsilon_lower_bound"] if final else None,
            "end_of_run": end.epsilon_lower_bound, "end_violation": end.violation,
            "seconds": round(time.perf_counter() - began, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--eps", type=float, default=4.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--p", type=float, default=0.064)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("-m", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import numpy as np
    import torch

    import dpaudit

    torch.set_num_threads(args.threads)
    cal = dpaudit.calibrate(eps=args.eps, delta=args.delta, p=args.p, steps=args.steps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            row = run(seed, args, cal.sigma, cal.epsilon, Path(tmp) / f"s{seed}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    ratio = [r["final_look"] / r["end_of_run"] for r in rows if r["final_look"] and r["end_of_run"] > 0]
    print(json.dumps({"summary": True, "sigma": cal.sigma, "claim": cal.epsilon, "seeds": len(rows),
                      "false_alarms": sum(r["alarm"] for r in rows),
                      "end_of_run_violations": sum(r["end_violation"] for r in rows),
                      "median_final_look": float(np.median([r["final_look"] or 0 for r in rows])),
                      "median_end_of_run": float(np.median([r["end_of_run"] for r in rows])),
                      "final_over_end_median": float(np.median(ratio)) if ratio else None,
                      "final_over_end_min": float(min(ratio)) if ratio else None}))


if __name__ == "__main__":
    main()
