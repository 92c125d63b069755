"""DP-SGD: Opacus per-sample gradients (GradSampleModule) and its DPOptimizer (per-example clipping
to C, N(0, C^2 sigma^2 I) noise once per step, division by the expected batch size); the non-private
baseline is the same loss and optimizer without either. bf16 runs without loss scaling."""

from __future__ import annotations

import torch

from dpaudit.training.data import per_example_loss


def _audited(cls):
    """The Opacus optimizer with the two places an audit and a planted bug need: the clipped sum before
    noise (white-box canaries join it; "no-clip" skips clipping) and the release (read by the auditor;
    "actual-batch" divides by the realised batch size). With neither set it is Opacus, unchanged."""

    class Audited(cls):
        hook = None                 # GradientCanaryHook or None
        skip_clipping = False
        realised_batch: int | None = None   # set per step when the "actual-batch" bug is planted

        def clip_and_accumulate(self):
            if not self.skip_clipping:
                return super().clip_and_accumulate()
            kept, self.max_grad_norm = self.max_grad_norm, float("inf")  # clip factor 1: no clipping
            try:
                super().clip_and_accumulate()
            finally:
                self.max_grad_norm = kept

        def add_noise(self):
            if self.hook is not None:
                self.hook.add_to_sum(self.params, float("inf") if self.skip_clipping else self.max_grad_norm)
            super().add_noise()

        def scale_grad(self):
            if self.realised_batch is None:
                super().scale_grad()
            else:
                for p in self.params:
                    p.grad /= max(1, self.realised_batch)
            if self.hook is not None:  # what the auditor sees, in units of the expected batch's sum
                self.hook.read_release(self.params, self.expected_batch_size * self.accumulated_iterations)

    Audited.__name__ = f"Audited{cls.__name__}"
    return Audited


class FirstOrderTrainer:
    """DP-SGD (or SGD) behind the trainers' common interface: ``run_step``, ``state_dict``, ``close``.
    White-box canaries enter through ``hook`` (a GradientCanaryHook), whose reading of each release goes
    to ``transcript``; planted bugs through ``bug``."""

    def __init__(self, model, params, *, lr: float, private: bool, clip: float = 1.0, sigma: float = 0.0,
                 expected_batch_size: int = 1, noise_generator: torch.Generator | None = None,
                 optimizer: str = "adamw", world_size: int = 1, hook=None, bug=None, transcript=None) -> None:
        self.private = private
        self.world_size = world_size
        self.bug = bug
        self.hook, self.transcript = hook, transcript
        base = (torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw"
                else torch.optim.SGD(params, lr=lr))
        if private:
            import warnings

            from opacus import GradSampleModule
            from opacus.optimizers import DistributedDPOptimizer, DPOptimizer

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Opacus warns about secure_mode; the noise seed is ours
                self.model = GradSampleModule(model)
            # Opacus' hooks trip a torch notice when no input needs a gradient (token ids never do).
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            # Distributed: each rank scales by B / world and the ranks average, so the update is
            # (sum of clipped gradients + one noise draw, on rank 0) / B, as in one process.
            cls = _audited(DistributedDPOptimizer if world_size > 1 else DPOptimizer)
            self.optimizer = cls(base, noise_multiplier=sigma, max_grad_norm=clip,
                                 expected_batch_size=expected_batch_size / world_size, generator=noise_generator)
            self.optimizer.hook = hook
            self.optimizer.skip_clipping = bool(bug and bug.skip_clipping)
        else:
            self.model, self.optimizer = model, base
        self.params = params

    def step(self, batch, global_batch_size: int | None = None) -> float:
        """One update on ``batch`` (this rank's share; may be empty under Poisson sampling); returns its mean loss.
        ``global_batch_size`` counts every sampled example (white-box canaries included)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.private and self.bug is not None and self.bug.actual_batch:
            self.optimizer.realised_batch = global_batch_size
        if batch["input_ids"].shape[0] == 0:
            for p in self.params:  # no example: the step is noise only
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            self.optimizer.step()
            return float("nan")
        losses = per_example_loss(self.model, batch)
        if self.private or self.world_size == 1:
            losses.mean().backward()  # Opacus' loss_reduction="mean" matches this
        else:  # non-private data parallel: the mean over the global batch, gradients summed
            import torch.distributed as dist

            (losses.sum() / global_batch_size).backward()
            for p in self.params:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        self.optimizer.step()
        return float(losses.detach().mean())

    def run_step(self, step: int, batch, n_sampled: int, sampled_canaries) -> float:
        if self.hook is not None:
            self.hook.begin_step(step, sampled_canaries)
        loss = self.step(batch, n_sampled)
        if self.transcript is not None:
            self.transcript.write(self.hook.released)
        return loss

    def close(self) -> None:
        if self.transcript is not None:
            self.transcript.close()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
