"""A user's own loop audited at the user level: the probe's canaries as users of r records (``records=r``), each
record sampled at the loop's rate and clipped apart. A run whose noise meets a user-level claim reads consistent
against it; held to the example-level claim of the same noise, the canary users read VIOLATION."""

import numpy as np
import torch

from dpaudit.accounting.calibrate import calibrate_sigma
from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.registry import epsilon
from dpaudit.accounting.unit import Unit
from dpaudit.probes.probe import WhiteBoxProbe

RATE, STEPS, DELTA, K = 0.5, 60, 1e-5, 4


def _loop(out, sigma: float, records: int, m: int = 1000) -> WhiteBoxProbe:
    model = torch.nn.Linear(60, 20)
    probe = WhiteBoxProbe(list(model.parameters()), m=m, clip=1.0, sample_rate=RATE, out=out, secret_seed=4,
                          records=records, noise_multiplier=sigma)
    g = torch.Generator().manual_seed(5)
    for t in range(STEPS):
        probe.observe(t, [c + sigma * torch.randn(c.shape, generator=g) for c in probe.canary_gradients(t)])
    probe.close()
    return probe


def test_canary_users_are_drawn_record_by_record(tmp_path):
    probe = WhiteBoxProbe(list(torch.nn.Linear(60, 20).parameters()), m=400, clip=1.0, sample_rate=RATE,
                          out=tmp_path / "p", secret_seed=4, records=K)
    drawn = probe.begin(0)
    counts = np.bincount(drawn, minlength=400)[probe.canaries.member_ids]
    assert counts.max() <= K and abs(counts.mean() - K * RATE) < 0.3  # Binomial(k, p) copies a member user
    assert not np.isin(drawn, np.flatnonzero(~probe.canaries.members)).any()


def test_a_user_level_claim_holds_and_an_example_level_one_does_not(tmp_path):
    users = Mechanism("gaussian", 1.0, RATE, STEPS, unit=Unit("user", K))
    sigma = calibrate_sigma(users, 4.0, DELTA).sigma
    probe = _loop(tmp_path / "p", sigma, K)
    user_claim = epsilon(users.with_sigma(sigma), DELTA).epsilon
    example_claim = epsilon(Mechanism("gaussian", sigma, RATE, STEPS), DELTA).epsilon
    held = probe.audit(user_claim, DELTA, report=False)
    assert user_claim <= 4.0 and not held.violation
    over = probe.audit(example_claim, DELTA, report=False)
    assert example_claim < 1.5 and over.violation and over.epsilon_lower_bound > example_claim
