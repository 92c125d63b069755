"""Issue 40, item 3: the samplers a user switches to draw what is accounted, log it in the format the sampler
audit reads, and the audit recognises each (and refuses a log that is not balls-in-bins)."""

import json
import os

import numpy as np
import pytest

from dpaudit.audit.sampler import analyse_as, read_log
from dpaudit.core.errors import DPAuditError
from dpaudit.samplers import BallsInBinsSampler, PoissonSampler


def test_balls_in_bins_partitions_each_epoch_into_random_steps(tmp_path):
    n, b, epochs = 3000, 32, 6
    sampler = BallsInBinsSampler(n, b, epochs, seed=0).log(tmp_path / "batches.jsonl")
    t = n // b
    steps_of_zero = []
    for _ in range(epochs):
        batches = list(sampler)
        assert len(batches) == len(sampler) == t
        flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in batches])
        assert np.array_equal(np.sort(flat), np.arange(n))           # every example once an epoch
        steps_of_zero.append(next(i for i, x in enumerate(batches) if 0 in x))
    with pytest.raises(DPAuditError, match="made for 6 epoch"):
        next(iter(sampler))
    sampler.close()
    assert len(set(steps_of_zero)) > 1                                # not the same step every epoch
    assert oct(os.stat(tmp_path / "batches.jsonl").st_mode & 0o777) == "0o600"
    verdict, matches, observed = analyse_as(read_log(tmp_path / "batches.jsonl"), "balls-in-bins", n, None, b)
    assert matches and observed == "balls-in-bins"
    assert not analyse_as(read_log(tmp_path / "batches.jsonl"), "poisson", n, None)[1]
    with pytest.raises(DPAuditError, match="never overwritten"):
        BallsInBinsSampler(n, b, 1).log(tmp_path / "batches.jsonl")


def test_balls_in_bins_steps_are_uniform_across_examples():
    """Which step an example lands in is uniform over the t steps (chi-square over 10,000 examples, t = 10)."""
    from scipy import stats

    sampler = BallsInBinsSampler(10_000, 1000, 1, seed=3)
    step_of = np.empty(10_000, dtype=np.int64)
    for step, batch in enumerate(sampler):
        step_of[batch] = step
    counts = np.bincount(step_of, minlength=10)
    assert stats.chisquare(counts).pvalue > 1e-4
    # neighbouring examples are not kept together (the permutation mixes): the steps of i and i + 1 agree ~1/t
    assert np.mean(step_of[:-1] == step_of[1:]) < 0.2


def test_poisson_sampler_is_read_as_poisson_and_not_as_balls_in_bins(tmp_path):
    n, p = 4000, 0.02
    sampler = PoissonSampler(n, p, steps=300, seed=1).log(tmp_path / "p.jsonl")
    drawn = list(sampler)
    sampler.close()
    assert len(drawn) == 300 and all(len(set(x)) == len(x) for x in drawn)
    sizes = np.array([len(x) for x in drawn])
    assert abs(sizes.mean() - n * p) < 4 * np.sqrt(n * p / 300)
    verdict, matches, _ = analyse_as(read_log(tmp_path / "p.jsonl"), "poisson", n, p)
    assert matches and verdict.poisson_accounting_valid
    with pytest.raises(DPAuditError, match="twice in epoch"):
        analyse_as(read_log(tmp_path / "p.jsonl"), "balls-in-bins", n, None, 200)
    assert [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()] == drawn


def test_drop_in_to_a_data_loader_and_opacus(tmp_path):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(200, 3), torch.randint(0, 2, (200,)))
    loader = DataLoader(data, batch_sampler=BallsInBinsSampler(200, 20, 1, seed=0))
    assert sum(len(y) for _, y in loader) == 200
    opacus = pytest.importorskip("opacus")
    model = torch.nn.Linear(3, 2)
    engine = opacus.PrivacyEngine(accountant="prv")
    loader = DataLoader(data, batch_sampler=BallsInBinsSampler(200, 20, 1, seed=0))
    _, optimizer, private = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                                poisson_sampling=False)
    assert optimizer.expected_batch_size == 20 and len(private) == 10   # the rate Opacus reads: 1 / t


def test_bad_input():
    for make in (lambda: BallsInBinsSampler(10, 20, 1), lambda: BallsInBinsSampler(10, 2, 0),
                 lambda: PoissonSampler(10, 1.5), lambda: PoissonSampler(0, 0.1)):
        with pytest.raises(DPAuditError):
            make()
    with pytest.raises(DPAuditError, match="needs the dataset size and the batch size"):
        analyse_as([[0], [1]], "balls-in-bins")


def test_trainer_schedule_partitions_each_epoch_and_is_a_function_of_secret_and_step():
    from dpaudit.training.batches import SOURCES

    draw = SOURCES["balls-in-bins"].draw(100, 10, 7, None)
    again = SOURCES["balls-in-bins"].draw(100, 10, 7, None)
    epochs = [[draw(e * 10 + i) for i in range(10)] for e in range(3)]
    for batches in epochs:
        assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(100))
    assert not all(np.array_equal(a, b) for a, b in zip(epochs[0], epochs[1]))
    assert np.array_equal(again(25), epochs[2][5])           # a resume at step 25 draws the same batch


def test_bundled_trainer_draws_and_accounts_balls_in_bins(tiny_model_dir, tmp_path):
    from dpaudit.training.runner import TrainConfig, train

    texts = [f"Alice number {i} lives in Paris and likes bread." for i in range(40)]
    cfg = TrainConfig(method="dp-sgd", target_epsilon=3.0, steps=12, batch_size=8, lr=1e-3, secret_seed=1,
                      sampling="balls-in-bins")
    run = train(tiny_model_dir, texts, tmp_path / "run", cfg, show_progress=False)
    assert run.accountant == "allocation" and run.epsilon <= 3.0
    ledger = json.loads((run.run_dir / "privacy_ledger.json").read_text())
    assert ledger["sampling"] == "balls-in-bins" and ledger["accountant"] == "allocation"
    with pytest.raises(DPAuditError, match="white-box"):
        TrainConfig(method="dp-sgd", target_epsilon=3.0, sampling="balls-in-bins", white_box=100)
    with pytest.raises(DPAuditError, match="draw poisson, balls-in-bins"):
        TrainConfig(method="dp-sgd", target_epsilon=3.0, sampling="shuffle")


def test_a_resumed_balls_in_bins_run_keeps_its_epochs_allocation(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 53, item 2: resumed mid-epoch without --secret-seed, the run drew a fresh allocation for the rest of
    the epoch (N 40, B 4, killed at step 3: 8 examples in two steps of epoch 0, 4 in none). The allocation secret
    is now kept (0600) and read back; the finished run removes it."""
    import dataclasses
    import os
    import stat

    from dpaudit.core.errors import Interrupted
    from dpaudit.training import samplers as samplers_module
    from dpaudit.training.runner import TrainConfig, train

    texts = [f"Alice number {i} lives in Paris and likes bread." for i in range(40)]
    cfg = TrainConfig(method="dp-sgd", target_epsilon=8.0, steps=10, batch_size=4, lr=1e-3, save_every=3,
                      sampling="balls-in-bins")
    drawn: dict[int, list[int]] = {}
    real = samplers_module.AllocationSchedule.__call__
    kill = {"at": 4}

    def recording(self, step):
        if step == kill["at"]:
            kill["at"] = None
            raise KeyboardInterrupt
        batch = real(self, step)
        drawn[step] = batch.tolist()
        return batch

    monkeypatch.setattr(samplers_module.AllocationSchedule, "__call__", recording)
    run = tmp_path / "run"
    with pytest.raises(Interrupted):
        train(tiny_model_dir, texts, run, cfg, show_progress=False)
    secret = run / "allocation_secret.json"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    train(tiny_model_dir, texts, run, dataclasses.replace(cfg, allow_overspend=True), resume=True,
          show_progress=False)
    epoch = np.concatenate([drawn[s] for s in range(10)])
    assert np.array_equal(np.sort(epoch), np.arange(40))     # every example exactly once in the epoch
    assert not secret.exists()


def test_a_log_opened_after_drawing_is_refused(tmp_path):
    """Issue 53, item 17: .log(path) after iterating wrote an empty file, silently."""
    from dpaudit.training.samplers import PoissonSampler

    for sampler in (PoissonSampler(50, 0.1, steps=3, seed=1), BallsInBinsSampler(50, 5, 2, seed=1)):
        list(sampler)
        with pytest.raises(DPAuditError, match="call .log\\(path\\) before drawing"):
            sampler.log(tmp_path / f"{type(sampler).__name__}.jsonl")
        assert not (tmp_path / f"{type(sampler).__name__}.jsonl").exists()


def _log_of(placements):
    """Batches from an epochs x N array of each example's step (each epoch: t steps)."""
    t = int(placements.max()) + 1
    return [np.flatnonzero(row == s).tolist() for row in placements for s in range(t)]


def test_the_audit_tests_which_step_each_example_lands_in():
    """Issue 53, item 6: balls-in-bins puts each example in a uniformly random step of each epoch, independently. A
    log with the right fingerprints (Binomial batch sizes, each example once an epoch) whose examples keep their
    step from one epoch to the next half the time is refused, naming the placement; a uniform allocation of the
    same size is accepted (the test can fail both ways)."""
    n, b, epochs = 60, 6, 40
    t = n // b
    rng = np.random.default_rng(5)
    fair = rng.integers(0, t, size=(epochs, n))
    sticky = fair.copy()
    for e in range(1, epochs):
        keep = rng.random(n) < 0.5
        sticky[e, keep] = sticky[e - 1, keep]
    verdict, matches, observed = analyse_as(_log_of(fair), "balls-in-bins", n, None, b)
    assert matches and observed == "balls-in-bins"
    placement = verdict.tests["placement of examples in steps"]
    assert placement["epochs"] == epochs and "refuted" not in placement
    verdict, matches, observed = analyse_as(_log_of(sticky), "balls-in-bins", n, None, b)
    assert not matches and observed != "balls-in-bins"
    assert "not uniformly random" in verdict.looks_like and "same step too often" in verdict.looks_like
    assert verdict.advice["p"] == 1.0  # no amplification is advised for it
    one_epoch = analyse_as(_log_of(fair[:1]), "balls-in-bins", n, None, b)[0]
    assert "not tested" in one_epoch.tests["placement of examples in steps"]["note"]


def test_the_placement_test_flags_a_uniform_allocation_at_most_alpha_of_the_time():
    """Thirty seeded uniform allocations (the null exactly): the four placement tails get alpha / 8 each (the other
    half of alpha is the fingerprints'), so refusals here are rare; more than three of thirty fails the test."""
    from dpaudit.audit.sampler import _placement_tests

    rng = np.random.default_rng(9)
    refused = sum("refuted" in _placement_tests(rng.integers(0, 5, size=(8, 40)), 5, 0.05 / 2, seed=3)
                  for _ in range(30))
    assert refused <= 3


def test_no_training_code_branches_on_a_samplers_name():
    """The trainers ask a sampler's BatchSource (training/batches.py) what it draws and needs; a comparison with a
    sampler's name anywhere else in training/ is a branch the record should carry."""
    import ast
    from pathlib import Path

    import dpaudit.training
    from dpaudit.accounting.samplers import names

    samplers = set(names())
    found = []
    for path in Path(dpaudit.training.__file__).parent.glob("*.py"):
        if path.name == "batches.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
                for part in parts:
                    values = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                    if any(isinstance(v, ast.Constant) and v.value in samplers for v in values):
                        found.append(f"{path.name}:{node.lineno}")
    assert not found, found
