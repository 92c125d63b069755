"""DP-SGD: per-example clipping to C, N(0, C^2 sigma^2 I) noise once per step, division by the
expected batch size; the non-private baseline is the same loss and optimizer without either. bf16
runs without loss scaling.

Two ways to the clipped sum sum_i min(1, C / ||g_i||) g_i, the same number up to float rounding:
- ``ghost`` (default; Opacus' fast gradient clipping, Li et al. 2022 "ghost clipping"): one backward
  pass gives each example's gradient norm from the layer inputs and output gradients alone
  (||a_i^T b_i||^2 = <a_i a_i^T, b_i b_i^T> for a linear layer), without forming g_i; the clipped sum is then
  formed from the same inputs and output gradients, one product a layer (book-keeping, Bu et al. 2023; under
  FSDP2 a second backward of sum_i c_i l_i instead). Cost: SGD's backward without its weight gradients, the
  norms, and the weight gradients once; memory about SGD's. A weight two layers use (tied input/output
  embeddings) gets its exact norm from the pairwise products of the two layers' factors.
- ``materialise``: Opacus' GradSampleModule stores every example's gradient (B x parameters), then
  DPOptimizer clips and sums. Kept for comparison (``--per-sample-grads materialise``).

Where each part lives: the DP step's seams (clip, add noise, scale, step hook) in dp_step.py, ghost
clipping in ghost.py, per-example gradients of each layer kind in per_example.py; here the trainer.

Micro-batches (``micro_batch``): one logical Poisson batch is processed in chunks whose clipped
sums add up before the single noise draw, so accounting, noise and update are those of one batch.

ULS (``per_user``; accounting/unit.py): the batch holds every record of each sampled user, users whole in each
chunk (data.split_users), and each user's mean gradient is clipped to C as one. Ghost: the norm of that mean comes
from book-keeping's kept factors (``GhostClipping.user_coef``: a user's rows laid end to end are one example), and
each row is weighted c_u / n_u in the one clipped sum. Materialise: each user's per-example gradients are averaged
into one row (data.user_means), which Opacus clips like an example's.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from opacus import optimizers as dp

from dpaudit.core.errors import DPAuditError
from dpaudit.training.data import padded_chunks, per_example_loss, split, split_users, user_means
from dpaudit.training.heap import release_freed
from dpaudit.training.per_example import materialising_module, supported_for_dp_sgd
from dpaudit.training.streams import step_key
from dpaudit.training.bugs import seams
from dpaudit.training.dp_step import CorrelatedNoise, InPlace, NoisyShards, dp_optimizer
from dpaudit.training.bias_clipping import BiasClipping, bias_only
from dpaudit.training.ghost import GhostClipping
from dpaudit.training.shard import full_optimizer_state, gathered, load_optimizer_state, local_slices, sliced

PER_SAMPLE_GRADS = ("ghost", "materialise")
NOISE_STATE = "dpaudit_correlated_noise"  # the key of a correlated run's last noises in its optimizer state


def dp_optimizer_class(ghost: bool, world_size: int = 1, bug=None, correlated: bool = False):
    """Opacus' optimizer for the route (fast gradient clipping for ghost, else per-example gradients; distributed
    over several ranks), with dpaudit's DP-step seams (dp_step.py) and a planted bug's in front. Ghost in one
    process adds the noise in place into the clipped sum (dp_step.InPlace)."""

    if ghost:
        cls = dp.DistributedDPOptimizerFastGradientClipping if world_size > 1 else dp.DPOptimizerFastGradientClipping
    else:
        cls = dp.DistributedDPOptimizer if world_size > 1 else dp.DPOptimizer
    return dp_optimizer(cls, *seams(bug), *((CorrelatedNoise,) if correlated else ()),
                        *((InPlace,) if ghost and world_size == 1 else ()))


def per_example_module(model, ghost: bool, clip: float, sharded: bool = False):
    """``model`` wrapped to clip per example: ghost clipping at ``clip`` (ghost.py; book-keeping unless
    ``sharded``), or Opacus' materialised per-example gradients; a trainable layer DP-SGD cannot clip is refused
    first (per_example.py)."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        supported_for_dp_sgd(model)
        if ghost and not sharded and bias_only(model):  # DP-BiTFiT: the biases' own gradients (bias_clipping.py)
            wrapped = BiasClipping(model, clip)
        elif ghost:
            wrapped = GhostClipping(model, clip, book_keeping=not sharded)
        else:
            wrapped = materialising_module(model)
    # Opacus' hooks trip a torch notice when no input needs a gradient (token ids never do).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    return wrapped


class FirstOrderTrainer:
    """DP-SGD (or SGD) behind the trainer protocol (methods.Trainer).
    White-box canaries enter through ``probe`` (the WhiteBoxProbe a user attaches to their own loop, made
    by ``WhiteBoxProbe.for_run``), which reads each release into the transcript; planted bugs through
    ``bug``. ``per_sample_grads``: ghost or materialise (see the
    module's docstring); ``micro_batch``: at most this many examples per forward/backward (0: all).
    ``noise_seed``: the secret key of the noise (streams.step_key(noise_seed, step) per step).
    ``sharding``: the model is sharded with FSDP2 over the ranks (shard.py; ghost clipping only)."""

    def __init__(self, model, params, *, lr: float, private: bool, clip: float = 1.0, sigma: float = 0.0,
                 expected_batch_size: int = 1, noise_seed: int = 0, optimizer: str = "adamw",
                 world_size: int = 1, probe=None, bug=None, per_sample_grads: str = "ghost",
                 micro_batch: int = 0, sharding=None, noise_coefs=None, noise_blt=None, per_user: bool = False) -> None:
        if per_sample_grads not in PER_SAMPLE_GRADS:
            raise ValueError(f"unknown per-sample-grads mode {per_sample_grads!r}; use ghost or materialise")
        self.private, self.params = private, params
        self.world_size = world_size
        self.probe = probe
        self.ghost = private and per_sample_grads == "ghost"
        self.micro_batch = micro_batch
        self.sharding, self.inner = sharding, model
        self.noise_seed, self.step_index = noise_seed, 0
        self.noise_coefs = noise_coefs   # BandMF's strategy (dp_step.CorrelatedNoise); None: independent noise
        self.noise_blt = noise_blt       # or BLT's (theta, omega) (dp_step.CorrelatedNoise)
        base = (torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw"
                else torch.optim.SGD(params, lr=lr))
        self.base_optimizer = base
        if private:
            self.optimizer = self._dp_optimizer(base, clip, sigma, expected_batch_size, probe, bug)
            self.model = self._per_example_module(model)
            if per_user:   # ULS: each user's records' gradients averaged, then clipped as one
                if sharding is not None or (self.ghost and not isinstance(self.model, GhostClipping)):
                    raise ValueError("per-user clipping runs in one process, by book-keeping ghost clipping or "
                                     "materialised per-example gradients")
                self.optimizer.per_user = True
        else:
            self.model, self.optimizer = model, base

    @property
    def correlated(self) -> bool:
        """Correlated noise (BandMF or BLT): the optimizer keeps a noise state that checkpoints carry."""
        return self.noise_coefs is not None or self.noise_blt is not None

    def _dp_optimizer(self, base, clip: float, sigma: float, expected_batch_size: int, probe, bug):
        """Opacus' optimizer with the DP step's seams (dp_step.py), a planted bug's in front; sharded: NoisyShards.
        Distributed: each rank scales by B / world and the ranks average, so the update is (sum of clipped
        gradients + one noise draw, on rank 0) / B, as in one process."""

        if self.sharding is not None:
            cls = NoisyShards
            if self.correlated:   # each rank continues the noises of its own slices

                cls = type("CorrelatedNoisyShards", (CorrelatedNoise, NoisyShards), {})
            optimizer = cls(base, self.params, sigma * clip, expected_batch_size, clip, probe, self.sharding.sum)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Opacus warns about secure_mode; the noise is ours
                optimizer = dp_optimizer_class(self.ghost, self.world_size, bug, self.correlated)(
                    base, noise_multiplier=sigma, max_grad_norm=clip,
                    expected_batch_size=expected_batch_size / self.world_size)
            optimizer.probe = probe
        if self.noise_coefs is not None:
            optimizer.noise_coefs = tuple(float(c) for c in self.noise_coefs)
        if self.noise_blt is not None:
            optimizer.noise_blt = tuple(tuple(float(v) for v in part) for part in self.noise_blt)
        return optimizer

    def _per_example_module(self, model):
        """The model wrapped to clip per example, at the optimizer's clip norm (a planted "no-clip": infinite)."""
        return per_example_module(model, self.ghost, self.optimizer.clip_norm(), self.sharding is not None)

    def _clipped_backward(self, batch, real: bool = True) -> torch.Tensor:
        """Adds this chunk's sum of clipped per-example gradients to ``p.grad``; returns its losses.
        ``real`` False: a placeholder pass of a sharded model (weight 0: it adds nothing)."""
        losses = per_example_loss(self.model, batch)
        release_freed(losses.device.type)  # the forward's freed buffers, before the backward allocates
        if self.ghost:
            # Pass 1: the hooks take each example's gradient norm (torch.autograd.grad leaves p.grad,
            # which may hold earlier chunks, alone).
            if self.sharding is not None:  # the root unit (embeddings) stays gathered for pass 2
                self.inner.set_reshard_after_backward(False, recurse=False)
            try:
                coef = self.model.norm_pass(losses.sum(), self.params).to(losses.dtype)
            finally:
                if self.sharding is not None:
                    self.inner.set_reshard_after_backward(True, recurse=False)
            if self.clips_per_user:   # ULS: c_u / n_u for each of user u's rows, from the kept factors
                coef = self.model.user_coef(batch["user"]).to(losses.dtype)
            if not real:
                coef = torch.zeros_like(coef)
            release_freed(losses.device.type)  # the norm pass's output gradients, before pass 2
            self.model.clipped_backward(losses, coef)
        else:
            losses.mean().backward()  # Opacus' loss_reduction="mean" matches this
        return losses.detach()

    @property
    def clips_per_user(self) -> bool:
        return self.private and self.optimizer.clips_per_user()

    def _chunks(self, batch, global_batch_size) -> list[tuple[dict, bool]]:
        if self.clips_per_user:   # a user's rows in one chunk, or each part would be clipped on its own
            return [(chunk, True) for chunk in split_users(batch, self.micro_batch)]
        if self.sharding is not None:
            return padded_chunks(batch, self.micro_batch,
                                 self.sharding.passes(global_batch_size or 0, self.micro_batch))
        return [(chunk, True) for chunk in split(batch, self.micro_batch)]

    def step(self, batch, global_batch_size: int | None = None) -> float:
        """One update on ``batch`` (this rank's share; may be empty under Poisson sampling); returns its mean loss.
        ``global_batch_size`` counts every sampled example (white-box canaries included)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.private:
            self.optimizer.noise_key = step_key(self.noise_seed, self.step_index)
        self.step_index += 1
        if self.private:
            self.optimizer.realised_batch = global_batch_size  # read by a planted "actual-batch" bug only
        if batch["input_ids"].shape[0] == 0 and self.sharding is None:
            for p in self.params:  # no example: the step is noise only
                if self.ghost:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            self.optimizer.step()
            return float("nan")
        if not self.private:
            losses = self._plain_backward(batch, global_batch_size)
        else:
            chunks = self._chunks(batch, global_batch_size)
            losses = []
            for k, (chunk, real) in enumerate(chunks):
                chunk_losses = self._clipped_backward(chunk, real)
                if real:
                    losses.append(chunk_losses)
                if self.clips_per_user and not self.ghost:   # one row a user: its records' mean, clipped next
                    for p in self.params:
                        p.grad_sample = user_means(p.grad_sample, chunk["user"])
                if not self.ghost and k < len(chunks) - 1:
                    # materialise: clip this chunk into p.summed_grad now and free its per-example
                    # gradients; the last chunk is clipped by optimizer.step() as usual.
                    self.optimizer.clip_and_accumulate()
                    for p in self.params:
                        p.grad_sample = None
            losses = torch.cat(losses) if losses else torch.zeros(0)
        self.optimizer.step()
        return float(losses.float().mean()) if losses.numel() else float("nan")

    def _plain_backward(self, batch, global_batch_size) -> torch.Tensor:
        """Non-private: the mean loss's gradient (over the global batch under data parallelism)."""
        n = batch["input_ids"].shape[0]
        total = n if self.world_size == 1 else global_batch_size
        losses = []
        for chunk, real in self._chunks(batch, global_batch_size):
            chunk_losses = per_example_loss(self.model, chunk)
            release_freed(chunk_losses.device.type)
            (chunk_losses.sum() * (1.0 if real else 0.0) / max(1, total)).backward()
            if real:
                losses.append(chunk_losses.detach())
        if self.world_size > 1 and self.sharding is None:
            import torch.distributed as dist

            for p in self.params:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        return torch.cat(losses) if losses else torch.zeros(0)

    def run_step(self, step: int, batch, n_sampled: int, sampled_canaries) -> float:
        self.step_index = step
        if self.probe is not None:   # ULS: a canary user's records join as one clipped canary
            self.probe.begin(step, np.unique(sampled_canaries) if self.clips_per_user else sampled_canaries)
        return self.step(batch, n_sampled)

    def close(self) -> None:
        """Ends the run: the transcript is closed, and gradients and optimizer state are freed before the
        model is exported (a sharded export gathers the whole model on rank 0)."""
        if self.probe is not None:
            self.probe.close()
        self.base_optimizer.zero_grad(set_to_none=True)
        self.base_optimizer.state.clear()
        for p in self.params:  # Opacus' references to the last clipped sum
            p.summed_grad = p.grad_sample = None

    def state_dict(self) -> dict:
        """The optimizer's state; sharded: whole tensors by parameter name, on rank 0 (every rank calls). A checkpoint
        is taken with it: the probe's transcript is written up to here, so that a resume finds every row before it."""
        if self.probe is not None:
            self.probe.flush()
        if self.sharding is not None:
            state = full_optimizer_state(self.inner, self.base_optimizer)
            noises = ([gathered(step, self.params) for step in self.optimizer.noise_state()]
                      if self.correlated else None)   # every rank takes part; whole on rank 0
        else:
            state = self.optimizer.state_dict()
            noises = self.optimizer.noise_state() if self.correlated else None
        if noises is not None:   # correlated noise: what a resume continues (the last b - 1 noises, BLT's buffers)
            state = {**state, NOISE_STATE: noises}
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.correlated:
            if NOISE_STATE not in state:
                raise DPAuditError("the checkpoint holds no noise state of this correlated-noise run (its resumed "
                                   "steps would not continue the strategy); start the run again")
            state = dict(state)
            noises = state.pop(NOISE_STATE)
            if self.sharding is not None:   # checked whole, then each rank keeps its slices

                self.optimizer.check_noise_state(noises, [p.shape for p in self.params])
                noises = [sliced(step, self.params) for step in noises]
                self.optimizer.load_noise_state(noises, [local for local, _, _ in local_slices(self.params)])
            else:
                self.optimizer.load_noise_state(noises, self.optimizer.params)
        if self.sharding is not None:
            return load_optimizer_state(self.inner, self.base_optimizer, state)
        self.optimizer.load_state_dict(state)
