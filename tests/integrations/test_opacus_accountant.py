"""dpaudit's PLD as an Opacus accountant, checked through Opacus' own API."""

import math

import pytest

torch = pytest.importorskip("torch")
opacus = pytest.importorskip("opacus")

from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants import PRVAccountant  # noqa: E402

import dpaudit  # noqa: E402
from dpaudit.integrations.opacus_accountant import DpauditAccountant  # noqa: E402


def _private(engine, sigma=None, eps=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if eps is None:
        return engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
                                   max_grad_norm=1.0)
    return engine.make_private_with_epsilon(module=model, optimizer=opt, data_loader=loader, target_epsilon=eps,
                                            target_delta=1e-5, epochs=2, max_grad_norm=1.0)


def _train(model, opt, loader, steps):
    done = 0
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward() if len(x) else None
        opt.step()
        done += 1
        if done == steps:
            return


def test_privacy_engine_reports_dpaudits_add_remove_pld():
    engine = PrivacyEngine(accountant="dpaudit-pld")
    assert isinstance(engine.accountant, DpauditAccountant)
    model, opt, loader = _private(engine, sigma=1.0)
    _train(model, opt, loader, 5)
    assert len(engine.accountant) == 5
    ours = engine.get_epsilon(1e-5)
    assert ours == dpaudit.epsilon(sigma=1.0, delta=1e-5, p=loader.sample_rate, steps=5).epsilon
    # Opacus' PRV accountant on the same history: another valid upper bound, close to ours.
    prv = PRVAccountant()
    prv.history = list(engine.accountant.history)
    assert ours == pytest.approx(prv.get_epsilon(1e-5), rel=0.03)


def test_make_private_with_epsilon_calibrates_through_dpaudit():
    engine = PrivacyEngine(accountant="dpaudit-pld")
    _, opt, loader = _private(engine, eps=2.0)
    spent = dpaudit.epsilon(sigma=opt.noise_multiplier, delta=1e-5, p=loader.sample_rate,
                            steps=int(2 / loader.sample_rate)).epsilon
    assert 2.0 - 0.02 <= spent <= 2.0


def test_a_history_of_different_noise_levels_is_composed():
    acc = DpauditAccountant()
    for _ in range(50):
        acc.step(noise_multiplier=1.0, sample_rate=0.05)
    for _ in range(30):
        acc.step(noise_multiplier=2.0, sample_rate=0.1)
    assert acc.history == [(1.0, 0.05, 50), (2.0, 0.1, 30)]
    mixed = acc.get_epsilon(1e-5)
    first = dpaudit.epsilon(sigma=1.0, delta=1e-5, p=0.05, steps=50).epsilon
    both_noisy = dpaudit.epsilon(sigma=1.0, delta=1e-5, p=0.1, steps=80).epsilon
    assert first < mixed < both_noisy  # more than the first phase alone, less than the worse phase throughout
    prv = PRVAccountant()
    prv.history = list(acc.history)
    assert mixed == pytest.approx(prv.get_epsilon(1e-5), rel=0.03)


def test_mixed_histories_are_as_tight_as_converged_dp_accounting_and_split_ones_as_the_whole():
    import json

    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = DpauditAccountant()
    acc.history = [(1.0, 0.01, 1000), (0.9, 0.01, 1000)]
    ref = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for sigma, p, steps in acc.history:
        ref.compose(dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(sigma)), steps)
    converged = ref.get_epsilon(1e-5)
    assert abs(acc.get_epsilon(1e-5) - converged) <= 1e-3 * converged
    split, whole = DpauditAccountant(), DpauditAccountant()
    split.history = json.loads(json.dumps([(1.0, 0.01, 700), (1.0, 0.01, 1300)]))  # as a saved history loads
    whole.history = [(1.0, 0.01, 2000)]
    assert split.get_epsilon(1e-5) == whole.get_epsilon(1e-5)
    split.step(noise_multiplier=1.0, sample_rate=0.01)
    assert split.history[-1] == (1.0, 0.01, 1301)
    assert math.isfinite(acc.get_epsilon(1e-16))  # below what pld resolves: rdp, as for one phase


def test_a_per_step_noise_schedule_past_max_phases_is_composed_not_refused():
    """Issue 36: histories of more than 1000 distinct phases were refused. Rounded safe side (sigma down, p up)."""
    from dpaudit.integrations.opacus_accountant import DpauditAccountant

    schedule = DpauditAccountant()
    for i in range(1200):
        schedule.step(noise_multiplier=1.0 + i * 1e-4, sample_rate=0.01)
    eps = schedule.get_epsilon(1e-5)
    lowest, highest = DpauditAccountant(), DpauditAccountant()
    for _ in range(1200):
        lowest.step(noise_multiplier=1.0, sample_rate=0.01)
        highest.step(noise_multiplier=1.12, sample_rate=0.01)
    assert highest.get_epsilon(1e-5) <= eps <= lowest.get_epsilon(1e-5)
