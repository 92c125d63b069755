"""Per-example gradients of a layer, and which layers DP-SGD can clip per example.

Shared by both routes to the clipped sum (ghost.py: norms without forming the gradients; the materialising
route: Opacus' GradSampleModule): a layer's per-example gradient is sum_t b_t a_t^T over its inputs a and
output gradients b (an embedding's inputs are token ids), so its norm and the inner product of two uses of one
weight come from (a, b) alone (``gradient_inner_product``). A scaled embedding (E[ids] x c) has c x the
embedding's gradient; rows of a padding index get none, and are masked here as torch masks them.
"""

from __future__ import annotations

import math

import torch

from dpaudit.core.errors import DPAuditError


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
    with Opacus here: without it Gemma 3 failed with exit 3 after minutes of canary work)."""
    from opacus.grad_sample.utils import register_grad_sampler, register_norm_sampler

    for kind in check_layers(model):
        if kind not in _SCALED:
            _SCALED.add(kind)
            register_grad_sampler(kind)(_scaled("compute_embedding_grad_sample"))
            register_norm_sampler(kind)(_scaled("compute_embedding_norm_sample"))
    for kind in rms_norm_layers(model) - _RMS:
        _RMS.add(kind)
        register_grad_sampler(kind)(rms_norm_grad_sample)


def _rms_eps(module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def is_rms_norm(module) -> bool:
    """Whether ``module`` is an RMS norm of its last axis, w x x_hat (Llama, Qwen, Mistral, T5) or (1 + w) x x_hat
    (Gemma), x_hat = x / sqrt(mean(x^2) + eps) in float32: one trainable ``weight`` of that width, no buffers or
    children, an ``eps`` or ``variance_epsilon``, and a probe forward that agrees, so that a look-alike is never
    taken for one. Either way the per-example gradient of w is sum_t b_t x x_hat_t (``rms_norm_grad_sample``).
    torch's own nn.RMSNorm is Opacus' (it registers a sampler); a sharded (FSDP2) weight keeps functorch."""
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, torch.nn.RMSNorm) or set(params) != {"weight"} or not params["weight"].requires_grad:
        return False
    w, eps = params["weight"], _rms_eps(module)
    if type(w).__name__ == "DTensor" or w.dim() != 1 or w.is_meta or eps is None:
        return False
    if list(module.buffers(recurse=False)) or list(module.children()):
        return False
    x = torch.randn(2, 3, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        try:
            out = module(x)
        except Exception:  # noqa: BLE001 - a layer that takes something else is not one
            return False
        if not torch.is_tensor(out) or out.shape != x.shape:
            return False
        x_hat = _normalised(x, eps)
        tol = dict(rtol=2e-2, atol=2e-2) if w.dtype in (torch.float16, torch.bfloat16) else dict(rtol=1e-4, atol=1e-5)
        return any(torch.allclose(out.float(), (offset + w.float()) * x_hat, **tol) for offset in (0.0, 1.0))


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_layers(model) -> set[type]:
    """The types of ``model``'s trainable RMS norm layers (``is_rms_norm``, every instance of the type verified)."""
    seen: dict[type, bool] = {}
    for m in model.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)) and seen.get(type(m), True):
            seen[type(m)] = is_rms_norm(m)
    return {kind for kind, ok in seen.items() if ok}


def rms_norm_grad_sample(layer, activations, backprops) -> dict:
    """Per-example gradients of an RMS norm's weight: sum_t b_t x x_hat_t (x_hat in float32, as the layers
    compute it). Written here because Opacus samples torch's nn.RMSNorm only; the Hugging Face models' own RMS
    norm classes otherwise go through functorch, which cost 36 ms of a 0.77 s DP-SGD step."""
    if not layer.weight.requires_grad:
        return {}
    g = backprops.float() * _normalised(activations[0], _rms_eps(layer))
    return {layer.weight: g.flatten(1, -2).sum(1).to(layer.weight.dtype) if g.dim() > 2 else g.to(layer.weight.dtype)}


_RMS: set[type] = set()


def check_layers(model) -> set[type]:
    """The refusal of ``supported_for_dp_sgd`` alone (no Opacus import; on a meta model too, so ``audit run``
    and ``train`` refuse before any canary or weight work); returns the scaled embedding types found."""

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


def without_padding_rows(module, forward_output):
    if not isinstance(module, torch.nn.Embedding):
        return forward_output
    return (_mask_padding(module, module.activations[-1][0], forward_output[0]), *forward_output[1:])


def layer_gradient(module, inputs: torch.Tensor, output_grads: torch.Tensor):
    """(kind, a, b) for a layer whose per-example weight gradient is sum_t b_t a_t^T: a linear layer's
    inputs (n, T, in) and output gradients (n, T, out), or an embedding's token ids (n, T) and output
    gradients (n, T, dim), with rows of its padding index zeroed (torch gives that row no gradient)."""
    if isinstance(module, torch.nn.Embedding):  # a scaled embedding's gradient is c x its output gradients
        scale = embedding_scale(module, verify=False) or 1.0
        return "embedding", inputs, _mask_padding(module, inputs, output_grads) * scale
    if inputs.dim() == 2:  # no sequence axis
        inputs, output_grads = inputs.unsqueeze(1), output_grads.unsqueeze(1)
    return "linear", inputs.to(output_grads.dtype), output_grads


def weighted_gradient(module, kept, coef: torch.Tensor):
    """(parameter, sum_i coef_i g_i) for each trainable parameter of ``module``, from what the norm pass kept:
    a ``layer_gradient`` triple (linear: sum_i c_i sum_t b_it a_it^T and its bias sum_i c_i sum_t b_it; embedding:
    c_i b_it added into row x_it), or {parameter: per-example gradients} for any other layer."""
    if isinstance(kept, dict):
        return [(p, torch.einsum("n...,n->...", g, coef.to(g.dtype))) for p, g in kept.items()]
    kind, a, b = kept
    scale = coef.to(b.dtype).view(-1, *([1] * (b.dim() - 1)))
    out = []
    if module.weight.requires_grad:
        if kind == "linear":  # the factors scale the smaller side: (c b)^T a = b^T (c a)
            g = (b * scale).flatten(0, 1).T @ a.flatten(0, 1) if b.shape[-1] <= a.shape[-1] else \
                b.flatten(0, 1).T @ (a * scale).flatten(0, 1)
        else:
            rows = (b * scale).reshape(-1, b.shape[-1]).to(module.weight.dtype)
            g = torch.zeros_like(module.weight).index_add_(0, a.reshape(-1), rows)
        out.append((module.weight, g.to(module.weight.dtype)))
    bias = getattr(module, "bias", None) if kind == "linear" else None
    if bias is not None and bias.requires_grad:  # sum_i c_i sum_t b_it
        out.append((bias, (coef.to(b.dtype) @ b.sum(1)).to(bias.dtype)))
    return out


def materialising_module(model):
    """Opacus' GradSampleModule (per-example gradients stored), padding rows excepted."""
    from opacus import GradSampleModule

    class Materialising(GradSampleModule):
        def capture_backprops_hook(self, module, forward_input, forward_output, *args, **kwargs):
            if self.hooks_enabled:
                forward_output = without_padding_rows(module, forward_output)
            return super().capture_backprops_hook(module, forward_input, forward_output, *args, **kwargs)

    return Materialising(model, strict=False)  # buffers checked by supported_for_dp_sgd


def gradient_inner_product(u, v) -> torch.Tensor:
    """<G_u, G_v> per example for two uses of one weight, from ``layer_gradient`` triples, without
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
