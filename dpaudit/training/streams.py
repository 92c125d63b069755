"""Position-addressable Gaussian streams: DP-ZO directions and DP-SGD noise that any slice of a
parameter can draw on its own, so that a sharded run (each rank holding a slice) draws exactly the
numbers a single process draws.

Element k of parameter i under key K is element k mod BLOCK of block j = k // BLOCK, and a block is
``torch.randn(n)`` from a generator seeded with mix(K, i, j), n = BLOCK (the parameter's last block:
what remains). torch's normal sampler fills 16 or more numbers with a vectorised Box-Muller whose
values depend on n (a shorter draw is not a prefix of a longer one), so a block is always drawn whole
and sliced. A slice therefore draws at most two blocks it only partly uses.

The generator is that of the tensor's device (CPU: Mersenne twister; CUDA: Philox), so the stream of
a run is tied to the kind of device that drew it (run_config.json records it). No library offers a
seekable Gaussian stream on torch tensors (torch's CPU generator cannot skip ahead), hence here.
"""

from __future__ import annotations

import torch

BLOCK = 1 << 16
STREAM = "blocks-v1"        # recorded in run_config.json: how z and the noise were drawn
LEGACY = "sequential"       # runs before blocks-v1: one generator over the parameters in order
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def block_seed(key: int, index: int, block: int) -> int:
    return _mix(_mix(_mix(int(key) & _MASK) ^ index) ^ block)


def _blocks(key: int, index: int, offset: int, length: int, total: int, device):
    """(position in the slice, block values for it) covering elements [offset, offset + length)."""
    pos, end = offset, offset + length
    while pos < end:
        j = pos // BLOCK
        first = j * BLOCK
        size = min(BLOCK, total - first)
        gen = torch.Generator(device=device).manual_seed(block_seed(key, index, j))
        values = torch.randn(size, generator=gen, device=device, dtype=torch.float32)
        stop = min(first + size, end)
        yield pos - offset, values[pos - first:stop - first]
        pos = stop


def add_normal_(out: torch.Tensor, key: int, index: int, alpha: float, offset: int = 0,
                total: int | None = None) -> None:
    """out += alpha * z, z the elements [offset, offset + out.numel()) of parameter ``index``'s stream
    (``total`` elements in all: the whole parameter's size; default out's own)."""
    flat = out.view(-1)
    total = flat.numel() if total is None else total
    for at, values in _blocks(key, index, offset, flat.numel(), total, out.device):
        flat[at:at + values.numel()].add_(values.to(out.dtype), alpha=alpha)


def square_sum(key: int, index: int, length: int, offset: int = 0, total: int | None = None,
               device="cpu") -> float:
    """sum of z^2 over elements [offset, offset + length) of parameter ``index``'s stream."""
    total = length if total is None else total
    return sum(float(v.double().square().sum()) for _, v in _blocks(key, index, offset, length, total, device))


def step_key(seed: int, step: int) -> int:
    """The key of a step's stream: 64 bits of numpy's SeedSequence of (seed, step)."""
    import numpy as np

    lo, hi = np.random.SeedSequence([int(seed), int(step)]).generate_state(2)
    return int(lo) | int(hi) << 32
