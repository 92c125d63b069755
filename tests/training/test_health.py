"""The health check of the update (issue 55 item 3): on Opacus runs with the failures Opacus users report - LoRA
adapters left out of the optimizer, an optimizer built before make_private and stepped itself, a parameter group
never stepped, a detached adapter - each is named in one line and in the report; a correct run has no finding."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from cli_helpers import dpaudit
from dpaudit import WhiteBoxProbe
from dpaudit.core.run_folder import HEALTH
from dpaudit.probes.health import EVERY, UpdateHealth, update_bound

warnings.filterwarnings("ignore", module="opacus")
N, B, STEPS = 256, 32, EVERY + 10


class Adapted(torch.nn.Module):
    """A base layer and a LoRA-style adapter (down, then up) beside it; ``detached``: its output is scaled by 0 (a
    LoRA alpha of 0), so the loss reaches none of its weights. (An adapter the forward skips altogether is refused
    by Opacus itself: no per-sample gradient.)"""

    def __init__(self, detached: bool = False):
        super().__init__()
        self.base = torch.nn.Linear(20, 2)
        self.down = torch.nn.Linear(20, 4, bias=False)
        self.up = torch.nn.Linear(4, 2, bias=False)
        self.detached = detached

    def forward(self, x):
        return self.base(x) + (0.0 if self.detached else 1.0) * self.up(self.down(x))


def _run(tmp_path, *, build=None, mode: str = "hooks", detached: bool = False, steps: int = STEPS,
         extra_step: bool = False, hook=None):
    """An Opacus run with the probe attached (model given); ``build(model)`` makes the optimizer."""
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(N, 20, generator=g)
    y = (X[:, 0] > 0).long()
    model = Adapted(detached)
    optimizer = build(model) if build else torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=B)
    criterion = torch.nn.CrossEntropyLoss()
    kw = dict(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
              grad_sample_mode=mode, poisson_sampling=False)
    engine = PrivacyEngine(accountant="prv")
    if mode == "ghost":
        dp_model, dp_opt, criterion, loader = engine.make_private(criterion=criterion, **kw)
    else:
        dp_model, dp_opt, loader = engine.make_private(**kw)
    probe = WhiteBoxProbe.attach(dp_opt, m=20, out=tmp_path / "probe", model=model, secret_seed=0)
    if hook is not None:
        dp_opt.original_optimizer.register_step_post_hook(hook)
    done = 0
    while done < steps:
        for xb, yb in loader:
            dp_opt.zero_grad()
            criterion(dp_model(xb), yb).backward()
            dp_opt.step()
            if extra_step:  # a leftover optimizer built before make_private, stepped as well
                optimizer.step()
            done += 1
            if done == steps:
                break
    result = probe.audit(4.0, 1e-5)
    report = (tmp_path / "probe" / "report" / "report.md").read_text()
    return probe, result, report, json.loads((tmp_path / "probe" / HEALTH).read_text())


def _kinds(health: dict) -> set[tuple[str, str]]:
    return {(f["kind"], f["tensor"]) for f in health["findings"]}


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_correct_run_has_no_finding(tmp_path, mode, capsys):
    probe, result, report, health = _run(tmp_path, mode=mode)
    assert health["findings"] == [] and health["dp_steps"] == STEPS
    assert "no finding in" in report and not result.unprotected
    assert "health" not in capsys.readouterr().out


def test_adapters_left_out_of_the_optimizer_are_named_and_are_not_a_violation(tmp_path, capsys):
    """The optimizer was built on the base layer before the adapters joined: the adapters never train. Nothing
    leaks from them, so the verdict is not VIOLATION (it was, before the check: 'updated outside DP')."""
    probe, result, report, health = _run(tmp_path, build=lambda m: torch.optim.SGD(m.base.parameters(), lr=0.1))
    assert _kinds(health) == {("never-moved", "down.weight"), ("never-moved", "up.weight")}
    assert not result.unprotected and not result.violation
    assert "down.weight is trainable but the DP optimizer does not hold it" in report
    printed = capsys.readouterr().out  # one line for the two (one cause), once
    assert printed.count("dpaudit: health:") == 1 and "2 tensors (down.weight, up.weight)" in printed


def test_an_optimizer_built_before_make_private_and_stepped_itself_is_a_violation(tmp_path, capsys):
    probe, result, report, health = _run(tmp_path, extra_step=True)
    kinds = {k for k, _ in _kinds(health)}
    assert "stepped-outside" in kinds and result.violation and result.unprotected
    assert "updated outside DP" in result.verdict
    out = capsys.readouterr().out
    assert out.count("stepped by itself") == 1


def test_a_parameter_group_never_stepped_is_named(tmp_path):
    def build(m):
        return torch.optim.SGD([{"params": m.base.parameters()},
                                {"params": list(m.down.parameters()) + list(m.up.parameters()), "lr": 0.0}], lr=0.1)

    probe, result, report, health = _run(tmp_path, build=build)
    assert _kinds(health) == {("never-moved", "down.weight"), ("never-moved", "up.weight")}
    assert "has not moved in" in report and not result.violation


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_detached_adapter_is_named(tmp_path, mode):
    """An adapter whose output is scaled by 0 gets no gradient: its updates are the noise alone."""
    probe, result, report, health = _run(tmp_path, mode=mode, detached=True)
    assert _kinds(health) == {("no-gradient", "down.weight"), ("no-gradient", "up.weight")}
    assert "detached from the forward" in report


def test_an_update_far_above_what_the_optimizer_makes_is_named(tmp_path):
    def push(opt, args, kwargs):  # something else moves a weight inside the step
        with torch.no_grad():
            opt.param_groups[0]["params"][0].add_(5.0)

    probe, result, report, health = _run(tmp_path, hook=push)
    assert ("too-large", "base.weight") in _kinds(health)


def test_the_bounds_hold_for_sgd_and_adam():
    """update_bound is never below the change a real step makes (SGD with momentum and nesterov, Adam, AdamW)."""
    torch.manual_seed(1)
    for make in (lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, weight_decay=0.1),
                 lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, nesterov=True),
                 lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1),
                 lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.5, 0.9))):
        w = torch.nn.Parameter(torch.randn(50))
        opt = make([w])
        for t in range(40):
            w.grad = torch.randn(50) * (10.0 if t % 7 == 0 else 0.01)  # spikes: Adam's ratio at its largest
            before = w.detach().clone()
            opt.step()
            moved = float((w.detach() - before).abs().max())
            assert moved <= update_bound(opt, w, w.grad) * (1 + 1e-5)  # float32 steps
    assert update_bound(torch.optim.RMSprop([w]), w, w.grad) is None


def test_a_plain_loop_probe_looks_every_EVERY_steps(tmp_path):
    """WhiteBoxProbe(params, model=...) in a plain loop: the noised tensors must move, the others must not."""
    model = torch.nn.Linear(10, 3)
    probe = WhiteBoxProbe([model.weight], m=20, clip=1.0, sample_rate=0.5, out=tmp_path / "p", model=model,
                          secret_seed=0)
    for step in range(EVERY + 1):
        (grad,) = probe.canary_gradients(step)
        released = grad + torch.randn_like(grad)
        with torch.no_grad():
            model.weight -= 0.1 * released
            model.bias += 0.01  # trained, but not through the DP step
        probe.observe(step, [released])
    probe.close()
    kinds = _kinds(json.loads((tmp_path / "p" / HEALTH).read_text()))
    assert kinds == {("moved-outside", "bias")}
    result = probe.audit(4.0, 1e-5)
    assert result.violation and "bias" in result.unprotected


def test_fingerprints_see_one_changed_coordinate_in_the_sums():
    h = UpdateHealth([("w", torch.zeros(10_000))], every=1, say=lambda line: None)
    h.tensors[0][1234] += 1e-3  # not a strided sample: the sums see it
    h.look(1)
    assert h.moved == [True] and not h.findings
    assert np.isfinite(h.first).sum() == 2 + 64


@pytest.mark.parametrize("call", ["claimed", "accountant", "attached"])
def test_a_loop_that_steps_only_the_optimizer_built_before_make_private_is_a_violation_not_a_refusal(tmp_path, call):
    """The DP optimizer never steps, so nothing is released; the model trains all the same, without clipping or
    noise. The audit says VIOLATION (PrivacyViolation), never 'no released steps' (a refusal would hide it), in
    every documented form of the call: claimed_eps=, the README's accountant=, or the accountant attach found."""
    from opacus import PrivacyEngine

    from dpaudit.core.errors import PrivacyViolation

    torch.manual_seed(0)
    X = torch.randn(N, 20)
    y = (X[:, 0] > 0).long()
    model = Adapted()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=B)
    engine = PrivacyEngine(accountant="prv")
    dp_model, dp_opt, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False)
    probe = WhiteBoxProbe.attach(dp_opt, m=20, out=tmp_path / "probe", model=model, secret_seed=0)
    for xb, yb in list(loader)[:3]:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(dp_model(xb), yb).backward()
        optimizer.step()  # the optimizer built before make_private, not the DP one
    with pytest.raises(PrivacyViolation, match="VIOLATION: the DP optimizer released no step"):
        if call == "claimed":
            probe.audit(4.0, 1e-5)
        else:
            probe.audit(accountant=engine.accountant if call == "accountant" else None, delta=1e-5)
    probe.close()
    assert (tmp_path / "probe" / "health.json").is_file()
    out = dpaudit("audit", "transcript", "--run", tmp_path / "probe", *(
        ["--claimed-eps", "4", "--delta", "1e-5"] if call == "claimed" else []))
    assert out.returncode == 1 and "VIOLATION" in out.stdout and "no released steps" not in out.stderr


def test_a_short_run_is_checked_and_a_still_group_is_named(tmp_path, capsys):
    """The check looked at step 0 and every 50: a 12-step run could never warn. Now at 0, 1, 2, 4, 8 (and the
    audit): the group whose learning rate is 0 is named within the run."""
    def build(m):
        return torch.optim.SGD([{"params": m.base.parameters()},
                                {"params": list(m.down.parameters()) + list(m.up.parameters()), "lr": 0.0}], lr=0.1)

    probe, result, report, health = _run(tmp_path, build=build, steps=12)
    assert _kinds(health) == {("never-moved", "down.weight"), ("never-moved", "up.weight")}
    printed = capsys.readouterr().out
    assert printed.count("dpaudit: health:") == 1 and "have not moved in" in printed


def test_findings_of_one_cause_print_as_one_line_that_names_the_cause(capsys):
    """A frozen lora_B keeps every lora_A's gradient at zero: one line, naming lora_B (48 lines blamed 'detached
    from the forward' before); a bf16 tensor too small a step rounds away is said to be that."""
    from dpaudit.probes.health import UpdateHealth

    tensors = [(f"layers.{i}.q_proj.lora_A.weight", torch.zeros(4, 8)) for i in range(24)]
    health = UpdateHealth(tensors)
    for step in (0, 1):
        health.gradient_sums(step, [torch.zeros(4, 8) for _ in tensors])
    printed = capsys.readouterr().out
    assert printed.count("dpaudit: health:") == 1 and "24 tensors" in printed and "lora_B is not trained" in printed
    still = UpdateHealth([("bias", torch.ones(8, dtype=torch.bfloat16))])
    still.bracketed = False
    still.look(8)
    assert "stored in bfloat16, whose rounding swallows updates" in capsys.readouterr().out
