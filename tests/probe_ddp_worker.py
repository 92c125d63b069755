"""Launched by tests/training/test_probe.py under torchrun (gloo, CPU): Opacus DDP (DPDDP + DistributedDPOptimizer)
with a WhiteBoxProbe attached on every rank. argv: out sigma claimed_eps."""

import sys
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
SEED = 0  # the probe's secret_seed (reproducible verdicts)


def main() -> None:
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    from dpaudit import WhiteBoxProbe

    out, sigma, claimed = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 20, generator=g)
    y = (X[:, 0] > 0).long()
    model = DPDDP(torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=64)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                   data_loader=loader, noise_multiplier=sigma, max_grad_norm=1.0)
    probe = WhiteBoxProbe.attach(optimizer, m=200, out=out, secret_seed=SEED)
    steps = 0
    while steps < 40:
        for xb, yb in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            steps += 1
            if steps == 40:
                break
    result = probe.audit(claimed_eps=claimed, delta=1e-5)
    if dist.get_rank() == 0:
        print(f"RESULT {result.violation} {result.epsilon_lower_bound} {probe.step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
