"""A method, a sampler and a noise are each one record plus one file (issue 37): a temporary module, written here
and imported like outside code, registers a toy of each, and they run end to end (accounting, calibration, a
training run with its ledger, and the replay of its log). If any part of dpaudit branched on the built-in names
instead of asking the records, one of these would fail."""

import importlib.util
import math
import sys
import textwrap

import pytest

TOY = textwrap.dedent('''
    """Outside code: a toy noise, sampler and method, each one record (and this one file)."""
    from dpaudit.accounting.noises import register_noise
    from dpaudit.accounting.noises.gaussian import Gaussian
    from dpaudit.accounting.result import NeighboringRelation
    from dpaudit.accounting.samplers import Scheme, register_scheme, scheme
    from dpaudit.training.methods import METHODS, Method, register_method


    class ToyGaussian(Gaussian):  # the Gaussian under another name: every fact inherited
        kind = "toy-gaussian"


    register_noise(ToyGaussian())

    # Each of W ranks Poisson-samples its own shard at rate p: the union is Poisson(p) over the whole dataset.
    register_scheme(Scheme("toy-sharded-poisson", NeighboringRelation.ADD_OR_REMOVE_ONE, False,
                           "per-rank Poisson sampling with rate p = {p:g}, T = {T} steps", accountants=("pld", "rdp"),
                           independent_steps=True, rdp_event=scheme("poisson").rdp_event))


    def build(setup):  # a DP-ZO trainer with other defaults: built here, through the same protocol
        return METHODS["dp-zo"].build(setup)


    register_method(Method("toy-zo", {"lr": 1e-4, "clip": 0.1, "steps": 4}, ("toy-gaussian",), "scalar", build,
                           release="zo-log", zeroth_order=True))
''')


@pytest.fixture
def toy(tmp_path):
    from dpaudit.accounting.noises import NOISES
    from dpaudit.accounting.samplers import SCHEMES
    from dpaudit.training.methods import METHODS

    path = tmp_path / "dpaudit_toy_extension.py"
    path.write_text(TOY)
    spec = importlib.util.spec_from_file_location("dpaudit_toy_extension", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    NOISES.pop("toy-gaussian", None)
    SCHEMES.pop("toy-sharded-poisson", None)
    METHODS.pop("toy-zo", None)
    sys.modules.pop("dpaudit_toy_extension", None)


def test_a_registered_noise_and_sampler_are_accounted_and_calibrated_like_the_ones_they_copy(toy):
    import dpaudit

    plain = dpaudit.epsilon(1.0, mech="gaussian", p=0.01, steps=500, delta=1e-5)
    copied = dpaudit.epsilon(1.0, mech="toy-gaussian", p=0.01, steps=500, delta=1e-5, sampling="toy-sharded-poisson")
    assert copied.epsilon == pytest.approx(plain.epsilon, rel=1e-9)
    assert copied.neighboring == plain.neighboring
    rdp = dpaudit.epsilon(1.0, mech="toy-gaussian", p=0.01, steps=500, delta=1e-5, sampling="toy-sharded-poisson",
                          accountant="rdp")
    assert rdp.epsilon == pytest.approx(dpaudit.epsilon(1.0, p=0.01, steps=500, delta=1e-5, accountant="rdp").epsilon)
    sigma = dpaudit.calibrate(2.0, mech="toy-gaussian", p=0.01, steps=500, delta=1e-5, sampling="toy-sharded-poisson")
    assert sigma.sigma == pytest.approx(dpaudit.calibrate(2.0, p=0.01, steps=500, delta=1e-5).sigma, rel=1e-6)
    with pytest.raises(dpaudit.DPAuditError, match="exists already"):
        from dpaudit.accounting.samplers import Scheme, register_scheme

        register_scheme(Scheme("poisson", copied.neighboring, False, ""))


def test_a_registered_method_trains_with_the_registered_noise_and_its_log_replays(toy, tiny_model_dir, tmp_path):
    import torch

    from dpaudit.core import run_folder, run_record
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training.runner import TrainConfig, train
    from dpaudit.workflows.replay import replay_run

    texts = [f"Alice number {i} lives in Paris." for i in range(24)]
    cfg = TrainConfig(method="toy-zo", mechanism="toy-gaussian", target_epsilon=4.0, batch_size=8, secret_seed=1)
    assert (cfg.steps, cfg.lr, cfg.clip) == (4, 1e-4, 0.1)  # the record's defaults
    result = train(tiny_model_dir, texts, tmp_path / "run", cfg, show_progress=False)
    assert result.private and 0 < result.epsilon <= 4.0 and math.isfinite(result.sigma)
    record = run_record.read(tmp_path / "run")
    assert record.release == "zo-log" and record.settings.mechanism == "toy-gaussian"
    assert len(run_folder.zo_log(tmp_path / "run")[1]) == 4
    replayed, _ = replay_run(tmp_path / "run")
    trained, _ = load_causal_lm(result.model_dir)
    for a, b in zip(replayed.state_dict().values(), trained.state_dict().values()):
        torch.testing.assert_close(a, b)
    with pytest.raises(Exception, match="does not add laplace noise"):
        TrainConfig(method="toy-zo", mechanism="laplace", target_epsilon=4.0)
