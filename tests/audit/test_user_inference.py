"""Black-box canary users: r records that share one secret behind distinct prefixes, h held-out records never
inserted, and the user-inference score (Kandpal et al. 2023: each user's held-out records, model against the
reference) beside the per-record one, each at alpha / 2 so that reporting the larger bound stays valid."""

import json

import numpy as np
import pytest

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit.canaries.generate import make_canaries
from dpaudit.canaries.insert import insert_canaries
from dpaudit.canaries.manifest import CANARY_USER, load_manifest
from dpaudit.core.errors import DPAuditError


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from dpaudit.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_canary_users_share_a_secret_behind_distinct_prefixes_and_keep_the_first_record(tokenizer, tmp_path):
    one = make_canaries(tokenizer, 6, seed=3, membership_seed=1)
    users = make_canaries(tokenizer, 6, seed=3, membership_seed=1, records=3, held_out=2)
    for a, b in zip(one.canaries, users.canaries):
        assert (a.text, a.member) == (b.text, b.member)   # the first record does not depend on the user's size
        assert len(b.others) == 2 and len(b.held_out) == 2
        assert len({b.prefix, *b.others, *b.held_out}) == 5 and all(t.endswith(b.secret) for t in b.texts)
    users.save(tmp_path / "m.json")
    assert load_manifest(tmp_path / "m.json") == users


def test_a_members_records_go_in_with_its_user_id_and_held_out_records_never(tokenizer, tmp_path):
    manifest = make_canaries(tokenizer, 8, seed=0, membership_seed=2, records=3, held_out=2)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"note {i}", "user": f"u{i % 3}"}) + "\n" for i in range(9)))
    insert_canaries(manifest, data, tmp_path / "out.jsonl", user_field="user")
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    inserted = [r for r in rows if r["user"].startswith("dpaudit-canary-")]
    assert len(inserted) == 3 * len(manifest.members)
    for c in manifest.members:
        assert sorted(r["text"] for r in inserted if r["user"] == CANARY_USER.format(c.index)) == sorted(c.texts)
    texts = {r["text"] for r in rows}
    assert not any(p + c.secret in texts for c in manifest.canaries for p in c.held_out)
    assert not any(c.text in texts for c in manifest.canaries if not c.member)
    # a dataset that already holds a canary user's id is refused: the canary would not be one user
    data.write_text(json.dumps({"text": "x", "user": "dpaudit-canary-0"}) + "\n")
    with pytest.raises(DPAuditError, match="canary user"):
        insert_canaries(manifest, data, tmp_path / "again.jsonl", user_field="user")


def test_user_inference_reads_zero_on_the_reference_itself(tiny_model_dir, tokenizer, tmp_path):
    from dpaudit.canaries.hf import extend_model
    from dpaudit.core.atomic import save_model_folder
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.workflows.scoring import score_checkpoint

    manifest = make_canaries(tokenizer, 5, seed=0, membership_seed=0, records=2, held_out=3)
    lm, tok = load_causal_lm(tiny_model_dir)
    extend_model(lm, tok, manifest)
    save_model_folder(tmp_path / "ext", lm, tok)
    scores, members = score_checkpoint(tmp_path / "ext", manifest, score="user-inference", base=tmp_path / "ext",
                                       show_progress=False)
    assert scores.shape == (5,) and np.all(scores == 0)


def test_a_non_private_run_separates_canary_users_by_user_inference(tmp_path):
    # 200 canary users: at 40 the bound at alpha/2 needs near-perfect separation, and one membership draw of five
    # read 0 (measured over seeds 1-3 and T 3, 10); at 200 every seed tried separated them perfectly (AUC 1, 3.68)
    out = dpaudit("audit", "run", "--method", "dp-sgd", "--eps", "inf", "--repeat", "2", "--held-out", "2",
                  "--canaries", "200", "--examples", "100", "-T", "3", "--secret-seed", "1", "--out", tmp_path / "run",
                  "--json", "--threads", "1")
    assert out.returncode == 0, out.stderr[-800:]
    context = json.loads(out.stdout)["context"]
    assert context["user-inference bound (alpha/2)"] > 2   # held-out records, never trained, give users away
    assert "each at alpha/2" in context["bound reported"]


def test_the_larger_of_two_bounds_each_at_half_alpha_stays_valid_under_the_null():
    """No signal (scores independent of membership): the reported bound, the larger of two at alpha / 2, is above
    the true eps of 0 in at most alpha of the trials (binomial slack)."""
    from dpaudit.audit.analysis import analyse

    rng, trials, above = np.random.default_rng(5), 150, 0
    for _ in range(trials):
        members = rng.random(200) < 0.5
        bounds = [analyse(rng.normal(size=200), members, delta=1e-5, alpha=0.025, score=s).epsilon_lower_bound
                  for s in ("neg-loss", "user-inference")]
        above += max(bounds) > 0
    assert above <= 0.05 * trials + 3 * np.sqrt(0.05 * 0.95 * trials)


@pytest.mark.parametrize("flags, words", [
    (("--white-box", "--held-out", "2"), "--held-out is for black-box"),
    (("--held-out", "70", "--repeat", "1"), "canary user holds"),
])
def test_canary_users_the_audit_cannot_make_are_refused(tmp_path, flags, words):
    out = dpaudit("audit", "run", "--method", "dp-sgd", "--eps", "inf", "--canaries", "8", "--examples", "20",
                  "-T", "1", "--out", tmp_path / "run", "--threads", "1", *flags)
    assert_one_line_error(out)
    assert words in out.stderr
