"""Issue 67, item 23: an extended model (the base plus zero rows for new tokens) is written as a folder without
weights, and loads to the same model, bit for bit, as the extended model written in full; a base that changed or
went away is refused in one line."""

import os

import pytest
import torch

from dpaudit.core.atomic import save_model_folder
from dpaudit.core.errors import DPAuditError
from dpaudit.models.extension import MARKER, add_new_tokens, save_extension
from dpaudit.models.loading import load_causal_lm

TOKENS = ["<dpaudit_canary_a>", "<dpaudit_canary_b>", "<dpaudit_canary_c>"]


def _extended(base, folder, full=None):
    model, tok = load_causal_lm(base)
    ids = add_new_tokens(model, tok, TOKENS)
    save_extension(folder, base, model, tok, TOKENS)
    if full is not None:
        save_model_folder(full, model, tok)
    return ids


def _weights_bytes(folder):
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))


def test_an_extension_loads_as_the_full_extended_model(tiny_model_dir, tmp_path):
    ids = _extended(tiny_model_dir, tmp_path / "ext", full=tmp_path / "full")
    assert _weights_bytes(tmp_path / "ext") == 0 < _weights_bytes(tmp_path / "full")
    a, tok_a = load_causal_lm(tmp_path / "ext")
    b, tok_b = load_causal_lm(tmp_path / "full")
    assert tok_a.convert_tokens_to_ids(TOKENS) == tok_b.convert_tokens_to_ids(TOKENS) == ids
    assert tok_a.get_vocab() == tok_b.get_vocab()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert float(a.get_output_embeddings().weight[ids].detach().abs().sum()) == 0.0


def test_an_extension_with_a_start_row_loads_it_to_the_bit(tiny_model_dir, tmp_path):
    """Issue 70: new rows may all start at one row (canaries behind a shared prefix); the marker holds it as exact
    floats, and the extension loads as the model written in full. A marker of format 1 (zero rows) is still read;
    rows that differ cannot be written as an extension."""
    import json

    model, tok = load_causal_lm(tiny_model_dir)
    row = torch.randn(model.get_output_embeddings().weight.shape[1]) / 3
    ids = add_new_tokens(model, tok, TOKENS, row)
    save_extension(tmp_path / "ext", tiny_model_dir, model, tok, TOKENS)
    save_model_folder(tmp_path / "full", model, tok)
    a, _ = load_causal_lm(tmp_path / "ext")
    b, _ = load_causal_lm(tmp_path / "full")
    assert torch.equal(a.get_output_embeddings().weight[ids], row.expand(len(ids), -1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    marker = json.loads((tmp_path / "ext" / MARKER).read_text())
    marker.pop("row")
    (tmp_path / "ext" / MARKER).write_text(json.dumps({**marker, "format": 1}))
    old, _ = load_causal_lm(tmp_path / "ext")
    assert not bool(old.get_output_embeddings().weight[ids].any())
    with torch.no_grad():
        model.get_output_embeddings().weight[ids[0]] += 1
    with pytest.raises(DPAuditError, match="rows differ"):
        save_extension(tmp_path / "ext2", tiny_model_dir, model, tok, TOKENS)
    fresh, fresh_tok = load_causal_lm(tiny_model_dir)
    with pytest.raises(DPAuditError, match="start row"):
        add_new_tokens(fresh, fresh_tok, TOKENS, row[:3])


def test_an_extension_loads_in_bf16(tiny_model_dir, tmp_path):
    _extended(tiny_model_dir, tmp_path / "ext")
    model, _ = load_causal_lm(tmp_path / "ext", dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_a_base_beside_the_extension_is_found_after_the_two_move(tiny_model_dir, tmp_path):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "out" / "base_model")
    _extended(tmp_path / "out" / "base_model", tmp_path / "out" / "ext")
    (tmp_path / "out").rename(tmp_path / "moved")
    model, tok = load_causal_lm(tmp_path / "moved" / "ext")
    assert all(t in tok.get_vocab() for t in TOKENS)


@pytest.mark.parametrize("change", ["gone", "rewritten"])
def test_a_changed_or_missing_base_is_refused(tiny_model_dir, tmp_path, change):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    _extended(base, tmp_path / "ext")
    if change == "gone":
        shutil.rmtree(base)
    else:
        weights = next(base.glob("*.safetensors"))
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DPAuditError, match="gone" if change == "gone" else "changed"):
        load_causal_lm(tmp_path / "ext")


def test_a_forged_marker_is_refused(tiny_model_dir, tmp_path):
    _extended(tiny_model_dir, tmp_path / "ext")
    (tmp_path / "ext" / MARKER).write_text('{"format": 1, "base": 3, "tokens": []}')
    with pytest.raises(DPAuditError, match="not an added-tokens marker"):
        load_causal_lm(tmp_path / "ext")


def test_an_extension_of_an_extension_is_refused(tiny_model_dir, tmp_path):
    _extended(tiny_model_dir, tmp_path / "ext")
    model, tok = load_causal_lm(tmp_path / "ext")
    with pytest.raises(DPAuditError, match="itself an extension"):
        save_extension(tmp_path / "ext2", tmp_path / "ext", model, tok, TOKENS)
