"""Trainer mechanics: clipping bounds one example's influence, noise has the calibrated scale,
Poisson sampling has rate p, DP-ZO replays from its log, the ledger tells what a killed run spent."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from dpaudit.models.loading import load_causal_lm
from dpaudit.training import zo
from dpaudit.training.data import tokenize
from dpaudit.workflows.replay import max_weight_difference
from dpaudit.training.runner import TrainConfig, train
from dpaudit.training.batches import poisson_batch
from dpaudit.training.sgd import FirstOrderTrainer
from dpaudit.training.trainable import select_trainable, trainable_parameters

TEXTS = [f"Alice number {i} lives in Paris and likes bread." for i in range(30)] + \
        ["zq xv kj wp " * 6 + "!" for _ in range(2)]


def test_poisson_sampling_rate():
    rng = np.random.default_rng(0)
    sizes = np.array([len(poisson_batch(1000, 0.03, rng)) for _ in range(2000)])
    # mean 30, sd of the mean sqrt(1000*0.03*0.97/2000) = 0.12
    assert abs(sizes.mean() - 30) < 0.5
    assert abs(sizes.var() - 1000 * 0.03 * 0.97) < 3
    inclusion = np.zeros(50)
    for _ in range(4000):
        inclusion[poisson_batch(50, 0.2, rng)] += 1
    assert stats.chisquare(inclusion).pvalue > 1e-3  # every example equally likely


def _summed_clipped_grad(model, params, batch, clip):
    """The clipped sum of one step (no noise, B = 1, lr 0), through the default (ghost) route."""
    trainer = FirstOrderTrainer(model, params, lr=0.0, private=True, clip=clip, sigma=0.0, expected_batch_size=1,
                                optimizer="sgd")
    trainer.step(batch, batch["input_ids"].shape[0])
    out = torch.cat([p.grad.flatten() for p in params]).clone()
    trainer.model._close()
    return out


def test_dp_sgd_clipping_bounds_one_examples_influence(tiny_model_dir):
    model, tok = load_causal_lm(tiny_model_dir)
    params = trainable_parameters(select_trainable(model, "full"))
    data = tokenize(tok, TEXTS, 32)
    clip = 0.5
    with_outlier = _summed_clipped_grad(model, params, data.batch(range(len(TEXTS))), clip)
    without = _summed_clipped_grad(model, params, data.batch(range(len(TEXTS) - 1)), clip)
    change = float((with_outlier - without).norm())
    assert 0.0 < change <= clip * (1 + 1e-4)
    # Unclipped, the outlier moves the sum by far more than C: the bound comes from clipping.
    from dpaudit.training.data import per_example_loss
    model.zero_grad()
    per_example_loss(model, data.batch([len(TEXTS) - 1])).sum().backward()
    assert float(torch.cat([p.grad.flatten() for p in params]).norm()) > 2 * clip


def test_dp_sgd_noise_has_calibrated_scale(tiny_model_dir):
    model, _ = load_causal_lm(tiny_model_dir)
    params = trainable_parameters(select_trainable(model, "bias"))
    sigma, clip, batch = 1.7, 0.3, 8
    trainer = FirstOrderTrainer(model, params, lr=0.0, private=True, clip=clip, sigma=sigma,
                                expected_batch_size=batch, noise_seed=0)
    trainer.step({"input_ids": torch.zeros((0, 4), dtype=torch.long),
                  "attention_mask": torch.zeros((0, 4), dtype=torch.long)})  # no example: pure noise
    noise = torch.cat([p.grad.flatten() for p in params]).double().numpy()
    assert noise.size > 500
    assert stats.kstest(noise / (sigma * clip / batch), "norm").pvalue > 1e-3


@pytest.mark.parametrize("mech,dist", [("gaussian", "norm"), ("laplace", "laplace")])
def test_dp_zo_noise_scale_and_clipping(mech, dist):
    settings = zo.ZOSettings(lr=1.0, phi=0.01, clip=0.2, noise=mech, sigma=3.0)
    rng = np.random.default_rng(1)
    draws = np.array([zo.noisy_scalar(torch.zeros(4), settings, 10, rng) for _ in range(4000)])
    pre_noise = draws * 2 * settings.phi * 10  # back to the scale of the noisy sum
    assert stats.kstest(pre_noise / (settings.clip * settings.sigma), dist).pvalue > 1e-3
    quiet = zo.ZOSettings(lr=1.0, phi=0.01, clip=0.2, noise=None)
    diffs = torch.tensor([0.05, -0.1, 0.15])
    base = zo.noisy_scalar(diffs, quiet, 1, rng)
    for outlier in (1e6, -1e6, 0.1, float(0)):
        moved = zo.noisy_scalar(torch.cat([diffs, torch.tensor([outlier])]), quiet, 1, rng)
        assert abs(moved - base) * 2 * quiet.phi <= quiet.clip * (1 + 1e-6)  # float32 clamp


def test_sphere_direction_has_norm_sqrt_d():
    params = [torch.zeros(30, 7), torch.zeros(11)]
    scale = zo.direction_scale(params, seed=5, direction="sphere")
    zo.add_direction(params, 5, scale, direction="sphere")
    norm = math.sqrt(sum(float(p.square().sum()) for p in params))
    assert norm == pytest.approx(math.sqrt(221), rel=1e-5)


def test_rademacher_direction_is_plus_minus_one_and_on_the_sqrt_d_sphere():
    params = [torch.zeros(300, 70), torch.zeros(11)]
    assert zo.direction_scale(params, seed=5, direction="rademacher") == 1.0
    zo.add_direction(params, 5, 1.0, direction="rademacher")
    z = torch.cat([p.view(-1) for p in params])
    assert set(z.unique().tolist()) == {-1.0, 1.0} and abs(float(z.mean())) < 5 / math.sqrt(z.numel())
    gaussian = [torch.zeros_like(p) for p in params]
    zo.add_direction(gaussian, 5, 1.0, direction="gaussian")
    assert not torch.equal(z.abs(), torch.cat([p.view(-1) for p in gaussian]).abs())
    with pytest.raises(ValueError):
        zo.add_direction(params, 5, 1.0, stream="sequential", direction="rademacher")  # no legacy stream
    with pytest.raises(ValueError):
        zo.add_direction(params, 5, 1.0, direction="uniform")


def test_dp_zo_with_gaussian_directions_replays(tiny_model_dir, tmp_path):
    # The other replay tests train with the default (Rademacher) directions.
    from dpaudit.workflows.replay import replay_run

    cfg = TrainConfig(method="dp-zo", target_epsilon=2.0, steps=6, batch_size=8, lr=1e-3, secret_seed=3,
                      direction="gaussian")
    run = train(tiny_model_dir, TEXTS, tmp_path / "run", cfg, show_progress=False)
    replayed, _ = replay_run(run.run_dir)
    trained, _ = load_causal_lm(run.model_dir)
    base, _ = load_causal_lm(tiny_model_dir)
    moved = max_weight_difference(trained, base)
    assert moved > 1e-5 and max_weight_difference(replayed, trained) < 1e-3 * moved


@pytest.fixture(scope="module")
def zo_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("zo") / "run"
    cfg = TrainConfig(method="dp-zo", target_epsilon=2.0, steps=25, batch_size=8, lr=1e-3, secret_seed=3)
    return train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)


def test_dp_zo_replay_reproduces_weights(zo_run, tiny_model_dir):
    from dpaudit.workflows.replay import replay_run

    replayed, _ = replay_run(zo_run.run_dir)
    trained, _ = load_causal_lm(zo_run.model_dir)
    base, _ = load_causal_lm(tiny_model_dir)
    moved = max_weight_difference(trained, base)
    gap = max_weight_difference(replayed, trained)
    assert moved > 1e-4 and gap < 1e-3 * moved
    log = (zo_run.run_dir / "zo_steps.jsonl").read_text().splitlines()
    assert len(log) == 25 and set(json.loads(log[0])) == {"step", "seed", "scalar"}


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_an_honest_run_replays_within_the_default_tolerance_and_a_hidden_step_does_not(tiny_model_dir, tmp_path,
                                                                                       seed):
    """Issue 53, item 13: an honest DP-ZO run of 200 steps replayed 1.17e-5 off, over the fixed 1e-5: a false
    alarm. The default now bounds the float rounding by the run's length and weights (workflows/replay.py)."""
    from dpaudit.workflows.replay import default_tolerance, replay_run

    cfg = TrainConfig(method="dp-zo", target_epsilon=2.0, steps=60, batch_size=8, lr=1e-3, secret_seed=seed,
                      seed=seed)
    run = train(tiny_model_dir, TEXTS, tmp_path / "run", cfg, show_progress=False)
    replayed, _ = replay_run(run.run_dir)
    trained, _ = load_causal_lm(run.model_dir)
    tolerance = default_tolerance(replayed, 60)
    assert max_weight_difference(replayed, trained) <= tolerance
    steps = [json.loads(x) for x in (run.run_dir / "zo_steps.jsonl").read_text().splitlines()]
    hidden = steps[len(steps) // 2]   # one step more than the log says, of a logged step's size
    zo.apply_update(list(trained.parameters()), hidden["seed"], hidden["scalar"], cfg.lr, 1.0)
    assert max_weight_difference(replayed, trained) > tolerance


def test_runs_before_the_block_stream_replay_with_the_sequential_one(zo_run, tiny_model_dir, tmp_path):
    """A run folder without ``direction_stream`` (made before streams.py) drew z from one generator over
    the parameters in order; replay must use that stream for it, and refuse streams it does not know."""
    import shutil

    from dpaudit.core.errors import DPAuditError
    from dpaudit.workflows.replay import replay_run
    from dpaudit.training.streams import LEGACY, STREAM
    from dpaudit.training.trainable import trainable_parameters

    meta = json.loads((zo_run.run_dir / "run_config.json").read_text())
    assert meta["direction_stream"] == STREAM
    old = tmp_path / "old_run"
    shutil.copytree(zo_run.run_dir, old)
    meta.pop("direction_stream")
    meta["config"]["direction"] = "gaussian"  # every run of that time (the default then)
    (old / "run_config.json").write_text(json.dumps(meta))
    replayed, _ = replay_run(old)
    expected, _ = load_causal_lm(tiny_model_dir)
    params = trainable_parameters(expected)
    steps = [json.loads(line) for line in (old / "zo_steps.jsonl").read_text().splitlines()]
    with torch.no_grad():
        for r in steps:  # the sequential stream, written out
            gen = torch.Generator().manual_seed(r["seed"])
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen), alpha=-meta["config"]["lr"] * r["scalar"])
    assert max_weight_difference(replayed, expected) < 1e-6
    assert max_weight_difference(replayed, load_causal_lm(zo_run.model_dir)[0]) > 1e-4  # another stream
    (old / "run_config.json").write_text(json.dumps({**meta, "direction_stream": "blocks-v9"}))
    with pytest.raises(DPAuditError, match="blocks-v9"):
        replay_run(old)
    assert LEGACY != STREAM


def test_replay_command_rebuilds_the_run_model(zo_run, tiny_model_dir, tmp_path):
    from cli_helpers import dpaudit

    out = dpaudit("replay", "--run", zo_run.run_dir, "-o", tmp_path / "replayed", "--json")
    assert out.returncode == 0, out.stderr
    moved = max_weight_difference(load_causal_lm(zo_run.model_dir)[0], load_causal_lm(tiny_model_dir)[0])
    summary = json.loads(out.stdout)
    assert summary["max_abs_difference_to_run_model"] < 1e-3 * moved and summary["matches"]
    from dpaudit.workflows.replay import default_tolerance

    assert summary["verdict"].startswith("matches the run's model")
    assert summary["tolerance"] == pytest.approx(default_tolerance(load_causal_lm(tmp_path / "replayed")[0], 25))
    # A tolerance below what the replay reaches is a mismatch: exit 1 (the log would not explain the model).
    strict = dpaudit("replay", "--run", zo_run.run_dir, "-o", tmp_path / "strict", "--tolerance", "1e-300")
    if summary["max_abs_difference_to_run_model"] > 1e-300:
        assert strict.returncode == 1 and "DIFFERS" in strict.stdout
    again = dpaudit("replay", "--run", zo_run.run_dir, "-o", tmp_path / "replayed")
    assert again.returncode == 2 and "not empty" in again.stderr  # never overwritten silently


def test_replay_draws_directions_on_the_runs_device_kind(zo_run, tmp_path, monkeypatch):
    """CPU and CUDA generators give different z for one seed: a GPU run must be replayed on a GPU."""
    import shutil

    from dpaudit.core.errors import DPAuditError
    from dpaudit.workflows.replay import replay_run

    meta = json.loads((zo_run.run_dir / "run_config.json").read_text())
    assert meta["direction_device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    gpu_run = tmp_path / "gpu_run"
    shutil.copytree(zo_run.run_dir, gpu_run)
    (gpu_run / "run_config.json").write_text(json.dumps({**meta, "direction_device": "cuda"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DPAuditError, match="GPU"):
        replay_run(gpu_run)

def test_ledger_records_spend_and_claim(zo_run):
    ledger = json.loads((zo_run.run_dir / "privacy_ledger.json").read_text())
    assert ledger["steps_executed"] == ledger["steps_in_model"] == 25 and ledger["epsilon_spent"] <= 2.0
    assert ledger["relation"].startswith("add/remove") and ledger["sigma"] == pytest.approx(zo_run.sigma)
    assert "secret_seed" not in json.dumps(json.loads((zo_run.run_dir / "run_config.json").read_text()))


def test_killed_run_keeps_ledger_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    cfg = TrainConfig(method="dp-zo", target_epsilon=2.0, steps=12, batch_size=8, lr=1e-3, save_every=5,
                      secret_seed=4)
    real = zo.zo_step
    calls = {"n": 0}

    def dies_at_step_8(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(zo, "zo_step", dies_at_step_8)
    from dpaudit.core.errors import Interrupted
    with pytest.raises(Interrupted, match="interrupted at step 7; the ledger counts 8 steps"):
        train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    # Written ahead: the eighth step was counted before it could release anything.
    assert ledger["steps_executed"] == 8 and 0 < ledger["epsilon_spent"] <= ledger["epsilon_planned"] <= 2.0
    assert json.loads((run / "checkpoint" / "trainer_state.json").read_text())["step"] == 5
    monkeypatch.setattr(zo, "zo_step", real)
    from dpaudit.core.errors import DPAuditError
    with pytest.raises(DPAuditError, match="not empty"):
        train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)
    # Steps 6 to 8 ran twice (killed after the step-5 checkpoint): resuming spends more than planned,
    # which is refused unless accepted, and then written down.
    with pytest.raises(DPAuditError, match="allow-overspend"):
        train(tiny_model_dir, TEXTS, run, cfg, resume=True, show_progress=False)
    # Resumed with another plan (here the direction of a run trained before the default changed): refused,
    # naming what differs, and nothing in the folder is touched.
    with pytest.raises(DPAuditError, match=r"not as it was started: direction;"):
        train(tiny_model_dir, TEXTS, run, dataclasses.replace(cfg, direction="gaussian", allow_overspend=True),
              resume=True, show_progress=False)
    result = train(tiny_model_dir, TEXTS, run, dataclasses.replace(cfg, allow_overspend=True), resume=True,
                   show_progress=False)
    assert result.steps == 12
    assert [json.loads(x)["step"] for x in (run / "zo_steps.jsonl").read_text().splitlines()] == list(range(12))
    after = json.loads((run / "privacy_ledger.json").read_text())
    assert after["steps_in_model"] == 12 and after["steps_executed"] == 15
    assert after["steps_discarded_by_resume"] == 3 and after["overspend_allowed"]
    assert after["epsilon_planned"] == pytest.approx(ledger["epsilon_planned"])  # the plan is kept
    assert after["epsilon_spent"] == after["epsilon_total"] == result.epsilon > after["epsilon_planned"]
    assert after["epsilon_overspend"] == pytest.approx(result.epsilon - after["epsilon_planned"])
    assert (run / "model").is_dir() and not (run / "checkpoint").exists()  # one copy of the weights
    with pytest.raises(DPAuditError, match="complete"):
        train(tiny_model_dir, TEXTS, run, cfg, resume=True, show_progress=False)


def test_a_dp_sgd_step_redone_after_resume_draws_fresh_noise(tiny_model_dir, tmp_path, monkeypatch):
    """Killed after step 3 (checkpoint at step 2) and resumed: step 3 runs again with another batch. Its
    noise must be new; the same noise on another clipped sum would release their difference unprotected."""
    import dpaudit.training.batches as sampling
    from dpaudit.training import dp_step as sgd

    keys = []
    add = sgd.add_normals_
    monkeypatch.setattr(sgd, "add_normals_", lambda out, key, *a, **k: (keys.append(key), add(out, key, *a, **k)))
    draw, calls = sampling.poisson_batch, []

    def killed_at_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return draw(*args, **kwargs)

    cfg = TrainConfig(method="dp-sgd", target_epsilon=8.0, steps=4, batch_size=8, save_every=2, secret_seed=5,
                      allow_overspend=True)
    monkeypatch.setattr(sampling, "poisson_batch", killed_at_step_4)
    from dpaudit.core.errors import Interrupted
    with pytest.raises(Interrupted):
        train(tiny_model_dir, TEXTS, tmp_path / "run", cfg, show_progress=False)
    first = list(dict.fromkeys(keys))  # one key a step, in order
    monkeypatch.setattr(sampling, "poisson_batch", draw)
    keys.clear()
    train(tiny_model_dir, TEXTS, tmp_path / "run", cfg, resume=True, show_progress=False)
    again = list(dict.fromkeys(keys))
    assert len(first) == 3 and len(again) == 2  # steps 0-2, then 2-3
    assert again[0] != first[2] and not set(first) & set(again)


@pytest.mark.parametrize("subset", ["lora", "bias", "embeddings"])
def test_trainable_subsets_train_only_their_parameters(tiny_model_dir, tmp_path, subset):
    cfg = TrainConfig(method="dp-sgd", target_epsilon=8.0, steps=3, batch_size=8, trainable=subset, secret_seed=0)
    result = train(tiny_model_dir, TEXTS, tmp_path / "run", cfg, show_progress=False)
    base, _ = load_causal_lm(tiny_model_dir)
    tuned, _ = load_causal_lm(result.model_dir)
    ref = dict(base.named_parameters())
    changed = {n for n, p in tuned.named_parameters() if not torch.equal(p, ref[n])}
    assert changed
    if subset == "bias":
        assert all(n.endswith(".bias") for n in changed)
    elif subset == "embeddings":  # the token rows only (tied: the input embedding is the output layer too)
        assert changed <= {"model.embed_tokens.weight", "lm_head.weight"} and "model.embed_tokens.weight" in changed
    else:
        assert all("proj" in n for n in changed)  # merged adapters touch only the linear layers


def test_bf16_dp_sgd_runs(tiny_model_dir, tmp_path):
    cfg = TrainConfig(method="dp-sgd", target_epsilon=8.0, steps=2, batch_size=8, bf16=True, secret_seed=0)
    result = train(tiny_model_dir, TEXTS, tmp_path / "run", cfg, show_progress=False)
    tuned, _ = load_causal_lm(result.model_dir)
    assert next(tuned.parameters()).dtype == torch.bfloat16


def test_dp_zo_turns_dropout_off(tiny_model_dir):
    # With dropout on, l(theta + phi z) - l(theta - phi z) would compare two dropout masks.
    model, _ = load_causal_lm(tiny_model_dir)
    model.train()
    zo.ZOTrainer(model, trainable_parameters(model), zo.ZOSettings(lr=1e-3), run_seed=0, expected_batch=4,
                 private=True, rng=np.random.default_rng(0))
    assert not any(m.training for m in model.modules())


def test_dp_zo_micro_batches_give_the_same_losses(tiny_model_dir):
    model, tok = load_causal_lm(tiny_model_dir)
    params = trainable_parameters(select_trainable(model, "full"))
    batch = tokenize(tok, TEXTS, 32).batch(range(len(TEXTS)))
    whole = zo.perturbed_losses(model, params, batch, seed=3, phi=1e-3, scale=1.0)
    zo.add_direction(params, 3, 1e-3)  # back to theta
    chunked = zo.perturbed_losses(model, params, batch, seed=3, phi=1e-3, scale=1.0, micro_batch=5)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
