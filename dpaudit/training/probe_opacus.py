"""``WhiteBoxProbe.attach``: the probe on a user's Opacus ``DPOptimizer``, through the optimizer's own seams.

With Opacus (``WhiteBoxProbe.attach(optimizer)``) the probe attaches through the optimizer's seams, as its
accountant hook does: it puts the sampled canaries into ``p.summed_grad`` once a step - in the
per-sample-gradient modes (hooks, functorch, expanded weights) as extra per-sample rows that the
optimizer's own ``clip_and_accumulate`` clips, right after (and at the clip norm of) the examples'
clipping; in ghost / fast gradient clipping, where the per-example norms are taken in the loss's backward
pass that no canary enters, just before ``add_noise``, clipped by the probe at the optimizer's
``max_grad_norm`` (the report says so) - and after ``scale_grad`` its step hook (chained before the
accountant's) reads the release back, times ``expected_batch_size x accumulated_iterations`` when the loss
is a mean, which is the noisy sum again.

The seams are overridden the way Opacus' own subclasses override them: the attached optimizer's class becomes
``Probed`` (or ``ProbedDistributed``) in front of its own, so ``clip_and_accumulate``, ``add_noise``,
``scale_grad`` and ``reduce_gradients`` run the probe's part and then (or after) Opacus'. Nothing else of the
optimizer changes, its step hook (the accountant's) included; a second probe on the same optimizer is refused.
"""

from __future__ import annotations

import numpy as np

from dpaudit.core.errors import DPAuditError

OPACUS_BYPASS = ("ghost (fast gradient clipping): Opacus clips each example in the loss's backward pass, which "
                 "canaries never enter, so the probe clips them itself at the optimizer's max_grad_norm")


def attach(cls, optimizer, *, m, out, sample_rate, accountant, gain, seed, resume, model, secret_seed):
    """``cls.attach`` (cls: WhiteBoxProbe): the probe, with the optimizer's class put behind ``Probed``."""
    try:
        from opacus.optimizers import DPOptimizer
        from opacus.optimizers.optimizer_fast_gradient_clipping import DPOptimizerFastGradientClipping
    except ImportError:
        raise DPAuditError("WhiteBoxProbe.attach needs opacus: pip install 'dpaudit[train]'") from None
    if not isinstance(optimizer, DPOptimizer):
        raise DPAuditError(f"WhiteBoxProbe.attach takes an Opacus DPOptimizer, got {type(optimizer).__name__} "
                           "(for another loop, use WhiteBoxProbe(params, ...) with canary_gradients/observe)")
    if isinstance(optimizer, Probed):
        raise DPAuditError("a WhiteBoxProbe is already attached to this optimizer (one probe a run)")
    rate = sample_rate if sample_rate is not None else hooked_sample_rate(optimizer)
    if rate is None:
        raise DPAuditError("the optimizer does not say its sample rate (no Opacus accountant hook is attached); "
                           "pass sample_rate=")
    ghost = isinstance(optimizer, DPOptimizerFastGradientClipping)
    rank = int(getattr(optimizer, "rank", 0) or 0)  # Opacus' distributed optimizers know their rank
    if rank != 0:
        return Passive()  # rank 0 plants the canaries and reads the release; the others train as they are
    clip = optimizer.max_grad_norm if np.isscalar(optimizer.max_grad_norm) else max(optimizer.max_grad_norm)
    probe = cls(optimizer.params, m=m, clip=float(clip), sample_rate=rate, out=out, gain=gain, seed=seed,
                resume=resume, model=model, secret_seed=secret_seed, _source=f"Opacus {type(optimizer).__name__}")
    probe.bypass = OPACUS_BYPASS if ghost else None
    probe.accountant = accountant
    probe._write_spec(optimizer=type(optimizer).__name__, noise_multiplier=float(optimizer.noise_multiplier),
                      expected_batch_size=optimizer.expected_batch_size)
    kind = type(optimizer)
    mixin = ProbedDistributed if hasattr(optimizer, "reduce_gradients") else Probed
    optimizer.__class__ = type(f"{mixin.__name__}{kind.__name__}", (mixin, kind), {})
    optimizer.dpaudit_probe, optimizer.dpaudit_probe_ghost, optimizer.dpaudit_injected = probe, ghost, False
    probe.health.bracketed = True  # each DP step bracketed (Probed.step): moves in and between steps
    optimizer.dpaudit_health, optimizer.dpaudit_steps, optimizer.dpaudit_in_step = probe.health, 0, False
    original = getattr(optimizer, "original_optimizer", None)
    if original is not None and hasattr(original, "register_step_pre_hook"):
        def outside(opt, args, kwargs):  # the optimizer under the DP one, stepped by itself
            if not optimizer.dpaudit_in_step:
                probe.health.stepped_outside(opt)
        original.register_step_pre_hook(outside)
    return probe


class Probed:
    """Mixin in front of an Opacus DPOptimizer's class: the canaries join once a step (per-sample modes: in
    the same call as the examples' clipping, at whatever clip norm it uses then; ghost: the sums arrive
    clipped, so just before the noise), and the release is read after ``scale_grad``, before the step hook."""

    dpaudit_probe = None
    dpaudit_probe_ghost = False
    dpaudit_injected = False
    dpaudit_health = None
    dpaudit_steps = 0
    dpaudit_in_step = False

    def step(self, closure=None):
        """Opacus' step, bracketed for the update's health check (what moved in the step, and between steps); after
        it (its accountant hook has counted the step) a watched probe's planned final look."""
        health = self.dpaudit_health
        if health is None:
            result = super().step(closure)
            self.dpaudit_probe.final_look(counted=True)
            return result
        health.before(self.dpaudit_steps)
        self.dpaudit_in_step = True
        try:
            result = super().step(closure)
        finally:
            self.dpaudit_in_step = False
        if not self._is_last_step_skipped:
            health.after(self.dpaudit_steps, self.original_optimizer, [p.grad for p in self.params])
            self.dpaudit_steps += 1
            if health.due(self.dpaudit_steps):
                self.dpaudit_probe.save_health()
        self.dpaudit_probe.final_look(counted=True)
        return result

    def clip_and_accumulate(self):
        super().clip_and_accumulate()
        if not self.dpaudit_probe_ghost:
            self._join_once()

    def add_noise(self):
        if self.dpaudit_probe_ghost:
            self._join_once()
        super().add_noise()

    def scale_grad(self):
        super().scale_grad()
        self.dpaudit_injected = False  # the step's release is complete: the next clipping is the next step's
        if not hasattr(self, "reduce_gradients"):
            self._read(1)

    def _join_once(self) -> None:
        if not self.dpaudit_injected:  # gradient accumulation clips several times a step; canaries enter once
            if self.dpaudit_health is not None:  # the clipped sums before any canary joins
                self.dpaudit_health.gradient_sums(self.dpaudit_steps,
                                                  [getattr(p, "summed_grad", None) for p in self.params])
            inject(self.dpaudit_probe, self, self.dpaudit_probe_ghost)
            self.dpaudit_injected = True

    def _read(self, ranks: int) -> None:
        scale = self.expected_batch_size * self.accumulated_iterations if self.loss_reduction == "mean" else 1.0
        self.dpaudit_probe.observe(self.dpaudit_probe.step, [p.grad for p in self.params], scale * ranks)


class ProbedDistributed(Probed):
    """The release is the sum over the ranks: read once reduced (DDP: after Opacus' reduce_gradients)."""

    def reduce_gradients(self):
        super().reduce_gradients()
        self._read(self.world_size if self.loss_reduction == "mean" else 1)


def inject(probe, optimizer, ghost: bool) -> None:
    """The step's sampled canaries into the optimizer's clipped sum."""
    import torch

    sampled, signs = probe.begin(probe.step), probe.canaries.signs(probe.step)
    if not sampled.size:
        return
    if ghost:
        return probe.add_to_summed_grad(probe.params, float(optimizer.max_grad_norm))
    # Per-sample modes: the canaries are rows of per-sample gradients (zero but at their coordinate),
    # clipped and summed by the optimizer's own clip_and_accumulate. It runs on a view of the optimizer
    # that holds only the tensors the sampled canaries sit on: a canary's row is zero everywhere else, so
    # the other tensors would add nothing to its norm or its sum, only a pass over every weight.
    from types import SimpleNamespace

    owners = sorted({probe.where[i][0] for i in sampled})
    rows = len(sampled)
    held = {k: getattr(probe.params[k], "grad_sample", None) for k in owners}
    try:
        for k in owners:
            p = probe.params[k]
            g = torch.zeros((rows, p.numel()), dtype=p.dtype, device=p.device)
            for r, i in enumerate(sampled):
                kk, off = probe.where[i]
                if kk == k:
                    g[r, off] = probe.canaries.gain * probe.clip * signs[i]
            p.grad_sample = g.view(rows, *p.shape)
        view = SimpleNamespace(params=[probe.params[k] for k in owners], max_grad_norm=optimizer.max_grad_norm,
                               _get_flat_grad_sample=optimizer._get_flat_grad_sample)
        view.grad_samples = [p.grad_sample for p in view.params]
        norms = getattr(optimizer, "max_grad_norms", None)  # per-layer clipping: each tensor its own
        if norms is not None:
            index = {id(p): n for p, n in zip(optimizer.params, norms)}
            view.max_grad_norms = [index[id(p)] for p in view.params]
        _opacus_own(type(optimizer)).clip_and_accumulate(view)  # Opacus' own clipping, on the view
    finally:
        for k, g in held.items():
            probe.params[k].grad_sample = g


def _opacus_own(cls):
    """The Opacus class in ``cls``'s ancestry that defines clip_and_accumulate (past any seam mixin in front)."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("opacus.") and "clip_and_accumulate" in c.__dict__)


class Passive:
    """What ``attach`` returns on a rank other than 0 of a distributed run: it plants and records nothing
    (rank 0's probe does, once for the whole run), and its audit is rank 0's to make."""

    step = 0

    def close(self) -> None:
        pass

    def audit(self, *args, **kwargs):
        return None


def hooked_accountant(optimizer):
    """The Opacus accountant whose step hook PrivacyEngine attached to ``optimizer`` (the hook closes over it), or
    None: it says eps for the steps actually taken."""
    hook = getattr(optimizer, "step_hook", None)
    code = getattr(hook, "__code__", None)
    if code is None or "self" not in code.co_freevars:
        return None
    value = hook.__closure__[code.co_freevars.index("self")].cell_contents
    return value if hasattr(value, "get_epsilon") else None


def hooked_sample_rate(optimizer) -> float | None:
    """The sample rate PrivacyEngine gave the accountant's step hook (``get_optimizer_hook_fn(sample_rate,
    ...)``): the optimizer itself does not keep it, and the data loader may not be at hand."""
    hook = getattr(optimizer, "step_hook", None)
    code = getattr(hook, "__code__", None)
    if code is None or "sample_rate" not in code.co_freevars:
        return getattr(optimizer, "sample_rate", None)
    value = hook.__closure__[code.co_freevars.index("sample_rate")].cell_contents
    return float(value) if isinstance(value, (int, float)) else None


