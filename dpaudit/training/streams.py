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

import os
import threading

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


def _spans(offset: int, length: int, total: int):
    """(block j, its size, first and last+1 element of the slice inside the block) covering elements
    [offset, offset + length) of a parameter of ``total`` elements."""
    pos, end = offset, offset + length
    while pos < end:
        j = pos // BLOCK
        first = j * BLOCK
        size = min(BLOCK, total - first)
        stop = min(first + size, end)
        yield j, size, pos - first, stop - first
        pos = stop


def _draw(key: int, index: int, j: int, size: int, device, out: torch.Tensor | None = None) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(block_seed(key, index, j))
    if out is None:
        return torch.randn(size, generator=gen, device=device, dtype=torch.float32)
    return torch.randn(size, generator=gen, device=device, dtype=torch.float32, out=out[:size])


def _blocks(key: int, index: int, offset: int, length: int, total: int, device):
    """(position in the slice, block values for it) covering elements [offset, offset + length)."""
    for j, size, lo, hi in _spans(offset, length, total):
        yield j * BLOCK + lo - offset, _draw(key, index, j, size, device)[lo:hi]


# Drawing is the cost of a DP-ZO pass on CPU (torch's Mersenne twister: ~5 ns a number, against ~1 ns
# for the add), and the blocks are independent, so a CPU tensor of several blocks is split between
# torch's intra-op threads: each draws its own blocks into its own buffer and adds them to its own
# elements. The numbers and the result are those of one thread. A pool thread works in pieces below
# ATen's intra-op grain size (32,768 elements), so it never opens an OpenMP team of its own: a team per
# pool thread oversubscribes the cores (that made an earlier threaded version slower than this one).
_PIECE = 1 << 14
_pool = None
_local = threading.local()


def _workers(device, blocks: int) -> int:
    return min(torch.get_num_threads(), blocks) if torch.device(device).type == "cpu" else 1


def _add_spans(flat: torch.Tensor, key: int, index: int, alpha: float, offset: int, spans) -> None:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = torch.empty(BLOCK)
    with torch.no_grad():  # grad mode is per thread: a pool thread must not record the in-place add
        for j, size, lo, hi in spans:
            values = _draw(key, index, j, size, flat.device, buf)
            at = j * BLOCK + lo - offset
            for a in range(lo, hi, _PIECE):
                b = min(a + _PIECE, hi)
                flat[at + a - lo:at + b - lo].add_(values[a:b].to(flat.dtype), alpha=alpha)


def add_normal_(out: torch.Tensor, key: int, index: int, alpha: float, offset: int = 0,
                total: int | None = None) -> None:
    """out += alpha * z, z the elements [offset, offset + out.numel()) of parameter ``index``'s stream
    (``total`` elements in all: the whole parameter's size; default out's own)."""
    global _pool
    flat = out.view(-1)
    total = flat.numel() if total is None else total
    spans = list(_spans(offset, flat.numel(), total))
    workers = _workers(flat.device, len(spans))
    if workers <= 1:
        for j, size, lo, hi in spans:
            at = j * BLOCK + lo - offset
            flat[at:at + hi - lo].add_(_draw(key, index, j, size, flat.device)[lo:hi].to(out.dtype), alpha=alpha)
        return
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="dpaudit-draw")
    share = -(-len(spans) // workers)
    parts = [spans[k:k + share] for k in range(0, len(spans), share)]
    futures = [_pool.submit(_add_spans, flat, key, index, alpha, offset, part) for part in parts[1:]]
    _add_spans(flat, key, index, alpha, offset, parts[0])
    for f in futures:
        f.result()


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
