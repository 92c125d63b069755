"""Every GPU figure of docs/performance.md in one run (issue 54): the DP-ZO stream's check and cost, the trainers'
table at the SmolLM-135M shape (every row in one process on a GPU; DP-BiTFiT against BiTFiT), DP-SGD against SGD paired in one process, the Hugging Face Trainer rows, and the
main job. Each part runs in its own process under its own time limit and writes its log to --out; the summary
prints as the parts end. Made for the few minutes a GPU is lent (about 5 on one H100); runs on CPU too (slowly:
pass --quick there).

    python3 benchmarks/gpu.py --out /tmp/gpu-run [--quick] [--parts stream,trainers,paired,hf,main]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOL = ["--hidden", "576", "--layers", "30", "--heads", "9", "--kv-heads", "3", "--intermediate", "1536",
        "--vocab", "49152"]
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--vocab", "512"]


def stream_check(shape: list[str]) -> None:
    """counter-v1 on this device: compiled passes draw the CPU's eager signs exactly and its normals within
    rounding; one pass over the weights of the benchmark model timed for blocks-v1 and counter-v1 (the same
    tensors as trainers.py's, so that its processes find these kernels in the compile cache)."""
    import torch

    from dpaudit.training import streams
    from dpaudit.training.trainable import trainable_parameters
    from trainers import bench_model, shape_arguments

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    os.environ["DPAUDIT_COMPILE_STREAM"] = "1"
    ap = argparse.ArgumentParser()
    shape_arguments(ap, layers=4, batch=1, steps=1, threads=1)
    model, _ = bench_model(ap.parse_args(shape + ["--batch", "1"]))
    params = trainable_parameters(model.to(device))
    sizes = [p.numel() for p in params]
    picked = [1, 2, len(params) - 1]
    for kind, exact in (("signs", True), ("normal", False)):
        with torch.no_grad():
            for p in params:
                p.zero_()
            start = time.perf_counter()
            streams.add_counter_(params, 77, 0.5, kind)  # compiled: every weight becomes z / 2 exactly
            float(params[-1].sum())
            compiled = time.perf_counter() - start
        diff = max(float((0.5 * streams.counter_values(77, i, 0, sizes[i], kind) - params[i].detach().view(-1).cpu()).abs().max())
                   for i in picked)
        print(f"stream check {kind}: {device} compiled vs cpu eager on tensors {picked}, max |diff| {diff:.3g}"
              f" ({'must be 0' if exact else 'rounding'}): {'ok' if (diff == 0 if exact else diff < 1e-5) else 'FAILED'}"
              f"; first call (compiling) {compiled:.1f} s", flush=True)

    def timed(fn, reps=5):
        with torch.no_grad():
            return _timed(fn, reps)

    def _timed(fn, reps):
        fn()
        fn()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps

    rows = {}
    for kind in ("signs", "normal"):
        def blocks():
            for i, p in enumerate(params):
                streams.add_stream_(p, 5, i, 1e-3, kind=kind)
        rows[kind] = (timed(blocks, 2), timed(lambda: streams.add_counter_(params, 5, 1e-3, kind)))
    total = sum(sizes)
    print(f"one pass over {total / 1e6:.1f} M weights in {len(sizes)} tensors on {device}:")
    for kind, (b, c) in rows.items():
        print(f"  {kind:<7} blocks-v1 {b * 1e3:8.2f} ms   counter-v1 {c * 1e3:8.2f} ms   ({b / c:.1f}x faster)")


def main_job(out: Path) -> None:
    """The README's main job on this device, three ways, each timed whole (its first run builds the embedded model)."""
    runs = Path(tempfile.mkdtemp(prefix="dpaudit-gpu-"))  # the runs' folders (models): not among the logs
    for name, extra in (("dp-sgd --eps 1", []), ("dp-sgd --white-box --eps 4", ["--white-box"]), ("dp-zo --eps 1", [])):
        method, eps = name.split()[0], name.split()[-1]
        start = time.perf_counter()
        with open(out / f"main-{method}-{eps}{'-wb' if extra else ''}.log", "w") as log:
            rc = subprocess.run([sys.executable, "-m", "dpaudit.cli.main", "audit", "run", "--method", method, "--eps",
                                 eps, *extra, "--out", str(runs / name.replace(" ", "_"))], stdout=log,
                                stderr=subprocess.STDOUT).returncode
        print(f"audit run --method {name}: exit {rc}, {time.perf_counter() - start:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test of the script)")
    ap.add_argument("--parts", default="stream,trainers,hf,paired,main")  # in order of need: the last may not fit
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part == "stream":
        stream_check(TINY if args.quick else SMOL)
        return
    if args.part == "main":
        main_job(Path(args.out))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    shape = TINY if args.quick else SMOL
    batch = ["--batch", "4", "--seq", "32", "--steps", "3"] if args.quick else ["--batch", "32", "--seq", "256",
                                                                                 "--steps", "9"]
    threads = ["--threads", str(min(16, os.cpu_count() or 2))]
    parts = {
        "stream": ([py, __file__, "--out", str(out), "--part", "stream"] + (["--quick"] if args.quick else []), 180),
        "trainers": ([py, str(HERE / "trainers.py"), *shape, *batch, *threads, "--methods",
                      "dp-zo,dp-zo-gaussian,dp-sgd,dp-sgd-materialise,noise,dp-bitfit,bitfit"], 240),
        "paired": ([py, str(HERE / "dp_sgd_paired.py"), *shape, *batch, *threads], 60),
        "hf": ([py, str(HERE / "hf_trainer_cost.py"), *threads]
               + (["--hidden", "64", "--layers", "2", "--steps", "10", "--m", "100"] if args.quick else []), 120),
        "main": ([py, __file__, "--out", str(out), "--part", "main"], 180),
    }
    # one compile cache for every part: the stream check's kernels serve trainers.py's DP-ZO processes
    env = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir()) / "dpaudit-inductor"), **os.environ,
           "PYTHONUNBUFFERED": "1"}
    for name in args.parts.split(","):
        command, limit = parts[name]
        start = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit, env=env,
                                    cwd=HERE).returncode
            except subprocess.TimeoutExpired:
                rc = "timed out"
        text = (out / f"{name}.log").read_text(errors="replace").splitlines()
        keep = [line for line in text if not line.startswith(("WARNING", "W1", "I1", "{'", "dpaudit: warning"))]
        print(f"== {name}: {rc}, {time.perf_counter() - start:.0f} s", flush=True)
        print("\n".join(keep[-30:]), flush=True)


if __name__ == "__main__":
    main()
