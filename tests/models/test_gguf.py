"""A GGUF checkpoint (written here with gguf's writer: Llama layout, Q8_0) goes through the whole
workflow: canaries make -> extend -> insert -> train (2 steps, LoRA with the canary rows) -> audit;
converted once to a plain folder beside the file, reused after; a broken file is named in one line."""

import json

import pytest
import torch

from cli_helpers import assert_one_line_error, dpaudit
from gguf_writer import write_llama_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_model(llama_like_dir, tmp_path_factory):
    from dpaudit.models.loading import load_causal_lm

    model, tok = load_causal_lm(llama_like_dir)
    return write_llama_gguf(model, tok, tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf"), model, tok


def test_gguf_loads_as_the_model_it_was_written_from(gguf_model):
    from dpaudit.models.loading import load_causal_lm

    path, model, tok = gguf_model
    loaded, loaded_tok = load_causal_lm(path)
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert torch.equal(loaded_tok(text, return_tensors="pt")["input_ids"], ids)
    with torch.no_grad():
        a, b = model(ids).logits, loaded(ids).logits
    assert float((a - b).abs().max()) < 0.05 * float(a.abs().max())  # Q8_0 rounding only
    assert (path.parent / (path.name + ".hf") / "dpaudit_gguf.json").is_file()


def test_gguf_workflow_end_to_end(gguf_model, tmp_path):
    path, _, _ = gguf_model
    out = dpaudit("canaries", "make", "-t", path, "-o", tmp_path / "c.json", "-m", "20", "--prefix-length", "3")
    assert out.returncode == 0, out.stderr
    out = dpaudit("canaries", "extend", "--model", path, "-c", tmp_path / "c.json", "-o", tmp_path / "ext")
    assert out.returncode == 0, out.stderr
    assert "converting" not in out.stderr  # the folder made by `make` is reused
    (tmp_path / "d.txt").write_text("".join(f"plain sentence number {i} about bread\n" for i in range(30)))
    out = dpaudit("canaries", "insert", "-c", tmp_path / "c.json", "-d", tmp_path / "d.txt", "-o", tmp_path / "t.txt")
    assert out.returncode == 0, out.stderr
    out = dpaudit("train", "--model", tmp_path / "ext", "-d", tmp_path / "t.txt", "-o", tmp_path / "run",
                  "--method", "dp-sgd", "--eps", "8", "--steps", "2", "-B", "8", "--trainable", "lora",
                  "--secret-seed", "0", "--json")
    assert out.returncode == 0, out.stderr
    out = dpaudit("audit", "checkpoint", "--model", tmp_path / "run" / "model", "-c", tmp_path / "c.json", "--json")
    # Two LoRA steps at eps 8 on 20 canaries (seeded batches, noise and canaries): the audit must read consistent
    # (exit 0), its bound below the claim, the claim the run's own ledger, and an AUC within 3 null sd of 1/2.
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    ledger = json.loads((tmp_path / "run" / "privacy_ledger.json").read_text())
    assert report["claimed_epsilon"] == pytest.approx(ledger["epsilon_total"])
    assert not report["violation"] and report["epsilon_lower_bound"] < report["claimed_epsilon"]
    assert 0.1 <= report["auc"] <= 0.9


def test_a_broken_gguf_is_named_in_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    out = dpaudit("canaries", "make", "-t", bad, "-o", tmp_path / "c.json")
    assert_one_line_error(out)
    assert "broken.gguf" in out.stderr


def test_hub_cache_folder_resolves_to_its_main_snapshot(tiny_model_dir, tmp_path):
    import shutil

    from dpaudit.models.hf import resolve_model_path
    from dpaudit.models.loading import load_causal_lm

    hub = tmp_path / "models--org--tiny"
    shutil.copytree(tiny_model_dir, hub / "snapshots" / "abc123")
    (hub / "snapshots" / "old999").mkdir()
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("abc123\n")
    assert resolve_model_path(hub) == hub / "snapshots" / "abc123"
    model, _ = load_causal_lm(hub)
    assert sum(p.numel() for p in model.parameters()) > 0
    (hub / "refs" / "main").unlink()
    out = dpaudit("canaries", "make", "-t", hub, "-o", tmp_path / "c.json")
    assert_one_line_error(out)
    assert "2 snapshots" in out.stderr


def test_model_convert_writes_a_plain_folder_a_trainer_can_load(gguf_model, tmp_path):
    """Issue 53, item 18: `dpaudit model convert X.gguf -o DIR` (save_pretrained refuses a GGUF-loaded model, and
    running `canaries make` for its conversion was the only route)."""
    from dpaudit.models.loading import load_causal_lm

    path, model, _ = gguf_model
    out = dpaudit("model", "convert", path, "-o", tmp_path / "plain", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["output"] == str(tmp_path / "plain")
    assert (tmp_path / "plain" / "config.json").is_file() and any((tmp_path / "plain").glob("*.safetensors"))
    loaded, _ = load_causal_lm(tmp_path / "plain")
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())
    again = dpaudit("model", "convert", path, "-o", tmp_path / "plain")
    assert again.returncode == 2 and "not empty" in again.stderr          # never overwritten silently
    assert_one_line_error(dpaudit("model", "convert", tmp_path / "plain", "-o", tmp_path / "x"))  # not a GGUF


def test_model_embedded_writes_the_embedded_default(tmp_path):
    from dpaudit.models.embedded import is_embedded

    out = dpaudit("model", "embedded", "-o", tmp_path / "m")
    assert out.returncode == 0, out.stderr
    assert is_embedded(tmp_path / "m")


@pytest.mark.parametrize("quant, dtype", [("F16", torch.float16), ("Q8_0", torch.float32)])
def test_a_converted_gguf_keeps_its_own_precision_where_transformers_loads_it(llama_like_dir, tmp_path, quant, dtype):
    """An F16 GGUF was written as fp32 (twice its size); a quantized one stays fp32 (its dequantized values need it).
    dpaudit loads an fp16 folder in fp32 (training takes no loss scaling)."""
    from safetensors import safe_open

    from dpaudit.models.gguf import convert_to, stored_precision
    from dpaudit.models.loading import load_causal_lm

    model, tok = load_causal_lm(llama_like_dir)
    path = write_llama_gguf(model, tok, tmp_path / f"tiny-{quant}.gguf", quant=quant)
    assert stored_precision(path)[0] == dtype
    folder = convert_to(path, tmp_path / "plain")
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as fh:
        weights = {fh.get_tensor(k).dtype for k in fh.keys() if fh.get_tensor(k).ndim == 2}
    assert weights == {dtype}
    loaded, _ = load_causal_lm(folder)
    assert next(loaded.parameters()).dtype == torch.float32
