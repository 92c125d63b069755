"""Position-addressable Gaussian streams: any slice draws exactly the numbers of the whole, so a sharded
run perturbs and adds noise as one process does."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpaudit.training import streams
from dpaudit.training.streams import BLOCK, add_normal_, block_seed, square_sum, step_key


def whole(key, index, total):
    out = torch.zeros(total)
    add_normal_(out, key, index, 1.0)
    return out


@settings(max_examples=25, deadline=None)
@given(total=st.integers(1, 3 * BLOCK + 17), cuts=st.lists(st.floats(0, 1), min_size=1, max_size=4),
       key=st.integers(0, 2**64 - 1), index=st.integers(0, 500))
def test_any_split_into_slices_draws_the_whole_stream(total, cuts, key, index):
    reference = whole(key, index, total)
    bounds = sorted({0, total, *(int(c * total) for c in cuts)})
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        piece = torch.zeros(hi - lo)
        add_normal_(piece, key, index, 1.0, offset=lo, total=total)
        pieces.append(piece)
    assert torch.equal(torch.cat(pieces), reference)
    lo, hi = bounds[0], bounds[1]
    assert math.isclose(square_sum(key, index, hi - lo, lo, total), float(reference[lo:hi].double().square().sum()),
                        rel_tol=1e-12)


@settings(max_examples=15, deadline=None)
@given(total=st.integers(1, 2 * streams.BLOCKS["signs"] + 45), cut=st.floats(0, 1), key=st.integers(0, 2**64 - 1))
def test_any_split_of_a_sign_stream_draws_the_whole_one(total, cut, key):
    reference = torch.zeros(total)
    streams.add_stream_(reference, key, 2, 1.0, kind="signs")
    lo = int(cut * total)
    pieces = [torch.zeros(lo), torch.zeros(total - lo)]
    streams.add_stream_(pieces[0], key, 2, 1.0, 0, total, kind="signs")
    streams.add_stream_(pieces[1], key, 2, 1.0, lo, total, kind="signs")
    assert torch.equal(torch.cat(pieces), reference) and set(reference.unique().tolist()) <= {-1.0, 1.0}


def test_a_sign_is_bit_b_of_word_w():
    # Element 32 w + b is 1 - 2 (bit b of the block's w-th 32-bit word): the format replay relies on.
    block = streams.BLOCKS["signs"]
    out = torch.zeros(block + 40)
    streams.add_stream_(out, 7, 1, 1.0, kind="signs")
    for j, values in ((0, out[:block]), (1, out[block:])):
        gen = torch.Generator().manual_seed(block_seed(7, 1, j))
        words = torch.randint(0, 1 << 32, (-(-values.numel() // 32),), generator=gen, dtype=torch.int64)
        bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
        assert torch.equal(values, (1 - 2 * bits).view(-1)[:values.numel()].float())


def test_streams_differ_by_key_index_and_block_and_look_standard_normal():
    a = whole(1, 0, 2 * BLOCK)
    assert not torch.equal(a[:BLOCK], a[BLOCK:])  # blocks are independent draws
    assert not torch.equal(a, whole(2, 0, 2 * BLOCK))
    assert not torch.equal(a, whole(1, 1, 2 * BLOCK))
    assert abs(float(a.mean())) < 5 / math.sqrt(a.numel())
    assert abs(float(a.std()) - 1) < 0.02
    assert len({block_seed(k, i, j) for k in range(4) for i in range(4) for j in range(4)}) == 64


def test_alpha_scales_in_place_and_respects_dtype():
    out = torch.ones(10, dtype=torch.bfloat16)
    add_normal_(out, 3, 0, 0.5)
    assert out.dtype == torch.bfloat16
    expected = (1 + 0.5 * whole(3, 0, 10).to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.allclose(out.float(), expected.float(), atol=1e-2)


def test_step_keys_depend_on_seed_and_step():
    keys = {step_key(s, t) for s in range(3) for t in range(50)}
    assert len(keys) == 150 and all(0 <= k < 2**64 for k in keys)


def test_the_stream_version_is_recorded_apart_from_the_legacy_one():
    assert streams.STREAM != streams.LEGACY


def test_drawing_over_threads_gives_the_single_thread_numbers():
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.nn.Parameter(torch.ones(5 * BLOCK + 123))
            with torch.no_grad():
                add_normal_(out, 9, 4, 0.25, offset=BLOCK // 3, total=7 * BLOCK)
            results.append(out.detach().clone())
        assert torch.equal(results[0], results[1])
        assert not torch.equal(results[0], torch.ones_like(results[0]))
    finally:
        torch.set_num_threads(before)
