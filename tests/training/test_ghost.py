"""DP-SGD's two routes to the clipped sum agree: ghost clipping (the default; no per-example gradients)
and Opacus' materialised per-example gradients give the same privatised gradient for a fixed batch and
noise seed, on every trainable subset, with the tied embeddings of the embedded model, on empty Poisson
batches, in micro-batches and in bf16; a white-box run writes the same transcript and ledger."""

import json

import numpy as np
import pytest
import torch

from dpaudit.models.loading import load_causal_lm
from dpaudit.training.data import tokenize
from dpaudit.training.runner import TrainConfig, train
from dpaudit.training.sgd import FirstOrderTrainer
from dpaudit.training.trainable import select_trainable, trainable_parameters
from dpaudit.audit.whitebox_canaries import TRANSCRIPT

TEXTS = [f"Alice number {i} lives in Paris and likes bread." for i in range(6)] + \
        ["zq xv kj wp " * 6 + "!", "a", "the cat sat on the mat and looked at the dog for a while"]


def privatised_gradient(model_dir, mode, subset="full", indices=range(len(TEXTS)), sigma=0.0, micro_batch=0,
                        bf16=False, clip=0.5, book_keeping=True):
    """The released gradient of one step (lr 0: the weights do not move), as one float64 vector. ``book_keeping``
    False: ghost clipping's second backward (the sharded route) in place of book-keeping."""
    model, tok = load_causal_lm(model_dir, dtype=torch.bfloat16 if bf16 else None)
    torch.manual_seed(0)  # LoRA adapters start the same in both modes
    model = select_trainable(model, subset, 4)
    params = trainable_parameters(model)
    trainer = FirstOrderTrainer(model, params, lr=0.0, private=True, clip=clip, sigma=sigma, expected_batch_size=4,
                                noise_seed=1, optimizer="sgd",
                                per_sample_grads=mode, micro_batch=micro_batch)
    if mode == "ghost":
        trainer.model.book_keeping = book_keeping
    batch = tokenize(tok, TEXTS, 24).batch(list(indices))
    trainer.step(batch, len(indices))
    return torch.cat([p.grad.flatten().double() for p in params])


def test_the_embedded_model_ties_its_embeddings(tiny_model_dir):
    model, _ = load_causal_lm(tiny_model_dir)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight


@pytest.mark.parametrize("subset", ["full", "lora", "bias", "embeddings"])
def test_ghost_clipping_equals_materialised_per_example_gradients(tiny_model_dir, subset):
    ghost = privatised_gradient(tiny_model_dir, "ghost", subset)
    materialised = privatised_gradient(tiny_model_dir, "materialise", subset)
    scale = float(materialised.abs().max())
    assert scale > 1e-4  # a real gradient, not zeros
    assert float((ghost - materialised).abs().max()) <= 1e-5 * scale
    # Several examples are clipped (clip 0.5 is below most of their norms): the check covers the factors.
    unclipped = privatised_gradient(tiny_model_dir, "materialise", subset, clip=1e6)
    assert float((unclipped - materialised).abs().max()) > 1e-2 * scale
    # With noise from the same seed, the releases agree too.
    noisy_ghost = privatised_gradient(tiny_model_dir, "ghost", subset, sigma=0.7)
    noisy_materialised = privatised_gradient(tiny_model_dir, "materialise", subset, sigma=0.7)
    assert float((noisy_ghost - noisy_materialised).abs().max()) <= 1e-5 * float(noisy_materialised.abs().max())


@pytest.mark.parametrize("micro_batch", [0, 4])
def test_book_keeping_equals_the_second_backward(tiny_model_dir, micro_batch):
    """Book-keeping (the clipped sum from the norm pass's inputs and output gradients) and the second backward of
    sum_i c_i l_i (the route a sharded run takes) give the same clipped sum, across micro-batches too."""
    kept = privatised_gradient(tiny_model_dir, "ghost", micro_batch=micro_batch)
    two_pass = privatised_gradient(tiny_model_dir, "ghost", micro_batch=micro_batch, book_keeping=False)
    assert float(kept.abs().max()) > 1e-4
    assert float((kept - two_pass).abs().max()) <= 1e-5 * float(two_pass.abs().max())


def test_empty_poisson_batch_is_the_same_noise_in_both_modes(tiny_model_dir):
    ghost = privatised_gradient(tiny_model_dir, "ghost", indices=[], sigma=1.3)
    materialised = privatised_gradient(tiny_model_dir, "materialise", indices=[], sigma=1.3)
    assert torch.equal(ghost, materialised)
    assert abs(float(ghost.std()) - 1.3 * 0.5 / 4) < 0.01  # N(0, (C sigma)^2) / B, nothing else


@pytest.mark.parametrize("mode", ["ghost", "materialise"])
def test_micro_batches_give_the_single_batch_result(tiny_model_dir, mode):
    whole = privatised_gradient(tiny_model_dir, mode, sigma=0.7)
    for micro in (1, 4):
        chunked = privatised_gradient(tiny_model_dir, mode, sigma=0.7, micro_batch=micro)
        assert float((chunked - whole).abs().max()) <= 1e-5 * float(whole.abs().max())


def test_bf16_ghost_clipping_is_close_to_materialised(tiny_model_dir):
    ghost = privatised_gradient(tiny_model_dir, "ghost", bf16=True)
    materialised = privatised_gradient(tiny_model_dir, "materialise", bf16=True)
    scale = float(materialised.abs().max())
    assert float((ghost - materialised).abs().max()) <= 2e-2 * scale  # bf16 rounding, not a different sum


def test_white_box_transcript_and_ledger_do_not_depend_on_the_mode(tiny_model_dir, tmp_path):
    from dpaudit.models.corpus import sentences

    out = {}
    for mode in ("ghost", "materialise"):
        cfg = TrainConfig(method="dp-sgd", target_epsilon=4.0, steps=3, batch_size=0, white_box=50, secret_seed=5,
                          per_sample_grads=mode, micro_batch=3 if mode == "ghost" else 0, optimizer="sgd")
        train(tiny_model_dir, sentences(8, seed=3), tmp_path / mode, cfg, show_progress=False)
        ledger = json.loads((tmp_path / mode / "privacy_ledger.json").read_text())
        out[mode] = (np.fromfile(tmp_path / mode / TRANSCRIPT, dtype="<f4"),
                     {k: v for k, v in ledger.items() if "time" not in k and "second" not in k})
    (t_ghost, l_ghost), (t_mat, l_mat) = out["ghost"], out["materialise"]
    assert t_ghost.size == 3 * 50
    np.testing.assert_allclose(t_ghost, t_mat, rtol=1e-4, atol=1e-4 * float(np.abs(t_mat).max()))
    assert l_ghost == l_mat


def test_gradient_inner_products_match_explicit_per_example_gradients():
    from dpaudit.training.per_example import layer_gradient as _layer_gradient, gradient_inner_product

    g = torch.Generator().manual_seed(0)
    n, t, s, vocab, width = 3, 5, 4, 7, 6
    emb = torch.nn.Embedding(vocab, width, padding_idx=2)
    lin = torch.nn.Linear(width, vocab, bias=False)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    ids[0, 1] = 2  # a padding token inside an example: torch gives its row no gradient
    d = torch.randn(n, t, width, generator=g, dtype=torch.float64)
    h = torch.randn(n, s, width, generator=g, dtype=torch.float64)
    b = torch.randn(n, s, vocab, generator=g, dtype=torch.float64)
    explicit_emb = torch.zeros(n, vocab, width, dtype=torch.float64)
    for i in range(n):
        for k in range(t):
            if ids[i, k] != 2:
                explicit_emb[i, ids[i, k]] += d[i, k]
    explicit_lin = torch.einsum("nsv,nsh->nvh", b, h)
    e, li = _layer_gradient(emb, ids, d), _layer_gradient(lin, h, b)
    for u, v, gu, gv in [(e, e, explicit_emb, explicit_emb), (li, li, explicit_lin, explicit_lin),
                         (e, li, explicit_emb, explicit_lin), (li, e, explicit_lin, explicit_emb)]:
        expected = (gu * gv).sum((1, 2))
        torch.testing.assert_close(gradient_inner_product(u, v), expected)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    """A tiny Gemma 3 (scaled word embedding with an embed_scale buffer, tied output), built from its config."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dpaudit.core.atomic import save_model_folder
    from dpaudit.models.corpus import sentences
    from dpaudit.models.embedded import build_tokenizer

    tok = build_tokenizer(sentences(300, seed=7))
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                              sliding_window=32)
    torch.manual_seed(0)
    return save_model_folder(tmp_path_factory.mktemp("gemma3") / "model", Gemma3ForCausalLM(config), tok)


def test_a_scaled_embedding_gets_exact_per_example_gradients_in_both_modes(gemma3_dir):
    """Issue 36: Opacus rejected Gemma 3's scaled embedding (an embed_scale buffer), exit 3 after minutes.
    Both modes now give the clipped sum of each example's own gradient, computed here one example at a time."""
    from dpaudit.training.data import per_example_loss
    from dpaudit.training.per_example import embedding_scale

    model, tok = load_causal_lm(gemma3_dir)
    assert embedding_scale(model.get_input_embeddings()) == pytest.approx(32 ** 0.5, rel=1e-3)
    params = trainable_parameters(model)
    data = tokenize(tok, TEXTS, 24)
    clip, expected = 0.5, 4
    brute = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    norms = []
    for i in range(len(TEXTS)):
        grads = torch.autograd.grad(per_example_loss(model, data.batch([i])).sum(), params, allow_unused=True)
        g = torch.cat([(torch.zeros_like(p) if x is None else x).flatten().double() for p, x in zip(params, grads)])
        norms.append(float(g.norm()))
        brute += g * min(1.0, clip / max(float(g.norm()), 1e-12))
    assert sum(n > clip for n in norms) >= 2  # clipping is exercised
    brute /= expected
    for mode in ("ghost", "materialise"):
        got = privatised_gradient(gemma3_dir, mode)
        assert float((got - brute).abs().max()) <= 1e-4 * float(brute.abs().max()), mode


def test_a_trainable_layer_with_state_is_refused_in_one_line():
    from dpaudit.core.errors import DPAuditError
    from dpaudit.training.per_example import supported_for_dp_sgd

    with pytest.raises(DPAuditError, match=r"layer 1 \(BatchNorm1d\).*--trainable lora"):
        supported_for_dp_sgd(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))


def test_an_unsupported_layer_is_refused_at_preflight_before_any_work(tiny_model_dir, monkeypatch, gemma3_dir):
    """Issue 36: `audit run` reached the Opacus failure after 6.5 minutes of canary work; preflight (run before the
    output folder exists) now refuses from the config alone, and passes Gemma 3's scaled embedding."""
    from dpaudit.core.errors import DPAuditError
    from dpaudit.models import hf
    from dpaudit.training.runner import preflight

    assert preflight(gemma3_dir, TrainConfig(method="dp-sgd", target_epsilon=1.0), 100, warn=False) is not None
    monkeypatch.setattr(hf, "meta_model", lambda folder: torch.nn.Sequential(torch.nn.Linear(3, 4),
                                                                             torch.nn.BatchNorm1d(4)))
    with pytest.raises(DPAuditError, match="BatchNorm1d"):
        preflight(tiny_model_dir, TrainConfig(method="dp-sgd", target_epsilon=1.0), 100, warn=False)


class _ScaleOnly(torch.nn.Module):
    """An RMS norm look-alike (a weight and an eps) that does not normalise."""

    def __init__(self, width):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(width)), 1e-6

    def forward(self, x):
        return self.weight * x


def test_rms_norm_layers_get_exact_per_example_gradients_without_functorch(tiny_model_dir):
    """Issue 41: the Hugging Face RMS norms (w x x_hat in Llama, (1 + w) x x_hat in Gemma) went through
    functorch; ``rms_norm_grad_sample`` gives the same per-example gradients, and a look-alike is not taken."""
    from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from dpaudit.training.per_example import is_rms_norm, rms_norm_grad_sample, rms_norm_layers

    g = torch.Generator().manual_seed(0)
    for layer in (LlamaRMSNorm(16, eps=1e-5), Gemma3RMSNorm(16)):
        with torch.no_grad():
            layer.weight.add_(torch.randn(16, generator=g))
        assert is_rms_norm(layer)
        for shape in ((5, 16), (5, 7, 16)):
            x, b = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
            want = ft_compute_per_sample_gradient(layer, [x], b)[layer.weight]
            torch.testing.assert_close(rms_norm_grad_sample(layer, [x], b)[layer.weight], want)
    assert not is_rms_norm(_ScaleOnly(16)) and not is_rms_norm(torch.nn.LayerNorm(16))
    assert not is_rms_norm(torch.nn.RMSNorm(16))  # Opacus samples torch's own
    frozen = LlamaRMSNorm(16).requires_grad_(False)
    assert not is_rms_norm(frozen)
    model, _ = load_causal_lm(tiny_model_dir)
    assert {kind.__name__ for kind in rms_norm_layers(model)} == {"LlamaRMSNorm"}


def test_the_norm_pass_refuses_a_layer_that_no_probe_reaches():
    """Only layers none of whose inputs requires a gradient get the probe; a layer fed by a leaf of the user's own
    (not a trainable layer's output) lies on no path to a probe, and the norm pass refuses, never a stale norm.
    The same model fed plain inputs reports every layer's norms, and they are the per-example gradient norms."""
    from dpaudit.training.ghost import GhostClipping

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(5, 3)
    expected = []
    for i in range(5):
        grads = torch.autograd.grad(model(x[i:i + 1]).sum(), list(model.parameters()))
        expected.append(torch.cat([g.flatten() for g in grads]).norm())
    ghost = GhostClipping(model, clip=1.0)
    ghost.norm_pass(ghost(x).sum(), list(model.parameters()))
    assert torch.allclose(ghost.get_norm_sample(), torch.stack(expected), atol=1e-5)
    leaf = torch.randn(5, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="did not report"):
        ghost.norm_pass(ghost(leaf * 2).sum(), list(model.parameters()))


@pytest.mark.parametrize("book_keeping, passes", [(True, 1), (False, 2)])
def test_a_book_keeping_step_runs_one_backward(tiny_model_dir, monkeypatch, book_keeping, passes):
    """Issue 54: the clipped sum from the norm pass's kept inputs and output gradients, with no second backward
    (the sharded route's second backward counts 2, so the count can fail). Every backward torch runs goes through
    the autograd engine's ``run_backward``, counted here."""
    from torch.autograd import graph

    engine = graph.Variable._execution_engine
    calls = {"n": 0}
    real = engine.run_backward

    class Counting:
        def __getattr__(self, name):
            return getattr(engine, name)

        def run_backward(self, *args, **kwargs):
            calls["n"] += 1
            return real(*args, **kwargs)

    monkeypatch.setattr(graph.Variable, "_execution_engine", Counting())
    privatised_gradient(tiny_model_dir, "ghost", "full", book_keeping=book_keeping)
    assert calls["n"] == passes
