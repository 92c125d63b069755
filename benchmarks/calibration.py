"""Calibration, measured as a user runs it: each tool calibrates sigma in a fresh process (imports
included, as `dpaudit calibrate` or a user's script pays them), in one run, on the same cases.

Tools: dpaudit (`pld`, the default), dp-accounting's `calibrate_dp_mechanism` with its PLDAccountant
(add/remove), Opacus `get_noise_multiplier` with accountant="prv" and "rdp". Every sigma is then checked
by one referee, dp-accounting's pessimistic PLD refined well past dpaudit's own grid (the smallest of
several valid bounds): "valid" means the referee's eps <= target at that sigma. Ratios are ours / peer
(sigma: < 1 means less noise for the same guarantee; time: < 1 means faster).

    .venv/bin/python benchmarks/calibration.py            # T = 75,000 and T = 1e6 cases (~20 min)
    .venv/bin/python benchmarks/calibration.py --quick    # the T = 75,000, eps = 1 case only
    .venv/bin/python benchmarks/calibration.py --core     # the accounting core's table only (~1 min)

The core table (``--core``, also printed first by the other runs): each command in a fresh process, imports
included, against one dp-accounting eps evaluation at the paper case (p = 0.016, T = 75,000, delta = 1e-5) and a
20-point eps-versus-T curve by dp-accounting (20 evaluations, one process), with each process's peak memory.
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


PAPER_SIGMA = 16.369286977517604  # the README's max_steps example: eps = 1 at T = 75,000 (p = 16/1000)
CURVE_STEPS = "[int(t) for t in __import__('numpy').geomspace(1, 75000, 20)]"
PEAK = "\nimport resource; print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
CORE = {  # (tool, case): code run in a fresh process
    ("dpaudit", "max-steps"): f"""
import sys
from dpaudit.cli.main import run
sys.argv = ["dpaudit", "max-steps", "--sigma", "{PAPER_SIGMA!r}", "--eps", "1", "--p", "0.016", "--json"]
try:
    run()
except SystemExit:
    pass""",
    ("dpaudit", "calibrate"): """
import sys
from dpaudit.cli.main import run
sys.argv = ["dpaudit", "calibrate", "--eps", "1", "--p", "0.016", "--steps", "75000", "--json"]
try:
    run()
except SystemExit:
    pass""",
    ("dpaudit", "plot --vs steps, 50 points"): f"""
import sys, tempfile
from dpaudit.cli.main import run
out = tempfile.mktemp(suffix=".png")
sys.argv = ["dpaudit", "plot", "--vs", "steps", "--sigma", "{PAPER_SIGMA!r}", "--p", "0.016", "--steps", "75000",
            "--points", "50", "-o", out, "--json"]
try:
    run()
except SystemExit:
    pass""",
    ("dpaudit", "eps-vs-T curve, 20 points"): f"""
from dpaudit.accounting import Mechanism
from dpaudit.accounting.calibrate import epsilons_over_steps
print([r.epsilon for r in epsilons_over_steps(Mechanism("gaussian", {PAPER_SIGMA!r}, 0.016, 1), {CURVE_STEPS}, 1e-5)])""",
    ("dp-accounting", "one eps at T = 75,000"): f"""
import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
acc = pld_privacy_accountant.PLDAccountant()
acc.compose(dp_accounting.PoissonSampledDpEvent(0.016, dp_accounting.GaussianDpEvent({PAPER_SIGMA!r})), 75000)
print(acc.get_epsilon(1e-5))""",
    ("dp-accounting", "eps-vs-T curve, 20 points"): f"""
import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
out = []
for t in {CURVE_STEPS}:
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.016, dp_accounting.GaussianDpEvent({PAPER_SIGMA!r})), t)
    out.append(acc.get_epsilon(1e-5))
print(out)""",
}


def core_table(timeout: float) -> list[dict]:
    """The accounting core's timings: each (tool, case) in a fresh process, seconds and peak memory; ratios
    against dp-accounting's one eps evaluation at T = 75,000 measured in the same run."""
    rows = []
    for (tool, case), code in CORE.items():
        began = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, "-c", code + PEAK], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            rows.append({"tool": tool, "case": case, "error": f"over {timeout:g} s"})
            continue
        seconds = time.perf_counter() - began
        peak = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("PEAK ")]
        row = {"tool": tool, "case": case, "seconds": seconds, "peak_bytes": peak[-1] if peak else None}
        if out.returncode != 0:
            row["error"] = (out.stderr.strip().splitlines() or ["failed"])[-1][:200]
        rows.append(row)
    one = next((r["seconds"] for r in rows if r["case"] == "one eps at T = 75,000" and "error" not in r), None)
    for r in rows:
        if one and "seconds" in r:
            r["ratio_to_one_dp_accounting_eps"] = r["seconds"] / one
    return rows


def print_core(rows: list[dict]) -> None:
    print("\nThe accounting core (p = 0.016, sigma = 16.3693, delta = 1e-5; fresh process each, imports included)")
    print(f"  {'tool':<14} {'case':<28} {'s':>7} {'peak MB':>8} {'x one dp-accounting eps':>24}")
    for r in rows:
        if "error" in r and "seconds" not in r:
            print(f"  {r['tool']:<14} {r['case']:<28} {r['error']}")
            continue
        peak = f"{r['peak_bytes'] / 2**20:>8.0f}" if r.get("peak_bytes") else f"{'?':>8}"
        ratio = r.get("ratio_to_one_dp_accounting_eps")
        print(f"  {r['tool']:<14} {r['case']:<28} {r['seconds']:>7.2f} {peak} {ratio if ratio is None else round(ratio, 2):>24}"
              + (f"  ({r['error']})" if "error" in r else ""), flush=True)


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
    parser.add_argument("--core", action="store_true", help="the accounting core's table only")
    args = parser.parse_args()
    core = core_table(args.timeout)
    if not args.json:
        print_core(core)
    if args.core:
        if args.json:
            print(json.dumps(core, indent=2))
        return
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
