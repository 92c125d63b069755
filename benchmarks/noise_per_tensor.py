"""Noise dropped on one tensor of an Opacus MLP (5.7 k weights, p = 1/16, T = 200, sigma for eps = 4): does the
white-box probe see it? Each mode reads the 4,096-value weight without its noise, and the correct run, at m = 200
and 1000 canaries (issue 67 item 1: m = 200 read "consistent with eps = 4" before the per-tensor noise check).

    .venv/bin/python benchmarks/noise_per_tensor.py [--mode hooks ghost]
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import opacus.optimizers.optimizer as plain
import opacus.optimizers.optimizer_fast_gradient_clipping as ghost
import torch
from opacus import PrivacyEngine

from dpaudit import WhiteBoxProbe

N, B, STEPS, SIGMA = 512, 32, 200, 1.2532  # sigma: dpaudit calibrate --eps 4 --p 0.0625 -T 200


def run(mode: str, dropped: int, m: int, seed: int = 0, *, n: int = N, batch: int = B, steps: int = STEPS,
        sigma: float = SIGMA, width: int = 64, lr: float = 0.05):
    """One probed run with the noise of the tensor of ``dropped`` values left out (0: none); (its audit, the probe,
    the model). The MLP is 20 -> width -> width -> 2 on a synthetic task, Opacus' Poisson loader at batch / n."""
    real = plain._generate_noise

    def noise(std, reference, generator=None, secure_mode=False):
        drawn = real(std, reference, generator=generator, secure_mode=secure_mode)
        return drawn * 0 if reference.numel() == dropped else drawn

    plain._generate_noise = ghost._generate_noise = noise
    try:
        torch.manual_seed(seed)
        X = torch.randn(n, 20)
        y = (X[:, 0] > 0).long()
        model = torch.nn.Sequential(torch.nn.Linear(20, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                    torch.nn.ReLU(), torch.nn.Linear(width, 2))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=batch)
        engine, criterion = PrivacyEngine(accountant="prv"), torch.nn.CrossEntropyLoss()
        kw = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), data_loader=loader,
                  noise_multiplier=sigma, max_grad_norm=1.0, grad_sample_mode=mode)
        if mode == "ghost":
            model, optimizer, criterion, loader = engine.make_private(criterion=criterion, **kw)
        else:
            model, optimizer, loader = engine.make_private(**kw)
        probe = WhiteBoxProbe.attach(optimizer, m=m, out=tempfile.mkdtemp(prefix="noise-per-tensor-") + "/probe",
                                     secret_seed=seed, model=model)
        done = 0
        while done < steps:
            for xb, yb in loader:
                optimizer.zero_grad()
                criterion(model(xb), yb).backward()
                optimizer.step()
                done += 1
                if done == steps:
                    break
        return probe.audit(claimed_eps=4.0, delta=1e-5, report=False), probe, model
    finally:
        plain._generate_noise = ghost._generate_noise = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", nargs="+", default=["hooks", "ghost"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for mode in args.mode:
        for dropped in (4096, 0):
            for m in (200, 1000):
                result = run(mode, dropped, m)[0]
                print(f"{mode}, noise dropped on {'the 4,096-value weight' if dropped else 'nothing'}, m = {m}: "
                      f"{result.verdict} (bound {result.epsilon_lower_bound:.3f})", flush=True)


if __name__ == "__main__":
    main()
