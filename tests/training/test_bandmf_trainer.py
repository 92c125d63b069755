"""The bundled DP-SGD trainer with correlated noise (BandMF): the noise it adds is C^-1 z, its batches are cyclic
Poisson, one band is DP-SGD bit for bit, and what it does not run with is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpaudit.core.errors import DPAuditError
from dpaudit.training.dp_step import CorrelatedNoise


class _Fixed:
    """The seam below CorrelatedNoise: adds the step's z (given by the test) instead of a stream's."""

    def __init__(self, draws):
        self.draws, self.t = draws, 0

    def draw_noise(self, tensors, std):
        for x in tensors:
            x.add_(self.draws[self.t] * std)
        self.t += 1


class _Noise(CorrelatedNoise, _Fixed):
    pass


def test_the_noise_added_is_the_inverse_strategy_applied_to_the_draws():
    rng = np.random.default_rng(0)
    steps, coefs = 12, np.array([0.7, 0.5, 0.3, 0.2])
    coefs = coefs / np.linalg.norm(coefs)
    draws = rng.normal(size=(steps, 5))
    noise = _Noise(torch.tensor(draws))
    noise.noise_coefs = tuple(coefs)
    added = []
    for _ in range(steps):
        out = torch.zeros(5, dtype=torch.float64)
        noise.draw_noise([out], 2.0)
        added.append(out.numpy())
    c = np.zeros((steps, steps))
    for i in range(steps):
        for k in range(min(i + 1, coefs.size)):
            c[i, i - k] = coefs[k]
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


@pytest.mark.parametrize("extra,why", [({"save_every": 2}, "checkpoints"),
                                       ({"method": "dp-zo"}, "first-order"), ({"noise": "blt,theta=0.9,omega=0.5"}, "blt")])
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
