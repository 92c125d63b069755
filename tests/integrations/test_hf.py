"""The Hugging Face callback (issue 38) on real trainers: transformers.Trainer full fine-tune, PEFT LoRA with frozen
embeddings (new-token canaries refused, existing ones pass), TRL's SFTTrainer with completion-only loss, and a
Trainer whose optimizer is an Opacus DPOptimizer. Tiny models built here; nothing is downloaded."""

import json
import stat

import pytest

from dpaudit.core.errors import DPAuditError

TEXTS = [f"Record {i}: the weather in town {i % 37} was mild and the market sold {i % 11} kinds of bread."
         for i in range(400)]


def _model(tiny_model_dir):
    from dpaudit.models.loading import load_causal_lm

    return load_causal_lm(tiny_model_dir)


def _tokenised(tokenizer, rows, field="text"):
    return [dict(tokenizer(r[field], truncation=True, max_length=64)) for r in rows]


def _trainer(model, tokenizer, data, tmp_path, callback, **args):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    settings = dict(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=16, num_train_epochs=3,
                    learning_rate=3e-3, logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True,
                    disable_tqdm=True, seed=0)
    settings.update(args)
    return Trainer(model=model, args=TrainingArguments(**settings), train_dataset=data,
                   data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), callbacks=[callback])


def test_a_full_fine_tune_is_audited_in_the_trainer(tiny_model_dir, tmp_path):
    from dpaudit.integrations.hf import DPAuditCallback

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=40, repeats=4, canary_budget=0.25,
                                          out=tmp_path / "audit", claimed_eps=1.0, delta=1e-5, secret_seed=3)
    members = sum(c.member for c in audit.manifest.canaries)
    assert len(rows) == len(TEXTS) + 4 * members
    manifest = tmp_path / "audit" / "canaries.json"
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    _trainer(model, tok, _tokenised(tok, rows), tmp_path, audit).train()
    report = json.loads((tmp_path / "audit" / "report" / "report.json").read_text())
    assert (tmp_path / "audit" / "report" / "report.md").is_file()
    # Non-private training on members repeated 4 times: the audit sees it, and refutes a claim of eps = 1.
    assert report["auc"] > 0.9 and report["violation"] and report["verdict"].startswith("VIOLATION")
    assert report["context"]["headline score"] == "neg-loss"  # a full fine-tune has no base at hand
    steps, _, planned = report["context"]["steps run"].partition(" of ")
    assert steps == planned and int(steps) > 0
    assert report["context"]["verdict from"].startswith("black-box")
    assert set(report["tpr_at_fpr"]) >= {"0.01", "0.001"} and "tpr_interval" in report


def test_lora_freezes_new_token_rows_so_new_token_canaries_are_refused_and_existing_ones_train(tiny_model_dir,
                                                                                               tmp_path):
    from peft import LoraConfig, get_peft_model

    from dpaudit.canaries.hf import extend_model
    from dpaudit.integrations.hf import DPAuditCallback

    config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, out=tmp_path / "new",
                                          kind="new-token", claimed_eps=1.0, delta=1e-5, secret_seed=1)
    extend_model(model, tok, audit.manifest)
    trainer = _trainer(get_peft_model(model, config), tok, _tokenised(tok, rows), tmp_path, audit, num_train_epochs=1)
    with pytest.raises(DPAuditError, match="frozen.*trainable_token_indices"):
        trainer.train()

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=40, repeats=4, canary_budget=0.25,
                                          out=tmp_path / "existing", claimed_eps=1.0, delta=1e-5, secret_seed=1)
    _trainer(get_peft_model(model, config), tok, _tokenised(tok, rows), tmp_path, audit, learning_rate=1e-2,
             num_train_epochs=6).train()
    report = json.loads((tmp_path / "existing" / "report" / "report.json").read_text())
    assert report["context"]["headline score"] == "loss-vs-base"  # disable_adapter() on the unmerged LoRA
    assert report["auc"] > 0.75


def test_the_preflight_refuses_members_the_trainer_never_sees_and_secrets_cut_by_truncation(tiny_model_dir,
                                                                                             tmp_path):
    from dpaudit.integrations.hf import DPAuditCallback

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, out=tmp_path / "a",
                                          claimed_eps=1.0, delta=1e-5, secret_seed=2)
    plain = _tokenised(tok, [{"text": t} for t in TEXTS])  # the original data, not prepare()'s
    with pytest.raises(DPAuditError, match="none of the inserted member canaries"):
        _trainer(model, tok, plain, tmp_path, audit, num_train_epochs=1).train()
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, out=tmp_path / "b",
                                          claimed_eps=1.0, delta=1e-5, secret_seed=2)
    short = [dict(tok(r["text"], truncation=True, max_length=10)) for r in rows]  # prefix 8 + secret 6 tokens > 10
    with pytest.raises(DPAuditError, match="cut by truncation"):
        _trainer(model, tok, short, tmp_path, audit, num_train_epochs=1).train()
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, out=tmp_path / "c",
                                          claimed_eps=1.0, delta=1e-5, secret_seed=2, preflight="warn")
    _trainer(model, tok, short, tmp_path, audit, num_train_epochs=1, max_steps=2).train()
    report = json.loads((tmp_path / "c" / "report" / "report.json").read_text())
    assert "cut by truncation" in report["context"]["preflight warning 1"]
    assert report["context"]["steps run"] == "2 of 2"


def test_bad_input_is_one_line(tiny_model_dir, tmp_path):
    from dpaudit.integrations.hf import DPAuditCallback

    _, tok = _model(tiny_model_dir)
    rows = [{"text": t} for t in TEXTS]
    with pytest.raises(DPAuditError, match="found body, id"):
        DPAuditCallback.prepare(tok, [{"body": "x", "id": 1}], m=4, out=tmp_path / "x", delta=1e-5)
    with pytest.raises(DPAuditError, match="canary budget of 5% .* use m <= 40"):
        DPAuditCallback.prepare(tok, rows, m=1000, out=tmp_path / "y", delta=1e-5)
    with pytest.raises(DPAuditError, match="give the delta"):
        DPAuditCallback.prepare(tok, rows, m=10, out=tmp_path / "z")
    with pytest.raises(DPAuditError, match="already tokenised"):
        DPAuditCallback.prepare(tok, _tokenised(tok, rows[:50]), m=2, out=tmp_path / "w", delta=1e-5)
    with pytest.raises(DPAuditError, match="ordinary tokens .* need at least 256"):
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models

        tiny = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2},
                                                                                   unk_token="[UNK]")))
        DPAuditCallback.prepare(tiny, rows, m=10, out=tmp_path / "v", delta=1e-5)
