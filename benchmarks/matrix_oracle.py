"""dpaudit's correlated-noise accounting and strategies against jax_privacy's, on the cases its tests use.

jax_privacy is the oracle only: install it into a scratch environment (never a dependency of dpaudit), and run
this file with that environment's python, pointing --dpaudit at dpaudit's own environment:

    python3 -m venv /tmp/jpenv && /tmp/jpenv/bin/pip install jax-privacy
    /tmp/jpenv/bin/python benchmarks/matrix_oracle.py --dpaudit .venv/bin/dpaudit

Each row prints both values and their ratio (dpaudit / jax_privacy). The goal: eps within 0.1 % and never below
(dpaudit's PLD is pessimistic and refines its grid; jax_privacy's uses a fixed 1e-4 grid); the optimal banded
strategy's loss within 0.1 %; the min-separation sensitivity equal.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time

CASES = [
    # (name, sigma, in-group rate q, T, bands): jax_privacy's tests/accounting/analysis_test.py (PLD case,
    # cycle length 64: N = 50,000 x 64, B = 1024, T = 10,000 x 64) and tests/experimental/accounting_test.py
    ("analysis_test cycle 64", 4.0, 1024 / 50_000, 10_000 * 64, 64),
    ("experimental bandmf", 1.0, 0.01, 128, 16),
    ("embedded schedule b=8", 1.2, 0.2, 300, 8),
    ("60k schedule b=32", 3.0, 256 * 32 / 60_000, 2_000, 32),
]


def ours(dpaudit: str, *args: str) -> dict:
    out = subprocess.run([dpaudit, *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dpaudit", required=True, help="dpaudit's executable (its own environment)")
    ap.add_argument("--delta", type=float, default=1e-5)
    args = ap.parse_args()

    import dp_accounting
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax_privacy.experimental import accounting as jp_accounting
    from jax_privacy.matrix_factorization import toeplitz as jp_toeplitz

    print(f"{'case':28s} {'jax_privacy':>12s} {'dpaudit':>12s} {'ratio':>10s}")
    for name, sigma, q, steps, bands in CASES:
        event = jp_accounting.amplified_bandmf_event(sigma, steps, num_bands=bands, sampling_prob=q)
        theirs = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4).compose(event).get_epsilon(
            args.delta)
        mine = ours(args.dpaudit, "epsilon", "--sigma", str(sigma), "--p", repr(q / bands), "-T", str(steps),
                    "--noise", f"bandmf,b={bands}", "--delta", str(args.delta))["result"]["epsilon"]
        print(f"eps {name:24s} {theirs:12.6f} {mine:12.6f} {mine / theirs:10.6f}")

    for n, bands in [(100, 4), (500, 16), (2000, 8), (2000, 64)]:
        start = time.perf_counter()
        coefs = jp_toeplitz.optimize_banded_toeplitz(n, bands, reduction_fn=jnp.max)
        seconds = time.perf_counter() - start
        theirs = float(jp_toeplitz.loss(coefs, n, jnp.max))
        mine = ours(args.dpaudit, "compare", "--sigma", "1", "--p", "0.001", "-T", str(n),
                    "--noise", f"bandmf,b={bands}")["rows"][0]["expected_error"]
        print(f"loss T={n:<5d} b={bands:<3d}          {theirs:12.6f} {mine:12.6f} {mine / theirs:10.6f}"
              f"   (jax_privacy {seconds:.1f} s)")
        sqrt = jp_toeplitz.optimal_max_error_strategy_coefs(n)
        for k in (1, 3):
            theirs = float(jp_toeplitz.minsep_sensitivity_squared(sqrt, bands, k))
            from_ours = _our_minsep(args.dpaudit, n, bands, k)
            print(f"minsep T={n:<5d} sep={bands:<3d} k={k}     {theirs:12.6f} {from_ours:12.6f} "
                  f"{from_ours / theirs:10.6f}")


def _our_minsep(dpaudit: str, n: int, sep: int, k: int) -> float:
    code = ("import sys; from dpaudit.accounting.matrix import toeplitz as t; "
            f"print(t.minsep_sensitivity_squared(t.sqrt_coefs({n}), {sep}, {k}))")
    python = dpaudit.rsplit("/", 1)[0] + "/python"
    return float(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


if __name__ == "__main__":
    main()
