"""Where a probe meets an Opacus DP optimizer's step, and everything dpaudit reads of Opacus' internals to get there.

Opacus' ``DPOptimizer.pre_step`` runs clip_and_accumulate, add_noise, scale_grad, then the step hook (the
accountant's). A probe needs two places in that chain, the same whoever owns the optimizer: the canaries join the
clipped sum once a step, before the noise (``ProbeSeams.join_canaries``), and the release is read back once it is
complete (``ProbeSeams.read_release``), in units of the noisy sum (``release_scale``). The bundled trainer's step
(training/dp_step.py: DPStep) and a user's attached optimizer (probe_opacus.py: Probed) both inherit ``ProbeSeams``.

What is read of Opacus beyond its public API sits here alone, for the pinned range (pyproject: opacus>=1.6,<1.7):
the accountant and sample rate that PrivacyEngine's step hook closes over (``hooked_accountant``,
``hooked_sample_rate``), the rates an accountant's history counted (``accounted_rate``), the class in an
optimizer's ancestry that clips (``opacus_own``), its clipping run on stand-in parameters (``clip_rows``), and the
processed-flag helpers of ``add_noise`` (``check_processed``, ``mark_processed``). training/ghost.py reads Opacus'
grad-sample hooks for its own clipping, with the same pin.
"""

from __future__ import annotations

from types import SimpleNamespace


def release_scale(optimizer, reduced: bool = False) -> float:
    """What the optimizer's ``p.grad`` is multiplied by to give the step's noisy sum: the expected batch size times
    the accumulated iterations when the loss is a mean (1 for a sum); ``reduced``: read after data parallelism's
    reduction, which averages the ranks' means (Opacus' DistributedDPOptimizer.reduce_gradients)."""
    if optimizer.loss_reduction != "mean":
        return 1.0
    return optimizer.expected_batch_size * optimizer.accumulated_iterations * (
        optimizer.world_size if reduced else 1)


class ProbeSeams:
    """Mixin for a DP optimizer that carries a probe: the canaries into the clipped sum, and the release read."""

    def join_canaries(self, probe, clip_norm: float) -> None:
        """The step's sampled canaries, each clipped at ``clip_norm``, into ``p.summed_grad`` (the clipped sum)."""
        probe.add_to_summed_grad(self.params, clip_norm)

    def read_release(self, probe, reduced: bool = False) -> None:
        """The step's release (``p.grad`` after scale_grad, or after the ranks' reduction) into the transcript."""
        probe.observe(probe.step, [p.grad for p in self.params], release_scale(self, reduced))


def hooked_accountant(optimizer):
    """The Opacus accountant whose step hook PrivacyEngine attached to ``optimizer`` (the hook closes over it), or
    None: it says eps for the steps actually taken."""
    value = _closed_over(optimizer, "self")
    return value if hasattr(value, "get_epsilon") else None


def hooked_sample_rate(optimizer) -> float | None:
    """The sample rate PrivacyEngine gave the accountant's step hook (``get_optimizer_hook_fn(sample_rate,
    ...)``): the optimizer itself does not keep it, and the data loader may not be at hand."""
    hook = getattr(optimizer, "step_hook", None)
    code = getattr(hook, "__code__", None)
    if code is None or "sample_rate" not in code.co_freevars:
        return getattr(optimizer, "sample_rate", None)
    value = _closed_over(optimizer, "sample_rate")
    return float(value) if isinstance(value, (int, float)) else None


def _closed_over(optimizer, name: str):
    hook = getattr(optimizer, "step_hook", None)
    code = getattr(hook, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return hook.__closure__[code.co_freevars.index(name)].cell_contents


def accounted_rate(accountant) -> tuple[float | None, str]:
    """The lowest sample rate an Opacus accountant has counted (its history: (noise multiplier, sample rate,
    steps)), or (None, "") where it has counted nothing."""
    history = getattr(accountant, "history", None)
    rates = [float(h[1]) for h in history if len(h) >= 2] if isinstance(history, list) else []
    if not rates:
        return None, ""
    return min(rates), f"{type(accountant).__name__}'s history"


def opacus_own(cls):
    """The Opacus class in ``cls``'s ancestry that defines clip_and_accumulate (past any seam mixin in front)."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("opacus.") and "clip_and_accumulate" in c.__dict__)


def clip_rows(optimizer, stand_ins: list, max_grad_norms: list | None = None) -> None:
    """Opacus' own clip_and_accumulate run on ``stand_ins`` (tensors whose ``grad_sample`` holds per-sample rows):
    each stand-in's ``summed_grad`` becomes its rows clipped as the optimizer clips its examples (per layer when
    ``max_grad_norms`` is given) and summed."""
    view = SimpleNamespace(params=stand_ins, max_grad_norm=optimizer.max_grad_norm,
                           _get_flat_grad_sample=lambda q: q.grad_sample)
    view.grad_samples = [q.grad_sample for q in stand_ins]
    if max_grad_norms is not None:
        view.max_grad_norms = max_grad_norms
    opacus_own(type(optimizer)).clip_and_accumulate(view)


def check_processed(tensor) -> None:
    """Opacus' guard against adding noise twice to the same clipped sum."""
    from opacus.optimizers.optimizer import _check_processed_flag

    _check_processed_flag(tensor)


def mark_processed(tensor) -> None:
    from opacus.optimizers.optimizer import _mark_as_processed

    _mark_as_processed(tensor)
