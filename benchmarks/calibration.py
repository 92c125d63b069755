"""Calibration benchmark: dpaudit `pld` vs Opacus (accountant="prv") vs dp-accounting
`calibrate_dp_mechanism`, in one run. p = 0.016, T = 75000, delta = 1e-5, eps in {0.5, 1, 4}.
Every sigma found is re-checked with dp-accounting PLD add/remove (pessimistic, grid 1e-5).

    .venv/bin/python benchmarks/calibration.py
"""

import time

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

from dpaudit.accounting import Mechanism, calibrate_sigma
from dpaudit.accounting.pld import epsilon as pld_epsilon

P, T, DELTA = 0.016, 75_000, 1e-5


def check(sigma):
    return pld_epsilon(Mechanism("gaussian", sigma, P, T), DELTA, grid=1e-5).epsilon


def ours(target):
    return calibrate_sigma(Mechanism("gaussian", 1.0, P, T), target, DELTA, "pld").sigma


def opacus_prv(target):
    from opacus.accountants.utils import get_noise_multiplier
    return get_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=P, steps=T, accountant="prv")


def google(target):
    def make_event(sigma):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(P, dp_accounting.GaussianDpEvent(sigma)), T)
    return dp_accounting.calibrate_dp_mechanism(
        lambda: pld_privacy_accountant.PLDAccountant(), make_event, target, DELTA,
        dp_accounting.LowerEndpointAndGuess(0.1, 10.0), tol=1e-3)


def main():
    peers = {"dpaudit pld": ours, "dp-accounting calibrate": google}
    try:
        import opacus  # noqa: F401
        peers["opacus prv"] = opacus_prv
    except ImportError:
        print("opacus not installed (pip install '.[train]'): skipped")
    print(f"{'target':>6} {'tool':<24} {'sigma':>9} {'eps (PLD check)':>16} {'valid':>6} {'time s':>8}")
    for target in (0.5, 1.0, 4.0):
        found = {}
        for name, fn in peers.items():
            start = time.perf_counter()
            sigma = fn(target)
            seconds = time.perf_counter() - start
            eps = check(sigma)
            found[name] = (sigma, eps <= target, seconds)
            print(f"{target:>6} {name:<24} {sigma:>9.4f} {eps:>16.5f} {str(eps <= target):>6} {seconds:>8.2f}")
        ours_sigma, _, ours_time = found["dpaudit pld"]
        for name, (sigma, valid, seconds) in found.items():
            if name != "dpaudit pld":
                print(f"       ratio vs {name}: sigma {ours_sigma / sigma:.4f}x (peer valid: {valid}), "
                      f"time {ours_time / seconds:.3f}x")


if __name__ == "__main__":
    main()
