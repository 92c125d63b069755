"""counter-v1 (streams.py): element k of parameter i is SplitMix64's k-th output from a seed of (key, i), so
any split (slices, ranks, eager pieces, one compiled kernel) draws the same numbers, and a DP-ZO pass
dispatches a number of operators that grows with the number of parameter tensors, not with their size."""

import math
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpaudit.training import streams
from dpaudit.training.streams import COUNTER, add_counter_, counter_seed, counter_square_sum, counter_values

MASK = (1 << 64) - 1


def splitmix64(key: int, index: int, k: int) -> int:
    """The reference, in Python integers: SplitMix64's output k from the parameter's seed."""
    x = (counter_seed(key, index) + (k + 1) * 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@settings(max_examples=20, deadline=None)
@given(key=st.integers(0, 2**64 - 1), index=st.integers(0, 300), offset=st.integers(0, 2**40))
def test_signs_are_bit_63_of_splitmix64_at_the_position(key, index, offset):
    got = counter_values(key, index, offset, 40, "signs")
    want = torch.tensor([-1.0 if splitmix64(key, index, offset + k) >> 63 else 1.0 for k in range(40)])
    assert torch.equal(got, want)


def test_normals_are_box_muller_of_the_outputs_bits():
    key, index = 2**63 + 12345, 7
    got = counter_values(key, index, 1000, 50, "normal").double()
    want = []
    for k in range(50):
        x = splitmix64(key, index, 1000 + k)
        u1, u2 = ((x >> 32) + 1) * 2.0 ** -32, (x & 0xFFFFFFFF) * 2.0 ** -32
        want.append(math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2))
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=2e-6)


def test_the_streams_look_like_their_laws_and_differ_by_key_and_index():
    n = 1 << 20
    z = counter_values(11, 0, 0, n, "normal").double()
    assert abs(float(z.mean())) < 5 / math.sqrt(n) and abs(float(z.var()) - 1) < 5 * math.sqrt(2 / n)
    assert abs(float((z ** 4).mean()) - 3) < 0.05 and float(z.abs().max()) <= math.sqrt(64 * math.log(2)) + 1e-5
    s = counter_values(11, 0, 0, n, "signs")
    assert abs(float(s.mean())) < 5 / math.sqrt(n)
    others = [counter_values(12, 0, 0, 4096), counter_values(11, 1, 0, 4096)]
    for o in others:
        assert abs(float((o * z[:4096].float()).mean())) < 5 / math.sqrt(4096)


@settings(max_examples=15, deadline=None)
@given(total=st.integers(1, (1 << 21) + 99), cut=st.floats(0, 1), key=st.integers(0, 2**64 - 1),
       kind=st.sampled_from(["normal", "signs"]))
def test_any_split_draws_the_whole_stream(total, cut, key, kind):
    """A rank's slice (offset) and the eager pieces of 2**20 elements change nothing."""
    whole = torch.zeros(total)
    add_counter_([whole], key, 1.0, kind)
    at = int(cut * total)
    a, b = torch.zeros(at), torch.zeros(total - at)
    add_counter_([a, b], key, 1.0, kind, offsets=[0, at])  # b is parameter 1: its own stream
    assert torch.equal(a, whole[:at])
    c = torch.zeros(total - at)
    with mock.patch("dpaudit.training.zo.local_slices", lambda ps: [(c, at, total)]):
        from dpaudit.training.zo import add_direction

        add_direction([torch.zeros(total)], key, 1.0, COUNTER, "rademacher" if kind == "signs" else "gaussian")
    assert torch.equal(c, whole[at:])


def test_square_sum_and_dtype():
    ps = [torch.zeros(3000), torch.zeros(5, 7)]
    add_counter_(ps, 5, 1.0, "normal")
    assert math.isclose(counter_square_sum([torch.empty(3000), torch.empty(5, 7)], 5),
                        sum(float(p.double().square().sum()) for p in ps), rel_tol=1e-6)
    half = torch.zeros(64, dtype=torch.bfloat16)
    add_counter_([half], 5, 0.5, "signs")
    assert half.dtype == torch.bfloat16 and set(half.tolist()) <= {0.5, -0.5}


def _ops(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def test_a_dp_zo_pass_dispatches_per_tensor_not_per_element():
    """blocks-v1 draws block by block (its operator count grows with the weights' size); counter-v1 does not."""
    from dpaudit.training.zo import add_direction

    small = [torch.zeros(4096) for _ in range(5)]
    large = [torch.zeros(300_000) for _ in range(5)]
    more = [torch.zeros(4096) for _ in range(10)]
    counter = {name: _ops(lambda ps=ps: add_direction(ps, 1, 0.1, COUNTER, "gaussian"))
               for name, ps in (("small", small), ("large", large), ("more", more))}
    assert counter["small"] == counter["large"] and counter["more"] > counter["small"]
    blocks = [_ops(lambda ps=ps: add_direction(ps, 1, 0.1, streams.STREAM, "gaussian")) for ps in (small, large)]
    assert blocks[1] > blocks[0]  # the check can fail: the old stream fails it


def test_one_dp_zo_step_dispatches_as_many_operators_for_a_wider_model():
    """A whole step (two forwards, three passes) on two tiny Llamas with the same tensors, 4x wider."""
    import numpy as np

    from dpaudit.models.embedded import build_model, build_tokenizer
    from dpaudit.training.data import tokenize
    from dpaudit.training.trainable import trainable_parameters
    from dpaudit.training.zo import ZOSettings, zo_step

    tok = build_tokenizer(["a b c d e f g"])
    counts = []
    for hidden in (16, 64):
        torch.manual_seed(0)
        model = build_model(tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2)
        batch = tokenize(tok, ["a b c", "d e f g"], 8).batch(range(2))
        settings_ = ZOSettings(lr=1e-3, clip=1.0, noise="gaussian", sigma=1.0, stream=COUNTER)
        params = trainable_parameters(model)
        counts.append(_ops(lambda: zo_step(model, params, batch, 3, settings_, 2, np.random.default_rng(0))))
    assert counts[0] == counts[1]


@pytest.mark.slow
def test_the_compiled_pass_draws_the_eager_numbers():
    """torch.compile's kernel (C++ here, Triton on a GPU): one operator a tensor, the same signs exactly and
    normals within float32 rounding of the transcendental functions."""
    ps = [torch.randn(300, 7), torch.randn(5000), torch.randn(3)]
    outs = {}
    for mode in ("0", "1"):
        with mock.patch.dict(os.environ, {"DPAUDIT_COMPILE_STREAM": mode}):
            signs, normal = [p.clone() for p in ps], [p.clone() for p in ps]
            add_counter_(signs, 99, -0.7, "signs")
            add_counter_(normal, 99, 0.3, "normal", offsets=[0, 123, 0])
            outs[mode] = signs, normal, counter_square_sum(ps, 99)
    assert all(torch.equal(a, b) for a, b in zip(outs["0"][0], outs["1"][0]))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(outs["0"][1], outs["1"][1]))
    assert math.isclose(outs["0"][2], outs["1"][2], rel_tol=1e-6)


def test_a_counter_run_records_its_stream_replays_without_a_gpu_and_keeps_it_on_resume(tiny_model_dir, tmp_path,
                                                                                          monkeypatch):
    """A GPU run draws counter-v1 (streams.default_stream; here forced on the CPU): run_config.json says so, the
    replay redraws it (on a machine without a GPU too: the numbers do not depend on the device), and a resumed
    run keeps the stream it began with even where the default is another."""
    import json
    import shutil

    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training import streams as S
    from dpaudit.training.runner import TrainConfig, train
    from dpaudit.workflows.replay import max_weight_difference, replay_run

    texts = [f"Alice number {i} lives in Paris and likes bread." for i in range(30)]
    monkeypatch.setattr(S, "default_stream", lambda device: COUNTER)
    cfg = TrainConfig(method="dp-zo", target_epsilon=2.0, steps=6, batch_size=8, lr=1e-3, secret_seed=3)
    run = train(tiny_model_dir, texts, tmp_path / "run", cfg, show_progress=False)
    meta = json.loads((run.run_dir / "run_config.json").read_text())
    assert meta["direction_stream"] == COUNTER
    trained, base = load_causal_lm(run.model_dir)[0], load_causal_lm(tiny_model_dir)[0]
    gap, moved = max_weight_difference(replay_run(run.run_dir)[0], trained), max_weight_difference(trained, base)
    assert moved > 1e-4 and gap < 1e-3 * moved
    gpu_run = tmp_path / "gpu-run"
    shutil.copytree(run.run_dir, gpu_run)
    (gpu_run / "run_config.json").write_text(json.dumps({**meta, "direction_device": "cuda"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert max_weight_difference(replay_run(gpu_run)[0], trained) == gap
    # resumed where the default is blocks-v1: the run keeps counter-v1
    from dpaudit.training.runner import _direction_stream

    monkeypatch.setattr(S, "default_stream", lambda device: S.STREAM)
    assert _direction_stream(run.run_dir, 3, "cpu") == COUNTER and _direction_stream(tmp_path / "new", 0, "cpu") == S.STREAM


def test_a_bf16_weight_is_rounded_once():
    """w + alpha z computed in float32 and rounded once to bf16 (as torch's add_ does), not alpha z rounded first."""
    w = torch.full((4096,), 1.0, dtype=torch.bfloat16)
    add_counter_([w], 3, 0.0031, "normal")
    z = counter_values(3, 0, 0, 4096, "normal")
    assert torch.equal(w, (1.0 + 0.0031 * z).to(torch.bfloat16))


def test_a_compile_that_fails_midway_goes_on_eagerly_from_where_it_stopped(monkeypatch, capsys):
    """No C compiler, say: the tensors the compiled kernel updated are not updated twice, the rest are updated by
    eager code with the same numbers, and the run is told once."""
    calls = {"n": 0}

    def kernel(flat, mixed, index, offset, alpha, normal):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("no compiler")
        streams._add_one(flat, mixed, index, offset, alpha, normal)

    monkeypatch.setattr(streams, "_kernel", lambda: kernel)
    monkeypatch.setattr(streams, "_compile_failed", False)
    monkeypatch.setenv("DPAUDIT_COMPILE_STREAM", "1")
    got = [torch.zeros(100), torch.zeros(50), torch.zeros(7)]
    add_counter_(got, 8, 1.0, "signs")
    monkeypatch.setenv("DPAUDIT_COMPILE_STREAM", "0")
    want = [torch.zeros(100), torch.zeros(50), torch.zeros(7)]
    add_counter_(want, 8, 1.0, "signs")
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and streams._compile_failed
    assert "could not build" in capsys.readouterr().err
