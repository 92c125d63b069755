"""What a ULS step costs against an ELS step of the same records (docs/trainers.md, "User-level runs"): DP-SGD on the
embedded default, users of k records, B 64 records expected a step, seconds a step for ELS (ghost clipping, records
clipped), ULS by ghost clipping (each user's norm from book-keeping's kept factors) and ULS materialised (Opacus'
per-example gradients averaged per user), in one process, interleaved, ratios against ELS.

    .venv/bin/python benchmarks/uls_cost.py [--k 4 16] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def main() -> None:
    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_embedded_default
    from dpaudit.training.runner import TrainConfig, train

    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="uls-cost-"))
    model = build_embedded_default(work / "base", seed=0, pretrain_steps=20)
    texts = sentences(1024, seed=3)
    ways = {"ELS (ghost)": dict(), "ULS (ghost)": dict(user_sampling="uls"),
            "ULS (materialise)": dict(user_sampling="uls", per_sample_grads="materialise")}
    print(f"embedded default, DP-SGD, B 64 records expected a step, {args.steps} steps, {args.threads} threads; "
          "seconds a step (best of the rounds), ratio to ELS")
    print("| k | " + " | ".join(ways) + " |")
    print("|---|" + "---|" * len(ways))
    for k in args.k:
        users = [str(i // k) for i in range(len(texts))]
        best = {name: float("inf") for name in ways}
        for r in range(args.rounds):
            for name, kw in ways.items():
                cfg = TrainConfig(method="dp-sgd", sigma=1.0, steps=args.steps, batch_size=64, secret_seed=r,
                                  unit="user", records_per_user=k, **kw)
                out = work / f"{name}-{k}-{r}".replace(" ", "").replace("(", "").replace(")", "")
                result = train(model, texts, out, cfg, show_progress=False, users=users)
                best[name] = min(best[name], result.seconds_per_step)   # the steps alone (not the ledger's accounting)
        base = best["ELS (ghost)"]
        print(f"| {k} | " + " | ".join(f"{best[n]:.3f} ({best[n] / base:.2f}x)" for n in ways) + " |", flush=True)


if __name__ == "__main__":
    main()
