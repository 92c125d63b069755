"""Calibration, measured as a user runs it: each tool calibrates sigma in a fresh process (imports
included, as `dpaudit calibrate` or a user's script pays them), in one run, on the same cases.

Tools: dpaudit (`pld`, the default), dp-accounting's `calibrate_dp_mechanism` with its PLDAccountant
(add/remove), Opacus `get_noise_multiplier` with accountant="prv" and "rdp". Every sigma is then checked
by one referee, dp-accounting's pessimistic PLD refined well past dpaudit's own grid (the smallest of
several valid bounds): "valid" means the referee's eps <= target at that sigma. Ratios are ours / peer
(sigma: < 1 means less noise for the same guarantee; time: < 1 means faster).

    .venv/bin/python benchmarks/calibration.py            # T = 75,000 and T = 1e6 cases (~20 min)
    .venv/bin/python benchmarks/calibration.py --quick    # the T = 75,000, eps = 1 case only
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

CASES = [  # (p, T, eps, delta)
    (16 / 1000, 75_000, 1.0, 1e-5),
    (16 / 1000, 75_000, 4.0, 1e-5),
    (1e-3, 1_000_000, 2.0, 1e-5),
]

SNIPPETS = {
    "dpaudit pld": """
from dpaudit import calibrate
print(calibrate(eps={eps}, delta={delta}, p={p}, steps={T}).sigma)
""",
    "dp-accounting": """
import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
event = lambda s: dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent({p}, dp_accounting.GaussianDpEvent(s)), {T})
print(dp_accounting.calibrate_dp_mechanism(pld_privacy_accountant.PLDAccountant, event, {eps}, {delta},
      dp_accounting.LowerEndpointAndGuess(0.1, 10.0), tol=1e-3))
""",
    "opacus prv": """
from opacus.accountants.utils import get_noise_multiplier
print(get_noise_multiplier(target_epsilon={eps}, target_delta={delta}, sample_rate={p}, steps={T}, accountant="prv"))
""",
    "opacus rdp": """
from opacus.accountants.utils import get_noise_multiplier
print(get_noise_multiplier(target_epsilon={eps}, target_delta={delta}, sample_rate={p}, steps={T}, accountant="rdp"))
""",
}


def run_tool(name: str, p: float, steps: int, eps: float, delta: float, timeout: float) -> dict:
    code = SNIPPETS[name].format(p=p, T=steps, eps=eps, delta=delta)
    began = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"tool": name, "error": f"over {timeout:g} s"}
    seconds = time.perf_counter() - began
    if out.returncode != 0:
        return {"tool": name, "error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return {"tool": name, "sigma": float(out.stdout.split()[-1]), "seconds": seconds}


def referee(sigma: float, p: float, steps: int, delta: float) -> float:
    sys.path.insert(0, "benchmarks")
    from pld_convergence import reference_epsilon

    from dpaudit.accounting import Mechanism
    from dpaudit.core import limits as budget

    with budget.limits(max_memory="8G"):
        return reference_epsilon(Mechanism("gaussian", sigma, p, steps), delta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per tool and case")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    rows = []
    for p, steps, eps, delta in cases:
        found = [run_tool(name, p, steps, eps, delta, args.timeout) for name in SNIPPETS]
        for row in found:
            if "sigma" in row:
                row["referee_eps"] = referee(row["sigma"], p, steps, delta)
                row["valid"] = row["referee_eps"] <= eps
        ours = found[0]
        for row in found:
            row.update({"p": p, "T": steps, "eps": eps, "delta": delta})
            if "sigma" in row and "sigma" in ours and row is not ours:
                row["sigma_ratio_ours_over_peer"] = ours["sigma"] / row["sigma"]
                row["time_ratio_ours_over_peer"] = ours["seconds"] / row["seconds"]
        rows.extend(found)
        if not args.json:
            print(f"\np = {p:g}, T = {steps}, target eps = {eps:g}, delta = {delta:g}")
            print(f"  {'tool':<16} {'sigma':>10} {'referee eps':>12} {'valid':>6} {'s (process)':>12} "
                  f"{'sigma ours/peer':>16} {'time ours/peer':>15}")
            for r in found:
                if "error" in r:
                    print(f"  {r['tool']:<16} {r['error']}")
                    continue
                ratio = (f"{r['sigma_ratio_ours_over_peer']:>16.4f} {r['time_ratio_ours_over_peer']:>15.3f}"
                         if "sigma_ratio_ours_over_peer" in r else "")
                print(f"  {r['tool']:<16} {r['sigma']:>10.4f} {r['referee_eps']:>12.5f} {str(r['valid']):>6} "
                      f"{r['seconds']:>12.2f} {ratio}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))


if __name__ == "__main__":
    main()
