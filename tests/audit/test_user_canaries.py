"""User-level white-box audits: canary users of r records (each record sampled and clipped as an example), a
user-level claim that covers them, and the classic overclaim (a user-level run accounted one record at a time)
caught as a VIOLATION."""

import numpy as np
import pytest

from dpaudit.audit.whitebox import audit_run_folder, transcript_scores
from dpaudit.audit.whitebox_canaries import WhiteBoxCanaries
from dpaudit.core.errors import DPAuditError
from dpaudit.models.corpus import sentences
from dpaudit.training.runner import TrainConfig, train

TEXTS = sentences(16, seed=3)
USER = dict(method="dp-sgd", target_epsilon=4.0, steps=40, white_box=300, batch_size=0, secret_seed=5,
            unit="user", records_per_user=4, canary_records=4)


def _audited(tmp_path, tiny_model_dir, name, **kw):
    cfg = TrainConfig(**{**USER, **kw})
    result = train(tiny_model_dir, TEXTS, tmp_path / name, cfg, show_progress=False)
    audit, *_ = audit_run_folder(tmp_path / name, claimed_epsilon=result.epsilon, delta=cfg.delta)
    return result, audit


def test_canary_users_add_their_records_and_a_user_level_claim_holds(tmp_path, tiny_model_dir):
    result, audit = _audited(tmp_path, tiny_model_dir, "ok")
    stats, members, _, _ = transcript_scores(tmp_path / "ok")
    # full batches: a member user adds its 4 records, +4 C a step
    gap = stats["alignment"][members].mean() - stats["alignment"][~members].mean()
    assert gap == pytest.approx(4 * 40, rel=0.35)
    assert result.epsilon <= 4.0 and not audit.violation


def test_the_example_level_claim_of_a_user_level_run_reads_violation(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("DPAUDIT_ALLOW_BUGS", "1")
    result, audit = _audited(tmp_path, tiny_model_dir, "bug", plant_bug="example-level-claim")
    assert result.epsilon <= 4.0 and audit.violation and audit.epsilon_lower_bound > 4.0


def test_canary_users_are_saved_and_read_back(tmp_path):
    canaries = WhiteBoxCanaries.make(8, seed=1, membership_seed=2, records=3)
    assert list(canaries.member_records) == [i for i in canaries.member_ids for _ in range(3)]
    canaries.save(tmp_path)
    again = WhiteBoxCanaries.load(tmp_path)
    assert again.records == 3 and np.array_equal(again.members, canaries.members)


@pytest.mark.parametrize("kw, message", [
    (dict(canary_records=5), "over the run's cap"),
    (dict(canary_records=2, white_box=0), "--canary-records"),
    (dict(unit="example", records_per_user=None, canary_records=1, plant_bug="example-level-claim"),
     "user-level run"),
])
def test_canary_users_the_claim_cannot_cover_are_refused(kw, message, monkeypatch):
    monkeypatch.setenv("DPAUDIT_ALLOW_BUGS", "1")
    with pytest.raises(DPAuditError, match=message):
        TrainConfig(**{**USER, **kw})
