"""DP-SGD (ghost clipping) against SGD, paired in one process: two copies of the same model, one trainer each,
their steps alternating (ABBA), so that both see the same machine at the same moments; prints the median of
each and their ratio (issue 41's goal: <= 1.3x). A quieter reading than benchmarks/trainers.py, whose methods run
in separate processes (their drift between processes is about +-10 % on a shared machine).

    .venv/bin/python benchmarks/dp_sgd_paired.py [--batch 16] [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from trainers import bench_model, shape_arguments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(ap, layers=4, batch=16, steps=10, threads=2)
    args = ap.parse_args()
    import torch

    from dpaudit.training.sgd import FirstOrderTrainer
    from dpaudit.training.trainable import trainable_parameters

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # bench_model builds on the CPU: moved here
    trainers, batch = {}, None
    for kind in ("sgd", "dp-sgd"):
        model, data = bench_model(args)
        model = model.to(device)
        batch = {k: v.to(device) for k, v in data.batch(range(args.batch)).items()}
        batch["attention_mask"][:] = 1
        trainers[kind] = FirstOrderTrainer(model, trainable_parameters(model), lr=1e-4, private=kind == "dp-sgd",
                                           clip=1.0, sigma=1.0, expected_batch_size=args.batch, optimizer="sgd",
                                           per_sample_grads="ghost")
        trainers[kind].step(batch)  # warm-up
    times = {kind: [] for kind in trainers}
    for i in range(args.steps):
        for kind in (("sgd", "dp-sgd") if i % 2 else ("dp-sgd", "sgd")):
            start = time.perf_counter()
            trainers[kind].step(batch)
            if device == "cuda":
                torch.cuda.synchronize()
            times[kind].append(time.perf_counter() - start)
    sgd, dp = (statistics.median(times[k]) for k in ("sgd", "dp-sgd"))
    where = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {args.threads} threads"
    print(f"B = {args.batch}, {where}: SGD {sgd:.4f} s/step, DP-SGD {dp:.4f} s/step, "
          f"DP-SGD / SGD {dp / sgd:.3f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
