"""torch CPU threads for a training step: dpaudit's default (the cores this process may use, capped by
its CPU quota) against 1, and against more threads than cores (what torch picks on a box whose core
count exceeds the process's share), on a quiet machine and with competing busy processes.

    .venv/bin/python benchmarks/threads.py [--busy 1] [--late] [--threads 1,2,4,8] [--wait-policy active,passive]
Each setting runs in its own subprocess (a DP-SGD step, ghost clipping, 17.1M-parameter model,
B = 8 x 64 tokens, median of 5 steps); ratios are against the default in the same run.
``--late``: the competing processes start after the default is picked (a quiet machine that gets busy
mid-run, which no start-up sample sees). ``--wait-policy``: OpenMP's OMP_WAIT_POLICY for the workers
(the CLI sets passive unless the user set it: a waiting thread sleeps instead of spinning on a core that
another process needs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time


def worker(threads: int) -> float:
    import torch

    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_model, build_tokenizer
    from dpaudit.training.data import tokenize
    from dpaudit.training.sgd import FirstOrderTrainer
    from dpaudit.training.trainable import trainable_parameters

    adaptive = os.environ.get("DPAUDIT_BENCH_ADAPT") == "1"
    if adaptive:  # the CLI's default: picked now, re-picked between steps (dpaudit.core.threads.Governor)
        from dpaudit.core.threads import adapt, set_threads

        set_threads(None)
        torch.set_num_threads(threads)  # start from the parent's pick (with --late, made before the load came)
    else:
        torch.set_num_threads(threads)
    corpus = sentences(500, seed=0)
    tok = build_tokenizer(corpus)
    model = build_model(tok, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8)
    params = trainable_parameters(model)
    batch = tokenize(tok, [" ".join(corpus[i:i + 6]) for i in range(8)], 64).batch(range(8))
    trainer = FirstOrderTrainer(model, params, lr=1e-4, private=True, clip=1.0, sigma=1.0, expected_batch_size=8)
    trainer.step(batch)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        trainer.step(batch)
        times.append(time.perf_counter() - start)
        if adaptive:
            adapt()
    return statistics.median(times)


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes competing for the cores")
    ap.add_argument("--late", action="store_true", help="start the busy processes after the default is picked")
    ap.add_argument("--wait-policy", default="passive", help="OMP_WAIT_POLICY values to compare (comma-separated)")
    ap.add_argument("--worker", type=int)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    from dpaudit.core.threads import default_threads

    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    if args.late:
        default = default_threads()  # picked on the quiet machine; the load arrives afterwards
    for p in spinners:
        p.start()
    try:
        time.sleep(0.5)
        if not args.late:
            default = default_threads()  # what dpaudit would pick now, with the competing load running
        counts = sorted({default, *(int(t) for t in args.threads.split(","))})
        policies = [w.strip().upper() for w in args.wait_policy.split(",")]
        seconds = {}
        for policy in policies:
            for n in [*counts, "adaptive"]:
                out = subprocess.run([sys.executable, __file__, "--worker", str(default if n == "adaptive" else n)],
                                     capture_output=True, text=True, check=True,
                                     env={**os.environ, "OMP_WAIT_POLICY": policy,
                                          "DPAUDIT_BENCH_ADAPT": "1" if n == "adaptive" else "0"})
                seconds[policy, n] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for p in spinners:
            p.terminate()
    base = seconds[policies[-1], default]
    print(f"DP-SGD step (ghost), 17.1M parameters, B = 8 x 64 tokens; {args.busy} busy processes"
          f"{' (started after the default was picked)' if args.late else ''}; default threads: {default}")
    print(f"{'wait policy':>12}{'threads':>9}{'s/step':>10}{'x default':>11}")
    for (policy, n), s in seconds.items():
        mark = "  (default)" if n == default and policy == policies[-1] else ""
        print(f"{policy.lower():>12}{n!s:>9}{s:>10.3f}{s / base:>11.2f}{mark}")


if __name__ == "__main__":
    main()
