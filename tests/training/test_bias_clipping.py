"""DP-BiTFiT the paper's way (training/bias_clipping.py): the biases' per-example gradients from the output gradients
alone. The clipped sum equals the per-example reference (fp32 and bf16), nothing more than non-private BiTFiT keeps
for the backward pass is kept, and the bundled DP-SGD trainer takes this route for a biases-only model."""

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from dpaudit.training.bias_clipping import BiasClipping, bias_only
from dpaudit.training.ghost import GhostClipping


class Tiny(torch.nn.Module):
    """Every kind of biased layer the route takes: Linear (one of them called twice), LayerNorm, GPT-2's Conv1D;
    a per-example loss over a sequence (masked positions give no gradient)."""

    def __init__(self, width: int = 12, seed: int = 0, twice: bool = True):
        super().__init__()
        self.twice = twice
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(30, width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.conv = Conv1D(width, 2 * width)
        self.norm = torch.nn.LayerNorm(width)
        self.shared = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 30)

    def forward(self, ids):
        h = self.embed(ids)
        h = self.norm(h + self.conv(torch.tanh(self.up(h))))
        h = self.shared(torch.tanh(self.shared(h) if self.twice else h))  # twice: its bias's gradient sums both
        return self.head(h)

    def losses(self, ids, mask):
        logits = self.forward(ids)
        token = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(),
                                                  reduction="none").view(ids.shape[0], -1)
        return (token * mask[:, 1:]).sum(1)


def _biases_only(model):
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(".bias"))
    return [p for p in model.parameters() if p.requires_grad]


def _batch(n=6, t=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 30, (n, t), generator=g)
    mask = torch.ones(n, t)
    mask[0, 5:] = 0  # a shorter example
    return ids, mask


def _reference(model, params, ids, mask, clip):
    """sum_i min(1, C / ||g_i||) g_i from one backward per example."""
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(ids.shape[0]):
        grads = torch.autograd.grad(model.losses(ids[i:i + 1], mask[i:i + 1]).sum(), params)
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        for acc, g in zip(total, grads):
            acc += g.double() * min(1.0, clip / (float(norm) + 1e-6))
    return total


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("clip", [0.05, 1e9])
def test_the_clipped_sum_is_the_per_example_reference(dtype, tol, clip):
    model = Tiny().to(dtype)
    params = _biases_only(model)
    assert bias_only(model)
    ids, mask = _batch()
    want = _reference(model, params, ids, mask, clip)
    wrapped = BiasClipping(model, clip)
    losses = model.losses(ids, mask)
    coef = wrapped.norm_pass(losses.sum(), params)
    assert all(p.grad is None for p in params)  # the norm pass leaves the gradients alone
    wrapped.clipped_backward(losses, coef)
    scale = max(float(torch.cat([w.flatten() for w in want]).abs().max()), 1e-12)
    for p, w in zip(params, want):
        assert float((p.grad.double() - w).abs().max()) <= tol * scale
    if clip < 1:  # the examples were clipped, at C
        assert float(coef.max()) < 1 and torch.allclose(
            wrapped.per_sample_gradient_norms * coef, torch.full_like(coef, clip), rtol=1e-3)


def _kept_bytes(model, ids, mask) -> int:
    """Bytes the forward keeps for the backward: autograd's saved tensors (each storage once) and what Opacus'
    hooks hold in ``module.activations``."""
    seen = {}

    def pack(t):
        if t.device.type == "cpu" and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = model.losses(ids, mask) if hasattr(model, "losses") else model._module.losses(ids, mask)
    held = sum(int(x.numel() * x.element_size()) for m in model.modules()
               for kept in getattr(m, "activations", None) or [] for x in kept if torch.is_tensor(x))
    del losses
    return sum(seen.values()) + held


def test_dp_bitfit_keeps_no_more_for_the_backward_than_bitfit():
    """Non-private BiTFiT keeps what the backward to the biases needs; DP-BiTFiT the same (its per-example
    gradients are B x d a bias, formed in the backward); Opacus' hooks (the ghost route) kept every layer's inputs."""
    ids, mask = _batch(n=8, t=32)
    models = [Tiny(width=48, twice=False) for _ in range(3)]  # Opacus' ghost clipping refuses a layer used twice
    for m in models:
        _biases_only(m)
    bitfit = _kept_bytes(models[0], ids, mask)
    dp_bitfit = _kept_bytes(BiasClipping(models[1], 1.0), ids, mask)
    ghost = GhostClipping(models[2], 1.0)
    ghost.train()
    assert dp_bitfit <= bitfit
    opacus_route = _kept_bytes(ghost, ids, mask)
    assert opacus_route > 1.2 * bitfit  # what the paper's way leaves out


def test_a_layer_whose_output_misses_the_loss_is_refused_not_read_as_zero():
    model = Tiny()
    params = _biases_only(model)
    wrapped = BiasClipping(model, 1.0)
    ids, mask = _batch()
    logits = model.embed(ids).sum()  # no biased layer on the path
    with pytest.raises(RuntimeError, match="did not report"):
        wrapped.norm_pass(logits + sum(p.sum() for p in params) * 0, params)


def test_the_trainer_takes_the_bias_route_and_steps_by_the_clipped_sum(tiny_model_dir):
    """The bundled DP-SGD trainer on a biases-only model (DP-BiTFiT): BiasClipping, and at sigma 0 with SGD at
    lr 1 the update is the clipped sum over the expected batch size, as the per-example reference has it."""
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training.data import per_example_loss
    from dpaudit.training.sgd import FirstOrderTrainer
    from dpaudit.training.trainable import select_trainable, trainable_parameters

    model, tok = load_causal_lm(tiny_model_dir)
    params = trainable_parameters(select_trainable(model, "bias"))
    before = [p.detach().clone() for p in params]
    enc = tok(["alice lives in paris", "bob and carol", "a much longer sentence of several words here"],
              return_tensors="pt", padding=True)
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    clip = 0.01
    want = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(3):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(per_example_loss(model, one).sum(), params)
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
        for w, g in zip(want, grads):
            w += g.double() * min(1.0, clip / (norm + 1e-6))
    trainer = FirstOrderTrainer(model, params, lr=1.0, private=True, clip=clip, sigma=0.0, expected_batch_size=3,
                                optimizer="sgd")
    assert isinstance(trainer.model, BiasClipping)
    trainer.step(batch, 3)
    for p, b, w in zip(params, before, want):
        assert torch.allclose((b - p.detach()).double(), w / 3, atol=1e-7, rtol=1e-4)


def test_pre_flight_can_tell_the_route_before_any_parameter_is_marked():
    """Pre-flight's meta model has every parameter requiring a gradient: the route is read from the names that will
    train (the bias subset), as the trainer will see them."""
    model = Tiny()
    assert not bias_only(model) and bias_only(model, lambda name: name.endswith(".bias"))
    assert not bias_only(model, lambda name: name.endswith((".bias", "head.weight")))
