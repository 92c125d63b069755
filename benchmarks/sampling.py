"""What the batch sampler does to eps: one schedule accounted under each sampler, in one table with seconds.

For each schedule (sigma, B, N, T, delta): Poisson sampling at p = B / N (add/remove, pld: what a user
quotes), fixed-size batches without replacement (replace-one, rdp: dp-accounting's sampled-without-replacement
event), shuffled epochs (zero-out: the upper bound without amplification, and Chua et al.'s lower bound), balls-in-bins (add/remove:
the allocation accountant's upper and lower bound). The rows come from dpaudit.accounting.sampler_table, which
`dpaudit compare --sampling all` prints too. The
ratio column is each row's eps over the Poisson (add/remove) eps measured in the same run: by how much Poisson
accounting would understate a run that really used that sampler (the lower bound's ratio is what it
understates at least). Poisson under replace-one (dp-accounting's PLD) is shown too, the fixed row's peer
under the same relation. Also: a 3-phase `dpaudit check` config, timed as a whole process.

    .venv/bin/python benchmarks/sampling.py           # both schedules (~1 min)
    .venv/bin/python benchmarks/sampling.py --json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEDULES = [  # (name, sigma, B, N, T, delta): T the same for every sampler
    ("MNIST-like DP-SGD: N = 60,000, B = 256, 60 epochs of 234 batches", 1.1, 256, 60_000, 60 * 234, 1e-5),
    ("DP-ZO paper: N = 1000, B = 16, T = 75,000 (sigma 16.4, their eps = 1)", 16.4, 16, 1000, 75_000, 1e-5),
]

THREE_PHASES = """\
privacy:
  mechanism: gaussian
  dataset_size: 60000
  delta: 1.0e-5
  target_epsilon: 3.0
  phases:
    - {noise_multiplier: 1.5, batch_size: 128, steps: 2000}   # warm-up at a smaller batch
    - {noise_multiplier: 1.1, batch_size: 256, epochs: 10}
    - {noise_multiplier: 1.3, sampling_rate: 0.005, steps: 3000}  # a second fine-tuning phase
"""


def rows_for(sigma: float, b: int, n: int, steps: int, delta: float) -> list[dict]:
    from dpaudit.accounting import sampler_table

    return sampler_table.rows(sigma, b, n, steps, delta)


def check_seconds() -> tuple[float, int, str]:
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "three-phases.yaml"
        config.write_text(THREE_PHASES)
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dpaudit.cli.main", "check", str(config)], capture_output=True,
                              text=True)
        return time.perf_counter() - began, done.returncode, done.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for name, sigma, b, n, steps, delta in SCHEDULES:
        rows = rows_for(sigma, b, n, steps, delta)
        results.append({"schedule": name, "sigma": sigma, "batch_size": b, "dataset_size": n, "delta": delta,
                        "rows": rows})
        if not args.json:
            print(f"\n{name}: sigma = {sigma:g}, T = {rows[0]['steps']}, delta = {delta:g}")
            print(f"  {'sampler':<13} {'bound':<20} {'relation':<12} {'accountant':<10} {'eps':>10} "
                  f"{'x Poisson':>10} {'s':>7}")
            for r in rows:
                eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.4g}"
                ratio = "-" if r["vs_poisson"] is None else f"{r['vs_poisson']:.3g}"
                print(f"  {r['sampler']:<13} {r['bound']:<20} {r['relation']:<12} {r['accountant']:<10} {eps:>10} "
                      f"{ratio:>10} {r['seconds']:>7.2f}")
    seconds, code, said = check_seconds()
    if args.json:
        print(json.dumps({"schedules": results, "three_phase_check": {"seconds": seconds, "exit": code,
                                                                      "output": said}}, indent=2))
    else:
        print(f"\n3-phase `dpaudit check` (whole process): {seconds:.2f} s, exit {code}: {said}")


if __name__ == "__main__":
    main()
