"""Launched by tests/training/test_distributed.py under torchrun: one short training run, same seeds on every rank.
argv: model run method [options: shard, sphere, bf16, micro, save, resume, bandmf, blt, stop=K (exit at step K)]."""

import dataclasses
import os
import sys
from pathlib import Path

from dpaudit.training.distributed import exit_process
from dpaudit.training.runner import TrainConfig, train

TEXTS = [f"Carol number {i} sells {'maps' if i % 2 else 'tea'} in Oslo." for i in range(40)]


def stop_after(steps: int) -> None:
    """Every rank exits as the step after ``steps`` begins, as a killed run would (batches are drawn once a step)."""
    import dpaudit.training.batches as sampling

    draw, calls = sampling.poisson_batch, []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) > steps:
            raise SystemExit(3)
        return draw(*args, **kwargs)

    sampling.poisson_batch = counted

    def counted_draws(source):
        def made(*a, **k):
            draw = source(*a, **k)

            def step(t):
                calls.append(1)
                if len(calls) > steps:
                    raise SystemExit(3)
                return draw(t)

            return step

        return made

    cyclic = sampling.cyclic_source   # correlated runs: BandMF draws cyclic Poisson batches, fixed-order BLT its order
    sampling.cyclic_source = lambda *args, **kwargs: counted_draws(cyclic(*args, **kwargs))
    fixed = sampling.SOURCES["shuffle"]   # the trainers draw it as one fixed order (batches.BatchSource)
    sampling.SOURCES["shuffle"] = dataclasses.replace(fixed, draw=counted_draws(fixed.draw))


if __name__ == "__main__":
    model, run, method, *options = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]
    stop = next((int(o[5:]) for o in options if o.startswith("stop=")), 0)
    if stop:
        stop_after(stop)
    lr = 1e-3 if method == "dp-zo" else 1e-2
    cfg = TrainConfig(method=method, target_epsilon=4.0, steps=6, batch_size=12, lr=lr, secret_seed=11,
                      shard="shard" in options, direction="sphere" if "sphere" in options else "rademacher",
                      bf16="bf16" in options, micro_batch=3 if "micro" in options else 0,
                      save_every=2 if "save" in options else 0, allow_overspend="resume" in options,
                      white_box=64 if "whitebox" in options else 0,
                      noise="bandmf,b=2" if "bandmf" in options else "blt,buffers=2,order=fixed" if "blt" in options
                      else None, sampling="shuffle" if "blt" in options else "poisson")
    try:
        train(model, TEXTS, run, cfg, resume="resume" in options, show_progress=False)
    except SystemExit as stopped:  # stop=K: the killed run's exit status
        exit_process(stopped.code)
    print(f"rank {os.environ.get('RANK')} finished", file=sys.stderr)  # a failure after this line is at exit
    exit_process(0)  # as the CLI ends a torchrun rank: without the interpreter's finalization (exit_process)
