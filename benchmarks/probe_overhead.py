"""What the white-box probe adds to an Opacus DP-SGD step (issue 29's cost target: <= 5 %).

Two copies of the same model, made private by Opacus with the same settings, in one process: one with a
WhiteBoxProbe attached, one without. Their steps alternate ABBA on the same batch, so both see the same
machine; the figure is the median probed step over the median unprobed step. The model is the embedded
architecture (Llama-shaped; its RMSNorm weights frozen, as Opacus' hooks do not cover them), at the default
shape or a SmolLM-135M shape; the transcript's size per step is printed beside it (m x 4 bytes).

    .venv/bin/python benchmarks/probe_overhead.py --mode hooks --batch 64            # embedded default
    .venv/bin/python benchmarks/probe_overhead.py --mode ghost --batch 8 --hidden 576 --layers 30 \\
        --heads 9 --kv-heads 3 --intermediate 1536 --vocab 49152 --seq 32               # ~135M parameters
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def private_copy(args, seed: int):
    import torch
    from opacus import PrivacyEngine

    from trainers import bench_model

    torch.manual_seed(seed)
    model, data = bench_model(args)
    if args.mode == "ghost":  # Opacus' ghost clipping refuses tied weights: the output layer gets its own copy
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)
    model.config.use_cache = False
    batch = data.batch(range(args.batch))
    dataset = torch.utils.data.TensorDataset(batch["input_ids"], batch["attention_mask"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    engine = PrivacyEngine(accountant="prv")
    kw = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
              grad_sample_mode=args.mode, poisson_sampling=False)
    criterion = torch.nn.CrossEntropyLoss(reduction="mean")
    if args.mode == "ghost":
        model, optimizer, criterion, loader = engine.make_private(criterion=criterion, **kw)
    else:
        model, optimizer, loader = engine.make_private(**kw)
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def step():
        optimizer.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        if args.mode == "ghost":  # Opacus' criterion takes each sequence's mean over its tokens
            criterion(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), shape=logits.shape).backward()
        else:  # one loss per example (what per-sample clipping needs): the mean over its tokens
            token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            (token.sum(1) / mask[:, 1:].sum(1).clamp(min=1)).mean().backward()
        optimizer.step()

    return optimizer, step, engine


def main() -> None:
    import torch

    from trainers import shape_arguments

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shape_arguments(ap, layers=2, batch=64, steps=9, threads=2)
    ap.add_argument("--mode", default="hooks", choices=("hooks", "functorch", "ew", "ghost"))
    ap.add_argument("--m", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dpaudit import WhiteBoxProbe

    plain_optimizer, plain, _ = private_copy(args, 0)
    probed_optimizer, probed, _ = private_copy(args, 0)
    folder = Path(tempfile.mkdtemp(prefix="probe-bench-"))
    probe = WhiteBoxProbe.attach(probed_optimizer, m=args.m, out=folder / "probe", sample_rate=0.5)
    plain()
    probed()  # warm-up
    times = {"plain": [], "probed": []}
    for i in range(args.steps):
        order = (("plain", plain), ("probed", probed)) if i % 2 else (("probed", probed), ("plain", plain))
        for name, fn in order:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    probe.close()
    size = (folder / "probe" / "whitebox_transcript.f32").stat().st_size
    params = sum(p.numel() for p in probed_optimizer.params)
    ratio = statistics.median(times["probed"]) / statistics.median(times["plain"])
    print(f"mode {args.mode}, {params / 1e6:.1f}M trainable parameters, batch {args.batch} x {args.seq} tokens, "
          f"m = {args.m}, {args.threads} threads")
    print(f"step: unprobed {statistics.median(times['plain']):.3f} s, probed {statistics.median(times['probed']):.3f}"
          f" s (median of {args.steps}, ABBA): probed / unprobed = {ratio:.3f} (target <= 1.05: "
          f"{'met' if ratio <= 1.05 else 'MISSED'})")
    print(f"transcript: {size} bytes for {probe.step} steps = {size // max(1, probe.step)} bytes a step "
          f"(m x 4 = {4 * args.m})")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
