"""torch backend of the Monte-Carlo accountant: the same exact composed-loss draws as
``montecarlo.composed_losses`` (sharing its step formulas), on a GPU when one is present.
torch is imported only when this backend runs: importing the accounting core never imports torch."""

from __future__ import annotations

import numpy as np

from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.mc_losses import laplace_inside, laplace_regions, log_mix as _log_mix


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def composed_losses_torch(mech: Mechanism, direction: str, rows: int, stream: tuple[int, int, int],
                          block_elements: int = 1 << 24) -> np.ndarray:
    """``rows`` composed privacy losses for ``direction``; ``stream`` seeds a dedicated generator."""
    import torch

    device = _device()
    gen = torch.Generator(device=device).manual_seed(
        int(np.random.SeedSequence(stream[0], spawn_key=stream[1:]).generate_state(1)[0]))
    p, steps = mech.sampling_rate, mech.steps
    dt = torch.float64
    if mech.kind == "gaussian":
        s = mech.sigma
        total = torch.zeros(rows, dtype=dt, device=device)
        block = max(1, block_elements // rows)
        for start in range(0, steps, block):
            cols = min(block, steps - start)
            x = torch.randn((rows, cols), generator=gen, dtype=dt, device=device) * s
            if direction == "remove":
                x += (torch.rand((rows, cols), generator=gen, dtype=dt, device=device) < p).to(dt) if p < 1 else 1.0
            loss = _log_mix(p, (2 * x - 1) / (2 * s * s), torch).sum(dim=1)
            total += loss if direction == "remove" else -loss
        return total.cpu().numpy()
    b = mech.sigma
    low, mid, _ = laplace_regions(mech, direction)
    # The three-way multinomial of montecarlo._laplace_composed as two binomials.
    n = torch.full((rows,), float(steps), dtype=dt, device=device)
    n_low = torch.binomial(n, torch.full_like(n, low), generator=gen)
    n_mid = torch.binomial(n - n_low, torch.full_like(n, min(1.0, mid / (1 - low))), generator=gen)
    n_high = n - n_low - n_mid
    count = int(n_mid.sum().item())
    u = torch.rand(count, generator=gen, dtype=dt, device=device)
    mirror = torch.rand(count, generator=gen, dtype=dt, device=device) if direction == "remove" and p < 1 else None
    x = laplace_inside(u, mirror, mech, direction, torch)
    owner = torch.repeat_interleave(torch.arange(rows, device=device), n_mid.long())
    mid_loss = torch.zeros(rows, dtype=dt, device=device).index_add_(0, owner, _log_mix(p, (2 * x - 1) / b, torch))
    ends = _log_mix(p, torch.tensor([-1 / b, 1 / b], dtype=dt, device=device), torch)
    loss = n_low * ends[0] + n_high * ends[1] + mid_loss
    return (loss if direction == "remove" else -loss).cpu().numpy()
