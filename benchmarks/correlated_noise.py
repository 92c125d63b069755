"""DP-SGD with independent noise against BandMF (correlated noise) at one eps, on the embedded model.

Each run fine-tunes the embedded default with the bundled DP-SGD trainer (sigma calibrated to --eps for its own
noise: independent with Poisson batches, or BandMF with b bands and cyclic Poisson batches), then measures the
mean per-example loss of the final model on held-out sentences. Same seeds for both; the table gives each seed's
pair, and the median ratio (BandMF / independent) is the figure.

    .venv/bin/python benchmarks/correlated_noise.py --eps 4 --bands 4 --seeds 3
    .venv/bin/python benchmarks/correlated_noise.py --eps 4 --bands --blt blt,buffers=2,order=fixed --lr 1e-3

``--blt SPEC`` (repeat) adds BLT runs, accounted without amplification: ``order=fixed`` ones draw one fixed order
(--sampling shuffle), the others balls-in-bins epochs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def held_out_loss(model_dir: Path, texts: list[str]) -> float:
    import torch

    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training.data import per_example_loss, tokenize

    model, tokenizer = load_causal_lm(model_dir)
    model.eval()
    data = tokenize(tokenizer, texts, 64)
    with torch.no_grad():
        losses = per_example_loss(model, data.batch(list(range(len(texts)))))
    return float(losses.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eps", type=float, default=4.0)
    ap.add_argument("--bands", type=int, nargs="*", default=[4])
    ap.add_argument("--blt", action="append", default=[], help="a BLT spec to run as well (repeat)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=None, help="default: the trainer's (5e-3 for dp-sgd, AdamW)")
    args = ap.parse_args()

    import torch

    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_embedded_default
    from dpaudit.training.runner import TrainConfig, train

    torch.set_num_threads(args.threads)
    texts, held_out = sentences(1000, seed=7), sentences(300, seed=99)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = build_embedded_default(Path(tmp) / "base")
        print(f"base model: held-out loss {held_out_loss(base, held_out):.4f}", flush=True)
        for seed in range(args.seeds):
            for noise in [None] + [f"bandmf,b={b}" for b in args.bands] + args.blt:
                sampling = ("poisson" if not noise or not noise.startswith("blt")
                            else "shuffle" if "order=fixed" in noise else "balls-in-bins")
                cfg = TrainConfig(method="dp-sgd", target_epsilon=args.eps, steps=args.steps,
                                  batch_size=args.batch_size, secret_seed=1000 + seed, seed=seed, noise=noise,
                                  sampling=sampling, **({"lr": args.lr} if args.lr else {}))
                began = time.perf_counter()
                result = train(base, texts, Path(tmp) / f"run-{seed}-{noise}", cfg, show_progress=False)
                loss = held_out_loss(result.model_dir, held_out)
                rows.setdefault(noise or "independent", []).append(loss)
                print(f"seed {seed} {noise or 'independent':12s} sigma {result.sigma:.4f} eps {result.epsilon:.4f} "
                      f"held-out loss {loss:.4f} ({time.perf_counter() - began:.0f} s)", flush=True)
    base_losses = rows["independent"]
    print(f"\nheld-out loss at eps = {args.eps:g}, T = {args.steps}, B = {args.batch_size}, lr {args.lr or 'default'} (median over "
          f"{args.seeds} seeds)")
    for name, losses in rows.items():
        ratios = [a / b for a, b in zip(losses, base_losses)]
        print(f"  {name:12s} {statistics.median(losses):.4f}   vs independent: median ratio "
              f"{statistics.median(ratios):.4f}, lower in {sum(r < 1 for r in ratios)}/{len(ratios)} seeds")


if __name__ == "__main__":
    main()
