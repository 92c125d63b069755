"""A user's Opacus training script (make_private, --mode hooks or ghost) on the embedded model, audited
with WhiteBoxProbe.attach (--probe optimizer) or with PipelineProbe canaries in its data (--probe pipeline);
--bug plants one of common.BUGS. Prints one JSON line."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import B, DELTA, N, arguments, clock, data_and_model, noise_multiplier, report  # noqa: E402


def main() -> None:
    import torch
    from opacus import PrivacyEngine

    from dpaudit import SamplerAudit, WhiteBoxProbe

    warnings.filterwarnings("ignore")
    args = arguments(__doc__)
    torch.set_num_threads(args.threads)
    began = clock()
    pipeline = dict(m=args.m, out=args.out, secret_seed=args.seed, budget=args.budget) if args.probe == "pipeline" else None
    model, ids, mask, pipe = data_and_model(args.seed, untie=args.mode == "ghost", pipeline=pipeline)
    n = len(ids)  # the pipeline probe's members are examples too
    sigma, told_rate, _ = noise_multiplier(args.bug, args.eps, args.steps, n)
    C = 1.0
    noise, clip = sigma, C
    if args.bug == "sigma-over-batch":
        noise = sigma / B
    if args.bug == "no-clipping":  # clipping "off" (a huge norm), the noise kept at what C = 1 needs
        clip, noise = 1e6, sigma / 1e6
    dp_params = [p for n, p in model.named_parameters() if p.requires_grad
                 and not (args.bug == "lora-group-left-out" and ".mlp." in n)]
    left_out = [p for n, p in model.named_parameters() if p.requires_grad and ".mlp." in n] \
        if args.bug == "lora-group-left-out" else []
    optimizer = torch.optim.SGD(dp_params, lr=0.05)
    plain = torch.optim.SGD(left_out, lr=0.05) if left_out else None
    dataset = torch.utils.data.TensorDataset(ids, mask)
    shuffled = args.bug == "shuffle-as-poisson"
    loader = torch.utils.data.DataLoader(dataset, batch_size=B, shuffle=shuffled)
    engine = PrivacyEngine(accountant="prv")
    kw = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise, max_grad_norm=clip,
              grad_sample_mode=args.mode, poisson_sampling=not shuffled)
    criterion = torch.nn.CrossEntropyLoss(reduction="mean")
    if args.mode == "ghost":
        model, optimizer, criterion, loader = engine.make_private(criterion=criterion, **kw)
    else:
        model, optimizer, loader = engine.make_private(**kw)
    if args.bug == "noise-other-clip":  # noise drawn for C / 10 while the clipping uses C
        add_noise = optimizer.add_noise

        def add_noise_for_another_clip():
            optimizer.max_grad_norm = C / 10
            try:
                add_noise()
            finally:
                optimizer.max_grad_norm = C

        optimizer.add_noise = add_noise_for_another_clip
    if args.bug == "floor-normalisation":  # opacus#819: the mean taken over a floor-based expected batch
        optimizer.expected_batch_size = math.floor(N * (B / N) - 0.5)
    probe = pipe or WhiteBoxProbe.attach(optimizer, m=args.m, out=args.out, sample_rate=B / n, model=model)
    if args.watch and pipe is None:
        probe.watch(claimed_eps=args.eps, delta=DELTA, on_violation="warn", planned_steps=args.steps)
    aux = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05) \
        if args.bug == "aux-step" else None
    uses = 4 if args.bug == "batch-reused-4x" else 1  # optimizer steps per drawn batch

    def loss_of(x, keep):
        logits = model(input_ids=x).logits[:, :-1]
        target = x[:, 1:].masked_fill(keep[:, 1:] == 0, -100)
        if args.mode == "ghost":  # Opacus' criterion takes each sequence's mean over its tokens
            return criterion(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), shape=logits.shape)
        token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        return (token.sum(1) / keep[:, 1:].sum(1).clamp(min=1)).mean()

    batches, step = [], 0
    while step < args.steps:
        sampler = loader.batch_sampler
        for idx in sampler:
            if step >= args.steps:
                break
            idx = list(idx)
            batches.append(idx)
            x, keep = ids[idx], mask[idx]
            for _ in range(min(uses, args.steps - step)):
                optimizer.zero_grad()
                if plain is not None:
                    plain.zero_grad()
                loss_of(x, keep).backward()
                optimizer.step()
                if plain is not None:
                    plain.step()
                    for p in left_out:  # Opacus' hooks record per-sample gradients for them too; the user clears
                        p.grad_sample = None  # them (else the next backward refuses to accumulate)
                if aux is not None and len(idx):  # the side step: plain gradients of the same batch
                    optimizer.zero_grad()
                    aux.zero_grad()
                    loss_of(x, keep).backward()
                    aux.step()
                    optimizer.zero_grad()  # and the per-sample gradients Opacus' hooks recorded of it
                if pipe is not None:
                    pipe.observe(step, batch=x if args.batches else None)
                step += 1
    result = probe.audit(claimed_eps=args.eps, delta=DELTA, report=False,
                         **({"sample_rate": told_rate} if pipe is not None else {}))  # the rate accounted
    sampler = SamplerAudit(batches, steps=len(batches), dataset_size=n, sample_rate=B / n).run()
    report(args, f"opacus-{args.mode}", result, clock() - began,
           {"sigma": sigma, "sampler": sampler.looks_like, "sampler_ok": sampler.poisson_accounting_valid,
            **({"refreshed": pipe.refreshed, "probe_s": round(pipe.probe_seconds, 1)} if pipe else {})})


if __name__ == "__main__":
    main()
