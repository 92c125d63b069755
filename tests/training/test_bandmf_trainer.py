"""The bundled DP-SGD trainer with correlated noise (BandMF): the noise it adds is C^-1 z, its batches are cyclic
Poisson, one band is DP-SGD bit for bit, and what it does not run with is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpaudit.core.errors import DPAuditError
from correlated_helpers import FixedDrawNoise, dense, killed_run




def test_the_noise_added_is_the_inverse_strategy_applied_to_the_draws():
    rng = np.random.default_rng(0)
    steps, coefs = 12, np.array([0.7, 0.5, 0.3, 0.2])
    coefs = coefs / np.linalg.norm(coefs)
    draws = rng.normal(size=(steps, 5))
    noise = FixedDrawNoise(torch.tensor(draws))
    noise.noise_coefs = tuple(coefs)
    added = []
    for _ in range(steps):
        out = torch.zeros(5, dtype=torch.float64)
        noise.draw_noise([out], 2.0)
        added.append(out.numpy())
    c = dense(coefs, steps)
    np.testing.assert_allclose(np.array(added), np.linalg.solve(c, 2.0 * draws), rtol=1e-10, atol=1e-12)
    assert len(noise._past) == coefs.size - 1   # memory: b - 1 earlier noises, no more


def test_cyclic_batches_visit_each_example_only_in_its_group():
    from dpaudit.training.batches import cyclic_source

    draw = cyclic_source(4)(100, 10, 0, np.random.default_rng(1))
    seen = {}
    sizes = []
    for step in range(400):
        idx = draw(step)
        sizes.append(idx.size)
        for i in idx:
            seen.setdefault(int(i), set()).add(step % 4)
    assert all(groups == {i % 4} for i, groups in seen.items())
    assert np.mean(sizes) == pytest.approx(10, rel=0.1)   # the expected batch stays p N


def _train(tiny_model_dir, out, **kw):
    from dpaudit.models.corpus import sentences
    from dpaudit.training.runner import TrainConfig, train

    cfg = TrainConfig(method="dp-sgd", target_epsilon=4.0, steps=6, batch_size=8, secret_seed=11, **kw)
    return train(tiny_model_dir, sentences(80, seed=3), out, cfg, show_progress=False)


def test_one_band_is_dp_sgd_bit_for_bit(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    # at one sigma (calibration's two searches may stop at neighbouring sigmas within their tolerance)
    plain = _train(tiny_model_dir, tmp_path / "plain", sigma=0.9)
    band = _train(tiny_model_dir, tmp_path / "band", noise="bandmf,b=1", sigma=0.9)
    assert band.epsilon == plain.epsilon and band.accountant == "bandmf"
    a, b = (load_file(r.model_dir / "model.safetensors") for r in (plain, band))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_banded_run_is_accounted_and_recorded(tiny_model_dir, tmp_path):
    run = _train(tiny_model_dir, tmp_path / "b3", noise="bandmf,b=3")
    assert run.accountant == "bandmf" and run.epsilon <= 4.0
    header = json.loads((run.run_dir / "privacy_ledger.json").read_text())
    assert header.get("noise") == "bandmf,b=3" and header.get("accountant") == "bandmf"


def test_a_white_box_banded_run_is_audited_along_its_strategy(tiny_model_dir, tmp_path):
    """White-box canaries in a BandMF run: the audit reads their releases along C's columns (audit/correlated.py),
    as rounds at rate p b, and its bound stays below the claim."""
    from dpaudit.audit.whitebox import BANDMF, audit_run_folder

    run = _train(tiny_model_dir, tmp_path / "wb", noise="bandmf,b=2", white_box=400)
    result, _, _, facts = audit_run_folder(run.run_dir, claimed_epsilon=run.epsilon, delta=1e-5)
    assert facts["statistic"] == BANDMF and facts["steps"] == 2   # T = 6, b = 2: whole rounds s + b <= T
    assert result.epsilon_lower_bound <= run.epsilon


@pytest.mark.parametrize("extra,why", [({"method": "dp-zo"}, "first-order"),
                                       ({"noise": "blt,theta=0.9,omega=0.5"}, "balls-in-bins")])
def test_what_correlated_noise_does_not_run_with_is_refused(extra, why):
    from dpaudit.training.runner import TrainConfig

    kw = {"method": "dp-sgd", "target_epsilon": 4.0, "steps": 6, "noise": "bandmf,b=2", **extra}
    with pytest.raises(DPAuditError, match=why):
        TrainConfig(**kw)


def test_audit_run_takes_correlated_noise_and_audits_along_the_strategy(tmp_path):
    """`dpaudit audit run --white-box --noise bandmf,b=B`: the run is accounted by bandmf and its transcript read
    along the strategy's columns; p b > 1 (full batches) is refused in one line."""
    from cli_helpers import assert_one_line_error, dpaudit

    out = dpaudit("audit", "run", "--white-box", "--method", "dp-sgd", "--eps", "4", "-B", "16", "-T", "24",
                  "-m", "400", "--noise", "bandmf,b=4", "--secret-seed", "3", "--out", tmp_path / "run", "--json",
                  "--threads", "1")
    assert out.returncode == 0, out.stderr[-500:]
    result = json.loads(out.stdout)
    assert result["training"]["accountant"] == "bandmf" and not result["violation"]
    assert "BandMF" in result["context"]["statistic"] and result["epsilon_lower_bound"] <= 4.0
    assert_one_line_error(dpaudit("audit", "run", "--white-box", "--method", "dp-sgd", "--eps", "4", "--noise",
                                  "bandmf,b=4", "--out", tmp_path / "full", "--json"))


def test_a_resumed_attempt_continues_the_strategy_with_fresh_draws():
    """The premise of the resumed accounting (accounting/matrix/bandmf.py): an attempt resumed at step s from a
    checkpoint's noise state, with fresh draws z', releases what, multiplied by C (the earlier releases public),
    is z' on its rows: C w = z' at t >= s, with w before s the first attempt's."""
    rng = np.random.default_rng(1)
    steps, s, coefs = 10, 4, np.array([0.7, 0.5, 0.3, 0.2])
    coefs = coefs / np.linalg.norm(coefs)
    first_draws, fresh = rng.normal(size=(7, 3)), rng.normal(size=(steps - s, 3))

    def noises(noise, n):
        out = []
        for _ in range(n):
            w = torch.zeros(3, dtype=torch.float64)
            noise.draw_noise([w], 1.0)
            out.append(w.numpy())
        return out

    first = FixedDrawNoise(torch.tensor(first_draws))
    first.noise_coefs = tuple(coefs)
    early = noises(first, s)
    saved = first.noise_state()            # the checkpoint at step s
    noises(first, 3)                       # steps s .. s + 2 released, then the kill
    resumed = FixedDrawNoise(torch.tensor(fresh))
    resumed.noise_coefs = tuple(coefs)
    resumed.load_noise_state(saved, [torch.zeros(3, dtype=torch.float64)])
    w = np.array(early + noises(resumed, steps - s))
    c = dense(coefs, steps)
    np.testing.assert_allclose((c @ w)[s:], fresh, rtol=1e-10, atol=1e-12)
    with pytest.raises(DPAuditError, match="noise state"):
        resumed.load_noise_state(saved, [torch.zeros(4, dtype=torch.float64)])


def _killed_banded(tiny_model_dir, run, monkeypatch, kill_at=5, **kw):
    """A BandMF run (b = 3, T 8, checkpoints every 2 steps) killed at its ``kill_at``-th step."""
    return killed_run(tiny_model_dir, run, monkeypatch, kill_at, **kw)


def test_a_killed_banded_run_resumes_and_counts_each_coin_across_its_attempts(tiny_model_dir, tmp_path, monkeypatch):
    from dpaudit.accounting.matrix import bandmf
    from dpaudit.accounting.matrix.strategy import Strategy
    from dpaudit.accounting.mechanism import Mechanism
    from dpaudit.models.corpus import sentences
    from dpaudit.training.runner import train

    run = tmp_path / "run"
    cfg = _killed_banded(tiny_model_dir, run, monkeypatch)
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["attempt"] == 0
    result = train(tiny_model_dir, sentences(80, seed=3), run, cfg, resume=True, show_progress=False)
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    assert ledger["attempts"] == [[0, 5, None], [4, None, 0]] and ledger["steps_executed"] == 9
    mech = Mechanism("gaussian", 1.0, result.sampling_rate, 8, strategy=Strategy("bandmf", bands=3))
    resumed = bandmf.resumed_epsilon(mech, [(0, 5, None), (4, 8, 0)], cfg.delta).epsilon
    assert result.epsilon == pytest.approx(resumed, rel=1e-9) and result.accountant == "bandmf"
    assert result.epsilon > bandmf.epsilon(mech, cfg.delta).epsilon   # the redone step counts
    assert (run / "model" / "model.safetensors").is_file() and not (run / "checkpoint").exists()


def test_a_second_resume_from_the_same_checkpoint_keeps_the_first_attempts_lineage(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    from dpaudit.models.corpus import sentences
    from dpaudit.training.runner import train
    from dpaudit.training.sgd import FirstOrderTrainer

    run = tmp_path / "run"
    cfg = _killed_banded(tiny_model_dir, run, monkeypatch)
    real, calls = FirstOrderTrainer.run_step, []

    def dies_at_once(self, *args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:   # killed at its first step: no checkpoint of its own
        m.setattr(FirstOrderTrainer, "run_step", dies_at_once)
        with pytest.raises(Exception, match="interrupted"):
            train(tiny_model_dir, sentences(80, seed=3), run, cfg, resume=True, show_progress=False)
    train(tiny_model_dir, sentences(80, seed=3), run, cfg, resume=True, show_progress=False)
    ledger = json.loads((run / "privacy_ledger.json").read_text())
    assert ledger["attempts"] == [[0, 5, None], [4, 5, 0], [4, None, 0]]
    # the two resumes from step 4 (ledger counts 5, then 6) draw other batches and noise under one --secret-seed
    from dpaudit.training.streams import attempt_seed, step_key

    assert step_key(*attempt_seed(5, 4, 5)) != step_key(*attempt_seed(5, 4, 6))
    assert attempt_seed(5, 0, 0) == [5, 0]   # a first start draws as it always did


def test_a_checkpoint_without_its_noise_state_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    import torch as th

    from dpaudit.models.corpus import sentences
    from dpaudit.training import checkpoint
    from dpaudit.training.runner import train
    from dpaudit.training.sgd import NOISE_STATE

    run = tmp_path / "run"
    cfg = _killed_banded(tiny_model_dir, run, monkeypatch)
    folder = run / "checkpoint"
    state = th.load(folder / checkpoint.OPTIMIZER, weights_only=True)
    state.pop(NOISE_STATE)
    th.save(state, folder / checkpoint.OPTIMIZER)
    checkpoint.seal(folder, 4)   # a well-formed checkpoint that lacks the state (as from another tool)
    with pytest.raises(DPAuditError, match="noise state"):
        train(tiny_model_dir, sentences(80, seed=3), run, cfg, resume=True, show_progress=False)



def test_a_resumed_white_box_banded_run_is_audited_along_its_lineage(tiny_model_dir, tmp_path, monkeypatch):
    """The transcript is cut back to the checkpoint on resume, so the audit reads one lineage of releases (the
    first attempt's rows before step 4, the resumed one's after): a BandMF run with fresh draws from step 4 on."""
    from dpaudit.audit.whitebox import BANDMF, audit_run_folder
    from dpaudit.audit.whitebox_canaries import TRANSCRIPT
    from dpaudit.models.corpus import sentences
    from dpaudit.training.runner import train

    run = tmp_path / "run"
    cfg = _killed_banded(tiny_model_dir, run, monkeypatch, white_box=400)
    res = train(tiny_model_dir, sentences(80, seed=3), run, cfg, resume=True, show_progress=False)
    assert (run / TRANSCRIPT).stat().st_size == 8 * 400 * 4   # T rows of m float32, no redone row
    result, _, _, facts = audit_run_folder(run, claimed_epsilon=res.epsilon, delta=1e-5)
    assert facts["statistic"] == BANDMF and result.epsilon_lower_bound <= res.epsilon


def test_a_banded_run_is_reproduced_bit_for_bit_from_its_secret_seed(tiny_model_dir, tmp_path):
    """DP-SGD releases whole gradients, so there is no log to replay (``dpaudit replay`` is DP-ZO's); what a
    correlated run owes instead: its batches and noises are position-addressable, so the same secret seed gives the
    same weights."""
    from safetensors.torch import load_file

    a, b = (_train(tiny_model_dir, tmp_path / name, noise="bandmf,b=3", sigma=0.9) for name in ("a", "b"))
    first, second = (load_file(r.model_dir / "model.safetensors") for r in (a, b))
    assert all(torch.equal(first[k], second[k]) for k in first)
