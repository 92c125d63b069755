"""LoRA runs train the canaries' new-token rows (tied input/output embedding), with the same clipped
sums by both DP-SGD routes; the exported model carries the rows; DP-ZO replays such a run."""

import pytest
import torch

from dpaudit.core.atomic import save_model_folder
from dpaudit.canaries.generate import make_canaries
from dpaudit.canaries.hf import extend_model
from dpaudit.models.loading import load_causal_lm
from dpaudit.training.data import tokenize
from dpaudit.training.new_tokens import new_token_ids
from dpaudit.training.runner import TrainConfig, train
from dpaudit.training.sgd import FirstOrderTrainer
from dpaudit.training.trainable import select_trainable, trainable_parameters


@pytest.fixture(scope="module")
def extended(tiny_model_dir, tmp_path_factory):
    model, tok = load_causal_lm(tiny_model_dir)
    manifest = make_canaries(tok, 6, seed=0, prefix_length=3)
    extend_model(model, tok, manifest)
    folder = save_model_folder(tmp_path_factory.mktemp("ext") / "model", model, tok)
    return folder, [c.text for c in manifest.canaries]


def test_new_token_ids_are_the_canaries(extended):
    folder, texts = extended
    _, tok = load_causal_lm(folder)
    ids = new_token_ids(tok)
    assert len(ids) == 6 and min(ids) >= tok.vocab_size


def _lora(folder):
    model, tok = load_causal_lm(folder)
    torch.manual_seed(0)
    return select_trainable(model, "lora", 4, new_token_ids(tok)), tok


def test_lora_step_reaches_the_new_rows_equally_by_both_routes(extended):
    folder, texts = extended
    grads = {}
    for route in ("ghost", "materialise"):
        model, tok = _lora(folder)
        params = trainable_parameters(model)
        rows = model.get_base_model().get_input_embeddings().rows.weight
        assert any(p is rows for p in params)
        assert model.get_base_model().get_output_embeddings().rows.weight is rows  # tied, like the base
        trainer = FirstOrderTrainer(model, params, lr=0.0, private=True, clip=0.5, sigma=0.0,
                                    expected_batch_size=4, optimizer="sgd", per_sample_grads=route)
        trainer.step(tokenize(tok, texts, 16).batch(range(len(texts))), len(texts))
        grads[route] = (rows.grad.clone(), torch.cat([p.grad.flatten() for p in params]))
    assert grads["ghost"][0][1:].abs().sum() > 0 and torch.equal(grads["ghost"][0][0], torch.zeros_like(rows[0]))
    torch.testing.assert_close(grads["ghost"][1], grads["materialise"][1], rtol=1e-4, atol=1e-6)


def test_lora_run_exports_trained_canary_rows(extended, tmp_path):
    folder, texts = extended
    base, tok = load_causal_lm(folder)
    ids = new_token_ids(tok)
    assert float(base.get_input_embeddings().weight.detach()[ids].abs().sum()) == 0.0  # extend_model starts them at zero
    cfg = TrainConfig(method="dp-sgd", target_epsilon=50.0, steps=4, batch_size=4, trainable="lora",
                      secret_seed=0, lr=1e-2)
    result = train(folder, texts * 3 + ["plain words here"] * 6, tmp_path / "run", cfg, show_progress=False)
    tuned, _ = load_causal_lm(result.model_dir)
    assert float(tuned.get_input_embeddings().weight.detach()[ids].abs().sum()) > 0
    assert tuned.get_output_embeddings().weight is tuned.get_input_embeddings().weight
    unchanged = [i for i in range(tok.vocab_size) if i not in ids][:50]
    torch.testing.assert_close(tuned.get_input_embeddings().weight[unchanged],
                               base.get_input_embeddings().weight[unchanged])


def test_lora_dp_zo_run_with_new_rows_replays(extended, tmp_path):
    from dpaudit.workflows.replay import max_weight_difference, replay_run

    folder, texts = extended
    cfg = TrainConfig(method="dp-zo", target_epsilon=8.0, steps=5, batch_size=4, trainable="lora", secret_seed=0)
    result = train(folder, texts * 3, tmp_path / "run", cfg, show_progress=False)
    rebuilt, _ = replay_run(tmp_path / "run")
    tuned, _ = load_causal_lm(result.model_dir)
    assert max_weight_difference(rebuilt, tuned) < 1e-6


def test_bias_training_on_a_bias_free_model_is_refused_before_any_folder(llama_like_dir, tmp_path):
    from cli_helpers import assert_one_line_error, dpaudit

    (tmp_path / "d.txt").write_text("some words\nmore words\n")
    out = dpaudit("train", "--model", llama_like_dir, "-d", tmp_path / "d.txt", "-o", tmp_path / "run",
                  "--trainable", "bias", "--eps", "1")
    assert_one_line_error(out)
    assert "no bias terms" in out.stderr and not (tmp_path / "run").exists()
    out = dpaudit("audit", "run", "--model", llama_like_dir, "--trainable", "bias", "--out", tmp_path / "audit")
    assert_one_line_error(out)
    assert "no bias terms" in out.stderr and not (tmp_path / "audit").exists()


def test_new_tokens_subset_trains_the_canary_rows_alone_and_exports_them(extended, tmp_path):
    """`--trainable new-tokens` (the black-box DP-SGD audit run's default on the embedded model, issue 39): the
    canaries' rows are the only trainable parameter, every other weight of the exported model is the base's, and
    a DP-ZO run of it replays."""
    from dpaudit.workflows.replay import max_weight_difference, replay_run

    folder, texts = extended
    base, tok = load_causal_lm(folder)
    ids = new_token_ids(tok)
    model = select_trainable(load_causal_lm(folder)[0], "new-tokens", new_tokens=ids)
    params = trainable_parameters(model)
    assert len(params) == 1 and params[0].shape == (len(ids) + 1, base.config.hidden_size)  # tied: one matrix
    for method in ("dp-sgd", "dp-zo"):
        cfg = TrainConfig(method=method, target_epsilon=50.0, steps=3, batch_size=0, trainable="new-tokens",
                          secret_seed=0, lr=1.0 if method == "dp-sgd" else 1e-2, optimizer="sgd")
        result = train(folder, texts * 3 + ["plain words here"] * 6, tmp_path / method, cfg, show_progress=False)
        tuned, _ = load_causal_lm(result.model_dir)
        ref = dict(base.named_parameters())
        changed = {n for n, p in tuned.named_parameters() if not torch.equal(p, ref[n])}
        assert changed == {"model.embed_tokens.weight"}  # tied: lm_head is the same matrix
        moved = (tuned.get_input_embeddings().weight - base.get_input_embeddings().weight).detach().abs().sum(1)
        others = torch.ones(len(moved), dtype=torch.bool)
        others[ids] = False
        assert float(moved[ids].min()) > 0 and float(moved[others].max()) == 0.0
    rebuilt, _ = replay_run(tmp_path / "dp-zo")
    assert max_weight_difference(rebuilt, load_causal_lm(tmp_path / "dp-zo" / "model")[0]) < 1e-6


def test_new_tokens_subset_without_new_tokens_is_refused(tiny_model_dir):
    from dpaudit.core.errors import DPAuditError

    with pytest.raises(DPAuditError, match="no added tokens"):
        select_trainable(load_causal_lm(tiny_model_dir)[0], "new-tokens", new_tokens=[])


def test_row_zero_moves_no_old_token(extended):
    """DP-ZO perturbs whole parameters, row 0 (every old token's slot) included: whatever row 0 holds, old tokens'
    inputs and every example's loss but the canaries' stay the base model's, and a canary's input gets only its own
    row. (Before: a perturbed row 0 shifted every input alike, a loss change common to every example.)"""
    folder, texts = extended
    model, tok = load_causal_lm(folder)
    ids = new_token_ids(tok)
    model = select_trainable(model, "new-tokens", 4, ids)
    emb = model.get_input_embeddings()
    old = torch.tensor([[1, 2, 3]])
    new = torch.tensor([ids[:2]])
    with torch.no_grad():
        before_old, before_new = emb(old).clone(), emb(new).clone()
        emb.rows.weight[0] = torch.randn_like(emb.rows.weight[0])
        assert torch.equal(emb(old), before_old)
        assert torch.equal(emb(new), before_new)
        emb.rows.weight[1] += 1.0  # the first new token's own row does move its input
        assert not torch.equal(emb(new)[0, 0], before_new[0, 0]) and torch.equal(emb(new)[0, 1], before_new[0, 1])
