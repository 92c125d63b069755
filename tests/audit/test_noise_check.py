"""The per-tensor noise check (audit/noise_check.py): at its level when every tensor carries the accounted noise,
whatever the data's gradients and however the run adapts; a tensor without it refused and named; 16-bit releases
named as not checked."""

from __future__ import annotations

import numpy as np
import pytest

from dpaudit.audit.noise_check import check

NAMES = ["w", "b", "head"]


def _releases(rng, steps=60, missing=None, data_scale=0.5, s=1.0):
    """Columns on three tensors (10, 4, 2 canaries): a drifting data gradient, sampled canaries of size C, and
    noise N(0, s^2) on every tensor but ``missing``."""
    tensor_of = np.repeat([0, 1, 2], [10, 4, 2])
    m = tensor_of.size
    data = np.cumsum(rng.normal(0, data_scale / 4, (steps, m)), axis=0)  # slow drift, adapted to the past
    canary = (rng.random((steps, m)) < 0.1) * rng.choice([-1.0, 1.0], (steps, m))
    noise = rng.normal(0, s, (steps, m))
    if missing is not None:
        noise[:, tensor_of == missing] = 0
    return data + canary + noise, tensor_of


def test_correct_releases_are_refused_at_most_alpha_of_the_time():
    rng = np.random.default_rng(0)
    refused = sum(check(*_releases(rng), NAMES, 1.0, 0.05).refused for _ in range(400))
    assert refused <= 0.05 * 400 + 3 * np.sqrt(0.05 * 0.95 * 400)  # alpha plus three standard errors


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_a_tensor_without_noise_is_refused_and_named(missing):
    result = check(*_releases(np.random.default_rng(missing + 1), missing=missing), NAMES, 1.0, 0.05)
    assert result.refused and [t.name for t in result.missing] == [NAMES[missing]]
    assert NAMES[missing] in result.reason


def test_the_noise_itself_is_read_exactly_where_the_probe_measured_it():
    rng = np.random.default_rng(5)
    rows, tensor_of = _releases(rng)
    sizes, steps = [100, 20, 4], 60
    tally = {"sizes": sizes, "steps": [steps] * 3,
             "squares": [float((rng.normal(0, 1, n * steps) ** 2).sum()) for n in sizes]}
    ok = check(rows, tensor_of, NAMES, 1.0, 0.05, tally)
    assert not ok.refused and all(t.direct for t in ok.tensors) and ok.statistics == 3
    tally["squares"][1] *= 0.25  # half the noise on the biases
    half = check(rows, tensor_of, NAMES, 1.0, 0.05, tally)
    assert [t.name for t in half.missing] == ["b"] and half.tensors[1].ratio == pytest.approx(0.5, rel=0.1)


def test_tensors_released_in_16_bits_are_named_as_not_checked():
    rows, tensor_of = _releases(np.random.default_rng(9), missing=2)
    result = check(rows, tensor_of, NAMES, 1.0, 0.05, skipped={2})
    assert not result.refused and [t.name for t in result.tensors] == ["w", "b"]
    assert "1 released in 16 bits not checked" in result.verdict and "head" in result.verdict
