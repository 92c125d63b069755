"""What each way to a user-level claim costs in utility (docs/accounting.md, "The privacy unit"): the embedded
default's architecture (pre-trained briefly, so that fine-tuning has something to teach) fine-tuned with DP-SGD on 1,000 records of users holding k records each, at one user-level target eps, as
ELS (records sampled, accounted per user), group privacy (the same training, sigma from the `group` accountant) and
ULS (users sampled, each user's mean gradient clipped as one), beside the non-private run; the held-out loss of
each (mean next-token loss on 400 sentences no run saw), and its gap to the non-private run's.

    .venv/bin/python benchmarks/user_level_utility.py [--eps 8] [--k 1 4 16] [--steps 300] [--threads 2]

Every run is the same trainer, data, batch (B = 64 records expected a step), steps and seeds; only the sampling unit
and sigma differ.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def held_out_loss(model_dir: Path, texts: list[str]) -> float:
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training.data import per_example_loss, tokenize

    model, tok = load_causal_lm(model_dir)
    model.eval()
    with torch.no_grad():
        return float(per_example_loss(model, tokenize(tok, texts, 64).batch(list(range(len(texts)))), 100).mean())


def main() -> None:
    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_embedded_default
    from dpaudit.training.runner import TrainConfig, train

    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pretrain-steps", type=int, default=20,
                    help="the base's pre-training (the embedded default takes 150, after which this corpus has "
                         "little left to teach: fine-tuning it non-privately at the DP rate raised the held-out loss)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="user-utility-"))
    model = build_embedded_default(work / "base", seed=0, pretrain_steps=args.pretrain_steps)
    texts, held = sentences(args.records, seed=11), sentences(400, seed=12)
    base_loss = held_out_loss(model, held)
    common = dict(method="dp-sgd", steps=args.steps, batch_size=64, delta=args.delta, secret_seed=1, seed=0)

    def run(name: str, users, **kw) -> tuple[float, float, float]:
        began = time.perf_counter()
        result = train(model, texts, work / name, TrainConfig(**common, **kw), show_progress=False, users=users)
        return result.sigma or 0.0, held_out_loss(result.model_dir, held), time.perf_counter() - began

    _, plain, plain_s = run("non-private", None, target_epsilon=float("inf"))
    print(f"embedded default, {args.records} records, B 64, T {args.steps}, user-level eps {args.eps:g}, "
          f"delta {args.delta:g}; held-out loss before training {base_loss:.4f}, non-private {plain:.4f} "
          f"({plain_s:.0f} s)")
    print("| k | way | sigma | held-out loss | gap to non-private | s |")
    print("|---|---|---|---|---|---|")
    for k in args.k:
        users = [str(i // k) for i in range(len(texts))]
        user = dict(unit="user", records_per_user=k, target_epsilon=args.eps)
        for way, kw in (("ELS", {}), ("group privacy", {"accountant": "group"}),
                        ("ULS", {"user_sampling": "uls"})):
            sigma, loss, seconds = run(f"{way}-{k}".replace(" ", "-"), users, **user, **kw)
            print(f"| {k} | {way} | {sigma:.4g} | {loss:.4f} | {loss - plain:+.4f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
