"""Black-box audit power of `dpaudit audit run` on the embedded default (issue 39): the headline eps lower bound, AUC,
TPR at 1 % FPR and that TPR as a share of the claim's ceiling (the most TPR a run meeting the claim allows, from
its composed PLD), per method and claimed eps, m = 1000, one run each, several seeds and their median.

The peer measured in the same run is the audit run's old recipe (full fine-tune, 8 random prefix tokens before
each secret), run beside each lever, so every ratio compares runs made on the same loaded machine:

    .venv/bin/python benchmarks/audit_power.py --seeds 3 --only levers,dp-sgd   # ~20 min on 2 cores
    .venv/bin/python benchmarks/audit_power.py --seeds 3 --only dp-zo-defaults  # ~25 min (300 full batches a run)
    .venv/bin/python benchmarks/audit_power.py --seeds 3 --only dp-zo           # ~65 min (with the 3000-step before)
    .venv/bin/python benchmarks/audit_power.py --optimal    # what any attack could show on DP-SGD's schedule (1 min)
    .venv/bin/python benchmarks/audit_power.py --optimal --old-schedule   # the same on the schedule before
    .venv/bin/python benchmarks/audit_power.py --model M.gguf --only pretrained   # a real model (~6 min a run)
    .venv/bin/python benchmarks/audit_power.py --model M.gguf --only pretrained-zo  # DP-ZO on it (~2.5-4.5 min a run)

The real pretrained walk-through model (docs/auditing.md; never fetched at run time, see benchmarks/walkthrough.py):
--model runs every row on it (`audit run --model`); "pretrained-before" is its recipe before (~46 min a run).

Each run is `dpaudit audit run --method M --eps E --secret-seed S --json` in a fresh folder (`--threads 2`);
results are appended to --results as JSON lines, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DPAUDIT = str(Path(sys.executable).with_name("dpaudit"))
OLD_SCHEDULE = ["-B", "64", "-T", "300", "--optimizer", "adamw"]  # Poisson p = 64/1555, T = 300, AdamW 5e-3
BEFORE = ["--trainable", "full", "--prefix-length", "8", *OLD_SCHEDULE]  # the recipe before issue 39
ZO_BEFORE = ["--trainable", "full", "-B", "64", "-T", "3000", "--phi", "1e-3", "--examples", "1000"]  # DP-ZO's before
# (name, method, eps, extra arguments): the levers one at a time at eps = 4, then the defaults across eps
RUNS = {
    "levers": [("first: full, prefix 8", "dp-sgd", 4, BEFORE),
               ("embeddings, prefix 1 (the recipe before)", "dp-sgd", 4, ["--trainable", "embeddings",
                                                                          *OLD_SCHEDULE]),
               ("after: new-tokens, full batches, T = 3, SGD 5 (defaults)", "dp-sgd", 4, [])],
    "ablations": [("prefix 1", "dp-sgd", 4, ["--trainable", "full", *OLD_SCHEDULE]),
                  ("new-tokens (loss-vs-base), old schedule", "dp-sgd", 4, ["--trainable", "new-tokens",
                                                                             *OLD_SCHEDULE])],
    "dp-sgd": [("defaults", "dp-sgd", 1, []), ("defaults", "dp-sgd", 8, []),
               ("first: full, prefix 8", "dp-sgd", 1, BEFORE)],
    "dp-zo": [("before: full, B 64, T 3000 (the recipe before)", "dp-zo", 4, ZO_BEFORE),
              ("after: new-tokens, full batches, T 300, phi and rate from the model (defaults)", "dp-zo", 4, []),
              ("defaults", "dp-zo", 1, []), ("defaults", "dp-zo", 8, [])],
    "dp-zo-defaults": [("defaults", "dp-zo", 4, []), ("defaults", "dp-zo", 1, []), ("defaults", "dp-zo", 8, [])],
    # with --model: the pretrained recipe (new-tokens at the rate from the model) and the one before it
    "pretrained": [("defaults: new-tokens, rate from the model", "dp-sgd", 4, []),
                   ("defaults", "dp-sgd", 1, []), ("defaults", "dp-sgd", 8, [])],
    "pretrained-zo": [("defaults: new-tokens, T 3000, phi and rate from the model", "dp-zo", 4, []),
                      ("defaults", "dp-zo", 1, []), ("defaults", "dp-zo", 8, [])],
    "pretrained-before": [("embeddings, B 64, T 300, AdamW 5e-5 (the recipe before)", "dp-sgd", 4,
                           ["--trainable", "embeddings", "-B", "64", "-T", "300", "--optimizer", "adamw"])],
}
MODEL: list[str] = []  # --model PATH, passed to every run


def one(method: str, eps: float, extra: list[str], seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        proc = subprocess.run([DPAUDIT, "audit", "run", "--method", method, "--eps", str(eps), "--out", tmp + "/run",
                               "--secret-seed", str(seed), "--threads", "2", "--json", *MODEL, *extra],
                              capture_output=True, text=True)
        seconds = time.perf_counter() - began
    if proc.returncode not in (0, 1):
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200], "seconds": seconds}
    d = json.loads(proc.stdout)
    ceiling = (d.get("claim_ceiling") or {}).get("tpr_at_fpr", {}).get("0.01") or {}
    return {"headline": float(d["epsilon_lower_bound"]), "auc": d["auc"], "tpr1": d["tpr_at_fpr"]["0.01"],
            "ceiling1": ceiling.get("max_tpr"), "verdict": d["verdict"], "seconds": seconds}


def optimal(eps: float, trials: int = 101, m: int = 1000, batch: int = 1555, examples: int = 1555,
            steps: int = 3) -> tuple[float, float, float]:
    """What any attack could show in one run of an audit run's DP-SGD schedule (by default the black-box
    defaults: full batches of the 1555 examples, T = 3; ``--old-schedule``: p = 64 / 1555, T = 300), sigma
    calibrated to eps: the optimal score (each member's exact log-likelihood ratio over every step's release, a
    white-box reading no final model gives) audited as the audit run is. (median, 10th, 90th percentile) of the
    headline over ``trials`` runs: the peer every black-box figure should be read against."""
    import numpy as np

    from dpaudit.accounting.calibrate import calibrate_sigma
    from dpaudit.accounting.mechanism import Mechanism
    from dpaudit.audit.analysis import analyse

    p = batch / examples
    sigma = calibrate_sigma(Mechanism("gaussian", 1.0, p, steps), eps, 1e-5).sigma
    rng = np.random.default_rng(0)
    heads = []
    for _ in range(trials):
        members = rng.random(m) < 0.5
        x = rng.normal(size=(m, steps)) * sigma + ((rng.random((m, steps)) < p) & members[:, None])
        llr = np.log1p(p * np.expm1((2 * x - 1) / (2 * sigma ** 2))).sum(axis=1)
        heads.append(analyse(llr, members, claimed_epsilon=eps, delta=1e-5, mechanism="gaussian").epsilon_lower_bound)
    return float(np.median(heads)), float(np.percentile(heads, 10)), float(np.percentile(heads, 90))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only", default="levers,dp-sgd,dp-zo")
    ap.add_argument("--results", type=Path, default=Path("audit_power.jsonl"))
    ap.add_argument("--optimal", action="store_true", help="only the optimal attack's headline per eps (fast)")
    ap.add_argument("--old-schedule", action="store_true", help="with --optimal: the schedule before (B 64, T 300)")
    ap.add_argument("--model", type=Path, help="audit this model (a folder or .gguf) instead of the embedded default")
    args = ap.parse_args()
    if args.model:
        MODEL[:] = ["--model", str(args.model)]
    if args.optimal:
        print("| claimed eps | optimal attack, one run, m = 1000: median headline [10th, 90th percentile] |")
        print("|---|---|")
        for eps in (1, 4, 8):
            med, lo, hi = optimal(eps, **({"batch": 64, "steps": 300} if args.old_schedule else {}))
            print(f"| {eps} | {med:.3f} [{lo:.3f}, {hi:.3f}] |", flush=True)
        return
    rows = []
    for group in args.only.split(","):
        for name, method, eps, extra in RUNS[group]:
            got = []
            for seed in range(1, args.seeds + 1):
                r = {"name": name, "method": method, "eps": eps, "seed": seed, **one(method, eps, extra, seed)}
                with args.results.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                print(json.dumps(r), flush=True)
                got.append(r)
            rows.append((name, method, eps, [r for r in got if "error" not in r]))
    print("\n| recipe | method | claimed eps | headline (median; seeds) | headline / claim | AUC | TPR at 1% FPR | "
          "claim's ceiling at 1% | share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, method, eps, got in rows:
        if not got:
            print(f"| {name} | {method} | {eps} | error | | | | | |")
            continue
        med = {k: statistics.median(r[k] for r in got) for k in ("headline", "auc", "tpr1")}
        ceiling = statistics.median(r["ceiling1"] for r in got if r["ceiling1"] is not None) \
            if any(r["ceiling1"] is not None for r in got) else None
        each = ", ".join(f"{r['headline']:.3f}" for r in got)
        share = f"{med['tpr1'] / ceiling:.0%}" if ceiling else "-"
        print(f"| {name} | {method} | {eps:g} | {med['headline']:.3f} ({each}) | {med['headline'] / eps:.2f} | "
              f"{med['auc']:.3f} | {med['tpr1']:.3f} | {ceiling if ceiling is None else f'{ceiling:.3f}'} | "
              f"{share} |")


if __name__ == "__main__":
    main()
