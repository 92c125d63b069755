"""DP-ZO over new-token rows alone evaluates its losses from one forward's trunk outputs (training/frozen_trunk.py):
the same per-example losses as the model's own forward at any rows, a fallback wherever that does not hold, and
the same run."""

import json

import pytest
import torch

from dpaudit.canaries.generate import make_canaries
from dpaudit.canaries.hf import extend_model
from dpaudit.core.atomic import save_model_folder
from dpaudit.models.loading import load_causal_lm
from dpaudit.training.data import per_example_loss, tokenize
from dpaudit.training.frozen_trunk import FrozenTrunk
from dpaudit.training.new_tokens import new_token_ids
from dpaudit.training.trainable import select_trainable, trainable_parameters

PLAIN = ["Alice lives in Paris.", "Bob number 7 sells maps in Oslo and Rome every day.", "Carol."]


@pytest.fixture(scope="module")
def extended(tiny_model_dir, tmp_path_factory):
    model, tok = load_causal_lm(tiny_model_dir)
    manifest = make_canaries(tok, 8, seed=0, prefix_length=2)
    extend_model(model, tok, manifest)
    folder = save_model_folder(tmp_path_factory.mktemp("ext") / "model", model, tok)
    return folder, [c.text for c in manifest.canaries], [c.secret for c in manifest.canaries]


def _rows_model(folder, subset="new-tokens"):
    model, tok = load_causal_lm(folder)
    torch.manual_seed(0)
    model = select_trainable(model, subset, 4, new_token_ids(tok))
    model.eval()
    return model, tok, trainable_parameters(model)


def _set_rows(params, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_the_cached_losses_are_the_models_at_any_rows(extended):
    folder, canaries, _ = extended
    model, tok, params = _rows_model(folder)
    trunk = FrozenTrunk.for_run(model, params)
    assert trunk is not None
    batch = tokenize(tok, canaries + PLAIN, 24).batch(range(len(canaries) + len(PLAIN)))
    _set_rows(params, 1)
    first = trunk.losses(batch, micro_batch=4)  # the model's own forward, checked against the cached form
    assert trunk.key is not None and not trunk.disagreed
    torch.testing.assert_close(first, per_example_loss(model, batch))
    for seed in (2, 3):  # other rows: the cached form, no forward, against the model's own forward
        _set_rows(params, seed)
        calls = []
        hook = model.register_forward_hook(lambda *a: calls.append(1))
        cached = trunk.losses(batch)
        hook.remove()
        assert not calls
        torch.testing.assert_close(cached, per_example_loss(model, batch), rtol=1e-5, atol=1e-5)
        assert cached[:len(canaries)].std() > 0.1  # the rows move the canaries' losses, each its own way


def test_a_new_token_before_a_predicted_one_runs_the_model(extended):
    folder, _, secrets = extended
    model, tok, params = _rows_model(folder)
    trunk = FrozenTrunk.for_run(model, params)
    texts = [s + " and more words" for s in secrets[:3]] + PLAIN
    batch = tokenize(tok, texts, 24).batch(range(len(texts)))
    _set_rows(params, 4)
    torch.testing.assert_close(trunk.losses(batch), per_example_loss(model, batch))
    assert trunk.key is None  # never cached: the rows reach the trunk through the secret's input row


def test_a_batch_over_the_memory_budget_runs_the_model(extended, monkeypatch):
    from dpaudit.training import frozen_trunk

    folder, canaries, _ = extended
    model, tok, params = _rows_model(folder)
    trunk = FrozenTrunk.for_run(model, params)
    batch = tokenize(tok, canaries + PLAIN, 24).batch(range(len(canaries) + len(PLAIN)))
    monkeypatch.setattr(frozen_trunk, "MAX_BYTES", trunk._bytes(batch["attention_mask"]) - 1)
    _set_rows(params, 7)
    torch.testing.assert_close(trunk.losses(batch), per_example_loss(model, batch))
    assert trunk.key is None


def test_logits_that_are_not_the_heads_output_fail_the_check(extended):
    folder, canaries, _ = extended
    model, tok, params = _rows_model(folder)
    trunk = FrozenTrunk.for_run(model, params)
    forward = model.forward

    def capped(*args, **kwargs):  # a soft cap after the head, as Gemma 2 applies
        out = forward(*args, **kwargs)
        out.logits = 5 * torch.tanh(out.logits / 5)
        return out

    model.forward = capped
    batch = tokenize(tok, canaries + PLAIN, 24).batch(range(len(canaries) + len(PLAIN)))
    _set_rows(params, 5)
    assert trunk.losses(batch) is not None and trunk.disagreed
    _set_rows(params, 6)
    torch.testing.assert_close(trunk.losses(batch), per_example_loss(model, batch))


def test_only_a_run_of_the_rows_alone_takes_it(extended):
    folder, _, _ = extended
    model, _, params = _rows_model(folder, "lora")
    assert FrozenTrunk.for_run(model, params) is None
    model, _, params = _rows_model(folder, "full")
    assert FrozenTrunk.for_run(model, params) is None
    plain = torch.nn.Linear(2, 2)
    assert FrozenTrunk.for_run(plain, list(plain.parameters())) is None


def test_a_dp_zo_run_is_the_same_with_and_without_it(extended, tmp_path, monkeypatch):
    from dpaudit.training import zo
    from dpaudit.training.runner import TrainConfig, train

    folder, canaries, _ = extended
    cfg = TrainConfig(method="dp-zo", target_epsilon=8.0, steps=6, batch_size=0, trainable="new-tokens",
                      secret_seed=0, lr=0.5, phi=0.05, clip=0.5)
    scalars, evaluated = {}, []
    cached = FrozenTrunk._evaluate
    monkeypatch.setattr(FrozenTrunk, "_evaluate", lambda self, c, n: evaluated.append(n) or cached(self, c, n))
    for name in ("trunk", "model"):
        if name == "model":
            monkeypatch.setattr(zo, "loss_function", lambda model, params: None)
        train(folder, canaries + PLAIN * 3, tmp_path / name, cfg, show_progress=False)
        log = next((tmp_path / name).rglob("zo_log.jsonl"), None) or next((tmp_path / name).rglob("*.jsonl"))
        scalars[name] = [json.loads(line)["scalar"] for line in log.read_text().splitlines()]
    assert len(scalars["trunk"]) == 6
    assert len(evaluated) == 2 * 6  # one check, then every other evaluation from the cache: no forward
    assert scalars["trunk"] == pytest.approx(scalars["model"], rel=1e-4, abs=1e-6)
