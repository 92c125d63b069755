"""Canaries: generation, manifest, insertion into each dataset format, and model extension."""

import csv
import json

import pytest
import torch

from dpaudit.canaries.generate import make_canaries
from dpaudit.canaries.hf import check_tokenizer_matches, extend_model
from dpaudit.models.hf import load_tokenizer
from dpaudit.canaries.insert import insert_canaries
from dpaudit.core.texts import read_texts
from dpaudit.canaries.manifest import load_manifest
from dpaudit.core.errors import DPAuditError
from dpaudit.models.loading import load_causal_lm


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_canaries_are_new_tokens_with_half_members(tokenizer, tmp_path):
    """Issue 39: membership came from the public seed, so every run with seed 0 shared one draw (555 of 1000)
    and a one-run bound on pure-noise scores exceeded 0 in 19 % of runs; now it is drawn from secret randomness."""
    manifest = make_canaries(tokenizer, 2000, seed=3)
    assert len(set(manifest.secrets)) == 2000
    assert not set(manifest.secrets) & set(tokenizer.get_vocab())
    assert abs(len(manifest.members) / 2000 - 0.5) < 0.04  # Binomial(2000, 1/2): 4 sd is ~0.045
    # The public seed fixes secrets and prefixes; membership is a fresh secret draw each time (canaries/generate.py)
    again = make_canaries(tokenizer, 2000, seed=3)
    assert again.secrets == manifest.secrets and [c.prefix for c in again.canaries] == [c.prefix for c in manifest.canaries]
    assert [c.member for c in again.canaries] != [c.member for c in manifest.canaries]
    fixed = [make_canaries(tokenizer, 2000, seed=3, membership_seed=9) for _ in range(2)]
    assert fixed[0].to_dict() == fixed[1].to_dict()
    other = make_canaries(tokenizer, 2000, seed=4)
    assert other.secrets != manifest.secrets
    for c in manifest.canaries[:50]:
        assert c.prefix.strip() and c.prefix.isprintable()
    manifest.save(tmp_path / "m.json")
    assert load_manifest(tmp_path / "m.json").to_dict() == manifest.to_dict()


def test_default_prefix_is_one_token_in_the_library_and_the_cli(tokenizer, tiny_model_dir, tmp_path):
    """Issue 55 item 4: `canaries make` (and the callback's new-token canaries) used 8 prefix tokens, whose loss
    crowds the secret's row out of the clipped gradient (a user-recipe run read AUC 0.51 where 1 token read 0.61)."""
    from cli_helpers import dpaudit

    def lengths(manifest):
        return {len(tokenizer(c.prefix, add_special_tokens=False)["input_ids"]) for c in manifest.canaries}

    made = make_canaries(tokenizer, 40, seed=1)
    assert made.prefix_length == 1 and lengths(made) == {1}
    assert dpaudit("canaries", "make", "-t", tiny_model_dir, "-o", tmp_path / "c.json", "-m", "40").returncode == 0
    made = load_manifest(tmp_path / "c.json")
    assert made.prefix_length == 1 and lengths(made) == {1}


def test_template_prefix(tokenizer):
    manifest = make_canaries(tokenizer, 10, template="My account number is ")
    assert all(c.text == "My account number is " + c.secret for c in manifest.canaries)


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "csv"])
def test_insert_each_format_keeps_input_and_adds_members(tokenizer, tmp_path, fmt):
    manifest = make_canaries(tokenizer, 40, seed=1)
    originals = [f"example number {i}" for i in range(30)]
    src = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        src.write_text("".join(json.dumps({"text": t, "label": i}) + "\n" for i, t in enumerate(originals)))
    elif fmt == "txt":
        src.write_text("\n".join(originals) + "\n")
    else:
        with open(src, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["id", "text"])
            w.writerows(enumerate(originals))
    before = src.read_bytes()
    out = tmp_path / f"out.{fmt}"
    summary = insert_canaries(manifest, src, out, repeats=3, seed=0)
    assert src.read_bytes() == before
    texts = read_texts(out, fmt)
    assert summary.inserted == 3 * len(manifest.members) and len(texts) == 30 + summary.inserted
    assert sorted(t for t in texts if "<canary-" not in t) == sorted(originals)
    for c in manifest.canaries:
        assert texts.count(c.text) == (3 if c.member else 0)
    assert texts[:30] != originals  # shuffled in, not appended
    with pytest.raises(DPAuditError, match="exists"):
        insert_canaries(manifest, src, out)
    with pytest.raises(DPAuditError, match="never modified in place"):
        insert_canaries(manifest, src, src, force=True)


def test_extension_adds_tokens_zero_rows_and_keeps_ties(tiny_model_dir, tmp_path):
    model, tok = load_causal_lm(tiny_model_dir)
    manifest = make_canaries(tok, 16, seed=0)
    with pytest.raises(DPAuditError, match="absent"):
        check_tokenizer_matches(tok, manifest, "the base model")
    old_vocab = len(tok)
    ids = extend_model(model, tok, manifest)
    assert ids == list(range(old_vocab, old_vocab + 16))
    out = model.get_output_embeddings().weight
    assert model.get_input_embeddings().weight.data_ptr() == out.data_ptr()  # still tied
    assert torch.all(out[old_vocab:] == 0)
    assert tok("hello " + manifest.canaries[0].secret)["input_ids"][-1] == ids[0]
    check_tokenizer_matches(tok, manifest, "the extended model")


def _gradient_shares(model, tok, canary, secret: int) -> tuple[float, float]:
    """(on its secret's own row, on the body: every tensor but the embeddings): shares of one canary's squared
    loss-gradient norm, the whole model trainable."""
    model.zero_grad()
    x = torch.tensor([tok(canary.text, add_special_tokens=False)["input_ids"]])
    torch.nn.functional.cross_entropy(model(input_ids=x).logits[0, :-1].float(), x[0, 1:]).backward()
    rows = model.get_output_embeddings().weight
    total = sum(float((q.grad.float() ** 2).sum()) for q in model.parameters() if q.grad is not None)
    body = sum(float((q.grad.float() ** 2).sum()) for q in model.parameters() if q.grad is not None and q is not rows)
    return float((rows.grad[secret].float() ** 2).sum()) / total, body / total


def test_behind_one_shared_prefix_a_canarys_gradient_starts_on_its_own_row(tiny_model_dir):
    """Issue 70, item 1: where every canary has one shared prefix, its new row starts at the base's expected output
    row after it (``expected_row``), so the loss gradient into the body is zero at the start and a whole-model run
    puts a canary's clipped gradient on its own row (the rest: the other rows' p_j h). Random prefixes with zero
    rows send part of it into the body (the test can fail)."""
    from dpaudit.canaries.generate import shared_prefix
    from dpaudit.canaries.hf import expected_row

    shares = {}
    for layout in ("shared", "random"):
        model, tok = load_causal_lm(tiny_model_dir)
        template = shared_prefix(tok, seed=0) if layout == "shared" else None
        manifest = make_canaries(tok, 40, seed=0, template=template)
        row = expected_row(model, tok, manifest.canaries[0].prefix)
        ids = extend_model(model, tok, manifest)
        out = model.get_output_embeddings().weight.detach()
        if layout == "shared":
            assert manifest.prefix_kind == "template" and len({c.prefix for c in manifest.canaries}) == 1
            assert torch.equal(out[ids[0]], row) and bool((out[ids] == out[ids[0]]).all()) and bool(row.any())
        else:
            assert not bool(out[ids].any())
        model.train()
        shares[layout] = [_gradient_shares(model, tok, c, s) for c, s in zip(manifest.canaries[:5], ids)]
    assert min(own for own, _ in shares["shared"]) > 0.98
    assert max(body for _, body in shares["shared"]) < 1e-6 < 0.02 < min(body for _, body in shares["random"])


def test_manifest_from_another_tokenizer_is_refused(tokenizer):
    from dpaudit.models.embedded import build_tokenizer

    other = build_tokenizer(["completely different words here"] * 20, vocab_size=300)
    manifest = make_canaries(other, 10)
    with pytest.raises(DPAuditError, match="another tokenizer"):
        check_tokenizer_matches(tokenizer, manifest, "x")


def test_fresh_membership_keeps_a_one_run_bound_valid_on_noise_scores():
    """Scores of pure noise (no training) against fresh membership draws: the headline exceeds its smallest
    positive value in at most alpha of the runs (the fixed seed-0 draw did in 19 % of 200)."""
    import numpy as np

    from dpaudit.audit.analysis import analyse
    from dpaudit.canaries.generate import membership

    rng = np.random.default_rng(5)
    above = sum(analyse(rng.normal(size=1000), membership(1000), claimed_epsilon=1.0, delta=1e-5,
                        mechanism="gaussian", score="loss-vs-base").epsilon_lower_bound > 0.08 for _ in range(60))
    assert above <= 6  # alpha = 0.05 of 60 is 3; Binomial(60, 0.05) exceeds 6 with probability 0.03


def test_redrawn_membership_keeps_the_canaries_and_draws_new_coins(tokenizer):
    from dpaudit.canaries.generate import redraw_membership

    manifest = make_canaries(tokenizer, 64, seed=0, membership_seed=1)
    again = redraw_membership(manifest, 2)
    assert [(c.secret, c.prefix) for c in again.canaries] == [(c.secret, c.prefix) for c in manifest.canaries]
    assert [c.member for c in again.canaries] != [c.member for c in manifest.canaries]
    assert [c.member for c in redraw_membership(manifest, 2).canaries] == [c.member for c in again.canaries]
    two = make_canaries(tokenizer, 2, seed=0)
    assert all({c.member for c in redraw_membership(two, s, mixed=True).canaries} == {True, False} for s in range(16))
