"""The command line: answers, --json, exit codes, and one-line errors (never a traceback)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, dpaudit

DOCS = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_laplace_single_release_json():
    out = dpaudit("calibrate", "--mech", "laplace", "--eps", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["sigma"] == pytest.approx(0.25) and data["epsilon"] <= 4
    assert any("one release" in line for line in data["assumptions"])


def test_assumptions_name_the_accountant_that_answered():
    # delta below what a PLD grid resolves: rdp answers, and the assumptions say so (not "pld").
    out = dpaudit("epsilon", "--sigma", "1", "--p", "0.01", "-T", "100", "--delta", "1e-20", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["result"]["accountant"] == "rdp"
    assert any(line.startswith("accountant: rdp (pld was asked for") for line in data["assumptions"])


def test_check_passing_and_failing_examples():
    ok = dpaudit("check", str(DOCS / "passing.yaml"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["passed"] is True
    bad = dpaudit("check", str(DOCS / "failing.toml"), "--json")
    assert bad.returncode == 1
    data = json.loads(bad.stdout)
    assert data["passed"] is False and data["excess_epsilon"] > 0 and data["minimal_sigma"] > 12


@pytest.mark.parametrize("args", [
    ["calibrate", "--eps", "0"],
    ["calibrate", "--eps", "-1"],
    ["calibrate", "--eps", "1", "--delta", "1.5"],
    ["calibrate", "--eps", "1", "--p", "1.5"],
    ["epsilon", "--sigma", "0"],
    ["epsilon", "--sigma", "1", "--p", "0.1", "-T", "0"],
    ["epsilon", "--sigma", "1", "--accountant", "nope"],
    ["epsilon", "--sigma", "1", "--p", "0.1", "-T", "10", "--accountant", "pure"],
    ["max-steps", "--sigma", "0.5", "--eps", "0.01", "--p", "0.5"],
    ["check", "/nonexistent/config.yaml"],
    ["calibrate", "--eps", "1", "-p", "0.1"],          # unknown option
    ["calibrate", "--p", "0.1"],                         # missing required option
    ["epsilon", "--sigma", "abc"],                      # not a number
    ["no-such-command"],
])
def test_bad_input_is_one_line_and_exit_2(args):
    assert_one_line_error(dpaudit(*args, timeout=120))


def test_unusable_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mechanism: gaussian\nnoise_multipler: 3\ntarget_epsilon: 1\ndelta: 1e-5\n")
    out = dpaudit("check", str(cfg))
    assert out.returncode == 2 and "did you mean 'noise_multiplier'" in out.stderr


@pytest.mark.parametrize("args", [
    ["calibrate", "--eps", "50", "-B", "16", "-N", "1000", "-T", "1000"],
    ["calibrate", "--eps", "1", "--delta", "1e-12", "-B", "16", "-N", "1000", "-T", "75000"],
    ["epsilon", "--sigma", "0.3", "--p", "1", "-T", "1000000"],
])
def test_extreme_valid_inputs_answer_in_bounded_time(args):
    out = dpaudit(*args, "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)


def test_plot_writes_png_and_does_not_overwrite(tmp_path):
    png = tmp_path / "curve.png"
    out = dpaudit("plot", "--vs", "sigma", "--eps", "1", "--p", "0.01", "-T", "1000", "-o", str(png), "--points", "5")
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = dpaudit("plot", "--vs", "sigma", "--p", "0.01", "-T", "1000", "-o", str(png), "--points", "5")
    assert again.returncode == 2 and "exists" in again.stderr


def test_delta_command_pld_and_tilted_mc_agree():
    args = ["delta", "--mech", "laplace", "--sigma", "16.3", "--p", "0.016", "-T", "3000", "--eps", "0.2", "--json"]
    pld = dpaudit(*args)
    assert pld.returncode == 0, pld.stderr
    mc = dpaudit(*args, "-a", "mc", "--mc-tilt", "--mc-samples", "20000")
    assert mc.returncode == 0, mc.stderr
    p, m = json.loads(pld.stdout)["result"], json.loads(mc.stdout)["result"]
    assert m["estimate"] == pytest.approx(p["upper"], rel=0.05)
    assert m["upper"] >= m["estimate"]


def test_canaries_cli_make_and_insert(tiny_model_dir, tmp_path):
    manifest = tmp_path / "c.json"
    made = dpaudit("canaries", "make", "-t", tiny_model_dir, "-o", manifest, "-m", "20", "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["m"] == 20
    again = dpaudit("canaries", "make", "-t", tiny_model_dir, "-o", manifest, "-m", "20")
    assert again.returncode == 2 and "exists" in again.stderr  # never overwritten silently
    data = tmp_path / "d.txt"
    data.write_text("one example\nanother example\n")
    out = dpaudit("canaries", "insert", "-c", manifest, "-d", data, "-o", tmp_path / "o.txt", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["original_examples"] == 2
    assert data.read_text() == "one example\nanother example\n"


@pytest.mark.parametrize("content,message", [
    ("score,member\n0.1,1\n", "no non-member"),
    ("score,member\nabc,1\n0.2,0\n", "number score"),
    ("s,m\n0.1,1\n", "score,member"),
    ("score,member\nnan,1\n0.2,0\n", "NaN"),
    ("score,member\n0.1,1\n0.2,0\n0.3,1\n", "vacuous"),  # delta 0.4 >= 1/m
])
def test_audit_scores_bad_files(tmp_path, content, message):
    f = tmp_path / "s.csv"
    f.write_text(content)
    out = dpaudit("audit", "scores", f, "--claimed-eps", "1", "--delta", "0.4")
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_version_and_plain_progress_lines_in_logs(tmp_path, tiny_model_dir):
    out = dpaudit("--version")
    assert out.returncode == 0 and out.stdout.startswith("dpaudit ")
    data = tmp_path / "d.txt"
    data.write_text("".join(f"example number {i}\n" for i in range(20)))
    run = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", tmp_path / "run", "--eps", "8",
                  "--steps", "3", "-B", "4", "--threads", "1")
    assert run.returncode == 0, run.stderr
    # stderr is a pipe here, as in CI or nohup: plain progress lines, with the step, loss and eps spent
    assert "dp-sgd: 3/3 (100%)" in run.stderr and "eps spent" in run.stderr
    assert "FutureWarning" not in run.stderr


def test_a_process_in_a_process_group_leaves_without_finalizing_and_keeps_its_output_and_exit_code():
    """A torchrun rank ends through exit_process (os._exit after flushing): torch's C++ threads that touch
    Python during finalization can abort a finished run. The atexit line shows whether finalization ran."""
    script = ("import atexit, sys; import dpaudit.training.distributed as d; d._joined = True; "
              "atexit.register(lambda: print('finalized')); from dpaudit.cli.main import run; run(sys.argv[1:])")

    def rank(*args):
        return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)

    ok = rank("calibrate", "--mech", "laplace", "--eps", "4", "--json")  # stdout is a pipe: block-buffered
    assert ok.returncode == 0, ok.stderr
    assert "finalized" not in ok.stdout and json.loads(ok.stdout)["sigma"] == pytest.approx(0.25)
    bad = rank("calibrate", "--eps", "0")
    assert_one_line_error(bad)
    assert "finalized" not in bad.stdout
