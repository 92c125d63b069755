"""Kill a run at every rename and every release write of a short run, and check the ledger never
under-counts: after each kill, the steps the ledger counts cover every step whose output was written (the
DP-ZO log, the white-box transcript, an intact checkpoint), and after --resume the ledger covers every
release of both attempts. A kill is simulated in process by raising a BaseException that no handler in
dpaudit catches (like SIGKILL, it stops the run between two system calls; unlike it, ``finally`` blocks
run, which only release the lock and close files). One test kills a real process with strace, where
strace is installed."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest

from dpaudit.audit import whitebox_canaries as whitebox
from dpaudit.probes import transcript
from dpaudit.training import checkpoint, zo
from dpaudit.training.runner import TrainConfig, train

TEXTS = [f"Alice number {i} lives in Paris and likes bread." for i in range(30)]
STEPS = 4


class Killed(BaseException):
    """The simulated SIGKILL."""


class _Events:
    """Counts renames and release writes; raises Killed at the ``at``-th (0: never)."""

    def __init__(self, at: int):
        self.at, self.n = at, 0

    def tick(self) -> None:
        self.n += 1
        if self.n == self.at:
            raise Killed


class _KillableFile:
    def __init__(self, fh, events):
        self.fh, self.events = fh, events

    def write(self, data):
        self.events.tick()
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)


def _patch(monkeypatch, events) -> None:
    real_replace, real_open = os.replace, open

    def replace(*args, **kwargs):
        events.tick()
        return real_replace(*args, **kwargs)

    def killable_open(*args, **kwargs):
        return _KillableFile(real_open(*args, **kwargs), events)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(zo, "open", killable_open, raising=False)  # the DP-ZO (seed, scalar) log
    monkeypatch.setattr(transcript, "open", killable_open, raising=False)  # the DP-SGD white-box transcript


def _released(run) -> int:
    """Steps whose output a kill may have left readable."""
    steps = 0
    if (run / "zo_steps.jsonl").is_file():
        steps = len((run / "zo_steps.jsonl").read_text().splitlines())
    transcript = run / whitebox.TRANSCRIPT
    if transcript.is_file():
        steps = max(steps, transcript.stat().st_size // (4 * 4))
    for name in (checkpoint.FINAL, checkpoint.TMP, checkpoint.OLD):
        steps = max(steps, checkpoint.intact_step(run / name) or 0)
    if (run / "model").is_dir():
        steps = STEPS
    return steps


def _counted(run) -> int:
    ledger = run / "privacy_ledger.json"
    return json.loads(ledger.read_text())["steps_executed"] if ledger.is_file() else 0


CONFIGS = {
    "dp-zo": TrainConfig(method="dp-zo", sigma=2.0, steps=STEPS, batch_size=8, lr=1e-3, save_every=2,
                         secret_seed=3, allow_overspend=True),
    "dp-sgd": TrainConfig(method="dp-sgd", sigma=2.0, steps=STEPS, batch_size=8, save_every=2, secret_seed=3,
                          allow_overspend=True, white_box=4),
}


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_a_kill_at_any_rename_or_release_never_leaves_the_ledger_under_counting(method, tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    cfg = CONFIGS[method]
    dry = _Events(0)
    with monkeypatch.context() as m:
        _patch(m, dry)
        train(tiny_model_dir, TEXTS, tmp_path / "dry", cfg, show_progress=False)
    assert dry.n >= 3 * STEPS  # a ledger write and a release a step, and the checkpoint's renames
    for at in range(1, dry.n + 1):
        run = tmp_path / f"kill{at}"
        with monkeypatch.context() as m:
            _patch(m, _Events(at))
            with pytest.raises(Killed):
                train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)
        released = _released(run)
        assert _counted(run) >= released, f"killed at event {at}: {released} steps released, ledger counts fewer"
        if (run / "model").is_dir():
            continue  # killed after the model was written: nothing to resume
        start = max(checkpoint.intact_step(run / name) or 0 for name in (checkpoint.FINAL, checkpoint.TMP,
                                                                       checkpoint.OLD))
        if not (run / "run_config.json").is_file():
            shutil.rmtree(run)
            train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)
            continue
        train(tiny_model_dir, TEXTS, run, cfg, resume=True, show_progress=False)
        assert _counted(run) >= released + STEPS - start, f"killed at event {at}: the resumed ledger under-counts"
        ledger = json.loads((run / "privacy_ledger.json").read_text())
        assert ledger["steps_in_model"] == STEPS and ledger["epsilon_total"] >= ledger["epsilon_planned"]


def test_resume_takes_the_newest_intact_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """Killed between the checkpoint's two swaps (checkpoint -> .old, .tmp -> checkpoint): both copies are
    intact, and the resume continues from the newer (.tmp, step 4) instead of restarting from step 0."""
    cfg = dataclasses.replace(CONFIGS["dp-zo"], steps=6)
    run = tmp_path / "run"
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(src).endswith(checkpoint.TMP) and str(dst).endswith(checkpoint.FINAL) and (run / checkpoint.OLD).exists():
            raise Killed
        return real_replace(src, dst, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        with pytest.raises(Killed):
            train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)
    assert not (run / checkpoint.FINAL).exists()
    assert checkpoint.intact_step(run / checkpoint.TMP) == 4 and checkpoint.intact_step(run / checkpoint.OLD) == 2
    train(tiny_model_dir, TEXTS, run, cfg, resume=True, show_progress=False)
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    assert ledger["steps_discarded_by_resume"] == 0 and ledger["steps_executed"] == 6


def test_a_checkpoint_with_a_changed_file_is_not_trusted(tiny_model_dir, tmp_path, monkeypatch):
    from dpaudit.training import runner

    cfg = dataclasses.replace(CONFIGS["dp-sgd"], white_box=0)
    run = tmp_path / "run"

    def killed(*args, **kwargs):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(runner, "_export", killed)  # killed as the model is exported: the step-2 checkpoint stays
        with pytest.raises(Killed):
            train(tiny_model_dir, TEXTS, run, cfg, show_progress=False)
    saved = run / checkpoint.FINAL
    assert checkpoint.intact_step(saved) == 2
    original = (saved / checkpoint.STATE).read_bytes()
    (saved / checkpoint.STATE).write_text(json.dumps({**json.loads(original), "step": None}))
    assert checkpoint.intact_step(saved) is None
    (saved / checkpoint.STATE).write_bytes(original)
    assert checkpoint.intact_step(saved) == 2
    (saved / checkpoint.OPTIMIZER).write_bytes(b"")  # truncated, or a file made to look like ours
    assert checkpoint.intact_step(saved) is None
    train(tiny_model_dir, TEXTS, run, cfg, resume=True, show_progress=False)  # from step 0, all counted
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    assert ledger["steps_executed"] == STEPS + STEPS and ledger["steps_discarded_by_resume"] == STEPS


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_sigkill_at_a_rename_of_a_real_process(tiny_model_dir, tmp_path):
    """The same check with a real SIGKILL (strace injects it at the 5th rename: mid-run)."""
    data = tmp_path / "data.txt"
    data.write_text("\n".join(TEXTS) + "\n")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dpaudit.cli.main", "train", "--model", str(tiny_model_dir), "-d", str(data),
           "-o", str(run), "--method", "dp-zo", "--sigma", "2", "-T", str(STEPS), "-B", "8", "--save-every", "2",
           "--threads", "1", "--json"]
    done = subprocess.run(["strace", "-f", "-o", os.devnull, "-e", "trace=rename",
                           "-e", "inject=rename:signal=SIGKILL:when=5", *cmd], capture_output=True, timeout=300)
    if done.returncode == 0 and b"ptrace" in done.stderr:
        pytest.skip("ptrace is not permitted here")
    assert done.returncode != 0
    assert _counted(run) >= _released(run)
