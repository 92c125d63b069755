"""Black box on the user's recipe (issue 55 item 4): `audit run` as a user fine-tunes, the whole model with AdamW
and Poisson batches (B 64, T 300, claimed eps 4, m 1000 new-token canaries), over a grid of learning rates and
secret seeds, several runs at once. Prints each run's bound and AUC, then the median per rate.

    .venv/bin/python benchmarks/user_recipe.py --out /tmp/ur [--lrs model,1e-2] [--seeds 1,2,3] [--jobs 2]
    .venv/bin/python benchmarks/user_recipe.py --ceiling [--batches 64,256,1024]

``--ceiling``: what a perfect black-box canary could read on this schedule (N 1497: the embedded default's 1000
examples and the members), simulated: its whole clipped gradient on its own row, so its score is the sum of its
releases along that row (the number of steps that sampled it, plus the noise), the best a score of the final
model can do with a linear statistic; 9 simulated runs of m = 1000 through the same analysis.

``--share``: where a new-token canary's gradient goes on the embedded default (the whole model trainable, as the
recipe): the median share of its norm on its secret's own row for prefixes of 1, 2 and 8 random tokens (20
canaries each, zero rows), behind audit run's one shared prefix with rows at its expected row (what `audit run`
does where the body trains), and with the 1-token prefix chosen among the tokenizer's prefix pool for the largest
share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def one(out: Path, lr: str, seed: int, extra: list[str]) -> dict:
    folder = out / f"lr{lr}-s{seed}"
    command = [sys.executable, "-m", "dpaudit.cli.main", "audit", "run", "--method", "dp-sgd", "--eps", "4",
               "--trainable", "full", "--optimizer", "adamw", "-B", "64", "-T", "300", "-m", "1000",
               *(["--lr", lr] if lr != "model" else []), "--secret-seed", str(seed), "--threads", "2", "--force",
               "--json", "-o", str(folder), *extra]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent)  # not the
    # repository root, whose dpaudit/ folder would shadow the installed package (cli/ maps into it at install)
    try:
        summary = json.loads(done.stdout)
    except json.JSONDecodeError:
        return {"lr": lr, "seed": seed, "error": (done.stderr or done.stdout)[-300:]}
    return {"lr": lr, "seed": seed, "bound": summary["epsilon_lower_bound"], "auc": summary["auc"],
            "seconds": round(time.perf_counter() - start, 1)}


def perfect_canary(batch: int, examples: int = 1497, steps: int = 300, eps: float = 4.0, runs: int = 9) -> str:
    import numpy as np

    from dpaudit.api import calibrate
    from dpaudit.audit.analysis import analyse

    rate = batch / examples
    sigma = calibrate(eps, delta=1e-5, p=rate, steps=steps).sigma
    bounds = []
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        members = rng.random(1000) < 0.5
        scores = rng.binomial(steps, rate, 1000) * members + sigma * np.sqrt(steps) * rng.standard_normal(1000)
        bounds.append(analyse(scores, members, claimed_epsilon=eps, delta=1e-5, alpha=0.05,
                              score="neg-loss").epsilon_lower_bound)
    return (f"B {batch} (p {rate:.3f}, sigma {sigma:.3f}, T {steps}): separation p sqrt(T) / sigma = "
            f"{rate * steps ** 0.5 / sigma:.3f}; a perfect canary's bound, median of {runs} runs "
            f"{float(np.median(bounds)):.3f} (range {min(bounds):.2f}-{max(bounds):.2f})")


def gradient_share(canaries: int = 20) -> None:
    import numpy as np
    import tempfile
    import torch

    from dpaudit.canaries.generate import _prefix_pool, make_canaries, shared_prefix
    from dpaudit.canaries.hf import extend_model
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.workflows.audit_run import embedded_default

    torch.manual_seed(0)
    base = embedded_default(Path(tempfile.mkdtemp()) / "base", 0)

    def share(lm, ids: list[int], secret: int) -> float:
        lm.zero_grad()
        x = torch.tensor([ids])
        torch.nn.functional.cross_entropy(lm(input_ids=x).logits[0, :-1].float(), x[0, 1:]).backward()
        total = sum(float((q.grad.float() ** 2).sum()) for q in lm.parameters() if q.grad is not None)
        return (float((lm.get_input_embeddings().weight.grad[secret].float() ** 2).sum()) / total) ** 0.5

    for length in (1, 2, 8):
        lm, tok = load_causal_lm(base)
        manifest = make_canaries(tok, canaries, seed=0, prefix_length=length, membership_seed=1)
        secrets = extend_model(lm, tok, manifest)
        lm.train()
        got = [share(lm, tok(c.text)["input_ids"], s) for c, s in zip(manifest.canaries, secrets)]
        print(f"prefix of {length} random token(s): median share of the norm on the secret's row "
              f"{np.median(got):.3f} ({canaries} canaries)", flush=True)
    lm, tok = load_causal_lm(base)  # audit run's layout where the body trains: one shared prefix, expected rows
    manifest = make_canaries(tok, 1000, seed=0, template=shared_prefix(tok, 0), membership_seed=1)
    shared = extend_model(lm, tok, manifest)
    lm.train()
    got = [share(lm, tok(c.text)["input_ids"], s) for c, s in zip(manifest.canaries[:canaries], shared)]
    print(f"one shared prefix, rows at its expected row (1000 canaries): median share {np.median(got):.3f}",
          flush=True)
    lm, tok = load_causal_lm(base)
    secrets = extend_model(lm, tok, make_canaries(tok, canaries, seed=0, membership_seed=1))
    lm.train()
    pool = _prefix_pool(tok)  # the 1-token prefix chosen by the share it gives (a public choice, before membership)
    every = np.array([share(lm, [int(t), secrets[0]], secrets[0]) for t in pool])
    print(f"1-token prefix over the whole pool ({len(pool)} tokens): median {np.median(every):.3f}, the best "
          f"{canaries} {np.median(np.sort(every)[-canaries:]):.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--lrs", default="model", help="rates, comma-separated; 'model': audit run's own (no --lr)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ceiling", action="store_true", help="only the perfect canary's bound, simulated")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--share", action="store_true", help="only where a canary's gradient goes (embedded default)")
    ap.add_argument("extra", nargs="*", help="more `audit run` options (after --)")
    args = ap.parse_args()
    if args.ceiling:
        for batch in args.batches.split(","):
            print(perfect_canary(int(batch)), flush=True)
        return
    if args.share:
        gradient_share()
        return
    if not args.out:
        ap.error("--out is required (except with --ceiling)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = [(lr, int(s)) for lr in args.lrs.split(",") for s in args.seeds.split(",")]
    rows = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for row in pool.map(lambda g: one(out, g[0], g[1], args.extra), grid):
            print(json.dumps(row), flush=True)
            rows.append(row)
    for lr in args.lrs.split(","):
        got = [r for r in rows if r["lr"] == lr and "bound" in r]
        if got:
            print(f"lr {lr}: median bound {statistics.median(r['bound'] for r in got):.3f}, median AUC "
                  f"{statistics.median(r['auc'] for r in got):.3f} over {len(got)} runs", flush=True)


if __name__ == "__main__":
    main()
