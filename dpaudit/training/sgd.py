"""DP-SGD: per-example clipping to C, N(0, C^2 sigma^2 I) noise once per step, division by the
expected batch size; the non-private baseline is the same loss and optimizer without either. bf16
runs without loss scaling.

Two ways to the clipped sum sum_i min(1, C / ||g_i||) g_i, the same number up to float rounding:
- ``ghost`` (default; Opacus' fast gradient clipping, Li et al. 2022 "ghost clipping"): a first
  backward pass gives each example's gradient norm from the layer inputs and output gradients alone
  (||a_i^T b_i||^2 = <a_i a_i^T, b_i b_i^T> for a linear layer), without forming g_i; a second
  backward of sum_i c_i l_i gives the clipped sum directly. Cost: one more backward than SGD (the
  first without weight gradients), memory about SGD's. A weight two layers use (tied input/output
  embeddings) gets its exact norm from the pairwise products of the two layers' factors.
- ``materialise``: Opacus' GradSampleModule stores every example's gradient (B x parameters), then
  DPOptimizer clips and sums. Kept for comparison (``--per-sample-grads materialise``).

Micro-batches (``micro_batch``): one logical Poisson batch is processed in chunks whose clipped
sums add up before the single noise draw, so accounting, noise and update are those of one batch.
"""

from __future__ import annotations

import torch

from dpaudit.training.data import per_example_loss, split


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


PER_SAMPLE_GRADS = ("ghost", "materialise")


def _in_place(cls):
    """Opacus' fast-gradient-clipping optimizer without its two extra gradient-sized buffers: p.grad
    already holds the clipped sum, which Opacus copies to p.summed_grad and then adds the noise into a
    third tensor. Here the sum is p.grad itself and the noise is added in place: the same draws, in
    the same order, from the same generator."""
    from opacus.optimizers.optimizer import _check_processed_flag, _generate_noise, _mark_as_processed

    class InPlace(cls):
        def accumulate(self):
            for p in self.params:
                p.summed_grad = p.grad

        def add_noise(self):
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                p.summed_grad.add_(_generate_noise(std=self.noise_multiplier * self.max_grad_norm,
                                                   reference=p.summed_grad, generator=self.generator,
                                                   secure_mode=self.secure_mode))
                _mark_as_processed(p.summed_grad)

    InPlace.__name__ = f"InPlace{cls.__name__}"
    return InPlace


def _mask_padding(module, ids: torch.Tensor, output_grads: torch.Tensor) -> torch.Tensor:
    """An embedding's output gradients with the positions of its padding index zeroed: torch gives that
    row no gradient, but Opacus' embedding samplers would count it (in the norm, and in the sum)."""
    if not (isinstance(module, torch.nn.Embedding) and module.padding_idx is not None):
        return output_grads
    return output_grads.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0)


def _without_padding_rows(module, forward_output):
    if not isinstance(module, torch.nn.Embedding):
        return forward_output
    return (_mask_padding(module, module.activations[-1][0], forward_output[0]), *forward_output[1:])


def _layer_gradient(module, inputs: torch.Tensor, output_grads: torch.Tensor):
    """(kind, a, b) for a layer whose per-example weight gradient is sum_t b_t a_t^T: a linear layer's
    inputs (n, T, in) and output gradients (n, T, out), or an embedding's token ids (n, T) and output
    gradients (n, T, dim), with rows of its padding index zeroed (torch gives that row no gradient)."""
    if isinstance(module, torch.nn.Embedding):
        return "embedding", inputs, _mask_padding(module, inputs, output_grads)
    if inputs.dim() == 2:  # no sequence axis
        inputs, output_grads = inputs.unsqueeze(1), output_grads.unsqueeze(1)
    return "linear", inputs.to(output_grads.dtype), output_grads


def _materialising_module(model):
    """Opacus' GradSampleModule (per-example gradients stored), padding rows excepted."""
    from opacus import GradSampleModule

    class Materialising(GradSampleModule):
        def capture_backprops_hook(self, module, forward_input, forward_output, *args, **kwargs):
            if self.hooks_enabled:
                forward_output = _without_padding_rows(module, forward_output)
            return super().capture_backprops_hook(module, forward_input, forward_output, *args, **kwargs)

    return Materialising(model)


def gradient_inner_product(u, v) -> torch.Tensor:
    """<G_u, G_v> per example for two uses of one weight, from ``_layer_gradient`` triples, without
    forming either gradient: every term is a T x T matrix per example (ghost clipping's identity,
    extended to pairs of layers so that tied weights get their exact norm)."""
    if u[0] == "linear" and v[0] == "embedding":
        u, v = v, u
    (ku, au, bu), (kv, av, bv) = u, v
    if ku == kv:  # sum_{t,s} <b_t, b'_s> <a_t, a'_s>, where for embeddings <a_t, a'_s> = [x_t = x'_s]
        grads = torch.einsum("ntk,nsk->nts", bu, bv)
        inputs = (torch.einsum("ntk,nsk->nts", au, av) if ku == "linear"
                  else (au.unsqueeze(2) == av.unsqueeze(1)).to(grads.dtype))
        return torch.einsum("nts,nts->n", grads, inputs)
    # embedding (ids x_t, grads d_t) with a linear layer (inputs h_s, output grads b_s): row x_t of
    # the linear gradient is sum_s b_s[x_t] h_s, so the product is sum_{t,s} b_s[x_t] <d_t, h_s>.
    picked = torch.gather(bv, 2, au.unsqueeze(1).expand(-1, bv.shape[1], -1))  # [n, s, t] = b_s[x_t]
    return torch.einsum("nst,nts->n", picked, torch.einsum("ntk,nsk->nts", bu, av))


def _ghost_module(model, clip: float):
    """Opacus' GradSampleModuleFastGradientClipping, with three changes.

    Tied weights (the input and output embedding of most small LMs): Opacus refuses ghost clipping for
    a parameter two layers use. Here each use's (inputs, output gradients) is kept until the last one
    has reported, and the norm comes from the pairwise products (``gradient_inner_product``): exact,
    and never B x vocabulary x width. If a tied parameter sits in a layer that is neither linear nor a
    plain embedding, every tied use gets Opacus' per-example gradients instead (summed over the uses,
    normed, freed).

    Embeddings with a padding index: torch gives that row no gradient, so its part of the norm is
    dropped too (Opacus counts it, which is not the norm of the gradient the second pass sums).

    The norm pass: Opacus' hooks need only each layer's input and output gradient, but a plain
    backward also forms every weight gradient (about half its cost), only to throw it away. Every
    hooked layer's output gets + probe, a scalar zero; differentiating with respect to the probe alone
    runs every hook while autograd skips the weight gradients. Values are unchanged (x + 0 = x).
    """
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if p.requires_grad:
                users[id(p)] = users.get(id(p), 0) + 1
    hooked = [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    tied = {id(m) for m in hooked if any(users[id(p)] > 1 for p in m.parameters(recurse=False) if p.requires_grad)}
    exact = {id(m) for m in hooked if id(m) in tied and (
        type(m) is torch.nn.Linear or (type(m) is torch.nn.Embedding and m.max_norm is None
                                       and not m.scale_grad_by_freq and not m.sparse))}
    if tied - exact:
        exact = set()  # a tied weight in another kind of layer: Opacus' per-example route for every tied use

    class GhostClipping(GradSampleModuleFastGradientClipping):
        def __init__(self) -> None:
            super().__init__(model, max_grad_norm=clip, loss_reduction="sum", use_ghost_clipping=True)
            device = next(model.parameters()).device
            self.probe = torch.zeros((), device=device, requires_grad=True)
            self.all_probed = True
            self.uses: dict[int, list] = {}  # tied weight -> its uses' gradient factors so far
            for m in hooked:  # removed with Opacus' own hooks
                self.autograd_grad_sample_hooks.append(m.register_forward_hook(self._add_probe))

        def _add_probe(self, module, _inputs, output):
            if not (self.hooks_enabled and module.training and torch.is_grad_enabled()):
                return None
            if not (torch.is_tensor(output) and output.is_floating_point()):
                self.all_probed = False  # this step's norm pass differentiates for the weights instead
                return None
            return output + self.probe

        def norm_pass(self, loss, params) -> torch.Tensor:
            """Runs the hooks (each example's gradient norm); returns the clipping factors."""
            inputs = [self.probe] if self.all_probed else params
            for p in self.trainable_parameters:
                p._norm_sample = None
            torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
            self.all_probed = True
            if any(p._norm_sample is None for p in self.trainable_parameters):  # never a stale norm
                raise RuntimeError("a trainable layer did not report its per-example gradient norms")
            return self.get_clipping_coef()

        def capture_activations_hook(self, module, *args, **kwargs):
            ghost = self.use_ghost_clipping  # Opacus raises for tied weights under ghost clipping
            self.use_ghost_clipping = ghost and id(module) not in tied
            try:
                return super().capture_activations_hook(module, *args, **kwargs)
            finally:
                self.use_ghost_clipping = ghost

        def capture_backprops_hook(self, module, forward_input, forward_output, loss_reduction, batch_first):
            if not self.hooks_enabled:
                return None
            if id(module) in exact:
                return self._tied_backprops(module, forward_output, loss_reduction, batch_first)
            forward_output = _without_padding_rows(module, forward_output)
            ghost = self.use_ghost_clipping
            self.use_ghost_clipping = ghost and id(module) not in tied
            try:
                return super().capture_backprops_hook(module, forward_input, forward_output, loss_reduction,
                                                      batch_first)
            finally:
                self.use_ghost_clipping = ghost

        def _tied_backprops(self, module, forward_output, loss_reduction, batch_first) -> None:
            activations, backprops = self.rearrange_grad_samples(
                module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction,
                batch_first=batch_first)
            use = _layer_gradient(module, activations[0], backprops)
            for p in module.parameters(recurse=False):
                if not p.requires_grad:
                    continue
                if users[id(p)] > 1:
                    self.uses.setdefault(id(p), []).append(use)
                else:  # the bias of a linear layer whose weight is tied
                    p._norm_sample = use[2].sum(1).flatten(1).norm(dim=1)
                p._forward_counter -= 1
                if p._forward_counter == 0 and id(p) in self.uses:
                    parts = self.uses.pop(id(p))
                    square = sum(gradient_inner_product(u, v) * (1 if i == j else 2)
                                 for i, u in enumerate(parts) for j, v in enumerate(parts) if j >= i)
                    p._norm_sample = square.clamp(min=0).sqrt()
            if not module.activations and hasattr(module, "max_batch_len"):
                del module.max_batch_len

    return GhostClipping()


class FirstOrderTrainer:
    """DP-SGD (or SGD) behind the trainers' common interface: ``run_step``, ``state_dict``, ``close``.
    White-box canaries enter through ``hook`` (a GradientCanaryHook), whose reading of each release goes
    to ``transcript``; planted bugs through ``bug``. ``per_sample_grads``: ghost or materialise (see the
    module's docstring); ``micro_batch``: at most this many examples per forward/backward (0: all)."""

    def __init__(self, model, params, *, lr: float, private: bool, clip: float = 1.0, sigma: float = 0.0,
                 expected_batch_size: int = 1, noise_generator: torch.Generator | None = None,
                 optimizer: str = "adamw", world_size: int = 1, hook=None, bug=None, transcript=None,
                 per_sample_grads: str = "ghost", micro_batch: int = 0) -> None:
        if per_sample_grads not in PER_SAMPLE_GRADS:
            raise ValueError(f"unknown per-sample-grads mode {per_sample_grads!r}; use ghost or materialise")
        self.private = private
        self.world_size = world_size
        self.bug = bug
        self.hook, self.transcript = hook, transcript
        self.ghost = private and per_sample_grads == "ghost"
        self.micro_batch = micro_batch
        base = (torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw"
                else torch.optim.SGD(params, lr=lr))
        if private:
            import warnings

            from opacus import optimizers as dp

            skip_clipping = bool(bug and bug.skip_clipping)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Opacus warns about secure_mode; the noise seed is ours
                if self.ghost:  # "no-clip": a clip factor of 1 for every example
                    self.model = _ghost_module(model, float("inf") if skip_clipping else clip)
                else:
                    self.model = _materialising_module(model)
            # Opacus' hooks trip a torch notice when no input needs a gradient (token ids never do).
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            # Distributed: each rank scales by B / world and the ranks average, so the update is
            # (sum of clipped gradients + one noise draw, on rank 0) / B, as in one process.
            if self.ghost:
                cls = (dp.DistributedDPOptimizerFastGradientClipping if world_size > 1
                       else _in_place(dp.DPOptimizerFastGradientClipping))
            else:
                cls = dp.DistributedDPOptimizer if world_size > 1 else dp.DPOptimizer
            self.optimizer = _audited(cls)(base, noise_multiplier=sigma, max_grad_norm=clip,
                                           expected_batch_size=expected_batch_size / world_size,
                                           generator=noise_generator)
            self.optimizer.hook = hook
            self.optimizer.skip_clipping = skip_clipping
        else:
            self.model, self.optimizer = model, base
        self.params = params

    def _clipped_backward(self, batch) -> torch.Tensor:
        """Adds this chunk's sum of clipped per-example gradients to ``p.grad``; returns its losses."""
        losses = per_example_loss(self.model, batch)
        if self.ghost:
            # Pass 1: the hooks take each example's gradient norm (torch.autograd.grad leaves p.grad,
            # which may hold earlier chunks, alone).
            coef = self.model.norm_pass(losses.sum(), self.params).to(losses.dtype)
            self.model.disable_hooks()
            try:  # pass 2: the clipped sum, accumulated into p.grad
                (coef.detach() * losses).sum().backward()
            finally:
                self.model.enable_hooks()
        else:
            losses.mean().backward()  # Opacus' loss_reduction="mean" matches this
        return losses.detach()

    def step(self, batch, global_batch_size: int | None = None) -> float:
        """One update on ``batch`` (this rank's share; may be empty under Poisson sampling); returns its mean loss.
        ``global_batch_size`` counts every sampled example (white-box canaries included)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.private and self.bug is not None and self.bug.actual_batch:
            self.optimizer.realised_batch = global_batch_size
        if batch["input_ids"].shape[0] == 0:
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
            chunks = split(batch, self.micro_batch)
            losses = []
            for k, chunk in enumerate(chunks):
                losses.append(self._clipped_backward(chunk))
                if not self.ghost and k < len(chunks) - 1:
                    # materialise: clip this chunk into p.summed_grad now and free its per-example
                    # gradients; the last chunk is clipped by optimizer.step() as usual.
                    self.optimizer.clip_and_accumulate()
                    for p in self.params:
                        p.grad_sample = None
            losses = torch.cat(losses)
        self.optimizer.step()
        return float(losses.float().mean())

    def _plain_backward(self, batch, global_batch_size) -> torch.Tensor:
        """Non-private: the mean loss's gradient (over the global batch under data parallelism)."""
        chunks = split(batch, self.micro_batch)
        n = batch["input_ids"].shape[0]
        total = n if self.world_size == 1 else global_batch_size
        losses = []
        for chunk in chunks:
            chunk_losses = per_example_loss(self.model, chunk)
            (chunk_losses.sum() / total).backward()
            losses.append(chunk_losses.detach())
        if self.world_size > 1:
            import torch.distributed as dist

            for p in self.params:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        return torch.cat(losses)

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
