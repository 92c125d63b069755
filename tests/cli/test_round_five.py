"""Issue 67 (reliability, round five): what a user's run trips on outside the probe. Item 12: --check-inputs runs the
run's own refusals; 13: --resume on a folder that holds no run; 10: a symbolic link as the run folder; 14: audit
sampler --bands on a log of negative indices or no batch; 15/21: check takes Opacus' key names."""

from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error, dpaudit


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {i} of town {i % 7}"}) + "\n" for i in range(200)))
    return path


@pytest.mark.parametrize("flags", [["--sigma", "0"], ["--sigma", "1", "-B", "100", "--noise", "bandmf,b=4"],
                                   ["--sigma", "1", "-B", "8", "--noise", "bandmf,b=4", "-T", "30000"]])
def test_check_inputs_refuses_what_the_run_refuses(tiny_model_dir, data, tmp_path, flags):
    """sigma 0, p b > 1 and a banded strategy past its T were "inputs usable" (exit 0) and then refused by the run."""
    out = dpaudit("train", "--model", tiny_model_dir, "--data", data, "-o", tmp_path / "run", *flags, "--check-inputs")
    assert_one_line_error(out)
    assert not (tmp_path / "run").exists()


def test_check_inputs_says_usable_for_a_run_that_runs(tiny_model_dir, data, tmp_path):
    out = dpaudit("train", "--model", tiny_model_dir, "--data", data, "-o", tmp_path / "run", "--sigma", "1", "-B", "8",
                  "--noise", "bandmf,b=4", "-T", "300", "--check-inputs")
    assert out.returncode == 0 and "inputs usable" in out.stdout, out.stderr


@pytest.mark.parametrize("inside", [None, "model"])
def test_resume_on_a_folder_that_holds_no_run_is_refused_and_nothing_is_left(tiny_model_dir, data, tmp_path, inside):
    """An empty or absent folder started a new run (exit 0); the user's own model/ read "the run is complete" and
    kept a lock file."""
    folder = tmp_path / "mine"
    if inside:
        (folder / inside).mkdir(parents=True)
    out = dpaudit("train", "--model", tiny_model_dir, "--data", data, "-o", folder, "--sigma", "1", "-T", "2",
                  "--resume")
    assert_one_line_error(out)
    assert "holds no dpaudit run to resume" in out.stderr
    assert sorted(p.name for p in folder.iterdir()) == ([inside] if inside else []) if folder.exists() else not inside


def test_a_run_folder_that_is_a_symbolic_link_is_refused(tiny_model_dir, data, tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    out = dpaudit("train", "--model", tiny_model_dir, "--data", data, "-o", tmp_path / "link", "--sigma", "1",
                  "-T", "2")
    assert_one_line_error(out)
    assert "not a plain folder" in out.stderr and not any((tmp_path / "target").iterdir())


@pytest.mark.parametrize("text, message", [("", "holds no batch"), ("[0, 1]\n[-1, 2]\n", "is negative")])
def test_audit_sampler_bands_refuses_what_the_poisson_mode_refuses(tmp_path, text, message):
    log = tmp_path / "batches.log"
    log.write_text(text)
    out = dpaudit("audit", "sampler", "--log", log, "--bands", "2")
    assert_one_line_error(out)
    assert message in out.stderr


def test_check_takes_opacus_key_names(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("target_epsilon: 8\ntarget_delta: 1.0e-5\nnoise_multiplier: 1.0\nsample_rate: 0.01\n"
                   "steps: 1000\nlearning_rate: 0.1\n")
    out = dpaudit("check", cfg, "--json")
    assert out.returncode == 0, out.stderr
    ours = tmp_path / "ours.yaml"
    ours.write_text("target_epsilon: 8\ndelta: 1.0e-5\nnoise_multiplier: 1.0\nsampling_rate: 0.01\nsteps: 1000\n")
    assert json.loads(out.stdout)["epsilon"] == json.loads(dpaudit("check", ours, "--json").stdout)["epsilon"]
    both = tmp_path / "both.yaml"
    both.write_text("target_epsilon: 8\ntarget_delta: 1.0e-5\ndelta: 1.0e-5\nnoise_multiplier: 1.0\n"
                    "sample_rate: 0.01\nsteps: 1000\n")
    out = dpaudit("check", both)
    assert_one_line_error(out)
    assert "both target_delta and delta" in out.stderr
