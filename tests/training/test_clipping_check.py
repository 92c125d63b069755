"""The per-example clipping check (audit/clipping.py) of a probe whose canaries enter as examples: a plain loop that
clips each example passes it (z ~ N(0, 1) over seeds), one that clips the batch's sum, or clips above C, fails it
and reads VIOLATION whatever its eps bound (issue 55: that bug read 0.0 with canary_examples before)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpaudit.probes.probe import CLIP_TALLY, WhiteBoxProbe

C, SIGMA, N_PARAMS = 1.0, 1.0, 400


def _loop(out, seed: int, clipping: str, steps: int = 80, m: int = 100, rate: float = 0.3, batch: int = 20):
    """A plain DP-SGD loop on one 400-weight tensor: ``batch`` data rows of norm 3C a step plus the canaries."""
    param = torch.zeros(N_PARAMS, requires_grad=True)
    probe = WhiteBoxProbe([param], m=m, clip=C, sample_rate=rate, out=out, secret_seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        (canaries,) = probe.canary_examples(step)
        data = torch.randn(batch, N_PARAMS, generator=gen)
        data = 3 * C * data / data.norm(dim=1, keepdim=True)
        rows = torch.cat([data, canaries])
        if clipping == "per-example":
            summed = (rows * (C / rows.norm(dim=1, keepdim=True)).clamp(max=1.0)).sum(0)
        elif clipping == "above-C":  # the loop clips at 4C while it says C
            summed = (rows * (4 * C / rows.norm(dim=1, keepdim=True)).clamp(max=1.0)).sum(0)
        else:  # the batch's sum clipped as one vector
            summed = rows.sum(0)
            summed = summed * min(1.0, C / float(summed.norm()))
        released = summed + SIGMA * C * torch.randn(N_PARAMS, generator=gen)
        probe.observe(step, [released])
    return probe


def test_per_example_clipping_passes_and_its_z_is_standard_normal_over_seeds(tmp_path):
    from dpaudit.audit.clipping import check, read_tally

    zs = []
    for seed in range(40):
        probe = _loop(tmp_path / f"r{seed}", seed, "per-example", steps=30)
        probe.close()
        result = check(read_tally(tmp_path / f"r{seed}", probe.run_id), 0.005)
        zs.append(result.z)
    zs = np.array(zs)
    assert abs(zs.mean()) < 0.6 and 0.6 < zs.std() < 1.5, (zs.mean(), zs.std())
    assert (zs > 2.576).sum() <= 2  # P[z > 2.576] = 0.005 each: at most 2 of 40 (binomial 99.9 %: 2)


def test_a_loop_that_clips_the_batch_sum_reads_violation_and_one_that_clips_above_c_too(tmp_path):
    probe = _loop(tmp_path / "run", 0, "batch-sum")
    result = probe.audit(claimed_eps=4.0, delta=1e-5, report=False)
    assert result.clipping is not None and result.clipping.refused
    assert result.violation and "not clipped per example" in result.verdict
    assert result.epsilon_lower_bound < 4.0  # the eps bound alone does not see it
    assert result.to_dict()["clipping_check"]["refused"] is True
    # clipping at 4C (both canary sizes above it: equal contributions): the eps bound reads it instead
    above = _loop(tmp_path / "above", 0, "above-C").audit(claimed_eps=4.0, delta=1e-5, report=False)
    assert not above.clipping.refused and above.violation and above.epsilon_lower_bound > 4.0
    good = _loop(tmp_path / "good", 0, "per-example").audit(claimed_eps=4.0, delta=1e-5, report=False)
    assert not good.clipping.refused and "consistent with per-example clipping" in good.clipping.verdict
    assert good.headline == "gaussian-run"  # the probe samples its canaries by Poisson at 0.3: the family's reading
    assert good.alpha == pytest.approx(0.05)  # the check's share and the bounds' add up to the level asked


def test_the_tally_survives_a_resume_and_refuses_a_tampered_file(tmp_path):
    from dpaudit.core.errors import DPAuditError

    out = tmp_path / "run"
    probe = _loop(out, 1, "per-example", steps=70)  # past one block: the tally was saved at step 64
    probe.close()
    saved = json.loads((out / CLIP_TALLY).read_text())
    assert saved["steps"] == 70 and saved["small"][0] > 0 and saved["large"][0] > 0
    resumed = WhiteBoxProbe([torch.zeros(N_PARAMS, requires_grad=True)], m=100, clip=C, sample_rate=0.3, out=out,
                            resume=True)
    assert resumed.step == 70 and resumed.clip_tally.values[0][0] == saved["small"][0]
    resumed.close()
    (out / CLIP_TALLY).write_text(json.dumps({**saved, "small": [1, "x", 2]}))
    with pytest.raises(DPAuditError, match="not as a probe"):
        WhiteBoxProbe([torch.zeros(N_PARAMS, requires_grad=True)], m=100, clip=C, sample_rate=0.3, out=out,
                      resume=True)


def test_canaries_added_after_clipping_make_no_tally(tmp_path):
    param = torch.zeros(N_PARAMS, requires_grad=True)
    probe = WhiteBoxProbe([param], m=50, clip=C, sample_rate=0.3, out=tmp_path / "run", secret_seed=0)
    for step in range(5):
        (g,) = probe.canary_gradients(step)
        probe.observe(step, [g + torch.randn(N_PARAMS)])
    result = probe.audit(claimed_eps=4.0, delta=1e-5, report=False)
    assert result.clipping is None and not (tmp_path / "run" / CLIP_TALLY).exists()


def test_a_consistent_answer_says_the_checks_reach():
    """Under batch-sum clipping the z-statistic reaches at most about sqrt(T / 2) / sd: a check without that power
    says so beside its "consistent" (at eps 1 of the user-bug zoo it read 2.35, 1.71, 1.21 with a reach of 2.8)."""
    from dpaudit.audit.clipping import check

    weak = check({"small": [3100, 3100 * 0.0, 3100 * 3.6 ** 2], "large": [3100, 3100 * 0.1, 3100 * 3.6 ** 2],
                  "size_ratio": 8, "steps": 200}, 0.005)
    assert not weak.refused and weak.reach == pytest.approx((200 / 2) ** 0.5 / 3.6, rel=1e-3)
    assert "could reach z = 2.78 here, short of the 3.86" in weak.verdict
    strong = check({"small": [3100, 0.0, 3100 * 1.2 ** 2], "large": [3100, 3100 * 0.01, 3100 * 1.2 ** 2],
                    "size_ratio": 8, "steps": 200}, 0.005)
    assert "could reach z = 8.33 here" in strong.verdict and "short of" not in strong.verdict
