"""DP-ZO vs DP-SGD (ghost clipping; Opacus' materialised per-example gradients) vs non-private SGD vs one inference forward.

Each method runs in its own subprocess so that peak memory is its own. On CPU, peak memory is the
high-water mark of the resident set minus the resident set before the model was built (so: weights,
activations, gradients, optimizer state, allocator slack); on GPU,
torch.cuda.max_memory_allocated. Same model and batch for every method; prints step time and peak
memory as ratios to one forward, and DP-SGD's as ratios to non-private SGD.

    .venv/bin/python benchmarks/trainers.py [--hidden 512 --layers 4 --batch 64 --seq 64 --steps 5]
Targets (issue 14): DP-SGD (ghost) step <= 2x SGD and peak memory <= 1.3x SGD; DP-ZO peak memory
<= 1.2x a forward pass and step <= 2.2x one forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

METHODS = ("forward", "dp-zo", "dp-sgd", "dp-sgd-materialise", "sgd")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        import os

        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(method: str, args) -> dict:
    import numpy as np
    import torch

    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_model, build_tokenizer
    from dpaudit.training.data import per_example_loss, tokenize
    from dpaudit.training.sgd import FirstOrderTrainer
    from dpaudit.training.trainable import trainable_parameters
    from dpaudit.training.zo import ZOSettings, zo_step

    torch.set_num_threads(args.threads)
    before_model = rss_bytes()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    corpus = sentences(2000, seed=0)
    tok = build_tokenizer(corpus)
    model = build_model(tok, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8).to(device)
    params = trainable_parameters(model)
    data = tokenize(tok, [" ".join(corpus[i:i + 6]) for i in range(args.batch)], args.seq)
    batch = {k: v.to(device) for k, v in data.batch(range(args.batch)).items()}
    batch["attention_mask"][:] = 1
    rng = np.random.default_rng(0)
    if method == "forward":
        model.eval()

        def step():
            with torch.no_grad():
                per_example_loss(model, batch)
    elif method == "dp-zo":
        settings = ZOSettings(lr=1e-6, clip=0.05, noise="gaussian", sigma=1.0)

        def step():
            zo_step(model, params, batch, seed=int(rng.integers(2**31)), settings=settings,
                    denominator=args.batch, rng=rng)
    else:
        trainer = FirstOrderTrainer(model, params, lr=1e-4, private=method != "sgd", clip=1.0, sigma=1.0,
                                    expected_batch_size=args.batch, optimizer="sgd",
                                    per_sample_grads="materialise" if method.endswith("materialise") else "ghost")

        def step():
            trainer.step(batch)
    step()  # warm-up (allocations, kernels)
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else peak_rss_bytes() - before_model
    return {"method": method, "seconds_per_step": statistics.median(times), "peak_bytes": peak,
            "parameters": sum(p.numel() for p in model.parameters()), "device": device}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)  # the DP-ZO paper's batch size; try --batch 16 too
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", choices=METHODS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    rows = {}
    for method in METHODS:
        cmd = [sys.executable, __file__, "--worker", method] + [
            f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "batch", "seq", "steps", "threads")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[method] = json.loads(out.stdout.strip().splitlines()[-1])
    fwd = rows["forward"]
    print(f"model: {fwd['parameters'] / 1e6:.1f} M parameters, batch {args.batch} x {args.seq} tokens, "
          f"{fwd['device']}, {args.threads} threads, median of {args.steps} steps")
    sgd = rows["sgd"]
    print(f"{'method':<20}{'s/step':>9}{'x fwd':>7}{'x SGD':>7}{'peak MiB':>10}{'x fwd':>7}{'x SGD':>7}")
    for method, r in rows.items():
        t, m = r["seconds_per_step"], r["peak_bytes"]
        print(f"{method:<20}{t:>9.4f}{t / fwd['seconds_per_step']:>7.2f}{t / sgd['seconds_per_step']:>7.2f}"
              f"{m / 2**20:>10.1f}{m / fwd['peak_bytes']:>7.2f}{m / sgd['peak_bytes']:>7.2f}")
    zo, dp = rows["dp-zo"], rows["dp-sgd"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    print(f"targets: DP-SGD step <= 2x SGD: {verdict(dp['seconds_per_step'] <= 2 * sgd['seconds_per_step'])}; "
          f"DP-SGD memory <= 1.3x SGD: {verdict(dp['peak_bytes'] <= 1.3 * sgd['peak_bytes'])}; "
          f"DP-ZO memory <= 1.2x forward: {verdict(zo['peak_bytes'] <= 1.2 * fwd['peak_bytes'])}; "
          f"DP-ZO step <= 2.2x forward: {verdict(zo['seconds_per_step'] <= 2.2 * fwd['seconds_per_step'])}")


if __name__ == "__main__":
    main()
