"""The DP-SGD step as a chain of small overridable methods, the Opacus way (``opacus/optimizers/optimizer.py``:
``pre_step`` calls clip_and_accumulate, add_noise, scale_grad, then the step hook). ``DPStep`` is a mixin in
front of an Opacus optimizer class that splits those calls into the seams an audit and a planted bug need:

    clip_norm()          the norm each example is clipped at (Opacus' max_grad_norm)
    clips_per_user()     ULS: each user's records averaged into one gradient before clipping (sgd.py)
    join_clipped_sum()   what joins the clipped sum before the noise: the white-box canaries (``probe``)
    noise_std()          sigma x C
    draw_noise(ts, s)    N(0, s^2) added to the tensors in place (tensor i from index i of the step's position-
                         addressable stream, streams.add_normals_: the numbers a sharded run draws slice by
                         slice; on a GPU all tensors in one captured pass)
    divisor()            what the noisy sum is divided by: the expected batch size (x accumulated iterations)
    on_release()         the release, read (the probe's transcript), before Opacus' step hook

With no probe and no bug, each seam is Opacus' own behaviour. A planted bug is a mixin overriding one seam
(bugs.py: ``NoClipping``, ``RealisedBatch``), put in front by ``bugs.planted``. ``NoisyShards`` is the same
chain for sharded weights (DP-ZeRO), whose clipped sums arrive reduce-scattered.
"""

from __future__ import annotations

import torch

from dpaudit.training.streams import add_normals_
from dpaudit.core.errors import DPAuditError
from dpaudit.probes.opacus_seams import ProbeSeams, check_processed, mark_processed, release_scale
from dpaudit.training.shard import local_slices


class DPStep(ProbeSeams):
    """Mixin: ``class X(DPStep, opacus.optimizers.DPOptimizer)`` (or any of its subclasses). The probe's two places
    (the canaries in, the release out) are probes/opacus_seams.ProbeSeams, as on a user's attached optimizer."""

    probe = None                 # the run's WhiteBoxProbe (probe.py) or None
    noise_key: int = 0           # the step's noise stream (streams.step_key), set per step
    realised_batch: int | None = None  # the step's realised batch size, set per step (read by RealisedBatch)

    per_user: bool = False       # ULS: each user's rows are one unit, clipped as one (set by the trainer)

    # -- the seams ---------------------------------------------------------------------------------------
    def clip_norm(self) -> float:
        return self.max_grad_norm

    def clips_per_user(self) -> bool:
        """ULS: the per-example gradients of a user's records are averaged into one before clipping."""
        return self.per_user

    def join_clipped_sum(self) -> None:
        if self.probe is not None:  # canaries join once: rank 0's sum, as its noise does
            self.join_canaries(self.probe, self.clip_norm())

    def noise_std(self) -> float:
        return self.noise_multiplier * self.max_grad_norm

    def draw_noise(self, tensors: list, std: float) -> None:
        add_normals_(tensors, self.noise_key, std)

    def divisor(self) -> float:
        return release_scale(self)

    def on_release(self, reduced: bool = False) -> None:
        if self.probe is not None:  # the release, in units of the noisy sum
            self.read_release(self.probe, reduced)

    # -- Opacus' calls, made of the seams ----------------------------------------------------------------
    def clip_and_accumulate(self):
        norm = self.clip_norm()
        if norm == self.max_grad_norm:
            return super().clip_and_accumulate()
        kept, self.max_grad_norm = self.max_grad_norm, norm
        try:
            super().clip_and_accumulate()
        finally:
            self.max_grad_norm = kept

    def add_noise(self):
        """The clipped sum plus the noise, in place; under data parallelism on rank 0 only, before the ranks'
        sums are added."""
        adds = getattr(self, "rank", 0) == 0
        if adds:
            self.join_clipped_sum()
        std = self.noise_std()
        for p in self.params:
            check_processed(p.summed_grad)
        if adds and std > 0:
            self.draw_noise([p.summed_grad for p in self.params], std)
        for p in self.params:
            p.grad = p.summed_grad.view_as(p)
            mark_processed(p.summed_grad)

    def scale_grad(self):
        divisor = self.divisor()
        for p in self.params:
            p.grad /= divisor
        if not self.distributed:
            self.on_release()

    distributed = False  # the ranks' release is read once reduced (DistributedDPStep)


class DistributedDPStep(DPStep):
    distributed = True

    def reduce_gradients(self):
        """Data parallelism: the release is the ranks' average (each scaled by B / world), read once reduced."""
        super().reduce_gradients()
        self.on_release(reduced=True)


class CorrelatedNoise:
    """Mixin: BandMF's noise (accounting/matrix/bandmf.py). The mechanism releases C x + z with z ~ N(0, s^2 I) per
    step and C lower-triangular banded Toeplitz (coefficients c_0..c_{b-1}, column norm 1); a trainer that updates
    with each step's estimate C^-1 (C x + z) = x + C^-1 z adds, at step t, w_t = C^-1 z at t, which solves C w = z:
        w_t = (z_t - sum_{k=1}^{b-1} c_k w_{t-k}) / c_0

    z_t comes from the step's position-addressable stream (the seam below, as for independent noise), and the last
    b - 1 noises are kept: memory (b - 1) x the trainable parameters, in the parameters' dtype and device. With
    b = 1 (c = [1]) this is DP-SGD's noise exactly. A checkpoint keeps the b - 1 noises (``noise_state``) and a
    resumed run continues them with fresh draws (accounting/matrix/bandmf.py: resumed runs).

    BLT (``noise_blt = (theta, omega)``, Dvijotham et al. 2024): C = 1 + sum_i omega_i x / (1 - theta_i x) as a
    generating function (coefficients 1, then c_k = sum_i omega_i theta_i^(k-1)), so C w = z is solved by

        w_t = z_t - sum_i omega_i s_i,t,   s_i,t = sum_{k>=1} theta_i^(k-1) w_{t-k},   then s_i <- theta_i s_i + w_t

    with d buffers s_i: memory d x the trainable parameters, whatever T (the buffers are the noise state a
    checkpoint keeps; a resume continues them, accounting/matrix/single.py: resumed runs)."""

    noise_coefs: tuple = (1.0,)
    noise_blt: tuple | None = None
    _past: list | None = None

    def draw_noise(self, tensors: list, std: float) -> None:
        if self.noise_blt is not None:
            return self._draw_blt(tensors, std)
        if tuple(self.noise_coefs) == (1.0,):   # one band: C = I, DP-SGD's noise, drawn as DP-SGD draws it
            return super().draw_noise(tensors, std)
        z = [torch.zeros_like(t) for t in tensors]
        super().draw_noise(z, std)
        past = self._past if self._past is not None else []
        c = self.noise_coefs
        for k, earlier in enumerate(past, start=1):   # past[0] is w_{t-1}
            for zi, wi in zip(z, earlier):
                zi.sub_(wi, alpha=c[k])
        if c[0] != 1.0:
            for zi in z:
                zi.div_(c[0])
        for t, zi in zip(tensors, z):
            t.add_(zi)
        self._past = ([z] + past)[:len(c) - 1]

    def _draw_blt(self, tensors: list, std: float) -> None:
        theta, omega = self.noise_blt
        w = [torch.zeros_like(t) for t in tensors]
        super().draw_noise(w, std)   # z_t, from the step's stream
        buffers = self._past
        if buffers:
            for weight, buffer in zip(omega, buffers):
                for wi, si in zip(w, buffer):
                    wi.sub_(si, alpha=weight)
        else:   # the first step: every buffer is 0
            buffers = [[torch.zeros_like(t) for t in tensors] for _ in theta]
        for decay, buffer in zip(theta, buffers):
            for si, wi in zip(buffer, w):
                si.mul_(decay).add_(wi)
        for t, wi in zip(tensors, w):
            t.add_(wi)
        self._past = buffers

    def noise_state(self) -> list:
        """The noise a resume continues, for a checkpoint: BandMF's last b - 1 noises (newest first), BLT's d
        buffers."""
        return [[w.detach().clone() for w in step] for step in (self._past or [])]

    def load_noise_state(self, state, params) -> None:
        """The noises a checkpoint kept, checked against this run's strategy and parameters, kept as its own."""
        self.check_noise_state(state, [p.shape for p in params])
        self._past = [[w.to(device=p.device, dtype=p.dtype) for w, p in zip(step, params)] for step in state]

    def check_noise_state(self, state, shapes) -> None:
        """A list of tensor lists (BandMF: one per earlier step, at most b - 1, newest first; BLT: its d buffers, or
        none before the first step), each tensor of its shape in ``shapes``; else refused in one line."""
        shapes = [tuple(s) for s in shapes]
        if not isinstance(state, list):
            fits = False
        elif self.noise_blt is not None:
            fits = len(state) in (0, len(self.noise_blt[0]))
        else:
            fits = len(state) <= max(0, len(self.noise_coefs) - 1)
        if not fits or not all(
                isinstance(step, list) and len(step) == len(shapes) and all(
                    isinstance(w, torch.Tensor) and tuple(w.shape) == shape for w, shape in zip(step, shapes))
                for step in state):
            raise DPAuditError("the checkpoint's noise state does not fit this run's strategy and parameters; "
                               "start the run again")


class InPlace:
    """Mixin for Opacus' fast-gradient-clipping optimizer without its gradient-sized copy: p.grad already holds
    the clipped sum, which Opacus copies to p.summed_grad before adding the noise; here the sum is p.grad
    itself (add_noise then adds in place)."""

    def accumulate(self):
        for p in self.params:
            p.summed_grad = p.grad


def dp_optimizer(opacus_class, *mixins):
    """``opacus_class`` with the DP step's seams (and ``mixins`` in front: a planted bug, InPlace)."""
    step = DistributedDPStep if hasattr(opacus_class, "reduce_gradients") else DPStep
    return type("".join(b.__name__ for b in mixins) + f"DPStep{opacus_class.__name__}", (*mixins, step, opacus_class), {})


class NoisyShards(DPStep):
    """DP-SGD's release on sharded weights (DP-ZeRO, shard.py), with the same seams: after the reduce-scatter,
    each rank's p.grad holds its slice of the clipped sum over all ranks' examples; the rank adds its slice of
    the step's noise stream (the numbers one process adds to the whole sum), divides by the expected batch
    size, and the base optimizer updates its shards. No copy of a gradient is made."""

    def __init__(self, base, params, std: float, expected_batch_size: float, clip: float = 1.0, probe=None,
                 all_sum=None) -> None:
        self.original_optimizer, self.params = base, params
        self.std, self.expected_batch_size, self.max_grad_norm = std, expected_batch_size, clip
        self.probe, self.all_sum = probe, all_sum  # white-box canaries; the ranks' sum of a numpy vector
        self.slices = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def join_clipped_sum(self) -> None:
        if self.probe is not None:  # each canary joins the slice its coordinate lies in, on one rank
            self.probe.add_to_slices(self.slices, self.clip_norm())

    def noise_std(self) -> float:
        return self.std

    def draw_noise(self, tensors: list, std: float) -> None:
        add_normals_(tensors, self.noise_key, std, [at for _, at, _ in self.slices], [n for _, _, n in self.slices])

    def divisor(self) -> float:
        return self.expected_batch_size

    def on_release(self, reduced: bool = False) -> None:
        if self.probe is not None:  # the slices hold the noisy sum over the expected batch size
            self.probe.observe_slices(self.probe.step, self.slices, self.expected_batch_size, self.all_sum)

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.slices = list(local_slices([p.grad for p in self.params]))
        self.join_clipped_sum()
        std, divisor = self.noise_std(), self.divisor()
        if std > 0:
            self.draw_noise([grad for grad, _, _ in self.slices], std)
        for grad, _, _ in self.slices:
            grad.div_(divisor)
        self.on_release()
        self.original_optimizer.step()
