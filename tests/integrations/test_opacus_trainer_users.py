"""User-level DP in the Hugging Face Trainer (``opacus_trainer(user_column=...)``): the user column read and dropped
before the collator, each user capped at k by the rule `dpaudit train` uses, ELS accounted per user by dpaudit's
PLD (Opacus' accountants count one row, and are refused for it), ULS sampling whole users at q and clipping each
user's mean gradient as one."""

import pytest
import torch

from dpaudit.core.errors import DPAuditError

TEXTS = [f"Member {u} wrote note {j} about the maps of town {u % 7}." for u in range(30) for j in range(5)]
USERS = [f"id{u}" for u in range(30) for _ in range(5)]


def _trainer(tiny_model_dir, tmp_path, **kw):
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from dpaudit.integrations.hf import opacus_trainer
    from dpaudit.models.loading import load_causal_lm

    model, tok = load_causal_lm(tiny_model_dir)
    rows = [{**dict(tok(t, truncation=True, max_length=32)), "owner": u} for t, u in zip(TEXTS, USERS)]
    args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=12, max_steps=3,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0, logging_steps=1000)
    return opacus_trainer(model=model, args=args, train_dataset=rows,
                          data_collator=DataCollatorForLanguageModeling(tok, mlm=False), noise_multiplier=1.0,
                          max_grad_norm=1.0, noise_seed=3, user_column="owner", records_per_user=3, **kw)


@pytest.mark.parametrize("sampling", ["els", "uls"])
def test_a_user_level_trainer_caps_users_and_accounts_them(tiny_model_dir, tmp_path, sampling):
    from dpaudit.accounting.mechanism import Mechanism
    from dpaudit.accounting.registry import epsilon
    from dpaudit.accounting.unit import Unit

    trainer = _trainer(tiny_model_dir, tmp_path, user_sampling=sampling)
    rows = trainer.train_dataset
    assert len(rows) == 90 and rows.users == 30 and int(torch.bincount(rows.owners).max()) == 3
    trainer.train()
    rate = trainer.sample_rate_accounted
    expected = epsilon(Mechanism("gaussian", 1.0, rate, 3, unit=Unit("user", 3, "example" if sampling == "els"
                                                                      else "user")), 1e-5).epsilon
    assert trainer.accountant.get_epsilon(1e-5) == pytest.approx(expected, rel=1e-6)
    if sampling == "uls":
        assert trainer.dp_optimizer.clips_per_user() and trainer.dp_settings["mode"] == "ghost"
        assert trainer.dp_optimizer.expected_batch_size == pytest.approx(rate * 30)


def test_uls_batches_hold_whole_users_with_their_index():
    from dpaudit.integrations.hf_opacus import UserPoissonBatches

    owners = torch.tensor([0, 1, 0, 2, 1, 0, 3])
    g = torch.Generator().manual_seed(0)
    sampler = UserPoissonBatches(owners, 0.5, g)
    for batch in sampler:
        users = owners[batch].tolist()
        assert sorted(batch) == sorted(i for i, o in enumerate(owners.tolist()) if o in set(users))
    assert sampler.sample_rate == 0.5 and len(sampler) == 2


def test_els_under_an_accountant_that_counts_one_row_and_rows_without_owners_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(DPAuditError, match="ELS"):
        _trainer(tiny_model_dir, tmp_path, accountant="prv")
    from dpaudit.integrations.hf_opacus import UserRows

    with pytest.raises(DPAuditError, match="no user column"):
        UserRows([{"input_ids": [1, 2]}], "owner", 2, 0)


@pytest.mark.parametrize("sampling", ["els", "uls"])
def test_the_callback_inserts_canary_users_and_holds_them_to_the_user_level_claim(tiny_model_dir, tmp_path, sampling):
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from dpaudit.canaries.manifest import CANARY_USER
    from dpaudit.integrations.hf import DPAuditCallback, opacus_trainer
    from dpaudit.models.loading import load_causal_lm

    model, tok = load_causal_lm(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t, "owner": u} for t, u in zip(TEXTS, USERS)], m=20,
                                          repeats=2, out=tmp_path / "a", delta=1e-5, secret_seed=4,
                                          user_column="owner", records_per_user=3,
                                          canary_budget=0.2)
    inserted = [r for r in rows if r["owner"].startswith(CANARY_USER.format(""))]
    assert len(inserted) == 2 * len(audit.manifest.members)
    assert all(r["owner"] == CANARY_USER.format(c.index) for c in audit.manifest.members
               for r in inserted if r["text"].endswith(c.secret))
    tokenised = [{**dict(tok(r["text"], truncation=True, max_length=64)), "owner": r["owner"]} for r in rows]
    args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=12, max_steps=3,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0, logging_steps=1000)
    trainer = opacus_trainer(model=model, args=args, train_dataset=tokenised, callbacks=[audit],
                             data_collator=DataCollatorForLanguageModeling(tok, mlm=False), noise_multiplier=1.0,
                             max_grad_norm=1.0, noise_seed=3, user_column="owner", records_per_user=3,
                             user_sampling=sampling)
    trainer.train()
    # the white-box probe (its canaries at the loader's rate: ULS's users' q) read the user-level claim too
    assert audit.white_box is not None and audit.white_box.claimed_epsilon == pytest.approx(
        trainer.accountant.get_epsilon(1e-5))
    # canary users of 2 copies under a claim of 3 records a user: held to the claim itself, not group privacy
    assert [t.held_eps for t in audit.tiers] == [pytest.approx(trainer.accountant.get_epsilon(1e-5))]


def test_uls_in_the_trainer_clips_the_same_users_by_ghost_and_by_hooks(tiny_model_dir, tmp_path, monkeypatch):
    from dpaudit.training.dp_step import DPStep

    released = []
    monkeypatch.setattr(DPStep, "on_release", lambda self, reduced=False: released.append(
        torch.cat([p.grad.flatten().double() for p in self.params])))

    def first_release(mode):
        trainer = _trainer(tiny_model_dir, tmp_path / mode, user_sampling="uls", grad_sample_mode=mode)
        trainer.dp_settings["noise_multiplier"] = 0.0
        trainer.args.max_steps = 1
        trainer.train()
        return released.pop()

    ghost, hooks = first_release("ghost"), first_release("hooks")
    assert float(hooks.abs().max()) > 1e-5   # the same users drawn (the sampler's seed), a real gradient
    assert float((ghost - hooks).abs().max()) <= 1e-5 * float(hooks.abs().max())
