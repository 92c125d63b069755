"""The bundled DP-SGD trainer with BLT noise (buffered-linear-Toeplitz): the noise it adds is C^-1 z from d
buffers, its batches are balls-in-bins epochs, it is accounted by `matrix` at the noise it really adds (sigma x the
strategy's sensitivity), a killed run resumes and counts its attempts, and what it does not run with is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpaudit.accounting.matrix.strategy import Strategy
from dpaudit.core.errors import DPAuditError
from correlated_helpers import FixedDrawNoise, dense, killed_run

SPEC = "blt,theta=0.9:0.4,omega=0.3:0.2"
THETA, OMEGA = (0.9, 0.4), (0.3, 0.2)



def _blt(draws) -> FixedDrawNoise:
    noise = FixedDrawNoise(torch.tensor(draws))
    noise.noise_blt = (THETA, OMEGA)
    return noise


def _noises(noise, n: int, width: int) -> list:
    out = []
    for _ in range(n):
        w = torch.zeros(width, dtype=torch.float64)
        noise.draw_noise([w], 2.0)
        out.append(w.numpy())
    return out


def _lower_toeplitz(steps: int) -> np.ndarray:
    """C as a dense matrix, from the strategy's own coefficients (1, then sum_i omega_i theta_i^(k-1))."""
    coefs = np.asarray(Strategy("blt", theta=THETA, omega=OMEGA).coefs(steps))
    assert coefs[0] == pytest.approx(1.0) and coefs[3] == pytest.approx(sum(w * t ** 2 for t, w in zip(THETA, OMEGA)))
    return dense(coefs, steps)


def test_the_noise_added_is_the_inverse_strategy_applied_to_the_draws():
    steps = 15
    draws = np.random.default_rng(0).normal(size=(steps, 4))
    noise = _blt(draws)
    added = np.array(_noises(noise, steps, 4))
    np.testing.assert_allclose(added, np.linalg.solve(_lower_toeplitz(steps), 2.0 * draws), rtol=1e-10, atol=1e-12)
    assert len(noise._past) == len(THETA)   # memory: d buffers, whatever T


def test_a_resumed_attempt_continues_the_buffers_with_fresh_draws():
    """The premise of the resumed accounting (accounting/matrix/single.py): an attempt resumed at step s from the
    checkpoint's buffers, with fresh draws z', releases what, multiplied by C (the earlier releases public), is z'
    on its rows."""
    rng = np.random.default_rng(1)
    steps, s = 10, 4
    first_draws, fresh = rng.normal(size=(7, 3)), rng.normal(size=(steps - s, 3))
    first = _blt(first_draws)
    early = _noises(first, s, 3)
    saved = first.noise_state()            # the checkpoint at step s
    _noises(first, 3, 3)                   # steps s .. s + 2 released, then the kill
    resumed = _blt(fresh)
    resumed.load_noise_state(saved, [torch.zeros(3, dtype=torch.float64)])
    w = np.array(early + _noises(resumed, steps - s, 3))
    np.testing.assert_allclose((_lower_toeplitz(steps) @ w)[s:], 2.0 * fresh, rtol=1e-10, atol=1e-12)
    with pytest.raises(DPAuditError, match="noise state"):
        resumed.load_noise_state(saved[:1], [torch.zeros(3, dtype=torch.float64)])   # a buffer missing


def _train(model_dir, out, **kw):
    from dpaudit.models.corpus import sentences
    from dpaudit.training.runner import TrainConfig, train

    cfg = TrainConfig(method="dp-sgd", steps=12, batch_size=8, secret_seed=11,
                      **{"target_epsilon": 4.0, "noise": SPEC, "sampling": "balls-in-bins", **kw})
    return cfg, train(model_dir, sentences(80, seed=3), out, cfg, show_progress=False)


def test_a_blt_run_is_accounted_at_the_noise_it_adds(tiny_model_dir, tmp_path):
    from dpaudit.accounting import epsilon
    from dpaudit.accounting.matrix.single import sensitivity
    from dpaudit.training.runner import privacy_plan

    cfg, run = _train(tiny_model_dir, tmp_path / "blt")
    assert run.accountant == "matrix" and run.epsilon == pytest.approx(4.0, abs=1e-6)
    header = json.loads((run.run_dir / "privacy_ledger.json").read_text())
    plan = privacy_plan(cfg, run.sampling_rate, 80)
    mech = plan.mechanism
    assert header["noise"] == SPEC and header["sampling"] == "balls-in-bins"
    # sigma is relative to the strategy's sensitivity under 2 epochs (T 12, N // B = 10 steps an epoch), which the
    # trainer multiplies in: without it the noise would be several times too small for the claim
    sens = sensitivity(mech)
    assert sens > 1.5 and header["noise_std"] == pytest.approx(mech.sigma * sens)
    assert epsilon(mech, cfg.delta).details["participations"] == 2


def test_what_blt_does_not_run_with_is_refused():
    from dpaudit.training.runner import TrainConfig

    base = {"method": "dp-sgd", "target_epsilon": 4.0, "steps": 6, "noise": SPEC}
    for extra, why in [({}, "balls-in-bins"), ({"sampling": "balls-in-bins", "noise": SPEC + ",order=fixed"},
                                                "one fixed order"),
                       ({"sampling": "balls-in-bins", "white_box": 100}, "white-box")]:
        with pytest.raises(DPAuditError, match=why):
            TrainConfig(**{**base, **extra})


def test_a_killed_blt_run_resumes_and_counts_each_attempt(tiny_model_dir, tmp_path, monkeypatch):
    from dpaudit.accounting.matrix import single
    from dpaudit.models.corpus import sentences
    from dpaudit.training.runner import privacy_plan, train

    run = tmp_path / "run"
    cfg = killed_run(tiny_model_dir, run, monkeypatch, sampling="balls-in-bins", noise=SPEC)
    result = train(tiny_model_dir, sentences(80, seed=3), run, cfg, resume=True, show_progress=False)
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    assert ledger["attempts"] == [[0, 5, None], [4, None, 0]]
    mech = privacy_plan(cfg, result.sampling_rate, 80).mechanism
    assert result.epsilon == pytest.approx(single.resumed_epsilon(mech, 2, cfg.delta).epsilon, rel=1e-9)
    assert result.epsilon > single.epsilon(mech, cfg.delta).epsilon and result.accountant == "matrix"


def test_a_searched_blt_trains_with_the_strategy_it_names(tiny_model_dir, tmp_path):
    """blt,buffers=2: the plan finds theta and omega for the run's T and epochs; the trainer adds that strategy's
    noise and the ledger names it."""
    from dpaudit.accounting.matrix.strategy import parse

    cfg, run = _train(tiny_model_dir, tmp_path / "searched", noise="blt,buffers=2")
    header = json.loads((run.run_dir / "privacy_ledger.json").read_text())
    named = parse(header["noise"])
    assert len(named.theta) == 2 and run.accountant == "matrix"
    assert run.epsilon == pytest.approx(4.0, abs=1e-6)


def test_fixed_order_epochs_keep_every_example_an_epoch_apart():
    from dpaudit.training.batches import fixed_order_source

    n, b = 50, 8                       # 6 steps an epoch; 2 examples of the permutation never take part
    draw = fixed_order_source(n, b, 7, np.random.default_rng(0))
    seen: dict = {}
    for step in range(30):
        batch = draw(step)
        assert batch.size == b
        for i in batch:
            seen.setdefault(int(i), []).append(step)
    assert len(seen) == 48 and all(np.all(np.diff(steps) == 6) and len(steps) == 5 for steps in seen.values())
    assert np.array_equal(fixed_order_source(n, b, 7, None)(3), draw(3))   # the order is the secret's: a resume's


def test_a_fixed_order_blt_run_is_accounted_at_its_separation(tiny_model_dir, tmp_path):
    from dpaudit.accounting import epsilon
    from dpaudit.training.runner import TrainConfig, privacy_plan

    cfg, run = _train(tiny_model_dir, tmp_path / "fixed", sampling="shuffle", noise="blt,buffers=2,order=fixed")
    mech = privacy_plan(cfg, run.sampling_rate, 80).mechanism
    result = epsilon(mech, cfg.delta)
    assert run.accountant == "matrix" and result.relation.startswith("zero-out")
    assert result.details["min_separation"] == 10 and result.details["participations"] == 2
    with pytest.raises(DPAuditError, match="order=fixed"):   # shuffle is drawn for a fixed-order BLT only
        TrainConfig(method="dp-sgd", target_epsilon=4.0, sampling="shuffle")
    with pytest.raises(DPAuditError, match="one fixed order"):
        TrainConfig(method="dp-sgd", target_epsilon=4.0, sampling="balls-in-bins", noise="blt,buffers=2,order=fixed")
