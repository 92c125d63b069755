"""The white-box probe on the user's own DP training: Opacus in every grad_sample_mode, a plain PyTorch
loop (the docs' example, run as written), scalar releases; bad input; independence from the user's RNG."""

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_helpers import dpaudit
from dpaudit import WhiteBoxProbe
from dpaudit.core.errors import DPAuditError
from dpaudit.probes.injector import Injector

warnings.filterwarnings("ignore", module="opacus")
N, B = 512, 64
SEED = 0  # the probes' secret_seed: membership and canary sampling fixed, so every verdict here is reproducible


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 20, generator=g)
    return X, (X[:, 0] > 0).long()


def _opacus(mode: str, sigma: float, seed: int = 0, clip: float = 1.0):
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    X, y = _data()
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=B)
    engine = PrivacyEngine(accountant="prv")
    criterion = torch.nn.CrossEntropyLoss()
    kw = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=sigma, max_grad_norm=clip,
              grad_sample_mode=mode)
    if mode == "ghost":
        model, optimizer, criterion, loader = engine.make_private(criterion=criterion, **kw)
    else:
        model, optimizer, loader = engine.make_private(**kw)
    return engine, model, optimizer, criterion, loader


def _train(model, optimizer, criterion, loader, steps: int) -> None:
    done = 0
    while done < steps:
        for xb, yb in loader:
            optimizer.zero_grad()
            criterion(model(xb), yb).backward()
            optimizer.step()
            done += 1
            if done == steps:
                return


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew", "ghost"])
def test_an_optimizer_without_noise_is_a_violation_in_every_mode(mode, tmp_path):
    engine, model, optimizer, criterion, loader = _opacus(mode, sigma=0.0)
    probe = WhiteBoxProbe.attach(optimizer, m=200, out=tmp_path / "probe", secret_seed=SEED)
    assert probe.rate == pytest.approx(B / N)  # the sample rate PrivacyEngine gave its accountant
    _train(model, optimizer, criterion, loader, 40)
    result = probe.audit(claimed_eps=1.0, delta=1e-5)
    assert result.violation and result.epsilon_lower_bound > 4
    report = (tmp_path / "probe" / "report" / "report.md").read_text()
    assert ("bypass" in report and "ghost" in report) if mode == "ghost" else "optimizer's own clipping" in report
    unclaimed = probe.audit(accountant=engine.accountant, delta=1e-5)  # Opacus' prv cannot account noise 0
    assert unclaimed.claimed_epsilon is None and unclaimed.epsilon_lower_bound > 4
    assert "noise multiplier is 0, so its eps is infinite" in (tmp_path / "probe" / "report" / "report.md").read_text()


def test_a_correct_opacus_run_is_consistent_and_the_cli_reads_the_same_folder(tmp_path):
    engine, model, optimizer, criterion, loader = _opacus("hooks", sigma=1.0)
    probe = WhiteBoxProbe.attach(optimizer, m=200, out=tmp_path / "probe", secret_seed=SEED, accountant=engine.accountant)
    _train(model, optimizer, criterion, loader, 60)
    result = probe.audit(delta=1e-5)  # claimed eps: the accountant's after the 60 steps taken
    assert sum(h[2] for h in engine.accountant.history) == 60 and result.claimed_epsilon == pytest.approx(
        engine.accountant.get_epsilon(delta=1e-5))
    assert not result.violation and 0 < result.epsilon_lower_bound < result.claimed_epsilon
    report = (tmp_path / "probe" / "report" / "report.md").read_text()
    assert "claimed eps from: PRVAccountant.get\\_epsilon" in report and "after the 60 steps taken" in report
    out = dpaudit("audit", "transcript", "--run", tmp_path / "probe", "--json")
    assert out.returncode == 0, out.stderr
    import json

    cli = json.loads(out.stdout)
    assert cli["epsilon_lower_bound"] == pytest.approx(result.epsilon_lower_bound)
    assert (tmp_path / "probe" / "whitebox_transcript.f32").stat().st_size == 60 * 200 * 4  # m x 4 bytes a step
    assert oct((tmp_path / "probe" / "whitebox_canaries.json").stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("steps", [1, 5])
def test_attaching_a_probe_changes_neither_the_users_rng_nor_their_noise(tmp_path, steps):
    """Same batches and noise: the user's RNG is where it would be, and after one step the weights differ
    only at the canary coordinates (later steps differ everywhere, the model having moved)."""
    after = {}
    for probed in (False, True):
        engine, model, optimizer, criterion, loader = _opacus("hooks", sigma=1.0, seed=3)
        probe = WhiteBoxProbe.attach(optimizer, m=500, out=tmp_path / f"p{probed}", secret_seed=SEED) if probed else None
        _train(model, optimizer, criterion, loader, steps)
        after[probed] = (torch.get_rng_state(), [p.detach().clone().reshape(-1) for p in optimizer.params], probe)
    assert torch.equal(after[False][0], after[True][0])
    if steps > 1:
        return
    probe = after[True][2]
    assert np.fromfile(probe.out / "whitebox_transcript.f32", dtype="<f4").size == 500
    touched = {(k, off) for k, off in probe.where}
    for k, (a, b) in enumerate(zip(after[False][1], after[True][1])):
        keep = torch.ones_like(a, dtype=torch.bool)
        for kk, off in touched:
            if kk == k:
                keep[off] = False
        assert torch.allclose(a[keep], b[keep], atol=1e-6)  # only the canary coordinates moved


def test_the_docs_plain_pytorch_example_runs_as_written(tmp_path, monkeypatch):
    text = (Path(__file__).resolve().parents[2] / "docs" / "auditing.md").read_text()
    code = re.search(r"\*\*Any PyTorch DP-SGD loop\*\*.*?```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 30
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(code, "docs/auditing.md", "exec"), scope)
    assert not scope["result"].violation and scope["result"].epsilon_lower_bound > 0


def _scalar_run(tmp_path, noise: float, steps: int = 300, m: int = 200):
    rng = np.random.default_rng(1)
    C, p = 1.0, 0.5
    probe = WhiteBoxProbe(kind="scalar", m=m, clip=C, sample_rate=p, out=tmp_path / f"scalar{noise}", secret_seed=SEED)
    for t in range(steps):
        data = np.clip(rng.normal(0, 1, rng.binomial(100, p)), -C, C).sum()
        probe.observe(t, data + probe.canary_sum(t) + rng.normal(0, noise * C))
    return probe


def test_scalar_releases_are_audited_the_same_way(tmp_path):
    assert _scalar_run(tmp_path, 0.0).audit(claimed_eps=1.0, delta=1e-5).violation
    honest = _scalar_run(tmp_path, 20.0).audit(claimed_eps=8.0, delta=1e-5)
    assert not honest.violation


def test_bad_input_is_one_line(tmp_path):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(DPAuditError, match="need as many trainable coordinates"):
        WhiteBoxProbe(list(model.parameters()), m=100, clip=1.0, sample_rate=0.1, out=tmp_path / "a")
    with pytest.raises(DPAuditError, match="takes an Opacus DPOptimizer"):
        WhiteBoxProbe.attach(torch.optim.SGD(model.parameters(), lr=0.1), m=4, out=tmp_path / "b")
    probe = WhiteBoxProbe(list(model.parameters()), m=4, clip=1.0, sample_rate=0.5, out=tmp_path / "c")
    probe.canary_gradients(0)
    with pytest.raises(DPAuditError, match="expected the release of step 0, got step 1"):
        probe.observe(1, [torch.zeros(2, 3), torch.zeros(2)])
    with pytest.raises(DPAuditError, match="not empty"):
        WhiteBoxProbe(list(model.parameters()), m=4, clip=1.0, sample_rate=0.5, out=tmp_path / "c")
    with pytest.raises(DPAuditError, match="m = 4; resume it as it was"):
        WhiteBoxProbe(list(model.parameters()), m=5, clip=1.0, sample_rate=0.5, out=tmp_path / "c", resume=True)


def test_a_probe_resumed_after_a_crash_keeps_only_complete_releases(tmp_path):
    model = torch.nn.Linear(30, 2)
    params = list(model.parameters())
    seed = 1  # of 8 canaries, seed 0 draws no member (1 in 256), and an audit needs both kinds
    probe = WhiteBoxProbe(params, m=8, clip=1.0, sample_rate=0.5, out=tmp_path / "p", secret_seed=seed)
    for t in range(3):
        probe.observe(t, [c + torch.randn_like(c) for c in probe.canary_gradients(t)])
    probe.close()
    with open(tmp_path / "p" / "whitebox_transcript.f32", "ab") as fh:
        fh.write(b"\0" * 10)  # killed in the middle of the fourth row
    again = WhiteBoxProbe(params, m=8, clip=1.0, sample_rate=0.5, out=tmp_path / "p", secret_seed=seed, resume=True)
    assert again.step == 3 and (tmp_path / "p" / "whitebox_transcript.f32").stat().st_size == 3 * 8 * 4
    again.observe(3, [c + torch.randn_like(c) for c in again.canary_gradients(3)])
    assert again.audit(claimed_eps=50.0, delta=1e-5, report=False).m == 8


def test_canary_examples_pass_through_the_users_own_clipping(tmp_path):
    """A loop that clips per-example gradients gets the canaries as rows before its clipping: clipped, they
    are C on their coordinate; a loop that forgets to clip releases gain x C, and the audit shows it."""
    model = torch.nn.Linear(40, 5)
    params = list(model.parameters())
    for clips in (True, False):
        probe = WhiteBoxProbe(params, m=100, clip=1.0, sample_rate=0.5, out=tmp_path / f"clips{clips}", secret_seed=SEED)
        gen = torch.Generator().manual_seed(0)
        for step in range(150):
            rows = probe.canary_examples(step)
            assert all(r.shape[1:] == p.shape for r, p in zip(rows, params))
            flat = torch.cat([r.reshape(len(rows[0]), -1) for r in rows], 1)
            norms = flat.norm(dim=1)
            factor = (1.0 / (norms + 1e-6)).clamp(max=1.0) if clips else torch.ones_like(norms)
            summed = [torch.einsum("i,i...", factor, r) for r in rows]
            probe.observe(step, [s + 8.0 * torch.randn(s.shape, generator=gen) for s in summed])
        from dpaudit import epsilon

        claimed = epsilon(sigma=8.0, p=0.5, steps=150, delta=1e-5).epsilon  # 3.26: what the loop spends
        result = probe.audit(claimed_eps=claimed, delta=1e-5, report=False)
        assert result.violation is (not clips), result.verdict


def test_attach_after_make_private_with_epsilon(tmp_path):
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    X, y = _data()
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=B)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader, target_epsilon=4.0,
        target_delta=1e-5, epochs=5, max_grad_norm=1.0)
    probe = WhiteBoxProbe.attach(optimizer, m=200, out=tmp_path / "probe", secret_seed=SEED, accountant=engine.accountant)
    _train(model, optimizer, torch.nn.CrossEntropyLoss(), loader, 5 * len(loader))
    result = probe.audit(delta=1e-5)
    assert result.claimed_epsilon == pytest.approx(4.0, rel=0.05) and not result.violation


def test_opacus_ddp_rank_zero_plants_and_reads_the_reduced_release(tmp_path):
    """Two gloo processes (Opacus DPDDP): rank 0's probe plants the canaries once and reads the gradient
    after the all-reduce (what every rank applies); the other rank's probe does nothing."""
    import os
    import subprocess
    import sys

    worker = Path(__file__).resolve().parents[1] / "probe_ddp_worker.py"
    for sigma, violation in (("0", "True"), ("1", "False")):
        out = tmp_path / f"ddp{sigma}"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(worker), str(out), sigma, "1" if sigma == "0" else "30"], capture_output=True,
                              text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                          "CUDA_VISIBLE_DEVICES": ""})
        assert done.returncode == 0, done.stderr[-2000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
        assert line.split()[1] == violation and line.split()[3] == "40", line
        assert (out / "whitebox_transcript.f32").stat().st_size == 40 * 200 * 4


def test_a_claim_in_the_parent_folder_never_overrides_the_probe_folder_s_own(tmp_path):
    """Issue 36: a probe folder with a real violation read "consistent with eps = 1000" once a run_config.json
    and privacy_ledger.json claiming 1000 sat in its parent."""
    import json

    probe = WhiteBoxProbe(kind="scalar", m=200, clip=1.0, sample_rate=0.5, out=tmp_path / "parent" / "probe",
                          secret_seed=SEED)
    rng = np.random.default_rng(1)
    for t in range(300):
        probe.observe(t, probe.canary_sum(t) + rng.normal(0, 0.01))
    assert probe.audit(claimed_eps=1.0, delta=1e-5).violation
    (tmp_path / "parent" / "run_config.json").write_text(json.dumps({"config": {"method": "dp-sgd", "delta": 1e-5}}))
    (tmp_path / "parent" / "privacy_ledger.json").write_text(json.dumps({"epsilon_total": 1000}))
    out = dpaudit("audit", "transcript", "--run", tmp_path / "parent" / "probe", "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["claimed_epsilon"] == 1.0, out.stdout


def _gradient_probe(out, steps=100, noise=0.3, m=200):
    model = torch.nn.Linear(40, 10)
    probe = WhiteBoxProbe(list(model.parameters()), m=m, clip=1.0, sample_rate=0.5, out=out, secret_seed=SEED)
    g = torch.Generator().manual_seed(2)
    for t in range(steps):
        probe.observe(t, [c + noise * torch.randn(c.shape, generator=g) for c in probe.canary_gradients(t)])
    probe.close()
    return probe, model


def test_probe_arguments_are_checked_in_one_line(tmp_path):
    """Issue 36: gain nan/inf put NaN in the user's sum, gain 0 raised ZeroDivisionError, m='8' a TypeError."""
    params = list(torch.nn.Linear(30, 2).parameters())
    for bad in ({"gain": float("nan")}, {"gain": float("inf")}, {"gain": 0.0}, {"m": "8"}, {"m": 1},
                {"clip": float("nan")}, {"sample_rate": 0.0}):
        kwargs = {"m": 8, "clip": 1.0, "sample_rate": 0.5, **bad}
        with pytest.raises(DPAuditError):
            WhiteBoxProbe(params, out=tmp_path / f"p{len(str(bad))}", **kwargs)


def test_a_release_without_its_canaries_or_of_the_wrong_shape_is_refused(tmp_path):
    model = torch.nn.Linear(30, 2)
    probe = WhiteBoxProbe(list(model.parameters()), m=8, clip=1.0, sample_rate=0.5, out=tmp_path / "p")
    with pytest.raises(DPAuditError, match=r"before the canaries of step 0 were drawn"):
        probe.observe(0, [torch.zeros(2, 30), torch.zeros(2)])
    probe.canary_gradients(0)
    with pytest.raises(DPAuditError, match="tensor 0 of 6 values"):
        probe.observe(0, [torch.zeros(2, 3), torch.zeros(2)])
    probe.observe(0, [torch.zeros(2, 30), torch.zeros(2)])


def test_resume_and_probe_json_are_checked_against_what_the_probe_wrote(tmp_path):
    import json

    probe, model = _gradient_probe(tmp_path / "p", steps=5, m=8)
    with pytest.raises(DPAuditError, match="same clip norm and sample rate"):
        WhiteBoxProbe(list(model.parameters()), m=8, clip=2.0, sample_rate=0.5, out=tmp_path / "p", resume=True)
    other = torch.nn.Linear(10, 40)  # as many values, other shapes
    with pytest.raises(DPAuditError, match="other shapes"):
        WhiteBoxProbe(list(other.parameters()), m=8, clip=1.0, sample_rate=0.5, out=tmp_path / "p", resume=True)
    spec = json.loads((tmp_path / "p" / "probe.json").read_text())
    (tmp_path / "p" / "probe.json").write_text(json.dumps({**spec, "clip": -1}))
    out = dpaudit("audit", "transcript", "--run", tmp_path / "p", "--claimed-eps", "1", "--delta", "1e-5")
    assert out.returncode == 2 and "refusing to audit it" in out.stderr


def test_an_empty_transcript_is_one_line(tmp_path):
    model = torch.nn.Linear(30, 2)
    WhiteBoxProbe(list(model.parameters()), m=8, clip=1.0, sample_rate=0.5, out=tmp_path / "p").close()
    out = dpaudit("audit", "transcript", "--run", tmp_path / "p", "--claimed-eps", "1", "--delta", "1e-5")
    assert out.returncode == 2 and "no released steps" in out.stderr


def test_a_few_outlying_releases_do_not_hide_a_violation(tmp_path):
    """Issue 36: one step's release set to 50 at 3 of 200 coordinates flipped a VIOLATION of 43 to consistent."""
    _gradient_probe(tmp_path / "p")
    clean = dpaudit("audit", "transcript", "--run", tmp_path / "p", "--claimed-eps", "1", "--delta", "1e-5", "--json")
    assert clean.returncode == 1
    raw = np.fromfile(tmp_path / "p" / "whitebox_transcript.f32", dtype="<f4").reshape(-1, 200)
    raw[7, :3] = 50.0
    raw.astype("<f4").tofile(tmp_path / "p" / "whitebox_transcript.f32")
    tampered = dpaudit("audit", "transcript", "--run", tmp_path / "p", "--claimed-eps", "1", "--delta", "1e-5")
    assert tampered.returncode == 1, tampered.stdout


def test_rows_kept_on_the_device_are_written_in_blocks_and_read_the_same(tmp_path, monkeypatch):
    """On a GPU a step's row waits on the device (no host synchronisation a step) and BLOCK_ROWS rows go to the
    transcript at once; forced here on the CPU: the file lags by less than a block, and flush (a checkpoint, an
    audit, close) writes the same transcript as one row a step does. One gather a tensor, not one read a canary."""
    from dpaudit.probes import probe as probe_module

    transcripts = {}
    for kept in (False, True):
        monkeypatch.setattr(Injector, "keeps_rows", staticmethod(lambda row, kept=kept: kept))
        engine, model, optimizer, criterion, loader = _opacus("hooks", sigma=1.0, seed=5)
        probe = WhiteBoxProbe.attach(optimizer, m=200, out=tmp_path / f"k{kept}", secret_seed=SEED)
        path = probe.out / "whitebox_transcript.f32"
        steps = probe_module.BLOCK_ROWS + 6
        _train(model, optimizer, criterion, loader, steps)
        written = path.stat().st_size // (4 * 200)
        assert written == (probe_module.BLOCK_ROWS if kept else steps)
        probe.flush()
        assert path.stat().st_size == steps * 200 * 4
        transcripts[kept] = np.fromfile(path, dtype="<f4")
        probe.close()
    assert np.array_equal(transcripts[False], transcripts[True])


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def _drop_noise_on(numel: int):
    """Patch Opacus' noise so that the tensor of ``numel`` values gets none (the MLP's tensor sizes are distinct)."""
    import opacus.optimizers.optimizer as plain
    import opacus.optimizers.optimizer_fast_gradient_clipping as ghost

    real = plain._generate_noise

    def noise(std, reference, generator=None, secure_mode=False):
        drawn = real(std, reference, generator=generator, secure_mode=secure_mode)
        return drawn * 0 if reference.numel() == numel else drawn
    return pytest.MonkeyPatch.context(), (plain, ghost), noise


SIZES = [64 * 20, 64, 64 * 64, 64, 640, 10]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_noise_missing_on_any_one_tensor_of_an_opacus_run_is_a_violation_that_names_it(mode, tmp_path):
    """Each trainable tensor in turn released without its noise (the rest correct, sigma for eps = 4): VIOLATION,
    naming that tensor, from canaries on every tensor and the noise each step added; the correct run is not."""
    from opacus import PrivacyEngine

    X, y = _data()
    y = (X[:, :4] @ torch.arange(1.0, 5.0)).argsort().argsort() * 10 // N
    for dropped in [None, 1280, 64, 4096, 640, 10]:  # 64: both hidden biases at once (the patch goes by size)
        context, modules, noise = _drop_noise_on(dropped or -1)
        with context as mp:
            for module in modules:
                mp.setattr(module, "_generate_noise", noise)
            model = _mlp()
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=32)
            engine, criterion = PrivacyEngine(accountant="prv"), torch.nn.CrossEntropyLoss()
            kw = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=loader,
                      noise_multiplier=1.2532, max_grad_norm=1.0, grad_sample_mode=mode)
            if mode == "ghost":
                model, optimizer, criterion, loader = engine.make_private(criterion=criterion, **kw)
            else:
                model, optimizer, loader = engine.make_private(**kw)
            probe = WhiteBoxProbe.attach(optimizer, m=60, out=tmp_path / f"{mode}{dropped}", secret_seed=SEED,
                                         model=model, data_loader=loader)
            _train(model, optimizer, criterion, loader, 30)
            result = probe.audit(claimed_eps=4.0, delta=1e-5)
        names = [t.name for t in result.noise.missing]
        if dropped is None:
            assert not result.violation and not names, result.verdict
        else:
            expected = [f"_module.{2 * (k // 2)}.{'bias' if k % 2 else 'weight'}" for k, n in enumerate(SIZES)
                        if n == dropped]
            assert result.violation and names == expected, result.verdict
            assert "trainable tensors were released with less than the accounted noise" in result.verdict


@pytest.mark.parametrize("measured", [True, False])
def test_noise_missing_on_any_one_tensor_of_a_plain_loop_is_a_violation(tmp_path, measured):
    """The plain loop's probe (noise_multiplier= given): with the clipped sums passed to observe (measured), dropping
    the noise of any one tensor reads VIOLATION naming it; from the canaries' releases alone too (the output bias,
    whose data gradient is as large as the noise, by the steps' differences), and the verdict of the correct run then
    says what releases alone cannot tell."""
    X, y = _data()
    sigma, rate = 2.0, 8 / N
    for dropped in [None, *range(len(SIZES))]:
        model = _mlp()
        params = list(model.parameters())
        probe = WhiteBoxProbe(params, m=60, clip=1.0, sample_rate=rate, out=tmp_path / f"plain{dropped}",
                              secret_seed=SEED, model=model, noise_multiplier=sigma)
        g = torch.Generator().manual_seed(1)
        for step in range(40):
            batch = torch.nonzero(torch.rand(N, generator=g) < rate).reshape(-1)
            clipped = [torch.zeros_like(p) for p in params]
            for i in batch:
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(X[i:i + 1]), y[i:i + 1]).backward()
                norm = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
                for c, p in zip(clipped, params):
                    c += p.grad * min(1.0, 1.0 / float(norm))
            canaries = probe.canary_gradients(step)
            released = [c + a + (0 if k == dropped else sigma * torch.randn(p.shape, generator=g))
                        for k, (c, a, p) in enumerate(zip(clipped, canaries, params))]
            probe.observe(step, released, clipped=[c + a for c, a in zip(clipped, canaries)] if measured else None)
            with torch.no_grad():
                for p, r in zip(params, released):
                    p -= 0.05 * r / 8
        result = probe.audit(claimed_eps=50.0, delta=1e-5)
        names, blind = [t.name for t in result.noise.missing], [t.name for t in result.noise.blind]
        name = None if dropped is None else f"{2 * (dropped // 2)}.{'bias' if dropped % 2 else 'weight'}"
        if dropped is None:  # from the canaries alone, the verdict says what it could not tell
            assert not names and (measured or blind == ["4.bias"]), result.noise.verdict
            assert measured or "passes if the data's gradient at its canaries is as large" in result.noise.verdict
        else:
            assert result.violation and names == [name], result.noise.verdict
        assert all(t.direct for t in result.noise.tensors) == measured


def test_canaries_sit_on_every_trainable_tensor_spread_by_size(tmp_path):
    model = _mlp()
    probe = WhiteBoxProbe(list(model.parameters()), m=60, clip=1.0, sample_rate=0.1, out=tmp_path / "p",
                          secret_seed=SEED)
    per_tensor = np.bincount([k for k, _ in probe.where], minlength=len(SIZES))
    assert per_tensor.min() >= 1 and per_tensor.sum() == 60 and per_tensor.argmax() == SIZES.index(4096)
    with pytest.raises(DPAuditError, match="cannot cover the 6 trainable tensors"):
        WhiteBoxProbe(list(model.parameters()), m=5, clip=1.0, sample_rate=0.1, out=tmp_path / "q")


def test_an_accountant_told_a_lower_rate_than_the_loader_samples_at_is_a_violation(tmp_path):
    """The accountant counts p / 10 while the data loader samples at p: the canaries are drawn at the loader's rate
    and the audit reads VIOLATION, naming both rates (before: the canaries shared the wrong rate; read 0.0)."""
    engine, model, optimizer, criterion, loader = _opacus("hooks", sigma=1.0)
    from opacus.accountants import PRVAccountant

    wrong = PRVAccountant()
    optimizer.attach_step_hook(wrong.get_optimizer_hook_fn(sample_rate=B / N / 10))  # replaces the engine's hook
    probe = WhiteBoxProbe.attach(optimizer, m=200, out=tmp_path / "p", secret_seed=SEED, accountant=wrong,
                                 data_loader=loader)
    assert probe.rate == pytest.approx(B / N)
    _train(model, optimizer, criterion, loader, 20)
    result = probe.audit(delta=1e-5)
    assert result.violation and result.rate.refused and "samples at rate 0.125" in result.verdict, result.verdict
    right = WhiteBoxProbe.attach(_opacus("hooks", sigma=1.0)[2], m=200, out=tmp_path / "q", secret_seed=SEED,
                                 data_loader=loader)
    assert not (right.out / "probe.json").read_text().count('"accounted_rate": 0.0125')


@pytest.mark.parametrize("name", ["whitebox_transcript.f32", "running.jsonl", "clipping_check.json", None])
def test_symbolic_links_in_a_probe_folder_are_refused_when_it_starts(tmp_path, name):
    """A resumed probe appended to (and truncated) a symlinked transcript's target outside its folder; a symlinked
    clipping tally was refused only at step 64, from inside observe()."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 1000)
    folder = tmp_path / "probe"
    if name is None:  # the probe folder itself
        (tmp_path / "real").mkdir()
        folder.symlink_to(tmp_path / "real")
    model = torch.nn.Linear(40, 10)
    if name is not None:
        _, model = _gradient_probe(folder, steps=3)
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(outside)
    with pytest.raises(DPAuditError, match="symbolic link"):
        WhiteBoxProbe(list(model.parameters()), m=200, clip=1.0, sample_rate=0.5, out=folder, resume=name is not None)
    assert outside.read_bytes() == b"x" * 1000


def test_a_torn_last_look_counts_as_spent_and_the_watch_goes_on(tmp_path):
    from dpaudit.probes.probe import RUNNING

    _, model = _gradient_probe(tmp_path / "p", steps=3)
    (tmp_path / "p" / RUNNING).write_text('{"step": 16, "look": 1, "final": false}\n{"step": 32, "lo')
    again = WhiteBoxProbe(list(model.parameters()), m=200, clip=1.0, sample_rate=0.5, out=tmp_path / "p",
                          resume=True).watch(delta=1e-5, claimed_eps=4.0)
    assert again._watch.look == 2  # the torn look's alpha stays spent
    lines = [json.loads(x) for x in (tmp_path / "p" / RUNNING).read_text().splitlines()]
    assert lines[-1]["torn"] and len(lines) == 2
    assert {x["format"] for x in lines} == {"dpaudit-look/2"}  # rewritten whole, in this format


def test_opacus_adaptive_clipping_is_refused_at_attach_in_one_line(tmp_path):
    """attach then opt.step() raised AttributeError ('SimpleNamespace' has no 'sample_size') inside the user's step."""
    from opacus.optimizers import AdaClipDPOptimizer

    model = torch.nn.Linear(20, 2)
    optimizer = AdaClipDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                   target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
                                   min_clipbound=0.1, unclipped_num_std=20.0, max_grad_norm=1.0, expected_batch_size=8)
    with pytest.raises(DPAuditError, match="adaptive clipping"):
        WhiteBoxProbe.attach(optimizer, m=20, out=tmp_path / "p", sample_rate=0.1)
    assert not (tmp_path / "p").exists()
