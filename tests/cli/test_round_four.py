"""Issue 53 (reliability, round four): what a new user trips on in the accounting commands and `check`.
Item 14: integers in scientific notation; 15: a flat training config; 16: a closed pipe is not a verdict, and a
schedule without -T says it accounts one step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_helpers import assert_one_line_error, dpaudit


def test_steps_in_scientific_notation_are_taken_where_exact():
    a = dpaudit("epsilon", "--sigma", "1", "--p", "0.01", "-T", "1e3", "--json")
    b = dpaudit("epsilon", "--sigma", "1", "--p", "0.01", "-T", "1000", "--json")
    assert a.returncode == 0 == b.returncode, a.stderr
    assert json.loads(a.stdout)["result"]["epsilon"] == json.loads(b.stdout)["result"]["epsilon"]
    assert dpaudit("epsilon", "--sigma", "1", "-B", "2.56e2", "-N", "6e4", "-T", "1_000", "--json").returncode == 0
    for bad in ("1.5", "1e400", "ten"):
        assert_one_line_error(dpaudit("epsilon", "--sigma", "1", "--p", "0.01", "-T", bad))


def test_a_schedule_without_steps_says_it_accounts_one():
    out = dpaudit("epsilon", "--sigma", "1", "--p", "0.01")
    assert out.returncode == 0 and "one step (T = 1)" in out.stderr
    assert "one step" not in dpaudit("epsilon", "--sigma", "1", "--p", "0.01", "-T", "5").stderr


def _closed_early(*args) -> int:
    """Run dpaudit with stdout a pipe its reader closes after one byte (``| head -c 1``); its exit code."""
    proc = subprocess.Popen([sys.executable, "-m", "dpaudit.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()
    proc.wait(timeout=300)
    assert proc.stderr.read() == b""
    return proc.returncode


@pytest.mark.parametrize("as_json", [[], ["--json"]])
def test_a_closed_pipe_keeps_the_commands_own_exit_code(tmp_path, as_json):
    over, within = tmp_path / "over.yaml", tmp_path / "within.yaml"
    base = "sampling_rate: 0.01\nsteps: 1000\ntarget_epsilon: 8\ndelta: 1e-5\n"
    over.write_text("sigma: 0.3\n" + base)
    within.write_text("sigma: 1.0\n" + base)
    for _ in range(3):   # the race (the reader gone before or after the last write) went either way
        assert _closed_early("calibrate", "--eps", "1", "--p", "0.01", "-T", "1000", *as_json) == 0
        assert _closed_early("check", str(within), *as_json) == 0
        assert _closed_early("check", str(over), *as_json) == 1


def test_a_flat_training_config_ignores_its_other_keys(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("model: ./m\nlearning_rate: 0.001\nsigma: 1.0\nsampling_rate: 0.01\nsteps: 1000\n"
                   "target_epsilon: 8\ndelta: 1e-5\n")
    out = dpaudit("check", str(cfg), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ignored_keys"] == ["learning_rate", "model"]
    assert "ignored (not privacy keys): learning_rate, model" in dpaudit("check", str(cfg), "--verbose").stdout
    cfg.write_text("model: ./m\ndetla: 1e-6\nsigma: 1.0\nsampling_rate: 0.01\nsteps: 1000\ntarget_epsilon: 8\n"
                   "delta: 1e-5\n")
    out = dpaudit("check", str(cfg))
    assert_one_line_error(out)
    assert "did you mean 'delta'" in out.stderr
    cfg.write_text("privacy:\n  model: x\n  sigma: 1.0\n")   # under a section every key is a privacy key
    assert "unknown config key" in dpaudit("check", str(cfg)).stderr


def test_an_extended_embedded_model_keeps_the_embedded_learning_rates(tiny_model_dir, tmp_path):
    """Issue 53, item 13: `canaries extend` of the embedded default wrote no marker, so `train` took it for a
    pretrained model (DP-ZO lr 1e-6, not 3e-5)."""
    from dpaudit.cli.train_commands import _pretrained
    from dpaudit.models.embedded import is_embedded

    manifest = tmp_path / "c.json"
    assert dpaudit("canaries", "make", "-t", tiny_model_dir, "-o", manifest, "-m", "20").returncode == 0
    out = dpaudit("canaries", "extend", "--model", tiny_model_dir, "-c", manifest, "-o", tmp_path / "ext")
    assert out.returncode == 0, out.stderr
    assert is_embedded(tmp_path / "ext") and not _pretrained(tmp_path / "ext")


def test_compare_says_why_a_row_has_no_number():
    """Issue 53, item 17: compare printed "—" for the lower bounds with no reason."""
    out = dpaudit("compare", "--sigma", "1", "-B", "16", "-N", "1000", "-T", "30", "--sampling", "all", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert all(r["epsilon"] is not None or r.get("why") for r in rows)
    lower = next(r for r in rows if r["sampler"] == "balls-in-bins" and r["bound"] == "lower")
    assert "no complete epoch" in lower["why"]


def test_an_infinite_monte_carlo_answer_says_why():
    from dpaudit.accounting.mechanism import schedule
    from dpaudit.accounting.montecarlo import MonteCarloSettings, epsilon

    result = epsilon(schedule("gaussian", 1.0, 0.01, None, None, 100), 1e-5, MonteCarloSettings(samples=2000))
    assert result.epsilon == float("inf")
    assert "inf: no eps up to" in result.guarantee and "--mc-samples" in result.guarantee


def test_train_check_inputs_answers_before_any_rank_starts(tmp_path):
    """Issue 53, item 5: under torchrun a bad input's exit 2 reaches the shell as 1; `train --check-inputs` with the
    same flags says 2 first, in one process, without loading weights."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "d.txt"
    data.write_text("one example\nanother example\n")
    base = ["train", "--method", "dp-sgd", "--eps", "8", "-B", "1", "-T", "2", "--check-inputs"]
    assert_one_line_error(dpaudit(*base, "--model", model, "--data", tmp_path / "nonexist.txt", "-o", tmp_path / "r"))
    assert_one_line_error(dpaudit(*base, "--model", tmp_path / "nomodel", "--data", data, "-o", tmp_path / "r"))
    assert_one_line_error(dpaudit(*base, "--model", data.parent / "d.txt", "--data", data, "-o", tmp_path / "r"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert_one_line_error(dpaudit(*base, "--model", model, "--data", data, "-o", tmp_path / "busy"))
    ok = dpaudit(*base, "--model", model, "--data", data, "-o", tmp_path / "r", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["inputs"] == "usable" and not (tmp_path / "r").exists()
