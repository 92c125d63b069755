"""Start-up: wall time of whole `dpaudit` processes against `python -c pass`, in one run (median of N).

Budget (issue 12): `dpaudit --help` and closed-form commands <= 0.3 s on an idle 2-core machine; the
numerical ones pay only for what they import. Prints seconds and the ratio to `python -c pass`.

    .venv/bin/python benchmarks/startup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

EXE = os.path.join(os.path.dirname(sys.executable), "dpaudit")
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "dpaudit --help": [EXE, "--help"],
    "dpaudit calibrate --help": [EXE, "calibrate", "--help"],
    "calibrate --mech laplace --eps 4": [EXE, "calibrate", "--mech", "laplace", "--eps", "4"],
    "epsilon --mech laplace (pure)": [EXE, "epsilon", "--mech", "laplace", "--sigma", "10", "--p", "0.01", "-T", "1000"],
    "calibrate --eps 1 (analytic Gaussian)": [EXE, "calibrate", "--eps", "1"],
    "epsilon --sigma 1 --p 0.01 -T 1000 (pld)": [EXE, "epsilon", "--sigma", "1", "--p", "0.01", "-T", "1000"],
}
BUDGET = 0.3
CLOSED_FORMS = ("dpaudit --help", "dpaudit calibrate --help", "calibrate --mech laplace --eps 4",
                "epsilon --mech laplace (pure)")


def wall(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = {name: wall(cmd, args.repeat) for name, cmd in COMMANDS.items()}
    base = rows["python -c pass"]
    if args.json:
        print(json.dumps({"seconds": rows, "budget": BUDGET}, indent=2))
        return
    print(f"{'command':<44} {'median s':>9} {'x python -c pass':>17} {'budget':>8}")
    for name, seconds in rows.items():
        mark = ("ok" if seconds <= BUDGET else "OVER") if name in CLOSED_FORMS else ""
        print(f"{name:<44} {seconds:>9.3f} {seconds / base:>17.1f} {mark:>8}")


if __name__ == "__main__":
    main()
