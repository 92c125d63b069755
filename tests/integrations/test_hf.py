"""The Hugging Face callback (issue 38) on real trainers: transformers.Trainer full fine-tune, PEFT LoRA with frozen
embeddings (new-token canaries refused, existing ones pass), TRL's SFTTrainer with completion-only loss, and a
Trainer whose optimizer is an Opacus DPOptimizer. Tiny models built here; nothing is downloaded."""

import json
import stat

import pytest
from cli_helpers import dpaudit

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
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=40, out=tmp_path / "audit", repeats=1,
                                          controls=0, claimed_eps=1.0, delta=1e-5, secret_seed=3, regurgitation=True)
    members = sum(c.member for c in audit.manifest.canaries)
    assert len(rows) == len(TEXTS) + members
    manifest = tmp_path / "audit" / "canaries.json"
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600
    trainer = _trainer(model, tok, _tokenised(tok, rows), tmp_path, audit, num_train_epochs=6)
    trainer.train()
    report = json.loads((tmp_path / "audit" / "report" / "report.json").read_text())
    assert (tmp_path / "audit" / "report" / "report.md").is_file()
    # What SCORE_LATER.txt tells a sharded run to do gives the same audit from the saved model.
    trainer.save_model(str(tmp_path / "saved"))
    tok.save_pretrained(tmp_path / "saved")
    out = dpaudit("audit", "checkpoint", "--model", tmp_path / "saved", "-c", manifest, "--claimed-eps", "1",
                  "--delta", "1e-5", "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["auc"] == pytest.approx(report["auc"], abs=1e-6)
    # Non-private training on the members: the audit sees it, and refutes a claim of eps = 1.
    assert report["auc"] > 0.9 and report["violation"] and report["verdict"].startswith("VIOLATION")
    assert report["context"]["headline score"] == "neg-loss"  # a full fine-tune has no base at hand
    steps, _, planned = report["context"]["steps run"].partition(" of ")
    assert steps == planned and int(steps) > 0
    assert report["context"]["verdict from"].startswith("black-box")
    regurgitated = report["context"]["regurgitation (greedy, exact secret)"]
    assert regurgitated.startswith("members ") and f"of {members}," in regurgitated
    assert set(report["tpr_at_fpr"]) >= {"0.01", "0.001"} and "tpr_interval" in report


def test_exposure_tiers_and_controls_by_default(tiny_model_dir, tmp_path):
    """The defaults: members in tiers of 1, 4 and 16 copies, each tier held to its own group claim, and 100
    never-inserted controls among the ROC's non-members (never in a bound, never in the data)."""
    from dpaudit.integrations.hf import DPAuditCallback

    model, tok = _model(tiny_model_dir)
    data = [{"text": t} for t in TEXTS[:120]]
    audit, rows = DPAuditCallback.prepare(tok, data, m=30, canary_budget=1.0, out=tmp_path / "audit",
                                          claimed_eps=1.0, delta=1e-6, secret_seed=6)
    copies = {1: 0, 4: 0, 16: 0}
    texts = [r["text"] for r in rows]
    for i, c in enumerate(audit.manifest.canaries):
        if c.member:
            assert texts.count(c.text) == [1, 4, 16][i % 3]
            copies[[1, 4, 16][i % 3]] += 1
    assert len(rows) == len(data) + copies[1] + 4 * copies[4] + 16 * copies[16]
    assert len(audit.controls.canaries) == 100 and not any(c.member for c in audit.controls.canaries)
    assert not any(c.text in texts for c in audit.controls.canaries)
    _trainer(model, tok, _tokenised(tok, rows), tmp_path, audit, num_train_epochs=2).train()
    report = json.loads((tmp_path / "audit" / "report" / "report.json").read_text())
    assert report["canaries"]["m"] == 30 and report["canaries"]["nonmembers"] == 30 - sum(copies.values())
    assert {"tier 1x", "tier 4x", "tier 16x"} <= set(report["context"])
    assert "group privacy of 4 examples: eps 4 x 1 = 4" in report["context"]["tier 4x"]
    assert "too weak" in report["context"]["tier 16x"]  # 16 e^15 1e-6 >= 1 / (10 canaries)
    assert report["verdict"].startswith(("VIOLATION", "consistent")) and "tiers tested: 1x" in report["verdict"] \
        or report["verdict"].startswith("VIOLATION (")
    md = (tmp_path / "audit" / "report" / "report.md").read_text()
    assert "never-inserted controls among the ROC's non-members: 100" in md
    assert report["auc"] > 0.9  # non-private training on members copied up to 16 times


def test_the_tiers_verdict_is_wrong_at_most_alpha_at_the_null_and_sees_a_leak():
    """Validity of the tier split (Bonferroni over the tested tiers): no training, every score from one law, 300
    audits, VIOLATION at most alpha of the time; a leak into the one-copy tier alone is a VIOLATION of that tier."""
    import numpy as np

    from dpaudit.integrations.hf import _Settings, audit_tiers, tiers_verdict

    settings = _Settings(m=600, kind="existing", row_format="text", text_field="text", repeats=[1, 4, 16],
                         claimed_eps=0.0, delta=1e-5, alpha=0.05, preflight="refuse", reference=None,
                         regurgitation=False, inserted_rows=0, dataset_rows=0)
    rng = np.random.default_rng(0)
    wrong = 0
    for _ in range(200):
        members = rng.random(600) < 0.5
        _, tiers = audit_tiers(rng.normal(size=600), members, "loss-vs-base", settings, 0.0, rng.normal(size=50))
        wrong += tiers_verdict(tiers, 0.0)[0]
    assert wrong <= 0.05 * 200 + 2 * np.sqrt(0.05 * 0.95 * 200)  # alpha, plus two standard errors of 200 draws
    members = rng.random(600) < 0.5
    scores = rng.normal(size=600) + 4.0 * members * (np.arange(600) % 3 == 0)
    _, tiers = audit_tiers(scores, members, "loss-vs-base", settings, 1.0)
    violation, verdict = tiers_verdict(tiers, 1.0)
    assert violation and verdict.startswith("VIOLATION (1x tier)")
    assert [t.held_eps for t in tiers] == [1.0, 4.0, None]  # 16 e^15 1e-5 >= 1/200: the 16x tier tests nothing


def test_lora_freezes_new_token_rows_so_new_token_canaries_are_refused_and_existing_ones_train(tiny_model_dir,
                                                                                               tmp_path):
    from peft import LoraConfig, get_peft_model

    from dpaudit.canaries.hf import extend_model
    from dpaudit.integrations.hf import DPAuditCallback

    config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "new",
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
    # each member inserted 4 times: held to group privacy of 4 examples, not to the one-example claim
    assert "inserted 4 times" in report["context"]["claim audited (black-box)"] and report["claimed_epsilon"] == 4.0


def test_new_token_canaries_behind_one_shared_prefix_train_beside_a_lora_in_an_opacus_trainer(tiny_model_dir,
                                                                                                 tmp_path):
    """audit.extend(model) after get_peft_model: the canaries share one prefix, their output rows start at the base's
    expected row after it, and their rows train beside the adapters under opacus_trainer's per-example clipping;
    the base score takes the rows back to their start (disable_adapter() alone would leave them trained)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from dpaudit.canaries.hf import expected_row
    from dpaudit.integrations.hf import DPAuditCallback, opacus_trainer
    from dpaudit.training.new_tokens import new_token_parameters

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=40, repeats=1, controls=0,
                                          kind="new-token", out=tmp_path / "audit", claimed_eps=1.0, delta=1e-5,
                                          secret_seed=5, white_box_m=0)
    prefixes = {c.prefix for c in audit.manifest.canaries}
    assert len(prefixes) == 1 and audit.manifest.prefix_kind == "template"
    start = expected_row(model, tok, prefixes.pop())
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    ids = audit.extend(model)
    head = model.get_output_embeddings().base.weight
    assert torch.allclose(head[ids], start.expand(len(ids), -1), atol=1e-6)  # each row at the expected row
    (rows_param,) = new_token_parameters(model)  # the tiny model is tied: one parameter, two uses
    assert rows_param.requires_grad and not rows_param.any()
    # SGD: without noise AdamW would scale every row's small shared gradient (each new token's probability at every
    # position of every example) up to a full step, members' and non-members' alike
    args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=32, max_steps=40,
                             learning_rate=1.0, optim="sgd", save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, logging_steps=1000)
    opacus_trainer(model=model, args=args, train_dataset=_tokenised(tok, rows),
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[audit],
                   noise_multiplier=0.0, max_grad_norm=1.0).train()   # no noise: the members must show
    report = json.loads((tmp_path / "audit" / "report" / "report.json").read_text())
    assert report["context"]["headline score"] == "loss-vs-base"
    assert "one shared prefix" in report["context"]["canary prefix"]
    assert report["auc"] > 0.85  # members above non-members (at the null: 0.5, standard error 0.09 at m = 40)
    assert rows_param.any()  # trained, and put back after the base's losses were read at their start


def test_new_token_prefixes_are_shared_by_default_random_on_request_and_nothing_else(tiny_model_dir, tmp_path):
    from dpaudit.integrations.hf import DPAuditCallback

    _, tok = _model(tiny_model_dir)
    data = [{"text": t} for t in TEXTS]
    shared, _ = DPAuditCallback.prepare(tok, data, m=20, repeats=1, kind="new-token", out=tmp_path / "s",
                                        claimed_eps=1.0, delta=1e-5)
    random, _ = DPAuditCallback.prepare(tok, data, m=20, repeats=1, kind="new-token", prefix="random",
                                        out=tmp_path / "r", claimed_eps=1.0, delta=1e-5)
    assert len({c.prefix for c in shared.manifest.canaries}) == 1
    assert len({c.prefix for c in random.manifest.canaries}) > 1 and random.manifest.prefix_kind == "random-tokens"
    with pytest.raises(DPAuditError, match="prefix must be one of shared, random"):
        DPAuditCallback.prepare(tok, data, m=20, kind="new-token", prefix="template", out=tmp_path / "x",
                                claimed_eps=1.0, delta=1e-5)
    with pytest.raises(DPAuditError, match="same m, kind, prefix"):   # a resumed run keeps its canaries' layout
        DPAuditCallback.prepare(tok, data, m=20, repeats=1, kind="new-token", prefix="random", out=tmp_path / "s",
                                claimed_eps=1.0, delta=1e-5)


def test_a_resumed_lora_run_gets_its_canary_rows_back_from_the_checkpoint(tiny_model_dir, tmp_path):
    """audit.extend(model) resized the embeddings, so the PEFT checkpoint holds them and the canaries' own rows beside
    the adapters (peft's save_embedding_layers), and a resumed run reads them back; rows restarted at zero would make
    the audit read less than the run leaked."""
    import torch
    from peft import LoraConfig, get_peft_model

    from dpaudit.integrations.hf import DPAuditCallback
    from dpaudit.training.new_tokens import new_token_parameters

    def attempt(**train):
        model, tok = _model(tiny_model_dir)
        audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=40, repeats=1, controls=0,
                                              kind="new-token", out=tmp_path / "audit", claimed_eps=1.0, delta=1e-5,
                                              secret_seed=6)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        audit.extend(model)
        _trainer(model, tok, _tokenised(tok, rows), tmp_path, audit, max_steps=4, save_strategy="steps",
                 save_steps=4).train(**train)
        return audit, new_token_parameters(model)[0].detach().clone()

    _, trained = attempt()
    assert trained.any()
    audit, resumed = attempt(resume_from_checkpoint=str(tmp_path / "hf-out" / "checkpoint-4"))  # no step left
    assert audit.resumed_at == 4 and torch.equal(resumed, trained)


def test_the_preflight_refuses_members_the_trainer_never_sees_and_secrets_cut_by_truncation(tiny_model_dir,
                                                                                             tmp_path):
    from dpaudit.integrations.hf import DPAuditCallback

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "a",
                                          claimed_eps=1.0, delta=1e-5, secret_seed=2)
    plain = _tokenised(tok, [{"text": t} for t in TEXTS])  # the original data, not prepare()'s
    with pytest.raises(DPAuditError, match="none of the inserted member canaries"):
        _trainer(model, tok, plain, tmp_path, audit, num_train_epochs=1).train()
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "b",
                                          claimed_eps=1.0, delta=1e-5, secret_seed=2)
    short = [dict(tok(r["text"], truncation=True, max_length=10)) for r in rows]  # prefix 8 + secret 32 tokens > 10
    with pytest.raises(DPAuditError, match="cut by truncation"):
        _trainer(model, tok, short, tmp_path, audit, num_train_epochs=1).train()
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "c",
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
    with pytest.raises(DPAuditError, match=r"canary budget of 5% .* use m <= 5, or repeats=1 \(single copies: m <= 40\)"):
        DPAuditCallback.prepare(tok, rows, m=1000, out=tmp_path / "y", delta=1e-5)
    with pytest.raises(DPAuditError, match=r"use m <= 40, or raise canary_budget="):   # repeats=1 already: not offered
        DPAuditCallback.prepare(tok, rows, m=1000, repeats=1, out=tmp_path / "y", delta=1e-5)
    with pytest.raises(DPAuditError, match=r"delta = 0.2 >= 1/m"):
        DPAuditCallback.prepare(tok, rows, m=10, repeats=1, out=tmp_path / "d", delta=0.2)
    with pytest.raises(DPAuditError, match="give the delta"):
        DPAuditCallback.prepare(tok, rows, m=10, out=tmp_path / "z")
    with pytest.raises(DPAuditError, match="already tokenised"):
        DPAuditCallback.prepare(tok, _tokenised(tok, rows[:50]), m=2, out=tmp_path / "w", delta=1e-5)
    with pytest.raises(DPAuditError, match="ordinary tokens .* need at least 256"):
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models

        tiny = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2},
                                                                                   unk_token="[UNK]")))
        DPAuditCallback.prepare(tiny, rows, m=10, repeats=1, out=tmp_path / "v", delta=1e-5)


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_an_opacus_trainer_is_audited_white_box_and_a_missing_noise_is_caught(tiny_model_dir, tmp_path, mode):
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from dpaudit.integrations.hf import DPAuditCallback, opacus_trainer

    def run(out, sigma, claimed):
        model, tok = _model(tiny_model_dir)
        audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=out,
                                              claimed_eps=claimed, delta=1e-5, secret_seed=4)
        args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=32, max_steps=12,
                                 learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0, logging_steps=1000)
        trainer = opacus_trainer(model=model, args=args, train_dataset=_tokenised(tok, rows),
                                 data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[audit],
                                 noise_multiplier=sigma, max_grad_norm=1.0, grad_sample_mode=mode, noise_seed=12)
        trainer.train()
        return audit, json.loads((out / "report" / "report.json").read_text())

    # One seeded run each way (with fresh noise the correct run reads VIOLATION up to alpha of the time, by design:
    # the bounds' validity at alpha is tested statistically in tests/audit; here: the plumbing and the broken run)
    audit, report = run(tmp_path / "dp", 1.0, None)
    assert audit.white_box is not None and "the white-box audit" in report["context"]["verdict from"]
    claimed = report["context"]["claimed eps"]
    assert 0 < claimed < 50 and "get_epsilon" in report["context"]["claimed eps from"]  # the accountant's eps
    from dpaudit.probes.probe import RUNNING

    # the planned run's final look (max_steps 12), made after the accountant counted the last step: its claim
    looks = [json.loads(line) for line in (tmp_path / "dp" / "white-box" / RUNNING).read_text().splitlines()]
    assert [(x["step"], x["final"], x["alpha"]) for x in looks] == [(12, True, 0.005)]  # the stop rule's 1 %
    assert looks[0]["claimed_epsilon"] == pytest.approx(claimed) and not looks[0]["violation"]
    assert not audit.white_box.violation and not report["violation"] and audit.exit_code == 0
    parts = report["verdict_bound"]["parts"]  # the headline is the larger bound when both are consistent
    assert report["epsilon_lower_bound"] == max(parts.values()) and set(parts) == {"black-box audit", "white-box audit"}
    audit, report = run(tmp_path / "broken", 0.0, 1.0)  # no noise, a claim of eps = 1: the white-box audit sees it
    assert audit.white_box.violation and report["verdict"].startswith("VIOLATION") and audit.exit_code == 1
    # the bound that decided the verdict is the headline, in report.json and report.md, and in the last line
    assert report["verdict_bound"]["from"] == "white-box audit"
    assert report["epsilon_lower_bound"] == pytest.approx(audit.white_box.epsilon_lower_bound)
    assert audit.white_box.epsilon_lower_bound > 1
    md = (tmp_path / "broken" / "report" / "report.md").read_text()
    assert f"**Headline eps lower bound:** {audit.white_box.epsilon_lower_bound:.4f}, from the white-box audit" in md
    assert "from the white-box audit" in audit.verdict


def test_a_broken_opacus_trainer_run_is_stopped_at_the_first_look_that_reads_violation(tiny_model_dir, tmp_path):
    """The callback's probe is watched (on_violation="stop" by default): no noise at a claim of eps = 1 is stopped
    at the look at step 16 of 60, with the look's report and the end-of-run audit written."""
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from dpaudit.integrations.hf import DPAuditCallback, opacus_trainer
    from dpaudit.probes.probe import RUNNING

    model, tok = _model(tiny_model_dir)
    out = tmp_path / "broken"
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=out,
                                          claimed_eps=1.0, delta=1e-5, secret_seed=4)
    args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=32, max_steps=60,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, logging_steps=1000)
    trainer = opacus_trainer(model=model, args=args, train_dataset=_tokenised(tok, rows),
                             data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[audit],
                             noise_multiplier=0.0, max_grad_norm=1.0)
    trainer.train()
    assert trainer.state.global_step <= 17 and audit.probe.alarm is not None
    looks = [json.loads(line) for line in (out / "white-box" / RUNNING).read_text().splitlines()]
    assert looks[0]["step"] == 16 and looks[0]["violation"]
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["verdict"].startswith("VIOLATION") and "stopped early" in report["context"]["steps run"]


def test_masked_secret_labels_are_refused(tiny_model_dir, tmp_path):
    from transformers import DataCollatorForLanguageModeling

    from dpaudit.integrations.hf import DPAuditCallback

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "a",
                                          claimed_eps=1.0, delta=1e-5, secret_seed=2)
    lm = DataCollatorForLanguageModeling(tok, mlm=False)

    def last_tokens_only(rows):  # what a completion-only loss does to a row whose secret sits in the prompt
        batch = lm(rows)
        batch["labels"][:, :-2] = -100
        return batch

    trainer = _trainer(model, tok, _tokenised(tok, rows), tmp_path, audit, num_train_epochs=1)
    trainer.data_collator = last_tokens_only
    with pytest.raises(DPAuditError, match="labels masked"):
        trainer.train()


def test_trl_sft_trainer_with_completion_only_loss(tiny_model_dir, tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from dpaudit.integrations.hf import DPAuditCallback

    model, tok = _model(tiny_model_dir)
    data = [{"prompt": f"Question {i}: what was the weather in town {i % 37}?", "completion": " It was mild."}
            for i in range(400)]
    audit, ds = DPAuditCallback.prepare(tok, Dataset.from_list(data), m=40, repeats=4, canary_budget=0.25,
                                        out=tmp_path / "audit", claimed_eps=1.0, delta=1e-5, secret_seed=5)
    assert isinstance(ds, Dataset) and audit.settings.row_format == "prompt-completion"
    config = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_length=64, completion_only_loss=True,
                           per_device_train_batch_size=16, num_train_epochs=3, learning_rate=3e-3, report_to=[],
                           save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1000, seed=0)
    trl.SFTTrainer(model=model, args=config, train_dataset=ds, processing_class=tok, callbacks=[audit]).train()
    report = json.loads((tmp_path / "audit" / "report" / "report.json").read_text())
    assert report["auc"] > 0.9  # completion-only loss trains the secret: it is seen
    assert report["violation"] == (report["epsilon_lower_bound"] > report["claimed_epsilon"] == 4.0)  # 4 copies: group


def test_a_resumed_trainer_keeps_its_canaries_and_the_audit_covers_the_whole_run(tiny_model_dir, tmp_path):
    from dpaudit.integrations.hf import DPAuditCallback

    def prepare():
        return DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "audit",
                                       claimed_eps=1.0, delta=1e-5)  # membership from OS entropy

    model, tok = _model(tiny_model_dir)
    audit, rows = prepare()
    first = (tmp_path / "audit" / "canaries.json").read_bytes()
    _trainer(model, tok, _tokenised(tok, rows), tmp_path, audit, max_steps=6, save_strategy="steps",
             save_steps=3).train()
    model, tok = _model(tiny_model_dir)
    again, rows_again = prepare()  # the same folder: the same canaries and membership, inserted the same way
    assert (tmp_path / "audit" / "canaries.json").read_bytes() == first and rows_again == rows
    _trainer(model, tok, _tokenised(tok, rows_again), tmp_path, again, max_steps=6, save_strategy="steps",
             save_steps=3).train(resume_from_checkpoint=str(tmp_path / "hf-out" / "checkpoint-3"))
    report = json.loads((tmp_path / "audit" / "report" / "report.json").read_text())
    assert report["context"]["resumed at step"] == 3 and report["context"]["steps run"] == "6 of 6"
    with pytest.raises(DPAuditError, match="same m, kind"):
        DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=10, repeats=1, out=tmp_path / "audit",
                                delta=1e-5)


def test_sharded_training_leaves_the_scoring_to_the_saved_checkpoint(tmp_path):
    from types import SimpleNamespace

    from dpaudit.integrations.hf import _score_later, _sharded

    assert _sharded(SimpleNamespace(fsdp="full_shard", deepspeed=None))
    assert _sharded(SimpleNamespace(fsdp="", deepspeed={"zero_optimization": {"stage": 3}}))
    assert not _sharded(SimpleNamespace(fsdp="", deepspeed={"zero_optimization": {"stage": 2}}))
    assert not _sharded(SimpleNamespace(fsdp="", deepspeed=None))
    text = _score_later(SimpleNamespace(output_dir="out"), tmp_path, [1])
    assert "dpaudit audit checkpoint --model out -c" in text and "--repeat" not in text
    tiers = _score_later(SimpleNamespace(output_dir="out"), tmp_path, [1, 4, 16])
    assert "--repeat 16 --report" in tiers and "group claim of the most copies" in tiers


class _Loader:
    """What the pre-flight reads of a Trainer's data loader: its dataset, collator and batch size."""

    def __init__(self, dataset, collate_fn, batch_size):
        self.dataset, self.collate_fn, self.batch_size = dataset, collate_fn, batch_size


def test_the_preflight_sees_what_depends_on_the_batch_or_on_edits_after_prepare(tiny_model_dir, tmp_path):
    """Issue 53, item 4: a collator that caps each batch's tokens cut every secret in training while each member
    collated alone passed; the dataset concatenated after prepare() (3k copies of a tier-k member) or
    de-duplicated (the 4x and 16x tiers collapse) passed silently."""
    from transformers import DataCollatorForLanguageModeling

    from dpaudit.integrations.hf import DPAuditCallback
    from dpaudit.integrations.hf_preflight import preflight_problems

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS * 6], m=12, out=tmp_path / "a",
                                          claimed_eps=1.0, delta=1e-5, secret_seed=2)
    data = _tokenised(tok, rows)
    plain = DataCollatorForLanguageModeling(tok, mlm=False)

    def check(dataset, collate=plain, batch=16):
        return preflight_problems(model, tok, audit.manifest, audit.settings, _Loader(dataset, collate, batch))

    assert check(data) == []

    def capped(features):   # at most 384 tokens a batch: 24 a row at batch 16
        width = max(1, 384 // len(features))
        return plain([{k: v[:width] for k, v in f.items()} for f in features])

    problems = check(data, capped)
    assert len(problems) == 1 and "when collated in a batch of 16" in problems[0]
    assert check(data, capped, batch=1) == []      # alone, the secrets fit: the batch is what cuts them
    tripled = check(data * 3)
    assert len(tripled) == 1 and "more often than prepare() put them" in tripled[0]
    unique = list({tuple(r["input_ids"]): r for r in data}.values())
    deduplicated = check(unique)
    assert len(deduplicated) == 1 and "fewer times than prepare() put them" in deduplicated[0]


def test_an_opacus_trainer_resumed_twice_claims_every_step_every_attempt_released(tiny_model_dir, tmp_path):
    """Killed after step 7 (checkpoint 6), resumed from 6 and killed after step 11 (checkpoint 9), resumed from 6
    again to the end (12): the accountant's claim is a fresh accountant's eps over the 7 + 5 + 6 = 18 steps
    released, and no two attempts draw the same noise at a step they share, even under one fixed noise_seed."""
    from opacus.accountants import PRVAccountant
    from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments

    from dpaudit.integrations.hf import DPAuditCallback, opacus_trainer
    from dpaudit.integrations.hf_opacus import LEDGER

    class Kill(TrainerCallback):
        def __init__(self, at):
            self.at = at

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.at:
                raise KeyboardInterrupt("killed")

    keys = []

    def attempt(kill_at, resume):
        model, tok = _model(tiny_model_dir)
        audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "a",
                                              delta=1e-5, secret_seed=4, on_violation="off")
        args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=32, max_steps=12,
                                 learning_rate=1e-3, save_strategy="steps", save_steps=3, report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0, logging_steps=1000)
        trainer = opacus_trainer(model=model, args=args, train_dataset=_tokenised(tok, rows),
                                 data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                                 callbacks=[audit] + ([Kill(kill_at)] if kill_at else []), noise_multiplier=1.0,
                                 max_grad_norm=1.0, noise_seed=12)
        step = trainer.training_step

        def logged(model, inputs, num_items_in_batch=None):
            out = step(model, inputs, num_items_in_batch)
            keys.append((int(trainer.state.global_step), trainer.dp_optimizer.noise_key))
            return out
        trainer.training_step = logged
        try:
            trainer.train(resume_from_checkpoint=resume)
        except KeyboardInterrupt:
            pass
        return trainer, audit

    attempt(7, None)
    attempt(11, str(tmp_path / "hf-out" / "checkpoint-6"))
    trainer, audit = attempt(None, str(tmp_path / "hf-out" / "checkpoint-6"))
    released = 7 + (11 - 6) + (12 - 6)
    ledger = json.loads((tmp_path / "hf-out" / LEDGER).read_text())
    assert ledger["released"] == released and len(keys) == released
    fresh = PRVAccountant()
    fresh.history = [(1.0, trainer.sample_rate_accounted, released)]
    report = json.loads((tmp_path / "a" / "report" / "report.json").read_text())
    assert report["context"]["claimed eps"] == pytest.approx(fresh.get_epsilon(delta=1e-5), rel=1e-9)
    by_step = {}
    for step_index, key in keys:
        by_step.setdefault(step_index, set()).add(key)
    assert all(len(k) == sum(1 for s, _ in keys if s == i) for i, k in by_step.items())  # never the same noise twice
    assert len(by_step[6]) == 3  # step 6 was run by all three attempts


def test_a_dp_optimizer_with_nothing_to_train_is_refused_before_training_in_one_line(tmp_path):
    """A LoRA run whose adapters are all frozen failed inside the callback with "m (the number of canaries) must be
    an integer >= 2, got 0"."""
    import torch
    from opacus.optimizers import DPOptimizer
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from dpaudit.integrations.hf import DPAuditCallback

    model = torch.nn.Linear(4, 2)
    for p in model.parameters():
        p.requires_grad_(False)
    dp = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                     expected_batch_size=4)
    audit = DPAuditCallback.__new__(DPAuditCallback)  # only on_train_begin's DP branch is exercised
    audit.settings = type("S", (), {"preflight": "off", "white_box_m": 5000})()
    audit.out, audit.tokenizer = tmp_path / "a", None
    args = TrainingArguments(output_dir=str(tmp_path / "o"), report_to=[], use_cpu=True)
    with pytest.raises(DPAuditError, match="nothing trains"):
        audit.on_train_begin(args, TrainerState(), TrainerControl(), model=model, optimizer=dp)


def test_an_opacus_trainer_without_noise_and_without_a_claim_says_eps_is_infinite(tiny_model_dir, tmp_path):
    """noise_multiplier=0 and no claimed_eps: Opacus' PRV overflowed out of on_train_end (a raw traceback, no
    report). Now the run ends, the report is written, and it says the eps is infinite."""
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from dpaudit.integrations.hf import DPAuditCallback, opacus_trainer

    model, tok = _model(tiny_model_dir)
    audit, rows = DPAuditCallback.prepare(tok, [{"text": t} for t in TEXTS], m=20, repeats=1, out=tmp_path / "a",
                                          delta=1e-5, secret_seed=4)
    args = TrainingArguments(output_dir=str(tmp_path / "hf-out"), per_device_train_batch_size=32, max_steps=4,
                             learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0, logging_steps=1000)
    opacus_trainer(model=model, args=args, train_dataset=_tokenised(tok, rows),
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[audit],
                   noise_multiplier=0.0, max_grad_norm=1.0).train()
    report = json.loads((tmp_path / "a" / "report" / "report.json").read_text())
    assert "eps is infinite" in report["context"]["claimed eps from"] and report["context"]["claimed eps"] is None
    assert audit.exit_code == 0  # no claim to violate: the report says why (and a claim given would be tested)
