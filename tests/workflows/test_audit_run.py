"""`dpaudit audit run` end to end on the embedded default: no DP leaks, DP at eps = 1 does not, and a
trainer that claims eps = 1 with its noise switched off is caught."""

import dataclasses
import json

import pytest

from dpaudit.core.errors import DPAuditError

from cli_helpers import assert_one_line_error, dpaudit


def run(tmp_path, name, *args):
    out = dpaudit("audit", "run", "--out", tmp_path / name, "--secret-seed", "1", "--json", *args, timeout=900)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return tmp_path_factory.mktemp("audit_run")


def test_non_private_dp_sgd_leaks(shared):
    code, data = run(shared, "nodp", "--method", "dp-sgd", "--eps", "inf")
    assert data["auc"] >= 0.9 and data["epsilon_lower_bound"] > 1
    assert code == 0 and data["claimed_epsilon"] is None  # nothing claimed, nothing violated
    assert (shared / "nodp" / "report" / "roc.png").is_file()


def test_dp_sgd_at_eps_1_holds(shared):
    code, data = run(shared, "eps1", "--method", "dp-sgd", "--eps", "1")
    assert code == 0 and not data["violation"]
    assert data["auc"] <= 0.65 and data["epsilon_lower_bound"] < data["claimed_epsilon"] <= 1
    ledger = json.loads((shared / "eps1" / "run" / "privacy_ledger.json").read_text())
    assert ledger["steps_executed"] == 3 and ledger["epsilon_spent"] <= 1
    # The black-box DP-SGD recipe on the embedded model (issue 39): the canaries' rows alone, full batches, SGD,
    # scored by the loss drop from the base model.
    ctx = data["context"]
    assert ctx["trainable"] == "new-tokens" and ctx["sampling rate p"] == 1.0 and data["score"]["name"] == "loss-vs-base"
    # The model in its run folder carries the run's claims: no --delta or --claimed-eps needed.
    again = dpaudit("audit", "checkpoint", "--model", shared / "eps1" / "run" / "model", "-c",
                    shared / "eps1" / "canaries.json", "--json")
    redone = json.loads(again.stdout)
    assert again.returncode == 0 and redone["delta"] == 1e-5
    assert redone["claimed_epsilon"] == pytest.approx(data["claimed_epsilon"])
    assert redone["context"]["method"] == "dp-sgd" and redone["context"]["steps"] == 3
    # ... and is scored as the run scored it: the loss drop from the extended model beside it.
    assert redone["score"]["name"] == "loss-vs-base" and "new-token rows" in redone["context"]["score chosen"]
    assert redone["auc"] == pytest.approx(data["auc"], abs=2e-3)
    # The claim's ceiling: from the run's own mechanism in the run, from the (eps, delta) region for scores alone.
    run_ceiling, region = data["claim_ceiling"], redone["claim_ceiling"]
    assert run_ceiling["source"] == "run" and region["source"] == "claim"
    assert 0.01 < run_ceiling["tpr_at_fpr"]["0.01"]["max_tpr"] < region["tpr_at_fpr"]["0.01"]["max_tpr"]


def test_noise_switched_off_is_caught(shared):
    code, data = run(shared, "broken", "--method", "dp-sgd", "--eps", "1", "--unsafe-disable-noise")
    assert code == 1 and data["violation"] and data["verdict"].startswith("VIOLATION")
    assert data["context"]["noise"].startswith("DISABLED")


@pytest.mark.parametrize("args,message", [
    (["--method", "dp-sgd", "--mech", "laplace"], "laplace is for dp-zo"),
    (["--method", "sgd"], "unknown method"),
    (["--method", "dp-zo", "--direction", "foo"], "unknown direction"),
    (["--eps", "-1"], "must be > 0"),
    (["--eps", "one"], "number or inf"),
    (["--model", "/nonexistent/model"], "not found"),
])
def test_audit_run_bad_inputs(tmp_path, args, message):
    out = dpaudit("audit", "run", "--out", tmp_path / "x", *args)
    assert_one_line_error(out)
    assert message in out.stderr


def test_a_rerun_reuses_its_canaries_and_extended_model(tiny_model_dir, tmp_path):
    """Issue 36: `audit run --model` made and extended the canaries again on every run (3-5 minutes and ~2 GB on
    a 270M model). A rerun into the same folder with the same base model and canary settings reuses them; another
    seed makes them again."""
    import json

    def run(*extra):
        out = dpaudit("audit", "run", "--out", tmp_path / "a", "--model", tiny_model_dir, "--method", "dp-sgd",
                      "--eps", "8", "-m", "20", "--examples", "40", "-T", "2", "-B", "8", "--secret-seed", "1",
                      "--threads", "1", "--force", "--json", *extra, timeout=600)
        assert out.returncode in (0, 1), out.stderr
        return json.loads(out.stdout)["context"]

    first = run()
    made = (tmp_path / "a" / "extended_model" / "config.json").stat().st_mtime_ns
    # issue 67, item 23: one copy of the weights, the trained model's; the extended model is the base plus zero
    # rows (models/extension.py), so its folder holds none
    weights = sorted(str(f.relative_to(tmp_path / "a")) for f in (tmp_path / "a").rglob("*.safetensors"))
    assert weights == ["run/model/model.safetensors"], weights
    manifest = (tmp_path / "a" / "canaries.json").read_text()
    again = run()
    assert "canaries" not in first and "reused" in again["canaries"]
    assert (tmp_path / "a" / "extended_model" / "config.json").stat().st_mtime_ns == made
    assert (tmp_path / "a" / "canaries.json").read_text() == manifest
    other = run("--seed", "3")
    assert "canaries" not in other and (tmp_path / "a" / "canaries.json").read_text() != manifest


def test_the_pretrained_recipe_rate_moves_a_logit_as_far_as_the_embedded_recipe_does(tmp_path, monkeypatch):
    """Issue 39: the black-box recipe on a pretrained model sets its SGD rate from the model (``sgd_exposure``):
    on the embedded default, with its N of ~1500, that rate is the embedded recipe's own lr 5. A step that does
    not fit the memory is micro-batched (same batches, noise and accounting)."""
    from dpaudit.canaries.generate import make_canaries
    from dpaudit.canaries.hf import extend_model
    from dpaudit.core.atomic import save_model_folder
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training import memory
    from dpaudit.training.preflight import check_model
    from dpaudit.training.runner import TrainConfig
    from dpaudit.workflows.audit_run import (
        EMBEDDED_RECIPE, PRETRAINED_RECIPE, embedded_default, prefix_hidden_norm, sgd_exposure,
    )

    lm, tok = load_causal_lm(embedded_default(tmp_path / "base", 0))
    manifest = make_canaries(tok, 64, seed=0)
    extend_model(lm, tok, manifest)
    h = prefix_hidden_norm(lm, tok, manifest)
    lr = sgd_exposure(h, 1500, 1.0, PRETRAINED_RECIPE.logit_step)
    assert 9 < h < 12 and lr == pytest.approx(EMBEDDED_RECIPE.lr, rel=0.05)
    assert sgd_exposure(h, 3000, 2.0, 0.034) == pytest.approx(lr)  # N / C
    save_model_folder(tmp_path / "extended", lm, tok)
    cfg = TrainConfig(method="dp-sgd", target_epsilon=4.0, trainable="new-tokens", batch_size=0, optimizer="sgd")
    texts = ["a b c d e f g h"] * 1500

    def micro_batch_that_fits(folder, cfg, texts):
        return check_model(folder, cfg).with_texts(texts, cfg.max_length).micro_batch_that_fits(cfg, len(texts))
    assert micro_batch_that_fits(tmp_path / "extended", cfg, texts) == 0  # a small model fits at once
    # --max-memory is the budget where given, not the free memory
    small = dataclasses.replace(cfg, max_memory=memory.IMPORTS + 2**25)
    assert 1 <= micro_batch_that_fits(tmp_path / "extended", small, texts) < 1500
    monkeypatch.setattr(memory, "available_bytes", lambda: memory.IMPORTS + 2**25)
    assert 1 <= micro_batch_that_fits(tmp_path / "extended", cfg, texts) < 1500


def test_the_dp_zo_black_box_recipe_takes_phi_and_rate_from_the_model(tmp_path):
    """Issue 39: a black-box DP-ZO audit trains the canaries' new-token rows in full batches, with phi = 2 C / |h| (a
    member's loss difference reaches the clip) and the rate at which the noise and the other members spread a
    secret's logit by 1.5 nats over the run (``zo_exposure``); a phi the user gives is kept, the rate follows it."""
    from dpaudit.workflows.audit_run import ZERO_ORDER_RECIPE, zo_exposure

    # The measured run of the docstring: |h| 10.3, N 597, C 0.05, T 300, sigma 18.7, 497 members.
    lr, phi = zo_exposure(10.3, 597, 1.0, 497, 0.05, 18.7, 300, ZERO_ORDER_RECIPE.logit_noise)
    assert phi == pytest.approx(0.0097, abs=1e-4) and lr == pytest.approx(0.067, abs=2e-3)
    assert zo_exposure(10.3, 597, 1.0, 497, 0.05, 18.7, 300, 1.5, phi=2 * phi)[0] == pytest.approx(2 * lr)

    def context(*extra):
        out = dpaudit("audit", "run", "--out", tmp_path / "zo", "--method", "dp-zo", "--eps", "4", "-m", "20",
                      "-T", "4", "--secret-seed", "1", "--threads", "1", "--force", "--json", *extra, timeout=600)
        assert out.returncode in (0, 1), out.stderr
        return json.loads(out.stdout)["context"]

    ctx = context()
    assert ctx["trainable"] == "new-tokens" and ctx["sampling rate p"] == 1.0 and ctx["steps"] == 4
    assert "2 C / |h|" in ctx["phi"] and "1.5 nats" in ctx["learning rate"]
    assert ctx["examples"] == 100 + sum(json.loads((tmp_path / "zo" / "canaries.json").read_text())["canaries"][i]
                                        ["member"] for i in range(20))
    phi, lr = float(ctx["phi"].split(",")[0]), float(ctx["learning rate"].split(",")[0])
    given = context("--phi", str(2 * phi))
    assert given["phi"].endswith("(given)")
    assert float(given["learning rate"].split(",")[0]) == pytest.approx(2 * lr, rel=1e-3)
    # |h| is measured once, on the model in memory when it is extended, and kept in the reuse stamp: the rerun above
    # (canaries reused) read it from there. It is the extended model's own, as a reload of its folder gives.
    from dpaudit.canaries.manifest import load_manifest
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.workflows.audit_run import HIDDEN_NORM, REUSE_STAMP, _stamped, prefix_hidden_norm

    h = _stamped(tmp_path / "zo", HIDDEN_NORM)
    assert "reused" in given["canaries"] and f"|h| = {h:.3g} at" in ctx["learning rate"] and \
        f"|h| = {h:.3g} at" in given["learning rate"]
    lm, tok = load_causal_lm(tmp_path / "zo" / "extended_model")
    assert h == pytest.approx(prefix_hidden_norm(lm, tok, load_manifest(tmp_path / "zo" / "canaries.json")), rel=1e-5)
    stamp = json.loads((tmp_path / "zo" / REUSE_STAMP).read_text())
    stamp.pop(HIDDEN_NORM)  # a stamp made before it was kept: measured again (None), the canaries still reused
    (tmp_path / "zo" / REUSE_STAMP).write_text(json.dumps(stamp))
    assert _stamped(tmp_path / "zo", HIDDEN_NORM) is None
    again = context()
    assert "reused" in again["canaries"] and f"|h| = {h:.3g} at" in again["learning rate"]


def test_white_box_dp_sgd_plants_5000_canaries_unless_the_transcript_would_grow_past_its_budget():
    """Gradient canaries never interfere (one coordinate each), so more only narrow the estimate of mu: 5000 by
    default (claimed eps 1, seeds 1-6: median headline 0.77, against 0.60 at 1000), fewer where T is so long that
    the transcript (m float32 a step) would pass 256 MiB, and never below the 1000 of before."""
    from dpaudit.training.runner import TrainConfig
    from dpaudit.workflows.audit_run import TRANSCRIPT_BYTES, white_box_canaries

    def m(steps):
        return white_box_canaries(TrainConfig(method="dp-sgd", target_epsilon=1.0, steps=steps))

    assert m(300) == 5000 and m(13_421) == 5000
    assert m(20_000) == TRANSCRIPT_BYTES // (4 * 20_000) == 3355
    assert m(100_000) == m(10**7) == 1000


def test_white_box_dp_sgd_on_the_embedded_default_trains_at_a_rate_that_does_not_diverge():
    """Issue 53, item 17: at AdamW 5e-3 a correct white-box DP-SGD run at eps 1 read "training diverged" (the loss
    rose 0.73 -> 5.3 under the noise). The white-box recipe trains at 5e-4; the audit reads the releases on the
    canaries' own coordinates, so its bound did not move (secret seed 1: 0.5862 at both rates)."""
    from dpaudit.workflows.audit_run import OTHER_RECIPE, black_box_recipe

    assert black_box_recipe(True, True, False).lr == 5e-4
    assert black_box_recipe(False, True, False) == OTHER_RECIPE       # DP-ZO keeps its own default
    assert black_box_recipe(True, True, True) == OTHER_RECIPE         # a pretrained model: its pretrained rate


def test_an_audit_runs_choices_are_the_users_where_given_else_its_recipes():
    """One resolution for the CLI and Python callers: a white-box run's full batches of 64 examples are its
    recipe's own (the CLI used to set them over a recipe of batches of 64); the recipe's rate only with its own
    subset and optimizer; phi from the model only where the recipe reads it and none is given."""
    from dpaudit.workflows.audit_run import (
        EMBEDDED_RECIPE, ZERO_ORDER_RECIPE, black_box_recipe, resolve_recipe,
    )

    white = resolve_recipe(black_box_recipe(True, True, False))
    assert (white.batch_size, white.examples, white.lr, white.trainable) == (0, 64, 5e-4, "full")
    assert resolve_recipe(black_box_recipe(True, True, False), batch_size=16, examples=10).batch_size == 16
    black = resolve_recipe(EMBEDDED_RECIPE)
    assert (black.lr, black.steps, black.optimizer) == (5.0, 3, "sgd")
    assert resolve_recipe(EMBEDDED_RECIPE, optimizer="adamw").lr is None  # the method's default rate, not 5
    zo = resolve_recipe(ZERO_ORDER_RECIPE)
    assert zo.phi_from_model and zo.logit_noise == ZERO_ORDER_RECIPE.logit_noise
    given = resolve_recipe(ZERO_ORDER_RECIPE, phi=0.01)
    assert not given.phi_from_model and given.phi == 0.01


def test_where_the_body_trains_canaries_share_a_prefix_and_the_rate_keeps_the_body_put():
    """Issue 70, item 1: a black-box DP-SGD run whose user trains the body (full, LoRA, embeddings: the canaries'
    rows train too) puts its canaries behind one shared prefix and, without --lr, takes the rate at which the noise
    walks each weight BODY_DRIFT of the base's typical weight (``drift_rate``). Not for subsets that
    never train the rows (bias), the new-token recipe itself, DP-ZO, or a white-box run."""
    from dpaudit.workflows.audit_run import (
        BODY_DRIFT, EMBEDDED_RECIPE, PRETRAINED_RECIPE, ZERO_ORDER_RECIPE, black_box_recipe, drift_rate,
        resolve_recipe,
    )

    full = resolve_recipe(EMBEDDED_RECIPE, trainable="full", optimizer="adamw")
    assert full.shared_prefix and full.body_drift == BODY_DRIFT and full.lr is None
    given = resolve_recipe(PRETRAINED_RECIPE, trainable="embeddings", lr=1e-3)
    assert given.shared_prefix and given.body_drift is None and given.lr == 1e-3
    lora = resolve_recipe(PRETRAINED_RECIPE, trainable="lora")
    assert lora.shared_prefix and lora.body_drift == BODY_DRIFT
    for recipe, trainable in ((EMBEDDED_RECIPE, "bias"), (EMBEDDED_RECIPE, None), (ZERO_ORDER_RECIPE, "full"),
                              (black_box_recipe(True, True, False), "full")):
        other = resolve_recipe(recipe, trainable=trainable)
        assert not other.shared_prefix and other.body_drift is None
    # AdamW (a step moves a weight about lr): the walk lr sqrt(T) is the drift's share of the weights' size
    assert drift_rate(0.05, 400, 1 / 16, 1.0) * 20 == pytest.approx(0.05 / 16)
    assert drift_rate(0.05, 400, 1 / 16, 0.01) == pytest.approx(100 * drift_rate(0.05, 400, 1 / 16, 1.0))


def test_a_whole_model_audit_run_trains_its_shared_prefix_canaries_at_the_rate_from_the_model(tiny_model_dir,
                                                                                             tmp_path):
    """Issue 70, item 1, end to end: `audit run --trainable full` (black-box DP-SGD) makes its canaries behind one
    shared prefix, starts every secret's row at the base's expected row after it (the extension folder holds that
    row and rebuilds it to the bit), trains at ``drift_rate`` of the model's weights, and says both in its report."""
    import math

    from dpaudit.canaries.hf import expected_row
    from dpaudit.canaries.manifest import load_manifest
    from dpaudit.models.loading import load_causal_lm
    from dpaudit.workflows.audit_run import BODY_DRIFT, drift_rate, weight_scale

    out = dpaudit("audit", "run", "--out", tmp_path / "a", "--model", tiny_model_dir, "--method", "dp-sgd",
                  "--eps", "8", "-m", "20", "--examples", "40", "-T", "4", "-B", "8", "--secret-seed", "1",
                  "--trainable", "full", "--optimizer", "adamw", "--threads", "1", "--json", timeout=600)
    assert out.returncode in (0, 1), out.stderr
    context = json.loads(out.stdout)["context"]
    manifest = load_manifest(tmp_path / "a" / "canaries.json")
    assert manifest.prefix_kind == "template" and "one shared prefix" in context["canary prefix"]
    base, tok = load_causal_lm(tiny_model_dir)
    row = expected_row(base, tok, manifest.canaries[0].prefix)
    extended, tok = load_causal_lm(tmp_path / "a" / "extended_model")
    ids = tok.convert_tokens_to_ids(list(manifest.secrets))
    assert bool((extended.get_output_embeddings().weight[ids] == row).all())
    lr = drift_rate(weight_scale(extended), 4, BODY_DRIFT, 1.0)  # AdamW: the walk over T = 4 steps is 2 lr
    assert context["learning rate"].startswith(f"{lr:.4g}, from the model")
    assert math.isclose(2 * lr, BODY_DRIFT * weight_scale(extended))
    # a prefix length the user chose: random prefixes, zero rows, and the method's rate (the rule was measured only
    # with the shared prefix)
    out = dpaudit("audit", "run", "--out", tmp_path / "b", "--model", tiny_model_dir, "--method", "dp-sgd",
                  "--eps", "8", "-m", "20", "--examples", "40", "-T", "4", "-B", "8", "--secret-seed", "1",
                  "--trainable", "full", "--optimizer", "adamw", "--prefix-length", "1", "--threads", "1", "--json",
                  timeout=600)
    assert out.returncode in (0, 1), out.stderr
    context = json.loads(out.stdout)["context"]
    assert "canary prefix" not in context and "learning rate" not in context
    assert load_manifest(tmp_path / "b" / "canaries.json").prefix_kind == "random-tokens"


def test_the_pretrained_recipe_micro_batches_within_max_memory_instead_of_refusing(tiny_model_dir, tmp_path):
    """Issue 67, item 23: `audit run --model M --max-memory X` was refused before the folder existed ("a step ...
    needs about 38.2 GB, over --max-memory 3 GB") where the recipe itself would have micro-batched the full batch
    to fit X. The early check now refuses only a step that cannot fit one example at a time."""
    from dpaudit.training.preflight import preflight
    from dpaudit.training.runner import TrainConfig
    from dpaudit.workflows.audit_run import AuditRunSettings, PRETRAINED_RECIPE, run_audit

    cfg = TrainConfig(method="dp-sgd", target_epsilon=8.0, trainable="new-tokens", batch_size=0, optimizer="sgd",
                      steps=1, secret_seed=1)
    one = preflight(tiny_model_dir, dataclasses.replace(cfg, micro_batch=1), 60, warn=False)
    whole = preflight(tiny_model_dir, cfg, 60, warn=False)
    assert one < whole
    cfg = dataclasses.replace(cfg, max_memory=(one + whole) // 2)
    with pytest.raises(DPAuditError, match="over --max-memory"):
        preflight(tiny_model_dir, cfg, 60, warn=False)
    settings = AuditRunSettings(canaries=20, examples=40, logit_step=PRETRAINED_RECIPE.logit_step)
    audit, result, summary = run_audit(tmp_path / "out", cfg, settings, model=tiny_model_dir, show_progress=False)
    ran = json.loads((tmp_path / "out" / "run" / "run_config.json").read_text())["config"]
    assert result.steps == 1 and ran["max_memory"] == cfg.max_memory  # trained within it (train's own check)


def test_an_audit_runs_sigma_is_calibrated_once(tmp_path, monkeypatch):
    """A black-box DP-ZO audit run builds its privacy plan twice (the recipe's rate reads the noise, then the
    trainer starts): the calibration, a search over sigma, runs once."""
    import dpaudit.training.plan as plan
    from dpaudit.training.runner import TrainConfig
    from dpaudit.workflows.audit_run import AuditRunSettings, ZERO_ORDER_RECIPE, embedded_default, run_audit

    calls, real = [], plan.calibrate_sigma
    monkeypatch.setattr(plan, "calibrate_sigma", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan._calibrated_sigma.cache_clear()
    base = embedded_default(tmp_path / "base", 0)
    cfg = TrainConfig(method="dp-zo", target_epsilon=4.0, trainable="new-tokens", batch_size=0, steps=10,
                      secret_seed=1)
    settings = AuditRunSettings(canaries=20, examples=40, logit_noise=ZERO_ORDER_RECIPE.logit_noise,
                                phi_from_model=True)
    _, result, _ = run_audit(tmp_path / "run", cfg, settings, model=base, show_progress=False)
    assert len(calls) == 1 and result.private and result.epsilon <= 4.0


@pytest.mark.parametrize("white_box", [0, 24])
def test_an_audit_runs_model_is_checked_once(tiny_model_dir, tmp_path, monkeypatch, white_box):
    """`audit run --model M` checks M's step once, before its folder exists (the refusals read only the config):
    the meta model is built once and the training texts are tokenised once for the estimate; the check, grown
    by the canaries' rows, goes on to the recipe's micro batch and to train. A model the run could not have
    fitted is still refused before the folder exists."""
    import dpaudit.training.preflight as preflight
    from dpaudit.models import hf
    from dpaudit.training.runner import TrainConfig
    from dpaudit.workflows.audit_run import AuditRunSettings, PRETRAINED_RECIPE, run_audit

    built, tokenised = [], []
    meta, longest = hf.meta_model, preflight.longest_tokens
    monkeypatch.setattr(hf, "meta_model", lambda *a: built.append(a) or meta(*a))
    monkeypatch.setattr(preflight, "longest_tokens", lambda *a: tokenised.append(a) or longest(*a))
    cfg = TrainConfig(method="dp-sgd", target_epsilon=8.0, trainable="full" if white_box else "new-tokens",
                      batch_size=8 if white_box else 0, optimizer="sgd", steps=1, secret_seed=1,
                      white_box=white_box)
    settings = AuditRunSettings(canaries=20, examples=40,
                                logit_step=None if white_box else PRETRAINED_RECIPE.logit_step)
    run_audit(tmp_path / "out", cfg, settings, model=tiny_model_dir, show_progress=False)
    assert len(built) == 1 and len(tokenised) == 1
    from dpaudit.core import run_record
    assert run_record.read(tmp_path / "out" / "run").estimated_peak_bytes > 0  # the check's estimate, recorded
    tiny = dataclasses.replace(cfg, max_memory=2**20)  # below the weights: refused with no folder made
    with pytest.raises(DPAuditError, match="max-memory|memory"):
        run_audit(tmp_path / "refused", tiny, settings, model=tiny_model_dir, show_progress=False)
    assert not (tmp_path / "refused").exists()
