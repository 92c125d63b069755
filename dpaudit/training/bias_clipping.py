"""DP-BiTFiT as its paper runs it (Bu, Wang, Zha & Karypis 2022, "Differentially private bias-term only fine-tuning
of foundation models"): per-example gradients of the bias terms from the output gradients alone.

A bias b added to a layer's output, y_t = f(x_t) + b at every position t, has per-example gradient
dL_i/db = sum_t dL_i/dy_it: the output gradient summed over the positions, a vector of b's size. Nothing else is
needed: no layer input is kept, no weight gradient (per-example or summed) is formed, no norm of one is taken. One
backward pass does it: a hook on each biased layer's output sums the gradient flowing back through it per example
(B x d a layer, kept until the step's clipping), and autograd itself computes no weight gradient since no weight
requires one. The clip factors c_i = min(1, C / (||g_i|| + 1e-6)), Opacus' own, come from those vectors, and the
clipped sum sum_i c_i g_i is one product a bias. The DP step that follows (clipped sum into the noise) is the ghost
route's (training/dp_step.py), so probes, ledger, resume and planted bugs see the same seams.

Layers whose bias is added along the output's last axes: torch's Linear and LayerNorm (its bias spans
normalized_shape), transformers' Conv1D (GPT-2's). A trainable parameter that is not such a bias, or a bias two
layers share, keeps ghost clipping (training/ghost.py): ``bias_only`` says which route a model takes.
"""

from __future__ import annotations

import torch


def _bias_axes(module) -> int | None:
    """How many trailing axes of ``module``'s output its bias spans, for the layers named above; else None."""
    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
        return 1
    if isinstance(module, torch.nn.LayerNorm):
        return len(module.normalized_shape)
    return None


def biased_layers(model, trains=None) -> list | None:
    """(layer, its bias) for every trainable parameter of ``model`` when each is the bias of one supported layer and
    used by that layer alone; None when any trainable parameter is something else (another route clips it).
    ``trains(name)``: which parameters train, where they are not marked yet (pre-flight's meta model); default: those
    that require a gradient."""
    trainable = {id(p) for name, p in model.named_parameters()
                 if (trains(name) if trains is not None else p.requires_grad)}
    owners: dict[int, list] = {}
    for m in model.modules():
        for attr, p in m.named_parameters(recurse=False):
            if id(p) in trainable:
                owners.setdefault(id(p), []).append((m, attr))
    layers = []
    for p in model.parameters():
        if id(p) not in trainable:
            continue
        uses = owners.get(id(p), [])
        if len(uses) != 1 or uses[0][1] != "bias" or _bias_axes(uses[0][0]) is None:
            return None
        layers.append((uses[0][0], p))
    return layers or None


def bias_only(model, trains=None) -> bool:
    return biased_layers(model, trains) is not None


class BiasClipping(torch.nn.Module):
    """``model`` (only biases trainable, ``bias_only``) wrapped for DP-BiTFiT at clip norm ``clip`` (inf: a clip
    factor of 1, the "no-clip" planted bug); the same two calls as ghost clipping: ``norm_pass`` then
    ``clipped_backward``."""

    def __init__(self, model, clip: float) -> None:
        super().__init__()
        layers = biased_layers(model)
        if layers is None:
            raise ValueError("BiasClipping clips models whose trainable parameters are all biases (bias_only)")
        self._module, self.max_grad_norm = model, float(clip)
        self.layers = layers
        self.grads: dict[int, torch.Tensor] = {}  # id(bias) -> per-example gradients (B, *bias.shape), this pass
        self.per_sample_gradient_norms = None
        self._rows: torch.Tensor | None = None  # the step's per-example gradients, between the two calls
        self._handles = [m.register_forward_hook(self._watch) for m, _ in layers]

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def _watch(self, module, inputs, output):
        if not (module.training and torch.is_grad_enabled() and torch.is_tensor(output) and output.requires_grad):
            return None
        bias, axes = module.bias, _bias_axes(module)

        def keep(grad: torch.Tensor) -> None:
            per_example = grad.reshape(grad.shape[0], -1, *grad.shape[grad.dim() - axes:]).sum(1, dtype=torch.float32)
            held = self.grads.get(id(bias))
            self.grads[id(bias)] = per_example if held is None else held + per_example  # a layer called twice

        output.register_hook(keep)
        return None

    def norm_pass(self, loss, params) -> torch.Tensor:
        """One backward of ``loss`` (the examples' summed losses) that leaves ``p.grad`` alone; returns the clip
        factors of the examples."""
        self.grads = {}
        torch.autograd.grad(loss, params, allow_unused=True)
        missing = [p for _, p in self.layers if id(p) not in self.grads]
        if missing:  # never a stale or partial norm: a bias whose layer's output did not reach the loss
            raise RuntimeError("a trainable bias did not report its per-example gradients")
        # all the biases' per-example gradients side by side (B x their total size): one norm, one product, however
        # many layers (a few operators a layer, not a norm and a sum each)
        self._rows = torch.cat([self.grads.pop(id(p)).flatten(1) for _, p in self.layers], dim=1)
        norms = torch.linalg.vector_norm(self._rows, dim=1)
        self.per_sample_gradient_norms = norms
        return (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)

    def clipped_backward(self, losses, coef) -> None:
        """Adds sum_i c_i g_i to each bias's ``p.grad`` (no second backward)."""
        rows, self._rows = self._rows, None
        total = coef.detach().to(rows.dtype) @ rows
        for (_, p), part in zip(self.layers, total.split([p.numel() for _, p in self.layers])):
            g = part.view_as(p).to(p.dtype)
            p.grad = g if p.grad is None else p.grad.add_(g)
