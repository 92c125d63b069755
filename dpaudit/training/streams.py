"""Position-addressable random streams: DP-ZO directions and DP-SGD noise that any slice of a
parameter can draw on its own, so that a sharded run (each rank holding a slice) draws exactly the
numbers a single process draws.

Element k of parameter i under key K is element k mod B of block j = k // B, and a block is drawn
from a generator seeded with mix(K, i, j), n = B numbers (the parameter's last block: what remains).
Two kinds of stream (B = ``BLOCKS[kind]``):
- "normal": ``torch.randn(n)``. torch's normal sampler fills 16 or more numbers with a vectorised
  Box-Muller whose values depend on n (a shorter draw is not a prefix of a longer one), so a block is
  always drawn whole and sliced. A slice therefore draws at most two blocks it only partly uses.
- "signs": +-1 (Rademacher): bit b of 32-bit word w (``torch.randint(0, 2**32, ...)``, ceil(n / 32)
  words) gives element 32 w + b, +1 for a 0 bit. One generator call per 32 numbers instead of one per
  number: a block draws in ~0.33 ns a number (the words, then three integer passes that build the
  floats) against randn's 3.5 (one core). Its blocks are 16x longer, so that torch's per-call overhead
  (~10 us an op) does not dominate.

The generator is that of the tensor's device (CPU: Mersenne twister; CUDA: Philox), so the stream of
a run is tied to the kind of device that drew it (run_config.json records it). No library offers a
seekable Gaussian stream on torch tensors (torch's CPU generator cannot skip ahead), hence here.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

BLOCK = 1 << 16
BLOCKS = {"normal": BLOCK, "signs": 1 << 20}
STREAM = "blocks-v1"        # recorded in run_config.json: how z and the noise were drawn
LEGACY = "sequential"       # runs before blocks-v1: one generator over the parameters in order
_MASK = (1 << 64) - 1
_BITS = 32


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def block_seed(key: int, index: int, block: int) -> int:
    return _mix(_mix(_mix(int(key) & _MASK) ^ index) ^ block)


def _spans(offset: int, length: int, total: int, block: int = BLOCK):
    """(block j, its size, first and last+1 element of the slice inside the block) covering elements
    [offset, offset + length) of a parameter of ``total`` elements."""
    pos, end = offset, offset + length
    while pos < end:
        j = pos // block
        first = j * block
        size = min(block, total - first)
        stop = min(first + size, end)
        yield j, size, pos - first, stop - first
        pos = stop


def _draw(key: int, index: int, j: int, size: int, device, out: torch.Tensor | None = None,
          kind: str = "normal") -> torch.Tensor:
    """Block j of parameter ``index``'s stream of ``kind`` (``out``: a buffer for a normal block)."""
    gen = torch.Generator(device=device).manual_seed(block_seed(key, index, j))
    if kind == "normal":
        out = None if out is None else out[:size]
        return torch.randn(size, generator=gen, device=device, dtype=torch.float32, out=out)
    words = torch.randint(0, 1 << _BITS, (-(-size // _BITS),), generator=gen, device=device, dtype=torch.int64)
    # Element 32 w + b is the float32 whose bits are 1.0's with bit b of word w as its sign bit: 1 - 2 bit.
    # Shifting each bit to bit 31 and setting 1.0's exponent builds the floats in three integer passes
    # (0.20 ms a million, against 0.44 for a byte-indexed table of eight signs; one core).
    signs = words.to(torch.int32).unsqueeze(1) << _sign_shifts(device)
    return signs.bitwise_and_(_SIGN_BIT).bitwise_or_(_ONE_BITS).view(torch.float32).view(-1)[:size]


_SIGN_BIT = -(1 << 31)     # int32 with only bit 31 set
_ONE_BITS = 0x3F800000     # the bits of float32 1.0


@functools.cache
def _sign_shifts(device) -> torch.Tensor:
    """Left shifts that move bit b of a word to bit 31, b = 0..31."""
    return (_BITS - 1 - torch.arange(_BITS, dtype=torch.int32)).to(device)


def _blocks(key: int, index: int, offset: int, length: int, total: int, device, kind: str = "normal"):
    """(position in the slice, block values for it) covering elements [offset, offset + length)."""
    block = _block(kind)
    for j, size, lo, hi in _spans(offset, length, total, block):
        yield j * block + lo - offset, _draw(key, index, j, size, device, kind=kind)[lo:hi]


def _block(kind: str) -> int:
    if kind not in BLOCKS:
        raise ValueError(f"unknown stream kind {kind!r}; use {' or '.join(BLOCKS)}")
    return BLOCKS[kind]


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
    """out += alpha * z, z standard normal: ``add_stream_`` of kind "normal"."""
    add_stream_(out, key, index, alpha, offset, total)


def add_stream_(out: torch.Tensor, key: int, index: int, alpha: float, offset: int = 0,
                total: int | None = None, kind: str = "normal") -> None:
    """out += alpha * z, z the elements [offset, offset + out.numel()) of parameter ``index``'s stream of
    ``kind`` (``total`` elements in all: the whole parameter's size; default out's own)."""
    global _pool
    flat = out.view(-1)
    total = flat.numel() if total is None else total
    if kind != "normal":  # signs: cheap to draw, so each block is drawn and added on torch's own threads
        for at, values in _blocks(key, index, offset, flat.numel(), total, flat.device, kind):
            flat[at:at + values.numel()].add_(values.to(out.dtype), alpha=alpha)
        return
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
