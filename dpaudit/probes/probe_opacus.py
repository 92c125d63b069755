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
from dpaudit.probes import probe_folder
from dpaudit.probes.opacus_seams import (
    ProbeSeams, accounted_rate, clip_rows, hooked_accountant, hooked_sample_rate,
)

OPACUS_BYPASS = ("ghost (fast gradient clipping): Opacus clips each example in the loss's backward pass, which "
                 "canaries never enter, so the probe clips them itself at the optimizer's max_grad_norm")


def attach(cls, optimizer, *, m, out, sample_rate, accountant, gain, seed, resume, model, secret_seed,
           data_loader=None, records: int = 1):
    """``cls.attach`` (cls: WhiteBoxProbe): the probe, with the optimizer's class put behind ``Probed``. The canaries
    are drawn at the data loader's own rate where the loader is given (audit/rate_check.py sets it beside the rate
    the accountant counts), else at ``sample_rate``, else at the rate the accountant's hook was given."""
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
    if getattr(optimizer, "target_unclipped_quantile", None) is not None:
        raise DPAuditError("WhiteBoxProbe.attach does not support Opacus adaptive clipping (clipping='adaptive'): "
                           "its clip norm changes every step, while the canaries and the per-tensor noise check hold "
                           "one C; probe a run with a fixed max_grad_norm")
    loader_rate, loader_source = loader_sample_rate(data_loader) if data_loader is not None else (None, "")
    accountant = accountant if accountant is not None else hooked_accountant(optimizer)
    hooked = hooked_sample_rate(optimizer)
    accounted, accounted_source = accounted_rate(accountant)
    if accounted is None and hooked is not None:
        accounted, accounted_source = hooked, "the rate PrivacyEngine gave the accountant's step hook"
    if accounted is None and sample_rate is not None:
        accounted, accounted_source = float(sample_rate), "sample_rate= given to attach"
    rate = loader_rate if loader_rate is not None else sample_rate if sample_rate is not None else hooked
    if rate is None:
        raise DPAuditError("the optimizer does not say its sample rate (no Opacus accountant hook is attached); "
                           "pass data_loader= (the loader you train with) or sample_rate=")
    ghost = isinstance(optimizer, DPOptimizerFastGradientClipping)
    rank = int(getattr(optimizer, "rank", 0) or 0)  # Opacus' distributed optimizers know their rank
    if rank != 0:
        return Passive()  # rank 0 plants the canaries and reads the release; the others train as they are
    clip = optimizer.max_grad_norm if np.isscalar(optimizer.max_grad_norm) else max(optimizer.max_grad_norm)
    probe = cls(optimizer.params, m=m, clip=float(clip), sample_rate=rate, out=out, gain=gain, seed=seed,
                resume=resume, model=model, secret_seed=secret_seed, _source=f"Opacus {type(optimizer).__name__}",
                noise_multiplier=float(optimizer.noise_multiplier), records=records)
    probe.bypass = OPACUS_BYPASS if ghost else None
    probe.accountant = accountant
    probe_folder.write_spec(probe, optimizer=type(optimizer).__name__,
                            expected_batch_size=optimizer.expected_batch_size,
                            loader_rate=loader_rate, loader_rate_source=loader_source,
                            accounted_rate=accounted, accounted_rate_source=accounted_source)
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


class Probed(ProbeSeams):
    """Mixin in front of an Opacus DPOptimizer's class: the canaries join once a step (per-sample modes: in
    the same call as the examples' clipping, at whatever clip norm it uses then; ghost: the sums arrive
    clipped, so just before the noise), and the release is read after ``scale_grad``, before the step hook."""

    dpaudit_probe = None
    dpaudit_probe_ghost = False
    dpaudit_injected = False
    dpaudit_health = None
    dpaudit_steps = 0
    dpaudit_in_step = False
    dpaudit_in_place = None  # whether add_noise adds into the clipped sums in place (learnt at the first step)
    dpaudit_unmeasurable = False  # the noise could not be measured (tensors it cannot read): the canaries' releases
                                  # alone then carry the per-tensor check

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
        measure = bool(self.dpaudit_probe.noise_multiplier) and not self.dpaudit_unmeasurable
        try:
            sums = [getattr(p, "summed_grad", None) for p in self.params] if measure else None
            copies = snapshot(self.params, sums) if measure and self.dpaudit_in_place is not False else None
        except Exception:  # noqa: BLE001 - tensors the measurement cannot read (sharded): never the user's step
            measure, self.dpaudit_unmeasurable = False, True
        super().add_noise()
        if measure:  # what this step added to each tensor: the noise itself, for the per-tensor check
            try:
                self.dpaudit_in_place = any(s is not None and p.grad is not None and s.data_ptr() == p.grad.data_ptr()
                                            for p, s in zip(self.params, sums))
                if not self.dpaudit_in_place or copies is not None:
                    self.dpaudit_probe.tally_noise([p.grad for p in self.params],
                                                   copies if self.dpaudit_in_place else sums)
            except Exception:  # noqa: BLE001 - as above: the steps measured so far stay in the tally
                self.dpaudit_unmeasurable = True

    def scale_grad(self):
        super().scale_grad()
        self.dpaudit_injected = False  # the step's release is complete: the next clipping is the next step's
        if not hasattr(self, "reduce_gradients"):
            self.read_release(self.dpaudit_probe)

    def _join_once(self) -> None:
        if not self.dpaudit_injected:  # gradient accumulation clips several times a step; canaries enter once
            if self.dpaudit_health is not None:  # the clipped sums before any canary joins
                self.dpaudit_health.gradient_sums(self.dpaudit_steps,
                                                  [getattr(p, "summed_grad", None) for p in self.params])
            inject(self.dpaudit_probe, self, self.dpaudit_probe_ghost)
            self.dpaudit_injected = True


class ProbedDistributed(Probed):
    """The release is the sum over the ranks: read once reduced (DDP: after Opacus' reduce_gradients)."""

    def reduce_gradients(self):
        super().reduce_gradients()
        self.read_release(self.dpaudit_probe, reduced=True)


SNAPSHOT_SHARE = 0.05  # of the trainable values: the most a step copies to measure the noise added in place


def snapshot(params, sums) -> list:
    """The clipped sums before the noise, for an optimizer that adds the noise into them in place (dpaudit's DPStep;
    Opacus' own add_noise writes a new p.grad, and the sums themselves serve: ``Probed.add_noise`` learns which at
    the first step): copies of the smaller tensors, up to SNAPSHOT_SHARE of all values, None for the rest (the
    per-tensor check then reads their canary releases alone)."""
    budget = SNAPSHOT_SHARE * sum(p.numel() for p in params)
    out, spent = [None] * len(params), 0
    for k in sorted(range(len(params)), key=lambda k: params[k].numel()):
        if sums[k] is None or spent + params[k].numel() > budget:
            continue
        out[k], spent = sums[k].detach().clone(), spent + params[k].numel()
    return out


def inject(probe, optimizer, ghost: bool) -> None:
    """The step's sampled canaries into the optimizer's clipped sum."""
    import torch

    sampled, signs = probe.begin(probe.step), probe.canaries.signs(probe.step)
    if not sampled.size:
        return
    if ghost:
        return optimizer.join_canaries(probe, float(optimizer.max_grad_norm))
    # Per-sample modes: the canaries are rows of per-sample gradients (zero but at their coordinate), clipped and
    # summed by the optimizer's own clip_and_accumulate. It runs on a view of the optimizer whose parameters are
    # stand-ins holding only the sampled canaries' coordinates of each tensor they sit on: a canary's row is zero
    # everywhere else, so the rest of a tensor would add nothing to its norm or its sum, only rows the size of the
    # tensor (a canary on a 100 M-value embedding would cost 400 MB a row). The stand-ins' clipped sums are then
    # added at those coordinates of the tensors' own clipped sums.

    rows, by_tensor = len(sampled), {}
    for r, i in enumerate(sampled):
        k, off = probe.where[i]
        by_tensor.setdefault(k, []).append((r, off, probe.canaries.gain * probe.clip * signs[i]))
    owners = sorted(by_tensor)
    stand_ins = []
    for k in owners:
        p = probe.params[k]
        q = torch.zeros(len(by_tensor[k]), dtype=p.dtype, device=p.device)
        g = torch.zeros((rows, q.numel()), dtype=p.dtype, device=p.device)
        for c, (r, _, value) in enumerate(by_tensor[k]):
            g[r, c] = value
        q.grad_sample, q.summed_grad = g, None
        stand_ins.append(q)
    norms = getattr(optimizer, "max_grad_norms", None)  # per-layer clipping: each tensor its own
    if norms is not None:
        index = {id(p): n for p, n in zip(optimizer.params, norms)}
        norms = [index[id(probe.params[k])] for k in owners]
    clip_rows(optimizer, stand_ins, norms)  # Opacus' own clipping, on the stand-ins
    for k, q in zip(owners, stand_ins):
        p = probe.params[k]
        if p.summed_grad is None:  # an empty batch of examples: the canaries' sum alone
            p.summed_grad = torch.zeros_like(p)
        at = torch.tensor([off for _, off, _ in by_tensor[k]], device=p.device)
        p.summed_grad.view(-1).index_add_(0, at, q.summed_grad.to(p.summed_grad.dtype))


class Passive:
    """What ``attach`` returns on a rank other than 0 of a distributed run: it plants and records nothing
    (rank 0's probe does, once for the whole run), and its audit is rank 0's to make."""

    step = 0
    alarm = alarm_report = health = None
    stop_requested = False

    def watch(self, **kwargs) -> "Passive":
        return self

    def final_look(self, counted: bool = False) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def audit(self, *args, **kwargs):
        return None


def loader_sample_rate(loader) -> tuple[float, str]:
    """The rate at which ``loader`` puts each example in a batch: an Opacus ``DPDataLoader``'s (Poisson) sample rate,
    else its batch size over its dataset's size (a loader of fixed batches: each example once an epoch)."""
    for holder, name in ((loader, "DPDataLoader"), (getattr(loader, "batch_sampler", None), "its batch sampler")):
        rate = getattr(holder, "sample_rate", None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate <= 1:
            return float(rate), f"{name}.sample_rate"
    size, batch = _length(getattr(loader, "dataset", None)), getattr(loader, "batch_size", None)
    if size and isinstance(batch, int) and batch > 0:
        return min(1.0, batch / size), f"batch size {batch} of {size} examples (fixed batches, not Poisson)"
    raise DPAuditError(f"data_loader: cannot read the rate a {type(loader).__name__} samples at (an Opacus "
                       "DPDataLoader, or a DataLoader with a batch size and a sized dataset)")


def _length(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None
