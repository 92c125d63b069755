"""Tokenised training data (training/data.py): stored right-padded whatever the tokenizer's padding side, so
every example's target tokens train (issue 36: a left-padding tokenizer trained on padding only, loss 0)."""

import json
import shutil

import pytest

from dpaudit.core.errors import DPAuditError

TEXTS = ["Alice lives in Paris.", "Bob number 7 sells maps in Oslo and Rome every day.", "Carol."] * 4


def _tokenizer(folder, side):
    from dpaudit.models.hf import load_tokenizer

    tok = load_tokenizer(folder)
    tok.padding_side = side
    return tok


def test_either_padding_side_gives_the_same_right_padded_examples(tiny_model_dir):
    from dpaudit.training.data import tokenize

    right = tokenize(_tokenizer(tiny_model_dir, "right"), TEXTS, 32)
    left_tok = _tokenizer(tiny_model_dir, "left")
    left = tokenize(left_tok, TEXTS, 32)
    assert left_tok.padding_side == "left"  # the user's tokenizer is left as it was
    assert (left.input_ids == right.input_ids).all() and (left.attention_mask == right.attention_mask).all()
    assert left.target_tokens() == right.target_tokens() == sum(
        len(ids) - 1 for ids in left_tok(TEXTS, add_special_tokens=False)["input_ids"])
    batch = left.batch([0, 1])
    assert int(batch["attention_mask"].sum()) == int(left.attention_mask[[0, 1]].sum())  # no real token cut


def test_a_left_padding_tokenizer_trains_as_a_right_padding_one(tiny_model_dir, tmp_path):
    """The same run, the tokenizer's padding side flipped in its folder: the same losses, never 0."""
    from dpaudit.training.runner import TrainConfig, train

    losses = {}
    for side in ("right", "left"):
        folder = shutil.copytree(tiny_model_dir, tmp_path / side)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": side}))
        cfg = TrainConfig(method="dp-sgd", target_epsilon=float("inf"), steps=3, batch_size=4, secret_seed=3)
        losses[side] = train(folder, TEXTS * 3, tmp_path / f"run-{side}", cfg, show_progress=False).last_loss
    assert losses["left"] > 0 and losses["left"] == pytest.approx(losses["right"], rel=1e-5)


def test_data_with_no_token_to_predict_is_refused(tiny_model_dir):
    from dpaudit.training.data import tokenize

    tok = _tokenizer(tiny_model_dir, "right")
    one_token = [t for t in ("a", "b", "the", "in") if len(tok(t, add_special_tokens=False)["input_ids"]) == 1]
    assert one_token
    with pytest.raises(DPAuditError, match="none of the .* training examples has a token to predict"):
        tokenize(tok, one_token * 3, 16)


def test_a_tokenizer_without_a_pad_token_tokenises_as_one_with(tiny_model_dir):
    """Many causal LMs have no pad token (GPT-2, Llama; SmolLM2 as transformers 5.17 reads its GGUF): the
    store pads by itself, so the same texts give the same tokens and mask (it raised "Asking to pad" before)."""
    from dpaudit.training.data import tokenize

    with_pad = tokenize(_tokenizer(tiny_model_dir, "right"), TEXTS, 32)
    tok = _tokenizer(tiny_model_dir, "left")
    tok.pad_token = None
    assert tok.pad_token_id is None
    without = tokenize(tok, TEXTS, 32)
    assert (without.attention_mask == with_pad.attention_mask).all()
    real = with_pad.attention_mask.bool()
    assert (without.input_ids[real] == with_pad.input_ids[real]).all()
    assert without.target_tokens() == with_pad.target_tokens() > 0
