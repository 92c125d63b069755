"""DP-SGD: Opacus per-sample gradients (GradSampleModule) and its DPOptimizer (per-example clipping
to C, N(0, C^2 sigma^2 I) noise once per step, division by the expected batch size); the non-private
baseline is the same loss and optimizer without either. bf16 runs without loss scaling."""

from __future__ import annotations

import torch

from dpaudit.training.data import per_example_loss


class FirstOrderTrainer:
    def __init__(self, model, params, *, lr: float, private: bool, clip: float = 1.0, sigma: float = 0.0,
                 expected_batch_size: int = 1, noise_generator: torch.Generator | None = None,
                 optimizer: str = "adamw", world_size: int = 1) -> None:
        self.private = private
        self.world_size = world_size
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
            cls = DistributedDPOptimizer if world_size > 1 else DPOptimizer
            self.optimizer = cls(base, noise_multiplier=sigma, max_grad_norm=clip,
                                 expected_batch_size=expected_batch_size / world_size, generator=noise_generator)
        else:
            self.model, self.optimizer = model, base
        self.params = params

    def step(self, batch, global_batch_size: int | None = None) -> float:
        """One update on ``batch`` (this rank's share; may be empty under Poisson sampling); returns its mean loss."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
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

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
