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
import math
import os
import threading
import sys
from concurrent.futures import ThreadPoolExecutor

import torch
import numpy as np

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


def step_key(seed: int, step: int, *more: int) -> int:
    """The key of a step's stream: 64 bits of numpy's SeedSequence of (seed, step[, more])."""

    lo, hi = np.random.SeedSequence([int(seed), int(step), *map(int, more)]).generate_state(2)
    return int(lo) | int(hi) << 32


def attempt_seed(secret: int, start: int, released: int) -> list[int]:
    """What a (re)start's batches and noise are drawn from: (secret, start), and the steps the ledger counted
    before it when that is more than ``start``. So two resumes from one checkpoint (the second after the first
    released steps) never draw the same noise, even under a fixed --secret-seed: a step redone with another
    attempt's noise would release the difference of the two signals."""
    return [int(secret), int(start)] + ([int(released)] if released > start else [])


# --- counter-v1: one kernel a pass --------------------------------------------------------------------
# blocks-v1 costs a generator and several small kernels for every block (2,055 blocks a pass for a 135 M
# model): on a GPU the launches, not the numbers, set DP-ZO's step time (6.9x a forward on an H100). In
# counter-v1 element k of parameter i under key K is a pure function of (K, i, k): the k-th output of
# SplitMix64 (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number generators"; it passes
# BigCrush) started at seed_i = block_seed(K, i, 0). Written as element-wise tensor code, a pass over a
# parameter, or a rank's slice of it, is one fused kernel under torch.compile (Triton on the GPU, C++ on
# the CPU), and the numbers do not depend on how the elements are split between calls, kernels or ranks.
# Integer arithmetic is int64 with wrap-around (torch's and Triton's); a right shift is made logical by
# masking. No library draws a seekable stream into torch tensors, hence here.
# - "signs": element k is +1 when bit 63 of the output is 0, else -1 (exact: the same on every device).
# - "normal": Box-Muller from the output's two 32-bit halves, u1 = (high + 1) / 2^32 in (0, 1] and
#   u2 = low / 2^32: sqrt(-2 ln u1) cos(2 pi u2) in float32, so |z| <= sqrt(64 ln 2) = 6.66, the bound of
#   torch's own CUDA randn (curand's Box-Muller on 32-bit uniforms), which blocks-v1 draws on a GPU. Used for
#   DP-ZO's public z and, on a GPU, DP-SGD's noise (add_normals_). Transcendentals differ by an ulp or so
#   between devices and between compiled and eager code.
COUNTER = "counter-v1"
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def counter_seed(key: int, index: int) -> int:
    """SplitMix64's start for parameter ``index`` under ``key`` (the pattern, 0 <= seed < 2**64)."""
    return block_seed(key, index, 0)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def _counter_bits(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output at ``positions`` (int64) from ``seed`` (an int64 tensor holding the pattern)."""
    x = seed + (positions + 1) * _signed(_GAMMA)
    x = (x ^ _lsr(x, 30)) * _signed(_M1)
    x = (x ^ _lsr(x, 27)) * _signed(_M2)
    return x ^ _lsr(x, 31)


def _counter_values(bits: torch.Tensor, normal: bool) -> torch.Tensor:
    if not normal:
        return 1.0 - 2.0 * (bits < 0).to(torch.float32)
    u1 = (_lsr(bits, 32) + 1).to(torch.float32) * 2.0 ** -32
    u2 = (bits & 0xFFFFFFFF).to(torch.float32) * 2.0 ** -32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)


def counter_values(key: int, index: int, offset: int, length: int, kind: str = "normal", device="cpu") -> torch.Tensor:
    """Elements [offset, offset + length) of parameter ``index``'s counter-v1 stream (float32, eager)."""
    _block(kind)
    positions = torch.arange(offset, offset + length, dtype=torch.int64, device=device)
    seed = _seed_t(_keys(key, (), device)[0], index)
    return _counter_values(_counter_bits(seed, positions), kind == "normal")


def _mix_t(x: torch.Tensor) -> torch.Tensor:
    """``_mix`` on int64 tensors."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _lsr(x, 30)) * _signed(_M1)
    x = (x ^ _lsr(x, 27)) * _signed(_M2)
    return x ^ _lsr(x, 31)


def _seed_t(mixed_key: torch.Tensor, index) -> torch.Tensor:
    """counter_seed on the device: block_seed(key, index, 0) from mixed_key = _mix(key)."""
    return _mix_t(_mix_t(mixed_key ^ index))


# The compiled kernel takes the key and the offset as int64 tensors (views of one [mix(key), offset_0, ...]):
# values loaded at run time, so that a new step or a rank's offset does not recompile, and so that Inductor does
# not fold offset * gamma into an index expression (it overflows int64 there, where the kernel's wrap-around is
# meant). Shapes are dynamic: one compile serves every parameter.
def _add_one(flat: torch.Tensor, mixed_key: torch.Tensor, index: torch.Tensor, offset: torch.Tensor,
             alpha: torch.Tensor, normal: bool) -> None:
    """flat += alpha * z in place, z the elements offset + (0 .. numel - 1) of parameter ``index``'s stream."""
    positions = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) + offset
    z = _counter_values(_counter_bits(_seed_t(mixed_key, index), positions), normal)
    flat.copy_((flat.float() + z * alpha).to(flat.dtype))  # one rounding to a bf16 weight, as add_ does


_compiled = None
_graphs: dict = {}
_seen: set = set()
_EAGER_PIECE = 1 << 20  # eager code's int64 temporaries: 8 MiB a piece, whatever the parameter's size


def compile_mode(device) -> bool:
    """Whether counter-v1 passes on ``device`` run one compiled kernel per tensor (torch.compile): on CUDA by
    default; DPAUDIT_COMPILE_STREAM=1 or 0 forces it on or off (the CPU tests turn it on)."""
    forced = os.environ.get("DPAUDIT_COMPILE_STREAM")
    if forced is not None:
        return forced == "1"
    return torch.device(device).type == "cuda"


def _kernel():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_add_one, dynamic=True, fullgraph=True)
    return _compiled


def _keys(key: int, offsets, device) -> torch.Tensor:
    """[mix(key), 0, 1, ..., n - 1, offsets...] on the device (one copy): the kernels' scalar arguments."""
    n = len(offsets)
    return torch.tensor([_signed(_mix(int(key) & _MASK)), *range(n), *offsets], dtype=torch.int64).to(device)


class _GraphPass:
    """A pass of compiled kernels over fixed tensors, captured once as a CUDA graph: one launch a pass instead
    of a few hundred (a kernel's launch and Python wrapper cost ~10-50 us, the kernel itself ~1 us a million
    elements on an H100). The key, offsets and factor are copied into the graph's own buffers before each replay;
    the tensors are updated where they are (DP-ZO never moves its weights; a pass over other tensors captures
    another graph)."""

    def __init__(self, tensors: list, normal: bool):
        device = tensors[0].device
        n = len(tensors)
        self.keys = torch.zeros(1 + 2 * n, dtype=torch.int64, device=device)
        self.alpha = torch.zeros((), dtype=torch.float32, device=device)
        kernel = _kernel()
        flats = [t.view(-1) for t in tensors]

        def run():
            for i, flat in enumerate(flats):
                kernel(flat, self.keys[0], self.keys[1 + i], self.keys[1 + n + i], self.alpha, normal)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()  # compiles, with alpha = 0: the tensors are unchanged (z is finite)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            run()

    def __call__(self, keys: torch.Tensor, alpha: float) -> None:
        self.keys.copy_(keys)
        self.alpha.fill_(float(alpha))
        self.graph.replay()


def _graph_pass(tensors: list, normal: bool):
    """The captured pass for these tensors (by address, shape and dtype), or None: before the same tensors come a
    second time (DP-SGD's gradients may move between steps: capturing for tensors seen once would cost more than
    it saves), or where capture fails."""
    sig = (normal, tuple((t.data_ptr(), tuple(t.shape), t.dtype, t.device) for t in tensors))
    if sig in _graphs:
        return _graphs[sig]
    if len(_graphs) >= 8 or len(_seen) >= 64:  # a few passes a run (z's kinds, the noise): never one a call
        forget_graphs()
    if sig not in _seen:
        _seen.add(sig)
        return None
    try:
        _graphs[sig] = _GraphPass(tensors, normal)
    except Exception:  # noqa: BLE001 - capture is an optimisation: the same kernels run uncaptured
        _graphs[sig] = None
    return _graphs[sig]


def forget_graphs() -> None:
    """Drop the captured passes (each keeps its tensors alive): for a process that trains one model after another."""
    _graphs.clear()
    _seen.clear()


def _compiled_pass(tensors: list, keys: torch.Tensor, alpha: float, normal: bool) -> None:
    device, n = tensors[0].device, len(tensors)
    if device.type == "cuda" and os.environ.get("DPAUDIT_CUDA_GRAPHS", "1") == "1":
        graph = _graph_pass(tensors, normal)
        if graph is not None:
            return graph(keys, alpha)
    alpha_t = torch.tensor(float(alpha), dtype=torch.float32).to(device)
    kernel = _kernel()
    for i, t in enumerate(tensors):
        try:
            kernel(t.view(-1), keys[0], keys[1 + i], keys[1 + n + i], alpha_t, normal)
        except Exception as exc:  # noqa: BLE001 - tensors before i are done: eager code goes on from i
            raise _Unfinished(i) from exc


class _Unfinished(Exception):
    """The compiled pass stopped at tensor ``done`` (a compile that failed): the tensors before it are updated."""

    def __init__(self, done: int):
        super().__init__(done)
        self.done = done


_compile_failed = False


def _give_up_compiling(exc: Exception) -> None:
    global _compile_failed
    _compile_failed = True

    print(f"dpaudit: note: torch.compile could not build the stream's kernel ({type(exc).__name__}); drawing with "
          "eager code (the same numbers, slower)", file=sys.stderr)


def add_counter_(tensors: list, key: int, alpha: float, kind: str = "normal", offsets=None) -> None:
    """tensors[i] += alpha * z_i for every i at once, z_i the elements [offsets[i], offsets[i] + numel) of
    parameter i's counter-v1 stream of ``kind``. Where ``compile_mode``: one compiled kernel a tensor, on CUDA
    replayed as one captured graph a pass; eager code in pieces of 2**20 elements otherwise (the same numbers)."""
    _block(kind)
    if not tensors:
        return
    device = tensors[0].device
    offsets = tuple(offsets or (0,) * len(tensors))
    n = len(tensors)
    keys = _keys(key, offsets, device)
    normal = kind == "normal"
    with torch.no_grad():
        first = 0
        if compile_mode(device) and not _compile_failed:
            try:
                return _compiled_pass(tensors, keys, alpha, normal)
            except Exception as exc:  # noqa: BLE001 - e.g. no C compiler for Triton's launcher: eager code draws
                first = exc.done if isinstance(exc, _Unfinished) else 0  # the same numbers, from the first tensor
                _give_up_compiling(exc.__cause__ or exc)  # not done (a graph's capture changes nothing: alpha 0)
        for i, t in enumerate(tensors[first:], start=first):
            seed = _seed_t(keys[0], i)
            flat = t.view(-1)
            for a in range(0, flat.numel(), _EAGER_PIECE):
                b = min(a + _EAGER_PIECE, flat.numel())
                positions = torch.arange(offsets[i] + a, offsets[i] + b, dtype=torch.int64, device=device)
                z = _counter_values(_counter_bits(seed, positions), normal)
                piece = flat[a:b]
                piece.copy_((piece.float() + z * alpha).to(flat.dtype))


def counter_square_sum(tensors: list, key: int, offsets=None) -> float:
    """sum of z^2 over the tensors' elements of the normal counter-v1 stream (the sphere's norm; eager code in
    pieces: one extra pass, for the sphere direction only)."""
    offsets = tuple(offsets or (0,) * len(tensors))
    total = 0.0
    with torch.no_grad():
        for i, t in enumerate(tensors):
            for a in range(0, t.numel(), _EAGER_PIECE):
                b = min(a + _EAGER_PIECE, t.numel())
                z = counter_values(key, i, offsets[i] + a, b - a, "normal", t.device)
                total += float(z.double().square().sum())
    return total


def default_stream(device) -> str:
    """The stream a new run draws with on ``device``: counter-v1 on a GPU (one kernel a pass), blocks-v1
    on the CPU, where drawing 32 signs a generator word is cheaper than hashing each element."""
    return COUNTER if torch.device(device).type == "cuda" else STREAM


def add_normals_(tensors: list, key: int, std: float, offsets=None, totals=None) -> None:
    """tensors[i] += std * z_i, z_i standard normal from stream index i (DP-SGD's noise; offsets and totals: a
    rank's slices of the parameters). On a GPU from counter-v1, one captured pass; on the CPU from blocks-v1."""
    if not tensors:
        return
    if tensors[0].device.type == "cuda":
        add_counter_(tensors, key, std, "normal", offsets)
        return
    offsets = offsets or [0] * len(tensors)
    for i, t in enumerate(tensors):
        add_normal_(t, key, i, std, offsets[i], totals[i] if totals else None)


STREAMS = (LEGACY, STREAM, COUNTER)
