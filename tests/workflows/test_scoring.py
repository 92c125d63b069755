"""End to end on a tiny Hugging Face causal LM built from a config: canaries in, a few non-private
steps on the members, audit the saved checkpoint; plus the bad inputs of `audit checkpoint`."""

import json

import pytest
import torch

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit.canaries.generate import make_canaries
from dpaudit.canaries.hf import extend_model
from dpaudit.models.loading import load_causal_lm

M = 200


@pytest.fixture(scope="module")
def audit_setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    model, tok = load_causal_lm(tiny_model_dir)
    manifest = make_canaries(tok, M, seed=7)
    manifest.save(root / "canaries.json")
    extend_model(model, tok, manifest)
    model.save_pretrained(root / "untrained")
    tok.save_pretrained(root / "untrained")
    # A few non-private full-batch steps on the member canaries only.
    members = [c.text for c in manifest.members]
    batch = tok(members, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(15):
        opt.zero_grad()
        model(**batch, labels=labels).loss.backward()
        opt.step()
    model.save_pretrained(root / "trained")
    tok.save_pretrained(root / "trained")
    return root


def test_trained_members_are_separated_and_flagged(audit_setup):
    root = audit_setup
    out = dpaudit("audit", "checkpoint", "--model", root / "trained", "--canaries", root / "canaries.json",
                  "--claimed-eps", "0.5", "--delta", "1e-5", "--report", root / "report", "--json")
    assert out.returncode == 1, out.stderr  # a non-private model cannot be 0.5-DP: VIOLATION
    data = json.loads(out.stdout)
    assert data["auc"] > 0.95
    assert data["violation"] and data["verdict"].startswith("VIOLATION")
    assert data["epsilon_lower_bound"] > 0.5 and data["canaries"]["m"] == M
    assert data["score"]["name"] == "neg-loss" and data["headline"]["bound"] == "fdp-gdp"
    for name in ("report.json", "report.md", "roc.png", "scores.csv"):
        assert (root / "report" / name).stat().st_size > 0
    # The report folder says which delta, claimed eps and score: nothing needs repeating.
    again = dpaudit("audit", "scores", root / "report" / "scores.csv", "--json")
    redone = json.loads(again.stdout)
    assert again.returncode == 1 and redone["auc"] == data["auc"] and redone["delta"] == 1e-5
    assert redone["epsilon_lower_bound"] == data["epsilon_lower_bound"] and redone["score"]["name"] == "neg-loss"
    calibrated = dpaudit("audit", "checkpoint", "--model", root / "trained", "--canaries", root / "canaries.json",
                         "--delta", "1e-5", "--score", "loss-vs-base", "--base", root / "untrained", "--json")
    assert json.loads(calibrated.stdout)["score"]["name"] == "loss-vs-base"
    assert json.loads(calibrated.stdout)["auc"] > 0.95


def test_delta_is_required_when_nothing_says_it(audit_setup):
    root = audit_setup
    out = dpaudit("audit", "checkpoint", "--model", root / "untrained", "--canaries", root / "canaries.json",
                  "--claimed-eps", "1")
    assert_one_line_error(out)
    assert "give --delta" in out.stderr


def test_untrained_model_is_at_chance(audit_setup):
    root = audit_setup
    out = dpaudit("audit", "checkpoint", "--model", root / "untrained", "--canaries", root / "canaries.json",
                  "--claimed-eps", "1", "--delta", "1e-5", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert abs(data["auc"] - 0.5) < 0.12
    assert data["verdict"] == "consistent with eps = 1"


def test_bad_inputs_exit_2_with_one_line(audit_setup, tiny_model_dir, tmp_path):
    root = audit_setup
    manifest = json.loads((root / "canaries.json").read_text())
    no_members = tmp_path / "no_members.json"
    no_members.write_text(json.dumps({**manifest, "canaries": [{**c, "member": False}
                                                                for c in manifest["canaries"]]}))
    from dpaudit.models.embedded import build_tokenizer
    other = tmp_path / "other.json"
    make_canaries(build_tokenizer(["other words entirely"] * 20, vocab_size=300), 10).save(other)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"garbage")
    trained = root / "trained"
    cases = [
        (trained, tmp_path / "missing.json", "not found"),
        (trained, other, "another tokenizer"),
        (tiny_model_dir, root / "canaries.json", "absent"),
        (trained, no_members, "member set is empty"),
        (broken, root / "canaries.json", "is not valid JSON"),
        (tmp_path / "nowhere", root / "canaries.json", "not found"),
    ]
    for model, canaries, message in cases:
        out = dpaudit("audit", "checkpoint", "--model", model, "--canaries", canaries, "--claimed-eps", "1",
                      "--delta", "1e-5")
        assert_one_line_error(out)
        assert message in out.stderr, (model, canaries, out.stderr)
