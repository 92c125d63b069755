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

import math

import torch

from dpaudit.training.data import padded_chunks, per_example_loss, split
from dpaudit.training.heap import release_freed
from dpaudit.training.streams import add_normal_, step_key


def _audited(cls):
    """The Opacus optimizer with the two places an audit and a planted bug need: the clipped sum before
    noise (white-box canaries join it; "no-clip" skips clipping) and the release (read by the auditor;
    "actual-batch" divides by the realised batch size). With neither set it is Opacus, unchanged."""

    distributed = hasattr(cls, "reduce_gradients")

    class Audited(cls):
        probe = None                # the run's WhiteBoxProbe (probe.py) or None
        skip_clipping = False
        realised_batch: int | None = None   # set per step when the "actual-batch" bug is planted
        noise_key: int = 0                  # the step's noise stream (streams.step_key), set per step

        def clip_and_accumulate(self):
            if not self.skip_clipping:
                return super().clip_and_accumulate()
            kept, self.max_grad_norm = self.max_grad_norm, float("inf")  # clip factor 1: no clipping
            try:
                super().clip_and_accumulate()
            finally:
                self.max_grad_norm = kept

        def add_noise(self):
            """The clipped sum plus N(0, (sigma C)^2 I) drawn from the step's position-addressable stream
            (streams.py; the same numbers a sharded run draws slice by slice), added in place; under
            data parallelism on rank 0 only, before the ranks' sums are added."""
            from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

            std = self.noise_multiplier * self.max_grad_norm
            adds = getattr(self, "rank", 0) == 0
            if self.probe is not None and adds:  # canaries join once: rank 0's sum, as its noise does
                self.probe.add_to_summed_grad(self.params, float("inf") if self.skip_clipping else self.max_grad_norm)
            for i, p in enumerate(self.params):
                _check_processed_flag(p.summed_grad)
                if adds and std > 0:
                    add_normal_(p.summed_grad, self.noise_key, i, std)
                p.grad = p.summed_grad.view_as(p)
                _mark_as_processed(p.summed_grad)

        def scale_grad(self):
            if self.realised_batch is None:
                super().scale_grad()
            else:
                for p in self.params:
                    p.grad /= max(1, self.realised_batch)
            if self.probe is not None and not distributed:  # the release, in units of the expected batch's sum
                self.probe.observe(self.probe.step, [p.grad for p in self.params],
                                   self.expected_batch_size * self.accumulated_iterations)

        def reduce_gradients(self):
            """Data parallelism: the release is the ranks' average (each scaled by B / world), read once reduced."""
            super().reduce_gradients()
            if self.probe is not None:
                self.probe.observe(self.probe.step, [p.grad for p in self.params],
                                   self.expected_batch_size * self.accumulated_iterations * self.world_size)

    Audited.__name__ = f"Audited{cls.__name__}"
    return Audited


PER_SAMPLE_GRADS = ("ghost", "materialise")


def _in_place(cls):
    """Opacus' fast-gradient-clipping optimizer without its gradient-sized copy: p.grad already holds
    the clipped sum, which Opacus copies to p.summed_grad before adding the noise; here the sum is
    p.grad itself (add_noise then adds in place)."""

    class InPlace(cls):
        def accumulate(self):
            for p in self.params:
                p.summed_grad = p.grad

    InPlace.__name__ = f"InPlace{cls.__name__}"
    return InPlace


class _NoisyShards:
    """DP-SGD's release on sharded weights (DP-ZeRO, shard.py): after the reduce-scatter, each rank's
    p.grad holds its slice of the clipped sum over all ranks' examples; the rank adds its slice of the
    step's noise stream (the numbers one process adds to the whole sum), divides by the expected batch
    size, and the base optimizer updates its shards. No copy of a gradient is made."""

    def __init__(self, base, params, std: float, expected_batch_size: float, clip: float = 1.0, probe=None,
                 all_sum=None) -> None:
        self.original_optimizer, self.params = base, params
        self.std, self.expected_batch_size, self.clip = std, expected_batch_size, clip
        self.probe, self.all_sum = probe, all_sum  # white-box canaries; the ranks' sum of a numpy vector
        self.noise_key = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        from dpaudit.training.shard import local_slices

        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        slices = list(local_slices([p.grad for p in self.params]))
        if self.probe is not None:  # each canary joins the slice its coordinate lies in, on one rank
            self.probe.add_to_slices(slices, self.clip)
        for i, (grad, at, total) in enumerate(slices):
            if self.std > 0:
                add_normal_(grad, self.noise_key, i, self.std, at, total)
            grad.div_(self.expected_batch_size)
        if self.probe is not None:
            self.probe.observe_slices(self.probe.step, slices, self.expected_batch_size, self.all_sum)
        self.original_optimizer.step()


def embedding_scale(module, verify: bool = True) -> float | None:
    """The constant c of a scaled embedding (Gemma's ``Gemma3TextScaledWordEmbedding``: E[ids] x c, c held in
    an ``embed_scale`` buffer, typically sqrt(width)); 1 for a plain nn.Embedding; None for anything else.
    A subclass counts as scaled only when its one buffer is a scalar ``embed_scale`` and its forward is
    E[ids] x c on a probe input, so a subclass that does something else is never taken for one. ``verify`` False
    skips that forward (inside a backward hook, for a layer ``check_layers`` verified when the trainer was built:
    a forward there would run the hooks again)."""
    if type(module) is torch.nn.Embedding:
        return 1.0
    if not isinstance(module, torch.nn.Embedding):
        return None
    buffers = dict(module.named_buffers(recurse=False))
    scale = buffers.get("embed_scale")
    if set(buffers) != {"embed_scale"} or scale is None or scale.numel() != 1:
        return None
    c = float(scale) if not scale.is_meta else math.nan  # a meta model (preflight): its structure alone
    if module.weight.is_meta or not verify:
        return c
    ids = torch.arange(min(4, module.num_embeddings), device=module.weight.device).unsqueeze(0)
    with torch.no_grad():
        same = torch.allclose(module(ids), torch.nn.functional.embedding(ids, module.weight) * c, rtol=1e-3, atol=1e-6)
    return c if same else None


def supported_for_dp_sgd(model) -> None:
    """Refuse, in one line and before any step, a trainable layer whose per-example gradients dpaudit cannot
    take: one with buffers (state Opacus does not privatise, e.g. batch norm's running statistics), other than
    the constant scale of a scaled embedding, whose per-example gradient is c x the embedding's (registered
    with Opacus here: issue 36, Gemma 3 failed with exit 3 after minutes of canary work)."""
    from opacus.grad_sample.utils import register_grad_sampler, register_norm_sampler

    for kind in check_layers(model):
        if kind not in _SCALED:
            _SCALED.add(kind)
            register_grad_sampler(kind)(_scaled("compute_embedding_grad_sample"))
            register_norm_sampler(kind)(_scaled("compute_embedding_norm_sample"))


def check_layers(model) -> set[type]:
    """The refusal of ``supported_for_dp_sgd`` alone (no Opacus import; on a meta model too, so ``audit run``
    and ``train`` refuse before any canary or weight work); returns the scaled embedding types found."""
    from dpaudit.core.errors import DPAuditError

    scaled = set()
    for name, m in model.named_modules():
        if not any(p.requires_grad for p in m.parameters(recurse=False)) or not list(m.buffers(recurse=False)):
            continue
        if embedding_scale(m) is None:
            raise DPAuditError(f"DP-SGD cannot take per-example gradients of the layer {name} ({type(m).__name__}): "
                               "it holds buffers that per-example clipping does not privatise; train adapters "
                               "(--trainable lora) or use --method dp-zo")
        scaled.add(type(m))
    return scaled


_SCALED: set[type] = set()


def _scaled(rule: str):
    """Opacus' embedding ``rule`` (per-example gradients or their norms) on c x the output gradients: the
    gradient of E[ids] x c with respect to E is c per use."""
    def sample(layer, activations, backprops):
        from opacus.grad_sample import embedding

        return getattr(embedding, rule)(layer, activations, backprops * float(layer.embed_scale))

    return sample


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
    if isinstance(module, torch.nn.Embedding):  # a scaled embedding's gradient is c x its output gradients
        scale = embedding_scale(module, verify=False) or 1.0
        return "embedding", inputs, _mask_padding(module, inputs, output_grads) * scale
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

    return Materialising(model, strict=False)  # buffers checked by supported_for_dp_sgd


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

    # Parameters are named, not held: under FSDP2 a layer's hooks see gathered copies of its weights,
    # not the sharded parameters, so norms are kept by (layer, attribute) -> first name.
    name_of: dict[tuple[int, str], str] = {}
    first: dict[int, str] = {}
    users: dict[str, int] = {}
    hooked = []
    for prefix, m in model.named_modules():
        mine = [(attr, p) for attr, p in m.named_parameters(recurse=False) if p.requires_grad]
        for attr, p in mine:
            name = first.setdefault(id(p), f"{prefix}.{attr}" if prefix else attr)
            name_of[(id(m), attr)] = name
            users[name] = users.get(name, 0) + 1
        if mine:
            hooked.append(m)
    tied = {id(m) for m in hooked if any(users[name_of[(id(m), a)]] > 1 for a, p in m.named_parameters(recurse=False)
                                         if p.requires_grad)}
    exact = {id(m) for m in hooked if id(m) in tied and (
        type(m) is torch.nn.Linear or (embedding_scale(m) is not None and m.max_norm is None
                                       and not m.scale_grad_by_freq and not m.sparse))}
    if tied - exact:
        exact = set()  # a tied weight in another kind of layer: Opacus' per-example route for every tied use

    class GhostClipping(GradSampleModuleFastGradientClipping):
        def __init__(self) -> None:
            # strict=False: buffers were checked by supported_for_dp_sgd (a scaled embedding's constant only)
            super().__init__(model, max_grad_norm=clip, loss_reduction="sum", use_ghost_clipping=True, strict=False)
            device = next(model.parameters()).device
            self.probe = torch.zeros((), device=device, requires_grad=True)
            self.all_probed = True
            self.uses: dict[str, list] = {}  # tied weight -> its uses' gradient factors so far
            self.norms: dict[str, torch.Tensor] = {}  # parameter name -> per-example gradient norms
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
            self.norms = {}
            torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
            self.all_probed = True
            if set(users) - set(self.norms):  # never a stale norm
                raise RuntimeError("a trainable layer did not report its per-example gradient norms")
            return self.get_clipping_coef()

        def get_norm_sample(self) -> torch.Tensor:
            norms = list(self.norms.values())
            norm_sample = torch.stack([n.to(norms[0].device) for n in norms]).norm(2, dim=0)
            self.per_sample_gradient_norms = norm_sample
            return norm_sample

        def _collect(self, module) -> None:
            """Moves the norms Opacus left on the layer's (possibly gathered) parameters to ``norms``."""
            for attr, p in module.named_parameters(recurse=False):
                if p.requires_grad and getattr(p, "_norm_sample", None) is not None:
                    self.norms[name_of[(id(module), attr)]] = p._norm_sample
                    p._norm_sample = None

        def capture_activations_hook(self, module, *args, **kwargs):
            for p in module.parameters(recurse=False):  # FSDP2's gathered copies lack Opacus' fields
                if not hasattr(p, "_forward_counter"):
                    p._forward_counter, p.grad_sample = 0, None
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
                self._tied_backprops(module, forward_output, loss_reduction, batch_first)
                return self._collect(module)
            forward_output = _without_padding_rows(module, forward_output)
            ghost = self.use_ghost_clipping
            self.use_ghost_clipping = ghost and id(module) not in tied
            try:
                super().capture_backprops_hook(module, forward_input, forward_output, loss_reduction, batch_first)
            finally:
                self.use_ghost_clipping = ghost
            return self._collect(module)

        def _tied_backprops(self, module, forward_output, loss_reduction, batch_first) -> None:
            activations, backprops = self.rearrange_grad_samples(
                module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction,
                batch_first=batch_first)
            use = _layer_gradient(module, activations[0], backprops)
            for attr, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                name = name_of[(id(module), attr)]
                if users[name] > 1:
                    self.uses.setdefault(name, []).append(use)
                else:  # the bias of a linear layer whose weight is tied
                    p._norm_sample = use[2].sum(1).flatten(1).norm(dim=1)
                p._forward_counter -= 1
                if p._forward_counter == 0 and name in self.uses:
                    parts = self.uses.pop(name)
                    square = sum(gradient_inner_product(u, v) * (1 if i == j else 2)
                                 for i, u in enumerate(parts) for j, v in enumerate(parts) if j >= i)
                    p._norm_sample = square.clamp(min=0).sqrt()
            if not module.activations and hasattr(module, "max_batch_len"):
                del module.max_batch_len

    return GhostClipping()


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
                 micro_batch: int = 0, sharding=None) -> None:
        if per_sample_grads not in PER_SAMPLE_GRADS:
            raise ValueError(f"unknown per-sample-grads mode {per_sample_grads!r}; use ghost or materialise")
        self.private, self.params = private, params
        self.world_size = world_size
        self.bug = bug
        self.probe = probe
        self.ghost = private and per_sample_grads == "ghost"
        self.micro_batch = micro_batch
        self.sharding, self.inner = sharding, model
        self.noise_seed, self.step_index = noise_seed, 0
        base = (torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw"
                else torch.optim.SGD(params, lr=lr))
        self.base_optimizer = base
        if private:
            import warnings

            from opacus import optimizers as dp

            skip_clipping = bool(bug and bug.skip_clipping)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Opacus warns about secure_mode; the noise is ours
                supported_for_dp_sgd(model)
                if self.ghost:  # "no-clip": a clip factor of 1 for every example
                    self.model = _ghost_module(model, float("inf") if skip_clipping else clip)
                else:
                    self.model = _materialising_module(model)
            # Opacus' hooks trip a torch notice when no input needs a gradient (token ids never do).
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            if sharding is not None:
                self.optimizer = _NoisyShards(base, params, sigma * clip, expected_batch_size, clip, probe,
                                              sharding.sum)
                return
            # Distributed: each rank scales by B / world and the ranks average, so the update is
            # (sum of clipped gradients + one noise draw, on rank 0) / B, as in one process.
            if self.ghost:
                cls = (dp.DistributedDPOptimizerFastGradientClipping if world_size > 1
                       else _in_place(dp.DPOptimizerFastGradientClipping))
            else:
                cls = dp.DistributedDPOptimizer if world_size > 1 else dp.DPOptimizer
            self.optimizer = _audited(cls)(base, noise_multiplier=sigma, max_grad_norm=clip,
                                           expected_batch_size=expected_batch_size / world_size)
            self.optimizer.probe = probe
            self.optimizer.skip_clipping = skip_clipping
        else:
            self.model, self.optimizer = model, base

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
            if not real:
                coef = torch.zeros_like(coef)
            release_freed(losses.device.type)  # the norm pass's output gradients, before pass 2
            self.model.disable_hooks()
            try:  # pass 2: the clipped sum, accumulated into p.grad
                (coef.detach() * losses).sum().backward()
            finally:
                self.model.enable_hooks()
        else:
            losses.mean().backward()  # Opacus' loss_reduction="mean" matches this
        return losses.detach()

    def _chunks(self, batch, global_batch_size) -> list[tuple[dict, bool]]:
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
        if self.private and self.bug is not None and self.bug.actual_batch:
            self.optimizer.realised_batch = global_batch_size
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
        if self.probe is not None:
            self.probe.begin(step, sampled_canaries)
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
        """The optimizer's state; sharded: whole tensors by parameter name, on rank 0 (every rank calls)."""
        if self.sharding is not None:
            from dpaudit.training.shard import full_optimizer_state

            return full_optimizer_state(self.inner, self.base_optimizer)
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.sharding is not None:
            from dpaudit.training.shard import load_optimizer_state

            return load_optimizer_state(self.inner, self.base_optimizer, state)
        self.optimizer.load_state_dict(state)
