"""DP-ZeRO (--shard, FSDP2) against plain data parallelism (DDP: every rank holds the whole model), per rank.

Each (mode, method) runs as its own torchrun launch of W ranks (gloo on CPU, NCCL on GPUs), with the same
model, the same B examples a step (B / W per rank) and the same seeds. Per rank it reports:
- "state": the bytes of the tensors a rank keeps between steps, counted tensor by tensor: its weights
  (a shard, or the whole model), their gradients and the optimizer's state (AdamW: two moments);
- step peak: torch.cuda.max_memory_allocated during the steps on GPU; on CPU the high-water mark of the
  resident set during the steps (reset once the model is built and sharded) minus the resident set
  before the model was built, measured in a second launch under MALLOC_MMAP_THRESHOLD_=131072 so that
  freed buffers go back to the system (what is alive, as on GPU: weights, gathered layers, activations);
- load peak: the same high-water mark while the model is built and sharded (each rank builds the whole
  model on the host before keeping its shards);
- the median step time (first launch).
Ratios are sharded / DDP from the same run. Targets (issue 16): state per rank <= 1.1 / W of DDP's,
step time <= 1.2x DDP.

    .venv/bin/python benchmarks/sharded.py [--procs 2 --hidden 512 --layers 4 --batch 16 --steps 4]
    # SmolLM-135M shape: --hidden 576 --layers 30 --heads 9 --kv-heads 3 --intermediate 1536 --vocab 49152 --batch 8
CPU ranks get one thread each (--threads); on a shared 2-core machine compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainers import SHAPE_FLAGS, shape_arguments  # noqa: E402  (the benchmark next to this one)

MODES = ("ddp", "shard")
METHODS = ("dp-sgd", "dp-zo")


def state_bytes(params, optimizer) -> int:
    """Bytes of this rank's weights, gradients and optimizer state (local shards when sharded)."""
    from dpaudit.training.shard import local_slices

    def size(t):
        return t.numel() * t.element_size()

    total = sum(size(local) for local, _, _ in local_slices(params))
    total += sum(size(local) for local, _, _ in local_slices([p.grad for p in params if p.grad is not None]))
    if optimizer is not None:
        for state in optimizer.state.values():
            values = [v for v in state.values() if hasattr(v, "numel") and v.dim() > 0]
            total += sum(size(local) for local, _, _ in local_slices(values))
    return total


def high_water_bytes(reset: bool = False) -> int:
    """The resident set's high-water mark (VmHWM); ``reset``: start it again from the current size."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def worker(mode: str, method: str, args) -> dict:
    import numpy as np
    import torch

    from dpaudit.training.distributed import setup_world
    from dpaudit.training.sgd import FirstOrderTrainer
    from dpaudit.training.shard import Sharding, shard_model
    from dpaudit.training.trainable import trainable_parameters
    from dpaudit.training.zo import ZOSettings, zo_step

    from trainers import bench_model, rss_bytes

    import torch.distributed.checkpoint.state_dict  # noqa: F401  (both modes pay for FSDP's code before
    import torch.distributed.fsdp  # noqa: F401                     the baseline, so it is not counted)

    torch.set_num_threads(args.threads)
    world = setup_world()
    before_model = rss_bytes()
    model, data = bench_model(args)  # the same weights on every rank (seeded)
    if mode != "shard":
        model = model.to(world.device)
    parameters = sum(p.numel() for p in model.parameters())
    sharding = None
    if mode == "shard":
        shard_model(model, world.device, world.size, False, method == "dp-zo")
        sharding = Sharding(world.size, world.sum)
    params = trainable_parameters(model)
    mine = world.shard(np.arange(args.batch))
    batch = {k: v.to(world.device) for k, v in data.batch(mine).items()}
    batch["attention_mask"][:] = 1
    rng = np.random.default_rng(0)
    gpu = world.device.startswith("cuda")
    load_peak = torch.cuda.max_memory_allocated() if gpu else high_water_bytes() - before_model
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    else:
        high_water_bytes(reset=True)
    optimizer = None
    if method == "dp-zo":
        settings = ZOSettings(lr=1e-6, clip=0.05, noise="gaussian", sigma=1.0)

        def step(k):
            zo_step(model, params, batch, seed=k, settings=settings, denominator=args.batch, rng=rng,
                    all_sum=world.sum, shard_sum=sharding.sum if sharding else None,
                    passes=sharding.passes(args.batch, 0) if sharding else 0)
    else:
        trainer = FirstOrderTrainer(model, params, lr=1e-4, private=True, clip=1.0, sigma=1.0,
                                    expected_batch_size=args.batch, optimizer="adamw", world_size=world.size,
                                    sharding=sharding)
        optimizer = trainer.base_optimizer

        def step(k):
            trainer.run_step(k, batch, args.batch, np.arange(0))
    step(0)  # warm-up (allocations, optimizer state)
    times = []
    for k in range(args.steps):
        world.barrier()
        if world.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(k + 1)
        if world.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if gpu else high_water_bytes() - before_model
    return {"mode": mode, "method": method, "rank": world.rank, "world": world.size, "device": world.device,
            "parameters": parameters, "state_bytes": state_bytes(params, optimizer), "peak_bytes": peak, "load_bytes": load_peak,
            "seconds_per_step": statistics.median(times)}


def launch(args, mode, method, tmp, options, env) -> list[dict]:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.procs}",
                    __file__, "--worker", mode, method, tmp, *options], check=True, env=env, capture_output=True,
                   text=True)
    return [json.loads(Path(tmp, f"{mode}-{method}-{r}.json").read_text()) for r in range(args.procs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=2)
    shape_arguments(ap, layers=4, batch=16, steps=4, threads=1)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "METHOD", "OUT"))
    args = ap.parse_args()
    if args.worker:
        mode, method, out = args.worker
        row = worker(mode, method, args)
        Path(out, f"{mode}-{method}-{row['rank']}.json").write_text(json.dumps(row))
        return
    common = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SHAPE_FLAGS]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in [m for m in METHODS if m in args.methods.split(",")]:
            for mode in MODES:
                ranks = launch(args, mode, method, tmp, [*common, f"--steps={args.steps}"], env)
                if not ranks[0]["device"].startswith("cuda"):  # memory from a launch that frees what it frees
                    live = launch(args, mode, method, tmp, [*common, "--steps=1"],
                                  {**env, "MALLOC_MMAP_THRESHOLD_": "131072"})
                    for r, m in zip(ranks, live):
                        r.update(peak_bytes=m["peak_bytes"], load_bytes=m["load_bytes"])
                rows[method, mode] = ranks
    first = next(iter(rows.values()))[0]
    print(f"model: {first['parameters'] / 1e6:.1f} M parameters, {args.procs} ranks ({first['device']}), "
          f"batch {args.batch} x {args.seq} tokens ({args.batch // args.procs} a rank), "
          f"median of {args.steps} steps; per rank: the largest over ranks")
    print(f"{'method':<8}{'mode':<7}{'state MiB':>11}{'x DDP':>7}{'x W':>6}{'step MiB':>10}{'x DDP':>7}"
          f"{'load MiB':>10}{'s/step':>9}{'x DDP':>7}")
    verdicts = []
    for method in METHODS:
        if (method, "ddp") not in rows:
            continue
        keys = ("state_bytes", "peak_bytes", "load_bytes", "seconds_per_step")
        base = {k: max(r[k] for r in rows[method, "ddp"]) for k in keys}
        for mode in MODES:
            r = {k: max(x[k] for x in rows[method, mode]) for k in base}
            ratio = {k: r[k] / base[k] for k in base}
            print(f"{method:<8}{mode:<7}{r['state_bytes'] / 2**20:>11.1f}{ratio['state_bytes']:>7.3f}"
                  f"{ratio['state_bytes'] * args.procs:>6.2f}{r['peak_bytes'] / 2**20:>10.1f}{ratio['peak_bytes']:>7.2f}"
                  f"{r['load_bytes'] / 2**20:>10.1f}{r['seconds_per_step']:>9.3f}{ratio['seconds_per_step']:>7.2f}")
            if mode == "shard":
                verdicts.append((f"{method}: state per rank <= 1.1/W of DDP's", ratio["state_bytes"] * args.procs <= 1.1))
                verdicts.append((f"{method}: step <= 1.2x DDP", ratio["seconds_per_step"] <= 1.2))
    for what, ok in verdicts:
        print(f"target: {what}: {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
