"""Reliability, round two (issue 30): a resume never re-accounts what was spent, nothing a user owns is
lost, every command is bounded, exit codes mean one thing, outputs are safe. (Kills at every rename and
release write: tests/training/test_ledger_faults.py.)"""

import fcntl
import json
import os
import stat
import struct
import time
from dataclasses import replace

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit.core.errors import DPAuditError

TEXTS = [f"Alice number {i} lives in Paris and likes bread." for i in range(30)]


# --- the ledger: a resume keeps what it accounts ---------------------------------------------------------

def _killed_run(tiny_model_dir, run, monkeypatch):
    """A DP-ZO run on TEXTS (p = 8/30) killed at its fifth step, with a checkpoint at step 4."""
    from dpaudit.training import zo
    from dpaudit.training.runner import TrainConfig, train

    cfg = TrainConfig(method="dp-zo", sigma=1.0, steps=6, batch_size=8, lr=1e-3, save_every=2, secret_seed=1,
                      allow_overspend=True)
    real, calls = zo.zo_step, []

    def dies_at_step_5(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(zo, "zo_step", dies_at_step_5)
        with pytest.raises(Exception, match="interrupted at step 4; the ledger counts 5 steps"):
            train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)
    return cfg


def test_resume_on_other_data_composes_a_new_phase_and_refuses_other_noise(tiny_model_dir, tmp_path, monkeypatch):
    import dpaudit
    from dpaudit.core import run_folder
    from dpaudit.training.runner import train

    run = tmp_path / "run"
    cfg = _killed_run(tiny_model_dir, run, monkeypatch)
    before = json.loads((run / "privacy_ledger.json").read_text())
    with pytest.raises(DPAuditError, match="another configuration .*sigma"):
        train(tiny_model_dir, TEXTS, run, replace(cfg, sigma=2.0), resume=True, show_progress=False)
    assert json.loads((run / "privacy_ledger.json").read_text()) == before  # nothing touched
    bigger = TEXTS + [f"Bob number {i} lives in Rome." for i in range(300)]
    result = train(tiny_model_dir, bigger, run, cfg, resume=True, show_progress=False)
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    old_p, new_p = before["sampling_rate"], ledger["sampling_rate"]
    assert new_p < old_p and [p["from_step"] for p in ledger["phases"]] == [0, 5]
    # The 5 released steps stay at the old rate; those run from the last checkpoint on take the new one.
    rerun = 6 - (5 - ledger["steps_discarded_by_resume"])
    assert rerun >= 1 and ledger["steps_executed"] == 5 + rerun
    composed = dpaudit.epsilon(phases=[{"sigma": 1.0, "p": old_p, "steps": 5},
                                       {"sigma": 1.0, "p": new_p, "steps": rerun}], delta=cfg.delta).epsilon
    assert result.epsilon == pytest.approx(composed, rel=1e-9)
    all_new = dpaudit.epsilon(sigma=1.0, p=new_p, steps=5 + rerun, delta=cfg.delta).epsilon
    assert result.epsilon > all_new  # re-accounting every step at the new p would have under-counted
    # The resumed run records the base model it started from, not its own checkpoint (replay needs it).
    assert json.loads((run / run_folder.RUN_CONFIG).read_text())["base_model"] == str(tiny_model_dir)


def test_a_ledger_that_does_not_say_what_ran_refuses_the_resume(tiny_model_dir, tmp_path):
    from dpaudit.training.runner import TrainConfig, train

    run = tmp_path / "run"
    run.mkdir()
    (run / "privacy_ledger.json").write_text(json.dumps({"steps_executed": None}))
    with pytest.raises(DPAuditError, match="spending is unknown"):
        train(tiny_model_dir, TEXTS, run, TrainConfig(method="dp-zo", sigma=1.0, steps=2, batch_size=8),
              resume=True, show_progress=False)


@pytest.mark.parametrize("tamper", ["deleted", "stripped", "phases-dropped"])
def test_a_resume_on_other_data_never_lowers_eps_when_the_ledger_is_gone_or_stripped(tiny_model_dir, tmp_path,
                                                                                    monkeypatch, tamper):
    """Issue 36: with the ledger deleted the resumed ledger read 13.53 (>= 19.91 composed); with sampling_rate,
    examples and data_sha256 removed, 13.93, below the 16.45 already recorded. Refused, never under-counted."""
    from dpaudit.training.resume import fingerprint as _fingerprint
    from dpaudit.training.runner import train

    run = tmp_path / "run"
    cfg = _killed_run(tiny_model_dir, run, monkeypatch)
    ledger_file = run / "privacy_ledger.json"
    ledger = json.loads(ledger_file.read_text())
    bigger = TEXTS + [f"Bob number {i} lives in Rome." for i in range(44)]
    if tamper == "deleted":
        ledger_file.unlink()
    elif tamper == "stripped":
        ledger_file.write_text(json.dumps({k: v for k, v in ledger.items()
                                           if k not in ("sampling_rate", "examples", "data_sha256")}))
    else:  # a ledger that claims the larger data all along, with the spending it already recorded
        ledger_file.write_text(json.dumps({**ledger, "sampling_rate": 8 / 74, "examples": 74,
                                           "data_sha256": _fingerprint(bigger),
                                           "epsilon_spent": ledger["epsilon_spent"]}))
    with pytest.raises(DPAuditError, match="spending is unknown"):
        train(tiny_model_dir, bigger, run, cfg, resume=True, show_progress=False)


# --- nothing a user owns is lost ------------------------------------------------------------------------

def _hold_lock(folder):
    """Another process's lock on ``folder`` (flock: a second open file description conflicts)."""
    from dpaudit.core.lock import LOCK

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, b"pid 4242 on elsewhere\n", 0)
    return fd


def test_force_never_removes_a_folder_a_live_run_holds(tmp_path):
    from dpaudit.core.atomic import guard_new_folder
    from dpaudit.core.lock import mark, remove_folder

    out = tmp_path / "X"
    out.mkdir()
    mark(out)
    (out / "run").mkdir()
    (out / "run" / "privacy_ledger.json").write_text("{}")
    fd = _hold_lock(out / "run")
    try:
        with pytest.raises(DPAuditError, match="in use by a running dpaudit process"):
            guard_new_folder(out, force=True)
        with pytest.raises(DPAuditError, match="in use by a running dpaudit process"):
            remove_folder(out / "run")
        assert (out / "run" / "privacy_ledger.json").is_file()
    finally:
        os.close(fd)
    remove_folder(out / "run")  # released: now it may go
    assert not (out / "run").exists()


def test_audit_run_force_refuses_while_a_run_inside_is_live(tmp_path):
    from dpaudit.core.lock import mark

    out = tmp_path / "X"
    out.mkdir()
    mark(out)
    (out / "summary.json").write_text("{}")
    fd = _hold_lock(out / "run")
    try:
        res = dpaudit("audit", "run", "--method", "dp-sgd", "--eps", "inf", "--steps", "1", "--canaries", "4",
                      "--examples", "20", "-B", "4", "--out", out, "--force")
        assert_one_line_error(res)
        assert "in use by a running dpaudit process (pid 4242" in res.stderr
        assert (out / "run").is_dir() and (out / "summary.json").is_file()
    finally:
        os.close(fd)


@pytest.mark.parametrize("exchange", [True, False])
def test_a_replaced_folder_stays_in_place_until_the_new_one_is_complete(tmp_path, monkeypatch, exchange):
    from dpaudit.core import atomic

    target = tmp_path / "ext1"
    target.mkdir()
    (target / "weights").write_text("old")
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    with pytest.raises(RuntimeError):
        with atomic.atomic_folder(target) as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("disk full")
    assert (target / "weights").read_text() == "old"
    # The swap itself fails (the second rename of the fallback, or the exchange): the old folder is back.
    real = os.replace
    calls = []

    def second_fails(src, dst):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", second_fails)
    if exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: (_ for _ in ()).throw(OSError(5, "EIO")))
    with pytest.raises(OSError):
        with atomic.atomic_folder(target) as tmp:
            (tmp / "weights").write_text("new")
    assert (target / "weights").read_text() == "old"
    monkeypatch.setattr(os, "replace", real)
    monkeypatch.undo()
    with atomic.atomic_folder(target) as tmp:
        (tmp / "weights").write_text("new")
    assert (target / "weights").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["ext1"]  # no leftovers


def test_outputs_inside_or_equal_to_an_input_are_refused(tmp_path):
    run = tmp_path / "R"
    (run / "model").mkdir(parents=True)
    (run / "model" / "keep").write_text("the run's model")
    res = dpaudit("replay", "--run", run, "-o", run / "model", "--force")
    assert_one_line_error(res)
    assert "is inside the run" in res.stderr and (run / "model" / "keep").is_file()
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    res = dpaudit("canaries", "insert", "-c", tmp_path / "c.json", "-d", data, "-o", data, "--force")
    assert_one_line_error(res)
    assert "is the dataset" in res.stderr and data.read_text() == '{"text": "a"}\n'
    res = dpaudit("canaries", "extend", "--model", tmp_path / "R" / "model", "-c", tmp_path / "c.json", "-o", run,
                  "--force")
    assert_one_line_error(res)
    assert "holds the model" in res.stderr


# --- every command is bounded ---------------------------------------------------------------------------

def _gguf_header(entries: list[bytes], version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(entries)) + b"".join(entries)


def _gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def test_a_gguf_with_a_huge_metadata_array_is_refused_before_it_is_read(tmp_path):
    key = _gguf_string(b"tokenizer.ggml.tokens")
    bomb = key + struct.pack("<IIQ", 9, 8, 5_000_000) + _gguf_string(b"a") * 1000  # claims 5M strings
    path = tmp_path / "bomb.gguf"
    path.write_bytes(_gguf_header([bomb]))
    began = time.monotonic()
    res = dpaudit("canaries", "make", "-t", path, "-o", tmp_path / "c.json")
    assert_one_line_error(res)
    assert "an array of 5000000 elements" in res.stderr and time.monotonic() - began < 60
    for hostile in (_gguf_header([key + struct.pack("<I", 8) + struct.pack("<Q", 1 << 40)]),  # a 1 TB string
                    _gguf_header([key + struct.pack("<IIQ", 9, 9, 3)]),  # arrays of arrays of...
                    b"GGUF" + struct.pack("<IQQ", 3, 10**9, 1)):  # a billion tensors
        path.write_bytes(hostile)
        assert_one_line_error(dpaudit("canaries", "make", "-t", path, "-o", tmp_path / "c.json"))


def test_the_gguf_cache_key_sees_a_header_changed_in_place(tmp_path):
    from dpaudit.models.gguf import scan_header

    entry = _gguf_string(b"general.name") + struct.pack("<I", 8) + _gguf_string(b"model-a")
    path = tmp_path / "m.gguf"
    path.write_bytes(_gguf_header([entry]))
    first = scan_header(path)
    st = path.stat()
    path.write_bytes(_gguf_header([entry.replace(b"model-a", b"model-b")]))  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the same mtime
    assert path.stat().st_size == st.st_size and scan_header(path) != first


def test_a_config_naming_1e8_layers_is_refused_at_once(tiny_model_dir, tmp_path):
    import shutil

    bomb = tmp_path / "bomb"
    shutil.copytree(tiny_model_dir, bomb)
    config = json.loads((bomb / "config.json").read_text())
    (bomb / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1e8}))
    res = dpaudit("audit", "checkpoint", "--model", bomb, "-c", tmp_path / "none.json", "--delta", "1e-5")
    assert_one_line_error(res)  # the manifest is missing, but the model is refused first or after: one line
    data = tmp_path / "d.txt"
    data.write_text("\n".join(TEXTS))
    res = dpaudit("train", "--model", bomb, "-d", data, "-o", tmp_path / "run", "--sigma", "1", "-T", "1")
    assert_one_line_error(res)
    assert "1e+08 layers" in res.stderr
    (bomb / "config.json").write_text(json.dumps({**config, "hidden_size": 10**6}))
    res = dpaudit("train", "--model", bomb, "-d", data, "-o", tmp_path / "run", "--sigma", "1", "-T", "1")
    assert_one_line_error(res)
    assert "parameters" in res.stderr
    (bomb / "config.json").write_text(" " * ((16 << 20) + 1))  # too large to read: refused, never skipped
    assert_one_line_error(dpaudit("train", "--model", bomb, "-d", data, "-o", tmp_path / "run", "--sigma", "1"))


def test_monte_carlo_workers_stop_at_the_timeout():
    began = time.monotonic()
    res = dpaudit("delta", "--sigma", "1", "--eps", "1", "--p", "0.01", "-T", "100000", "-a", "mc",
                  "--mc-samples", "100000000", "--mc-workers", "2", "--timeout", "4")
    assert_one_line_error(res)
    assert "time budget" in res.stderr and time.monotonic() - began < 40


def test_the_python_api_timeout_stops_the_call():
    from dpaudit import delta
    from dpaudit.accounting.montecarlo import MonteCarloSettings

    began = time.monotonic()
    with pytest.raises(DPAuditError, match="time budget"):
        delta(sigma=1.0, eps=1.0, p=0.01, steps=100_000, accountant="mc",
              options=MonteCarloSettings(samples=10**8, progress=False), timeout=1.0)
    assert time.monotonic() - began < 20


def test_scores_and_canary_counts_are_capped_before_anything_is_parsed(tmp_path):
    big = tmp_path / "big.csv"
    with open(big, "w") as fh:
        fh.write("score,member\n" + "0,1\n" * 1_000_001)
    res = dpaudit("audit", "scores", big, "--delta", "1e-5")
    assert_one_line_error(res)
    assert "at most 1000000" in res.stderr
    res = dpaudit("canaries", "make", "-t", tmp_path, "-m", "10000000", "-o", tmp_path / "c.json")
    assert_one_line_error(res)


def test_every_command_takes_timeout():
    for command in (["calibrate"], ["epsilon"], ["delta"], ["max-steps"], ["compare"], ["plot"], ["check"],
                    ["canaries", "make"], ["canaries", "insert"], ["canaries", "extend"], ["audit", "scores"],
                    ["audit", "checkpoint"], ["audit", "transcript"], ["audit", "run"], ["train"], ["replay"]):
        res = dpaudit(*command, "--help")
        assert res.returncode == 0 and "--timeout" in res.stdout and "--max-memory" in res.stdout, command


# --- exit codes mean one thing --------------------------------------------------------------------------

def test_nested_json_anywhere_is_one_line_exit_2(tmp_path):
    deep = "[" * 100_000
    manifest = tmp_path / "c.json"
    manifest.write_text(deep)
    assert_one_line_error(dpaudit("audit", "checkpoint", "--model", tmp_path, "-c", manifest, "--delta", "1e-5"))
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n' + deep + "\n")
    assert_one_line_error(dpaudit("canaries", "insert", "-c", manifest, "-d", data, "-o", tmp_path / "o.jsonl"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"config": {"method": "dp-zo", "clip": 1.0}}))
    (run / "whitebox_canaries.json").write_text(json.dumps({"m": 4, "seed": 0, "gain": 10.0,
                                                            "members": [1, 0, 1, 0], "coordinates": []}))
    (run / "zo_steps.jsonl").write_text(deep + "\n")
    assert_one_line_error(dpaudit("audit", "transcript", "--run", run, "--claimed-eps", "1", "--delta", "1e-5"))


def test_a_long_csv_field_is_read(tmp_path):
    from dpaudit.core.texts import read_texts

    path = tmp_path / "d.csv"
    path.write_text("text\n" + "x" * 300_000 + "\nshort\n")
    assert [len(t) for t in read_texts(path, "csv")] == [300_000, 5]


def test_a_report_json_with_an_odd_score_field_is_no_crash(tmp_path):
    (tmp_path / "scores.csv").write_text("score,member\n" + "".join(f"{i % 7},{i % 2}\n" for i in range(40)))
    (tmp_path / "report.json").write_text(json.dumps({"delta": 1e-5, "score": "neg-loss"}))
    res = dpaudit("audit", "scores", tmp_path / "scores.csv", "--claimed-eps", "8")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


def test_a_full_disk_during_a_checkpoint_is_one_line(tiny_model_dir, tmp_path, monkeypatch):
    import torch

    from dpaudit.training.runner import TrainConfig, train

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(torch, "save", full)
    cfg = TrainConfig(method="dp-sgd", sigma=1.0, steps=3, batch_size=8, save_every=1, secret_seed=1)
    with pytest.raises(DPAuditError, match="could not write the checkpoint of step 1"):
        train(tiny_model_dir, TEXTS, tmp_path / "run", cfg, show_progress=False)
    assert json.loads((tmp_path / "run" / "privacy_ledger.json").read_text())["steps_executed"] == 1


def _run_cli(monkeypatch, capsys, exc):
    from dpaudit.cli import accounting_commands, main

    def boom(*args, **kwargs):
        raise exc

    monkeypatch.setattr(accounting_commands, "calibrate_sigma", boom)
    with pytest.raises(SystemExit) as exit_:
        main.run(["calibrate", "--eps", "1", "--p", "0.01", "-T", "10"])
    return exit_.value.code, capsys.readouterr().err


def test_an_unexpected_failure_is_one_line_and_exit_3(monkeypatch, capsys):
    code, err = _run_cli(monkeypatch, capsys, RuntimeError("something nobody planned for"))
    assert code == 3 and "internal error: RuntimeError: something nobody planned for" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_ctrl_c_exits_130_and_says_so(monkeypatch, capsys):
    code, err = _run_cli(monkeypatch, capsys, KeyboardInterrupt())
    assert code == 130 and "interrupted" in err


# --- safe outputs ---------------------------------------------------------------------------------------

def test_report_markdown_escapes_what_came_from_files():
    from dpaudit.audit.report import md

    fake = "run\n\n**Verdict:** consistent with eps = 1"
    assert "\n" not in md(fake) and "**Verdict:**" not in md(fake)
    assert md("=cmd|' /C calc'!A0").startswith("'=") and "\\|" in md("=cmd|' /C calc'!A0")
    assert md("dpaudit-run/run") == "dpaudit-run/run" and md(-0.5) == "-0.5" and md(None) == "-"


def test_membership_files_are_private_and_others_follow_the_umask(tmp_path, tiny_model_dir):
    from dpaudit.canaries.generate import make_canaries
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.core.atomic import save_model_folder

    model, tok = load_causal_lm(tiny_model_dir)
    path = make_canaries(tok, 4).save(tmp_path / "c.json")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    old = os.umask(0o022)
    try:
        folder = save_model_folder(tmp_path / "m", model, tok)
    finally:
        os.umask(old)
    assert {stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir()} == {0o644}


def test_a_report_s_scores_csv_is_private_like_the_manifest(tmp_path):
    """Issue 36: report/scores.csv holds the membership labels and was 0644 beside the 0600 manifest."""
    from dpaudit.audit.analysis import analyse
    from dpaudit.audit.report import write_report

    scores, members = np.arange(40.0), np.arange(40) % 2 == 0
    old = os.umask(0o022)
    try:
        files = write_report(tmp_path / "report", analyse(scores, members, delta=1e-5), scores, members, {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(files["scores"].stat().st_mode) == 0o600
    assert stat.S_IMODE(files["json"].stat().st_mode) == 0o644


def test_a_config_s_single_phase_is_reported_with_its_own_sigma(tmp_path):
    """Issue 36: top-level sigma 10 with one phase at sigma 0.5 printed "sigma = 10 spends eps <= 13.36"."""
    config = tmp_path / "c.yaml"
    config.write_text("mechanism: gaussian\nnoise_multiplier: 10\ndelta: 1.0e-5\ntarget_epsilon: 1\n"
                      "phases:\n  - {noise_multiplier: 0.5, sampling_rate: 0.01, steps: 1000}\n")
    out = dpaudit("check", config)
    assert out.returncode == 1 and "sigma = 0.5 spends" in out.stdout and "sigma = 10 " not in out.stdout


def test_white_box_membership_is_not_a_batch_stream():
    from dpaudit.audit.whitebox_canaries import WhiteBoxCanaries

    members = WhiteBoxCanaries.make(1000, seed=0, membership_seed=12345).members
    for step in range(50):  # a batch stream is default_rng([secret, step])
        assert not np.array_equal(members, np.random.default_rng([12345, step]).random(1000) < 0.5)
    assert WhiteBoxCanaries.make(1000, seed=0, membership_seed=12345).members.tolist() == members.tolist()


def test_resume_takes_the_runs_own_flags(tiny_model_dir, tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("\n".join(TEXTS))
    run = tmp_path / "run"
    first = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", run, "--method", "dp-zo", "--sigma", "2",
                    "-T", "3", "-B", "8", "--lr", "1e-3", "--save-every", "2", "--json")
    assert first.returncode == 0, first.stderr
    # Only --resume: every flag comes from the run folder (a mismatch would be refused before "complete").
    again = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", run, "--resume")
    assert_one_line_error(again)
    assert "is complete" in again.stderr
    changed = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", run, "--resume", "-T", "5")
    assert "not as it was started: steps" in changed.stderr
