"""White-box audits of both trainers on the tiny model: canaries planted in the privatised releases, the
transcript (canary-aligned numbers only, never the secret seed), and planted bugs caught or not."""

import json

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit.audit.whitebox import audit_run_folder, transcript_scores
from dpaudit.models.corpus import sentences
from dpaudit.training.runner import TrainConfig, train
from dpaudit.audit.whitebox_canaries import MANIFEST, TRANSCRIPT

TEXTS = sentences(16, seed=3)


def run(tmp_path, tiny_model_dir, name, monkeypatch=None, bug=None, **kw):
    if bug:
        monkeypatch.setenv("DPAUDIT_ALLOW_BUGS", "1")
    cfg = TrainConfig(batch_size=0, secret_seed=5, plant_bug=bug, **kw)
    train(tiny_model_dir, TEXTS, tmp_path / name, cfg, show_progress=False)
    return tmp_path / name


def test_dp_sgd_gradient_canaries_and_transcript(tmp_path, tiny_model_dir):
    folder = run(tmp_path, tiny_model_dir, "sgd", method="dp-sgd", target_epsilon=4.0, steps=20, white_box=300)
    raw = np.fromfile(folder / TRANSCRIPT, dtype="<f4")
    assert raw.size == 20 * 300  # m floats a step: canary-aligned numbers, not gradients
    config = json.loads((folder / "run_config.json").read_text())
    assert "secret_seed" not in json.dumps(config) and config["config"]["white_box"] == 300
    assert len(json.loads((folder / MANIFEST).read_text())["coordinates"]) == 300
    stats, members, name, _ = transcript_scores(folder)
    assert name == "white-box-dp-sgd"
    scores = stats["alignment"]
    # full batches: a member adds +1 (in units of C) a step, so its mean score is T above a non-member's
    assert scores[members].mean() - scores[~members].mean() == pytest.approx(20, abs=6 * np.sqrt(20) * 2)
    result, *_ = audit_run_folder(folder, claimed_epsilon=4.0, delta=1e-5)
    assert result.headline == "gaussian" and not result.violation


@pytest.mark.parametrize("method,bug,extra", [
    ("dp-sgd", "noise-x0.1", {}),
    ("dp-sgd", "no-clip", {}),
    ("dp-zo", "public-noise-seed", {"lr": 1e-5}),
    ("dp-zo", "noise-x0.1", {"lr": 1e-5}),
    ("dp-zo", "no-clip", {"lr": 1e-5}),
])
def test_planted_bugs_are_caught(tmp_path, tiny_model_dir, monkeypatch, method, bug, extra):
    folder = run(tmp_path, tiny_model_dir, bug, monkeypatch, bug=bug, method=method, target_epsilon=1.0,
                 steps=40, white_box=200, **extra)
    assert json.loads((folder / "run_config.json").read_text())["config"]["plant_bug"] == bug
    result, _, _, facts = audit_run_folder(folder, claimed_epsilon=1.0, delta=1e-5)
    assert result.violation, (bug, result.epsilon_lower_bound, facts)


def test_correct_dp_zo_run_is_consistent(tmp_path, tiny_model_dir):
    folder = run(tmp_path, tiny_model_dir, "zo", method="dp-zo", target_epsilon=1.0, steps=40, white_box=200,
                 lr=1e-5)
    result, _, _, facts = audit_run_folder(folder, claimed_epsilon=1.0, delta=1e-5)
    # plain and public-noise replayed; full batches (p = 1): G_mu is the family itself, so no likelihood ratio
    assert not result.violation and facts["statistics tried"] == 2 and result.headline == "gaussian"


def test_a_poisson_sampled_run_is_read_through_its_own_family(tmp_path, tiny_model_dir):
    folder = run(tmp_path, tiny_model_dir, "poisson", method="dp-sgd", target_epsilon=4.0, steps=30, white_box=300)
    cfg = TrainConfig(batch_size=4, secret_seed=5, method="dp-sgd", target_epsilon=4.0, steps=30, white_box=300)
    train(tiny_model_dir, TEXTS, tmp_path / "p", cfg, show_progress=False)
    result, _, _, facts = audit_run_folder(tmp_path / "p", claimed_epsilon=4.0, delta=1e-5)
    assert facts["statistics tried"] == 3 and "likelihood-ratio scale (x C)" in facts
    assert result.headline == "gaussian-run" and not result.violation
    full, _, _, full_facts = audit_run_folder(folder, claimed_epsilon=4.0, delta=1e-5)
    assert full.headline == "gaussian" and full_facts["statistics tried"] == 2


def test_planted_bugs_are_gated_hidden_and_named(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("DPAUDIT_ALLOW_BUGS", raising=False)
    out = dpaudit("audit", "run", "--white-box", "--plant-bug", "no-clip", "--out", tmp_path / "x")
    assert_one_line_error(out)
    assert "DPAUDIT_ALLOW_BUGS" in out.stderr
    assert "plant-bug" not in dpaudit("audit", "run", "--help").stdout
    monkeypatch.setenv("DPAUDIT_ALLOW_BUGS", "1")
    out = dpaudit("train", "--model", tiny_model_dir, "-d", tmp_path / "d.txt", "-o", tmp_path / "r",
                  "--plant-bug", "public-noise-seed", "--method", "dp-sgd", "--eps", "1")
    assert_one_line_error(out)
    assert "applies to dp-zo" in out.stderr


def test_audit_transcript_command_reads_the_runs_claims(tmp_path, tiny_model_dir):
    folder = run(tmp_path, tiny_model_dir, "cli", method="dp-sgd", target_epsilon=2.0, steps=10, white_box=100)
    out = dpaudit("audit", "transcript", "--run", folder, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["delta"] == 1e-5 and data["claimed_epsilon"] <= 2.0
    assert data["score"]["name"] == "white-box-dp-sgd" and data["headline"]["bound"] == "gaussian"
