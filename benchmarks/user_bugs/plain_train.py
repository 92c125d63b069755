"""A user's own DP-SGD loop in plain PyTorch (torch.func per-example gradients), audited with the
framework-free WhiteBoxProbe (its canaries as per-example rows, clipped by the loop's own clipping);
--bug plants one of common.BUGS. Prints one JSON line."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import B, DELTA, N, arguments, clock, data_and_model, noise_multiplier, report  # noqa: E402


def main() -> None:
    import numpy as np
    import torch
    from torch.func import functional_call, grad, vmap

    from dpaudit import SamplerAudit, WhiteBoxProbe

    args = arguments(__doc__)
    torch.set_num_threads(args.threads)
    began = clock()
    model, ids, mask, _ = data_and_model(args.seed)
    C, p = 1.0, B / N
    sigma, _, _ = noise_multiplier(args.bug, args.eps, args.steps)
    trainable = {k: v for k, v in model.named_parameters() if v.requires_grad}
    left_out = {k for k in trainable if ".mlp." in k} if args.bug == "lora-group-left-out" else set()
    dp = {k: v for k, v in trainable.items() if k not in left_out}
    frozen = {k: v.detach() for k, v in model.named_parameters() if k not in dp}
    probe = WhiteBoxProbe(list(dp.values()), m=args.m, clip=C, sample_rate=p, out=args.out, model=model)
    if args.watch:
        probe.watch(claimed_eps=args.eps, delta=DELTA, on_violation="warn", planned_steps=args.steps)

    def loss_one(params, x, keep):
        logits = functional_call(model, {**params, **frozen}, (x[None],)).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits, x[1:].masked_fill(keep[1:] == 0, -100))

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
    rng = np.random.default_rng(args.seed + 1000)  # the user's own sampling and noise
    gen = torch.Generator().manual_seed(args.seed + 2000)
    batches, order = [], []
    for step in range(args.steps):
        if args.bug == "shuffle-as-poisson":  # fixed-size batches from a fresh permutation each epoch
            if len(order) < B:
                order = list(rng.permutation(N))
            idx, order = np.array(order[:B]), order[B:]
        else:
            idx = np.flatnonzero(rng.random(N) < p)
        batches.append(idx.tolist())
        x, keep = ids[idx], mask[idx]
        canaries = probe.canary_examples(step)  # per-example rows that our own clipping acts on
        g = per_example({k: v.detach() for k, v in dp.items()}, x, keep) if len(idx) else \
            {k: torch.zeros((0, *v.shape)) for k, v in dp.items()}
        g = {k: torch.cat([t, c]) for (k, t), c in zip(g.items(), canaries)}
        rows = len(idx) + len(canaries[0])
        norms = torch.sqrt(sum((t.reshape(rows, -1) ** 2).sum(1) for t in g.values()))
        factor = torch.ones_like(norms) if args.bug == "no-clipping" else (C / (norms + 1e-6)).clamp(max=1.0)
        summed = {k: torch.einsum("i,i...", factor, t) for k, t in g.items()}
        if args.bug == "batch-sum-clipping":  # the sum of the raw rows, clipped as one vector
            summed = {k: t.sum(0) for k, t in g.items()}
            total = torch.sqrt(sum((t ** 2).sum() for t in summed.values()))
            summed = {k: t * min(1.0, C / (float(total) + 1e-6)) for k, t in summed.items()}
        std = sigma * C / (B if args.bug == "sigma-over-batch" else 1) / (10 if args.bug == "noise-other-clip" else 1)
        released = {k: s + std * torch.randn(s.shape, generator=gen) for k, s in summed.items()}
        expected = math.floor(N * p - 0.5) if args.bug == "floor-normalisation" else N * p
        probe.observe(step, [r / expected for r in released.values()], scale=N * p)  # the user's belief
        with torch.no_grad():
            for k, r in released.items():
                dp[k] -= 0.05 * r / expected
        if left_out and len(idx):  # the left-out group: plain mean gradients, no clipping, no noise
            model.zero_grad()
            out = model(input_ids=x).logits[:, :-1]
            torch.nn.functional.cross_entropy(out.transpose(1, 2), x[:, 1:].masked_fill(keep[:, 1:] == 0, -100)).backward()
            with torch.no_grad():
                for k in left_out:
                    trainable[k] -= 0.05 * trainable[k].grad
    result = probe.audit(claimed_eps=args.eps, delta=DELTA, report=False)
    sampler = SamplerAudit(batches, steps=len(batches), dataset_size=N, sample_rate=p).run()
    report(args, "plain", result, clock() - began, {"sigma": sigma, "sampler": sampler.looks_like,
                                                     "sampler_ok": sampler.poisson_accounting_valid})


if __name__ == "__main__":
    main()
