"""Audits as the run trains (WhiteBoxProbe.watch, issue 55 item 2): looks at steps 16, 32, 64, ... at level
alpha / (j (j + 1)); a broken loop is stopped, warned of or raised on early with its report written; a correct one
raises a false alarm in at most alpha of runs over every look."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpaudit.core.errors import DPAuditError, PrivacyViolation
from dpaudit.probes.probe import RUNNING, WhiteBoxProbe

C, SIGMA, N_PARAMS, RATE = 1.0, 1.0, 400, 0.3


def _loop(probe, seed: int, steps: int, clip: bool = True, stop: bool = False) -> int:
    """A plain DP-SGD loop with the canaries as examples; returns the steps taken."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if stop and probe.stop_requested:
            return step
        (canaries,) = probe.canary_examples(step)
        data = torch.randn(20, N_PARAMS, generator=gen)
        rows = torch.cat([3 * C * data / data.norm(dim=1, keepdim=True), canaries])
        factor = (C / rows.norm(dim=1, keepdim=True)).clamp(max=1.0) if clip else torch.ones(len(rows), 1)
        probe.observe(step, [(rows * factor).sum(0) + SIGMA * C * torch.randn(N_PARAMS, generator=gen)])
    return steps


def _probe(out, seed: int, m: int = 200) -> WhiteBoxProbe:
    return WhiteBoxProbe([torch.zeros(N_PARAMS, requires_grad=True)], m=m, clip=C, sample_rate=RATE, out=out,
                         secret_seed=seed)


def test_a_loop_without_clipping_is_stopped_at_an_early_look_with_its_report(tmp_path, capsys):
    probe = _probe(tmp_path / "run", 0).watch(delta=1e-5, claimed_eps=4.0, on_violation="stop")
    taken = _loop(probe, 0, 200, clip=False, stop=True)
    assert taken <= 40 and probe.alarm is not None and probe.alarm.violation  # <= 20 % of the planned steps
    looks = [json.loads(line) for line in (tmp_path / "run" / RUNNING).read_text().splitlines()]
    assert looks[-1]["violation"] and looks[0]["step"] == 16 and looks[0]["alpha"] == pytest.approx(0.005)
    look = tmp_path / "run" / "looks" / f"step-{looks[-1]['step']}" / "report.md"
    assert look.is_file() and "stopping the run" in capsys.readouterr().out
    probe.audit(claimed_eps=4.0, delta=1e-5)  # the end-of-run report never replaces the look's, and names it
    assert look.is_file() and str(look) in (tmp_path / "run" / "report" / "report.md").read_text().replace("\\", "")


def test_raise_and_warn(tmp_path, capsys):
    probe = _probe(tmp_path / "r", 1).watch(delta=1e-5, claimed_eps=4.0, on_violation="raise")
    with pytest.raises(PrivacyViolation, match="VIOLATION") as caught:
        _loop(probe, 1, 200, clip=False)
    assert caught.value.result.violation
    probe = _probe(tmp_path / "w", 1).watch(delta=1e-5, claimed_eps=4.0, on_violation="warn")
    assert _loop(probe, 1, 80, clip=False) == 80 and probe.alarm is not None and not probe.stop_requested
    assert "VIOLATION" in capsys.readouterr().out
    with pytest.raises(DPAuditError, match="on_violation"):
        _probe(tmp_path / "x", 1).watch(delta=1e-5, claimed_eps=4.0, on_violation="ignore")
    with pytest.raises(DPAuditError, match="claim"):
        _probe(tmp_path / "y", 1).watch(delta=1e-5)


def test_correct_runs_raise_false_alarms_at_most_alpha_over_every_look(tmp_path):
    """20 correct runs at a claim they meet (sigma 1 at p = 0.3, held to the claim for the 128 steps the looks
    see): at most 3 alarms (binomial 99.9 % quantile of 20 at alpha = 0.05), and the looks read something."""
    from dpaudit.accounting.mechanism import Mechanism
    from dpaudit.accounting import pld

    claim = pld.epsilon(Mechanism("gaussian", SIGMA, RATE, 128), 1e-5).epsilon
    alarms, last = 0, []
    for seed in range(20):
        probe = _probe(tmp_path / f"c{seed}", 100 + seed).watch(delta=1e-5, claimed_eps=claim, first=32)
        _loop(probe, seed, 129)  # looks at 32, 64, 128
        alarms += probe.alarm is not None
        looks = [json.loads(line) for line in (tmp_path / f"c{seed}" / RUNNING).read_text().splitlines()]
        if probe.alarm is None:  # an alarm ends the looks
            assert [x["step"] for x in looks] == [32, 64, 128]
            last.append(looks[-1]["epsilon_lower_bound"])
    assert alarms <= 3
    assert np.median(last) > 0.3 * claim  # the looks measure something (a vacuous look would read 0)


def test_a_resumed_watch_goes_on_with_the_looks_it_has_spent(tmp_path):
    out = tmp_path / "run"
    probe = _probe(out, 2).watch(delta=1e-5, claimed_eps=50.0)
    _loop(probe, 2, 40)  # looks at 16 and 32
    probe.close()
    again = WhiteBoxProbe([torch.zeros(N_PARAMS, requires_grad=True)], m=200, clip=C, sample_rate=RATE, out=out,
                          resume=True).watch(delta=1e-5, claimed_eps=50.0)
    assert again._watch.look == 2 and again._watch.next == 64


def test_a_planned_run_gets_a_final_look_at_half_alpha_and_the_series_the_other_half(tmp_path):
    """watch(planned_steps=T): looks at 16, 32, 64 at alpha / (2 j (j + 1)), then the last step's look at alpha / 2
    (the sum stays <= alpha); a resumed probe does not make the final look twice."""
    out = tmp_path / "run"
    probe = _probe(out, 3).watch(delta=1e-5, claimed_eps=50.0, planned_steps=100, alpha=0.05)
    _loop(probe, 3, 100)
    looks = [json.loads(line) for line in (out / RUNNING).read_text().splitlines()]
    assert [x["step"] for x in looks] == [16, 32, 64, 100]
    assert [x["final"] for x in looks] == [False, False, False, True]
    assert [x["alpha"] for x in looks] == pytest.approx([0.05 / 4, 0.05 / 12, 0.05 / 24, 0.025])
    assert sum(x["alpha"] for x in looks) <= 0.05 and all(not x["violation"] for x in looks)
    probe.close()
    again = WhiteBoxProbe([torch.zeros(N_PARAMS, requires_grad=True)], m=200, clip=C, sample_rate=RATE, out=out,
                          resume=True).watch(delta=1e-5, claimed_eps=50.0, planned_steps=100)
    assert again._watch.final is None and again._watch.look == 3
    with pytest.raises(DPAuditError, match="planned_steps"):
        _probe(tmp_path / "z", 3).watch(delta=1e-5, claimed_eps=4.0, planned_steps=0)


def test_a_loop_without_clipping_is_caught_by_the_final_look_when_no_doubling_is_left(tmp_path):
    """A run too short for a doubling after its first look: the final look (at the last step) reads VIOLATION."""
    probe = _probe(tmp_path / "run", 4).watch(delta=1e-5, claimed_eps=4.0, planned_steps=24, first=32)
    _loop(probe, 4, 24, clip=False)
    looks = [json.loads(line) for line in (tmp_path / "run" / RUNNING).read_text().splitlines()]
    assert [x["step"] for x in looks] == [24] and looks[0]["final"] and looks[0]["violation"]
    assert probe.alarm is not None
