"""Ghost clipping (Li et al. 2022; Opacus' fast gradient clipping): each example's gradient norm from the
layers' inputs and output gradients alone, then the clipped sum sum_i c_i g_i, by book-keeping (Bu et al. 2023,
"Differentially private optimization on large model at small cost"): the norm pass keeps each layer's
(inputs, output gradients), and once the clip factors c are known each weight's clipped sum is one product,
sum_i c_i sum_t b_it a_it^T (an embedding's: c_i b_it added into row x_it), with no second backward. A layer
that is neither linear nor an embedding keeps Opacus' per-example gradients of its (small) weights instead.
Under FSDP2 the hooks see gathered copies, not the shards, so a sharded run takes the second backward of
sum_i c_i l_i instead (``book_keeping=False``); both give the same sum up to float rounding (tested).

``GhostClipping`` is Opacus' GradSampleModuleFastGradientClipping with the changes below.

Tied weights (the input and output embedding of most small LMs): Opacus refuses ghost clipping for a
parameter two layers use. Here each use's (inputs, output gradients) is kept until the last one has
reported, and the norm comes from the pairwise products (``per_example.gradient_inner_product``): exact,
and never B x vocabulary x width. If a tied parameter sits in a layer that is neither linear nor a plain
embedding, every tied use gets Opacus' per-example gradients instead (summed over the uses, normed, freed).

Embeddings with a padding index: torch gives that row no gradient, so its part of the norm is dropped too
(Opacus counts it, which is not the norm of the gradient the second pass sums).

The norm pass: Opacus' hooks need only each layer's input and output gradient, but a plain backward also
forms every weight gradient (about half its cost), only to throw it away. A hooked layer none of whose inputs
requires a gradient (an embedding, a LoRA A) gets + probe on its output, a scalar zero; differentiating with
respect to the probe alone runs every hook while autograd skips the weight gradients. Values are unchanged
(x + 0 = x). Every other hooked layer reads an input that requires a gradient only through the layers before it
(all trainable parameters sit in hooked layers), so by induction its input lies on a path to a probe and its
hook runs too; a leaf of the user's own that requires a gradient breaks that, and the norm pass then refuses
("did not report"), never a stale norm. Probing only these roots spares an add and a sum over every layer's
output (the largest: the vocabulary logits), 3-5 % of a step.

Book-keeping, above. Opacus 1.6 (pinned) stores a layer's inputs in ``module.activations`` until its backward
hook pops them; ``_keep`` reads them there first.

Linear layers' norms (with book-keeping): from the kept (inputs, output gradients), by batched matmuls, the inputs'
Gram matrix computed once for the layers that read one tensor (q, k and v; gate and up): ``_linear_norms``
(DP-SGD / SGD 1.32-1.35x -> 1.24-1.29x at B = 64, benchmarks/dp_sgd_paired.py).

Imported only when a DP-SGD trainer is built (it needs opacus, the ``train`` extra).
"""

from __future__ import annotations

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient

from dpaudit.core.errors import DPAuditError
from dpaudit.training.data import user_sums
from dpaudit.training.per_example import (
    embedding_scale, gradient_inner_product, layer_gradient, weighted_gradient, without_padding_rows,
)


class LayerUses:
    """Which trainable parameters each layer uses, by name. Parameters are named, not held: under FSDP2 a
    layer's hooks see gathered copies of its weights, not the sharded parameters, so norms are kept by
    (layer, attribute) -> the parameter's first name."""

    def __init__(self, model) -> None:
        self.name_of: dict[tuple[int, str], str] = {}
        self.users: dict[str, int] = {}   # parameter name -> how many layers use it
        self.hooked = []                  # layers holding a trainable parameter
        first: dict[int, str] = {}
        for prefix, m in model.named_modules():
            mine = [(attr, p) for attr, p in m.named_parameters(recurse=False) if p.requires_grad]
            for attr, p in mine:
                name = first.setdefault(id(p), f"{prefix}.{attr}" if prefix else attr)
                self.name_of[(id(m), attr)] = name
                self.users[name] = self.users.get(name, 0) + 1
            if mine:
                self.hooked.append(m)
        self.tied = {id(m) for m in self.hooked if any(
            self.users[self.name_of[(id(m), a)]] > 1 for a, p in m.named_parameters(recurse=False) if p.requires_grad)}
        self.exact = {id(m) for m in self.hooked if id(m) in self.tied and (
            type(m) is torch.nn.Linear or (embedding_scale(m) is not None and m.max_norm is None
                                           and not m.scale_grad_by_freq and not m.sparse))}
        if self.tied - self.exact:
            self.exact = set()  # a tied weight in another kind of layer: Opacus' per-example route for every tied use


class GhostClipping(GradSampleModuleFastGradientClipping):
    """``model`` wrapped for ghost clipping at ``clip`` (inf: a clip factor of 1, the "no-clip" planted bug)."""

    def __init__(self, model, clip: float, book_keeping: bool = True) -> None:
        self.layers = LayerUses(model)
        self.book_keeping = book_keeping
        self.book: list = []  # (layer, what its clipped sum needs), this pass
        self.grams: dict = {}  # an input tensor's key -> (the tensor, its per-example Gram matrix), this pass
        # strict=False: buffers were checked by supported_for_dp_sgd (a scaled embedding's constant only)
        super().__init__(model, max_grad_norm=clip, loss_reduction="sum", use_ghost_clipping=True, strict=False)
        device = next(model.parameters()).device
        self.probe = torch.zeros((), device=device, requires_grad=True)
        self.all_probed = True
        self.uses: dict[str, list] = {}  # tied weight -> its uses' gradient factors so far
        self.norms: dict[str, torch.Tensor] = {}  # parameter name -> per-example gradient norms
        for m in self.layers.hooked:  # removed with Opacus' own hooks
            self.autograd_grad_sample_hooks.append(m.register_forward_hook(self._add_probe))

    def _add_probe(self, module, inputs, output):
        if not (self.hooks_enabled and module.training and torch.is_grad_enabled()):
            return None
        if any(torch.is_tensor(x) and x.requires_grad for x in inputs):
            return None  # on a path to a probe already (the module docstring)
        if not (torch.is_tensor(output) and output.is_floating_point()):
            self.all_probed = False  # this step's norm pass differentiates for the weights instead
            return None
        return output + self.probe

    def norm_pass(self, loss, params) -> torch.Tensor:
        """Runs the hooks (each example's gradient norm); returns the clipping factors."""
        inputs = [self.probe] if self.all_probed else params
        self.norms, self.book, self.grams = {}, [], {}
        try:
            torch.autograd.grad(loss, inputs, retain_graph=not self.book_keeping, allow_unused=True)
        finally:
            self.grams = {}
        self.all_probed = True
        if set(self.layers.users) - set(self.norms):  # never a stale norm
            raise RuntimeError("a trainable layer did not report its per-example gradient norms")
        return self.get_clipping_coef()

    def user_coef(self, users: torch.Tensor) -> torch.Tensor:
        """ULS by book-keeping: each example's factor c_u / n_u, so that the clipped sum sum_i c_u / n_u g_i is
        sum_u c_u G_u with G_u the mean of user u's n_u per-example gradients and c_u = min(1, C / |G_u|) (Opacus'
        formula). |G_u| comes from what the norm pass kept, without forming G_u: a user's rows grouped into one
        example along the token axis (``_grouped``) make sum_{i in u} sum_t b_it a_it^T one example's gradient, whose
        square norm (and, for a tied weight, the products of its uses) ``gradient_inner_product`` gives; other layers'
        per-example gradients and linear biases are summed over the user's rows."""

        if not self.book_keeping:
            raise RuntimeError("per-user norms are read from book-keeping's kept factors")
        _, inverse = torch.unique(users, return_inverse=True)
        count = int(inverse.max()) + 1
        rows = torch.bincount(inverse, minlength=count)
        parts: dict[int, list] = {}   # a parameter -> its uses: ("factors", grouped triple) or ("dense", [U, ...])
        for module, kept in self.book:
            if isinstance(kept, dict):
                for q, g in kept.items():
                    parts.setdefault(id(q), []).append(("dense", user_sums(g, inverse, count)))
                continue
            kind, a, b = kept
            if module.weight.requires_grad:
                parts.setdefault(id(module.weight), []).append(("factors", _grouped(kept, inverse, rows)))
            bias = getattr(module, "bias", None) if kind == "linear" else None
            if bias is not None and bias.requires_grad:
                parts.setdefault(id(bias), []).append(("dense", user_sums(b.sum(1), inverse, count)))
        square = torch.zeros(count, dtype=torch.float32, device=users.device)
        for uses in parts.values():
            kinds = {k for k, _ in uses}
            if kinds == {"dense"}:
                total = sum(x for _, x in uses)
                square += total.flatten(1).float().pow(2).sum(1).to(square.device)
            elif kinds == {"factors"}:
                factors = [x for _, x in uses]
                square += sum(gradient_inner_product(u, v).float() * (1 if i == j else 2)
                              for i, u in enumerate(factors) for j, v in enumerate(factors) if j >= i).to(square.device)
            else:
                raise DPAuditError("ULS with ghost clipping cannot form this model's per-user norms (a weight tied "
                                   "across a linear or embedding layer and another kind); use --per-sample-grads "
                                   "materialise")
        norms = square.clamp(min=0).sqrt() / rows.to(square)
        factor = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        return (factor / rows.to(square))[inverse.to(square.device)]

    def clipped_backward(self, losses, coef) -> None:
        """Adds the clipped sum sum_i c_i g_i to ``p.grad``: from what the norm pass kept (book-keeping), or by
        a second backward of sum_i c_i l_i with the hooks off."""
        if self.book_keeping:
            book, self.book = self.book, []
            for module, kept in book:
                for p, g in weighted_gradient(module, kept, coef.detach()):
                    p.grad = g if p.grad is None else p.grad.add_(g)
            return
        self.disable_hooks()
        try:
            (coef.detach() * losses).sum().backward()
        finally:
            self.enable_hooks()

    def _keep(self, module, forward_output) -> None:
        """Book-keeping: what this layer's share of the clipped sum needs, read before Opacus pops the inputs."""
        inputs, grads = module.activations[-1], forward_output[0].detach()
        if type(module) is torch.nn.Linear or embedding_scale(module, verify=False) is not None:
            self.book.append((module, layer_gradient(module, inputs[0], grads)))
            return
        sampler = None if self.force_functorch else self.GRAD_SAMPLERS.get(type(module))
        samples = (sampler or ft_compute_per_sample_gradient)(module, inputs, grads)
        self.book.append((module, {p: g for p, g in samples.items() if p.requires_grad}))

    def get_norm_sample(self) -> torch.Tensor:
        norms = list(self.norms.values())
        norm_sample = torch.stack([n.to(norms[0].device) for n in norms]).norm(2, dim=0)
        self.per_sample_gradient_norms = norm_sample
        return norm_sample

    def _collect(self, module) -> None:
        """Moves the norms Opacus left on the layer's (possibly gathered) parameters to ``norms``."""
        for attr, p in module.named_parameters(recurse=False):
            if p.requires_grad and getattr(p, "_norm_sample", None) is not None:
                self.norms[self.layers.name_of[(id(module), attr)]] = p._norm_sample
                p._norm_sample = None

    def capture_activations_hook(self, module, *args, **kwargs):
        for p in module.parameters(recurse=False):  # FSDP2's gathered copies lack Opacus' fields
            if not hasattr(p, "_forward_counter"):
                p._forward_counter, p.grad_sample = 0, None
        ghost = self.use_ghost_clipping  # Opacus raises for tied weights under ghost clipping
        self.use_ghost_clipping = ghost and id(module) not in self.layers.tied
        try:
            return super().capture_activations_hook(module, *args, **kwargs)
        finally:
            self.use_ghost_clipping = ghost

    def capture_backprops_hook(self, module, forward_input, forward_output, loss_reduction, batch_first):
        if not self.hooks_enabled:
            return None
        if self.book_keeping:
            self._keep(module, forward_output)
            kept, untied = self.book[-1][1], id(module) not in self.layers.tied
            if untied and type(module) is torch.nn.Linear and kept[1].dim() == 3:
                self._linear_norms(module, forward_output, loss_reduction, batch_first)
                return self._collect(module)
            if untied and isinstance(kept, dict) and all(p._forward_counter == 1 for p in kept):
                self._sampled_norms(module, kept, forward_output, loss_reduction, batch_first)
                return self._collect(module)
        if id(module) in self.layers.exact:
            self._tied_backprops(module, forward_output, loss_reduction, batch_first)
            return self._collect(module)
        forward_output = without_padding_rows(module, forward_output)
        ghost = self.use_ghost_clipping
        self.use_ghost_clipping = ghost and id(module) not in self.layers.tied
        try:
            super().capture_backprops_hook(module, forward_input, forward_output, loss_reduction, batch_first)
        finally:
            self.use_ghost_clipping = ghost
        return self._collect(module)

    def _linear_norms(self, module, forward_output, loss_reduction, batch_first) -> None:
        """A linear layer's per-example gradient norms from the (inputs, output gradients) ``_keep`` just kept:
        ||sum_t b_t a_t^T||^2 = sum_{t,s} <b_t, b_s> <a_t, a_s>, as Opacus' norm sampler has it, with batched
        matmuls, and the inputs' Gram matrix computed once for the layers that read one tensor (q, k and v; gate
        and up). The Gram is held with its tensor, so a freed tensor's address is never taken for another's.
        Opacus' own bookkeeping (the popped inputs, the use counters) is its ``rearrange_grad_samples``."""
        self.rearrange_grad_samples(module=module, backprops=forward_output[0], loss_reduction=loss_reduction,
                                    batch_first=batch_first)  # pops the inputs (``_keep`` holds them)
        _, a, b = self.book[-1][1]
        if module.weight.requires_grad:
            key = (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
            held = self.grams.get(key)
            if held is None:
                held = self.grams[key] = (a, torch.bmm(a, a.transpose(1, 2)))
            square = torch.bmm(b, b.transpose(1, 2)).mul_(held[1]).sum((1, 2))
            module.weight._norm_sample = square.clamp(min=0).sqrt()
            module.weight._forward_counter -= 1
        if module.bias is not None and module.bias.requires_grad:
            module.bias._norm_sample = b.sum(1).norm(dim=-1)
            module.bias._forward_counter -= 1
        _drop_batch_len(module)

    def _sampled_norms(self, module, samples, forward_output, loss_reduction, batch_first) -> None:
        """The norms of a layer called once, whose per-example gradients ``_keep`` just formed (an RMS norm's
        weight): read from those, where Opacus' hook would form them a second time."""
        self.rearrange_grad_samples(module=module, backprops=forward_output[0], loss_reduction=loss_reduction,
                                    batch_first=batch_first)  # pops the inputs
        for p, g in samples.items():
            p._norm_sample = g.reshape(len(g), -1).norm(dim=-1) if g.numel() else g.new_zeros(len(g))
            p._forward_counter -= 1
        _drop_batch_len(module)

    def _tied_backprops(self, module, forward_output, loss_reduction, batch_first) -> None:
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction,
            batch_first=batch_first)
        use = layer_gradient(module, activations[0], backprops)
        for attr, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            name = self.layers.name_of[(id(module), attr)]
            if self.layers.users[name] > 1:
                self.uses.setdefault(name, []).append(use)
            else:  # the bias of a linear layer whose weight is tied
                p._norm_sample = use[2].sum(1).flatten(1).norm(dim=1)
            p._forward_counter -= 1
            if p._forward_counter == 0 and name in self.uses:
                parts = self.uses.pop(name)
                square = sum(gradient_inner_product(u, v) * (1 if i == j else 2)
                             for i, u in enumerate(parts) for j, v in enumerate(parts) if j >= i)
                p._norm_sample = square.clamp(min=0).sqrt()
        _drop_batch_len(module)


def _grouped(kept, inverse: torch.Tensor, rows: torch.Tensor):
    """A ``layer_gradient`` triple with each user's rows laid end to end along the token axis (users with fewer rows
    padded with zero output gradients, which add nothing): one example a user, whose gradient is the sum of its
    rows'."""
    kind, a, b = kept
    n, width = b.shape[0], b.shape[1]
    most = int(rows.max())
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(rows, 0) - rows
    slot = torch.empty_like(inverse)
    slot[order] = torch.arange(n, device=inverse.device) - starts[inverse[order]]
    where = (inverse * most + slot).to(b.device)
    count = len(rows)
    grouped_b = b.new_zeros((count * most, *b.shape[1:])).index_copy_(0, where, b)
    grouped_a = a.new_zeros((count * most, *a.shape[1:])).index_copy_(0, where, a)
    return (kind, grouped_a.reshape(count, most * width, *a.shape[2:]),
            grouped_b.reshape(count, most * width, *b.shape[2:]))


def _drop_batch_len(module) -> None:
    """What Opacus' own hook does once a layer's last call has reported."""
    if not module.activations and hasattr(module, "max_batch_len"):
        del module.max_batch_len
