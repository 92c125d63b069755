"""ULS training (users Poisson-sampled, each user's gradient clipped as one): the released sum is
sum_u clip_C(mean of u's per-example gradients) against a reference built from plain autograd, across micro-batches
that never split a user; DP-ZO clips each user's mean loss difference; the batches bring whole users at rate q; the
planted "uls-example-clipping" clips each record instead and moves the sum by up to k C."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cli_helpers import assert_one_line_error, dpaudit
from dpaudit.models.loading import load_causal_lm
from dpaudit.training.batches import user_source
from dpaudit.training.bugs import BUGS
from dpaudit.training.data import per_example_loss, split_users, tokenize, user_means
from dpaudit.training.sgd import FirstOrderTrainer
from dpaudit.training.trainable import trainable_parameters

TEXTS = [f"Alice number {i} lives in Paris and likes bread." for i in range(5)] + \
        ["zq xv kj wp " * 6 + "!", "the cat sat on the mat and looked at the dog for a while"]
OWNERS = [0, 0, 0, 1, 2, 2, 3]   # rows of a user adjacent, as user_source draws them


def _released(model_dir, per_user: bool, micro_batch: int = 0, clip: float = 0.3, bug=None, mode="materialise",
              subset="full", bf16: bool = False):
    from dpaudit.training.trainable import select_trainable

    model, tok = load_causal_lm(model_dir, dtype=torch.bfloat16 if bf16 else None)
    torch.manual_seed(0)
    model = select_trainable(model, subset, 4)
    params = trainable_parameters(model)
    trainer = FirstOrderTrainer(model, params, lr=0.0, private=True, clip=clip, sigma=0.0, expected_batch_size=1,
                                optimizer="sgd", per_sample_grads=mode, micro_batch=micro_batch,
                                per_user=per_user, bug=bug)
    batch = {**tokenize(tok, TEXTS, 24).batch(list(range(len(TEXTS)))), "user": torch.tensor(OWNERS)}
    trainer.step(batch, len(TEXTS))
    return torch.cat([p.grad.flatten().double() for p in params])


def _reference(model_dir, clip: float = 0.3, per_user: bool = True, subset="full"):
    """sum over units of clip_C(the unit's mean gradient), each record's gradient by its own backward."""
    from dpaudit.training.trainable import select_trainable

    model, tok = load_causal_lm(model_dir)
    torch.manual_seed(0)
    model = select_trainable(model, subset, 4)
    params = trainable_parameters(model)
    data = tokenize(tok, TEXTS, 24)
    grads = []
    for i in range(len(TEXTS)):
        loss = per_example_loss(model, data.batch([i]))[0]
        grads.append(torch.cat([g.flatten().double() for g in torch.autograd.grad(loss, params)]))
    grads = torch.stack(grads)
    units = user_means(grads, torch.tensor(OWNERS)) if per_user else grads
    factors = (clip / units.norm(dim=1)).clamp(max=1.0)
    return (units * factors[:, None]).sum(0)


@pytest.mark.parametrize("mode, micro_batch, subset", [("materialise", 0, "full"), ("materialise", 2, "full"),
                                                       ("ghost", 0, "full"), ("ghost", 2, "full"),
                                                       ("ghost", 0, "lora")])
def test_each_user_is_clipped_as_one_across_micro_batches(tiny_model_dir, mode, micro_batch, subset):
    """Ghost clipping's per-user norms (book-keeping's kept factors, a user's rows end to end; the embedded model's
    tied embeddings included) give the same clipped sum as the materialised per-example gradients, and both equal
    the autograd reference."""
    released = _released(tiny_model_dir, True, micro_batch, mode=mode, subset=subset)
    reference = _reference(tiny_model_dir, subset=subset)
    assert float(reference.abs().max()) > 1e-4
    assert float((released - reference).abs().max()) <= 1e-5 * float(reference.abs().max())
    # the sum's norm: at most C a user (4 users), where per-record clipping reaches C a record (7)
    assert float(released.norm()) <= 4 * 0.3 + 1e-6


def test_bf16_per_user_ghost_clipping_is_close_to_materialised(tiny_model_dir):
    ghost = _released(tiny_model_dir, True, mode="ghost", bf16=True)
    materialised = _released(tiny_model_dir, True, mode="materialise", bf16=True)
    scale = float(materialised.abs().max())
    assert scale > 1e-4
    assert float((ghost - materialised).abs().max()) <= 2e-2 * scale  # bf16 rounding, not a different sum


@pytest.mark.parametrize("mode", ["materialise", "ghost"])
def test_the_planted_bug_clips_each_record_and_exceeds_c_a_user(tiny_model_dir, mode):
    planted = _released(tiny_model_dir, True, bug=BUGS["uls-example-clipping"], mode=mode)
    per_record = _reference(tiny_model_dir, per_user=False)
    assert float((planted - per_record).abs().max()) <= 1e-5 * float(per_record.abs().max())
    assert float(planted.norm()) > float(_released(tiny_model_dir, True).norm()) * 1.2


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8), size=st.integers(0, 7))
def test_chunks_hold_whole_users_in_order_and_at_most_size_rows_unless_one_user_is_more(sizes, size):
    owners = torch.tensor(np.repeat(np.arange(len(sizes)), sizes))
    batch = {"input_ids": torch.arange(len(owners))[:, None], "user": owners}
    chunks = split_users(batch, size)
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks]), batch["input_ids"])
    seen = [set(c["user"].tolist()) for c in chunks]
    assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])  # no user in two chunks
    for c in chunks:
        assert size == 0 or len(c["user"]) <= size or len(set(c["user"].tolist())) == 1


def test_user_batches_bring_whole_users_at_rate_q():
    owners = np.repeat(np.arange(400), np.arange(400) % 4 + 1)   # 400 users of 1-4 records
    draw = user_source(owners)(owners.size, 100, 0, np.random.default_rng(0))
    joined = np.zeros(400)
    for step in range(300):
        idx = draw(step)
        users = owners[idx]
        assert np.all(np.diff(users) >= 0)   # grouped by user
        present = np.unique(users)
        assert np.array_equal(np.sort(idx), np.flatnonzero(np.isin(owners, present)))  # all their records
        joined[present] += 1
    q = 100 / owners.size
    assert abs(joined.mean() / 300 - q) < 4 * np.sqrt(q * (1 - q) / (300 * 400))


def test_dp_zo_averages_a_users_differences_before_clipping():
    from dpaudit.training.zo import clipped_sum

    diffs, users = torch.tensor([0.9, 0.9, -0.1, 2.0]), torch.tensor([0, 0, 1, 2])
    assert clipped_sum(user_means(diffs, users), 0.5) == pytest.approx(0.5 - 0.1 + 0.5)
    assert clipped_sum(diffs, 0.5) == pytest.approx(0.5 + 0.5 - 0.1 + 0.5)


def _users_file(tmp_path, users=12, each=5):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"Member {u} wrote note {j} about maps in Oslo.", "user": f"id{u}"})
                            + "\n" for u in range(users) for j in range(each)))
    return path


@pytest.mark.parametrize("method", ["dp-sgd", "dp-zo"])
def test_a_uls_run_trains_and_is_accounted_as_users_at_rate_q(tiny_model_dir, tmp_path, method):
    from dpaudit.accounting.mechanism import Mechanism
    from dpaudit.accounting.registry import epsilon
    from dpaudit.accounting.unit import Unit
    from dpaudit.core import run_record

    out = dpaudit("train", "--model", tiny_model_dir, "-d", _users_file(tmp_path), "-o", tmp_path / "run",
                  "--method", method, "--sigma", "1.5", "-B", "6", "-T", "4", "--threads", "1", "--unit", "user",
                  "--records-per-user", "3", "--user-sampling", "uls", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    expected = epsilon(Mechanism("gaussian", 1.5, 6 / 36, 4, unit=Unit("user", 3, "user")), 1e-5).epsilon
    assert result["epsilon"] == pytest.approx(expected, rel=1e-9) and "ULS" in result["relation"]
    assert run_record.read_ledger(tmp_path / "run").value("privacy_unit") == "user (ULS, k = 3)"
    # the noisy sum is divided by the expected users a step (q x 12 users), and the record says so: the white-box
    # audit of a DP-ZO log multiplies the scalars back by it
    assert run_record.read(tmp_path / "run").expected_batch_size == pytest.approx(6 / 36 * 12)


@pytest.mark.parametrize("extra, message", [
    (("--sampling", "balls-in-bins"), "Poisson batches"),
    (("--noise", "bandmf,b=2"), "independent noise"),
])
def test_uls_runs_it_cannot_clip_per_user_are_refused(tiny_model_dir, tmp_path, extra, message):
    out = dpaudit("train", "--model", tiny_model_dir, "-d", _users_file(tmp_path), "-o", tmp_path / "run",
                  "--sigma", "1.5", "-B", "6", "-T", "4", "--unit", "user", "--records-per-user", "3",
                  "--user-sampling", "uls", *extra)
    assert_one_line_error(out)
    assert message in out.stderr


def test_the_uls_bug_plants_only_in_a_uls_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DPAUDIT_ALLOW_BUGS", "1")
    out = dpaudit("train", "--model", tiny_model_dir, "-d", _users_file(tmp_path), "-o", tmp_path / "run",
                  "--sigma", "1.5", "-B", "6", "-T", "4", "--unit", "user", "--records-per-user", "3",
                  "--plant-bug", "uls-example-clipping")
    assert_one_line_error(out)
    assert "plants in a ULS run" in out.stderr


def test_a_killed_uls_run_resumes_as_uls_and_a_resume_without_its_users_is_refused(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    import dataclasses

    from dpaudit.core import run_record
    from dpaudit.core.errors import DPAuditError, Interrupted
    from dpaudit.training import batches
    from dpaudit.training.runner import TrainConfig, train

    texts = [f"Member {u} wrote note {j} about maps in Oslo." for u in range(12) for j in range(3)]
    users = [f"id{u}" for u in range(12) for _ in range(3)]
    cfg = TrainConfig(method="dp-sgd", sigma=1.5, batch_size=6, steps=6, save_every=2, unit="user",
                      records_per_user=3, user_sampling="uls", secret_seed=1)
    real = batches.user_source

    def killed_at_3(owners):
        make = real(owners)

        def source(*a):
            draw = make(*a)

            def at(step):
                if step == 3:
                    raise KeyboardInterrupt
                return draw(step)
            return at
        return source

    monkeypatch.setattr(batches, "user_source", killed_at_3)
    run = tmp_path / "run"
    with pytest.raises(Interrupted):
        train(tiny_model_dir, texts, run, cfg, show_progress=False, users=users)
    monkeypatch.setattr(batches, "user_source", real)
    with pytest.raises(DPAuditError, match="each record's user"):
        train(tiny_model_dir, texts, run, dataclasses.replace(cfg, allow_overspend=True), resume=True,
              show_progress=False)
    result = train(tiny_model_dir, texts, run, dataclasses.replace(cfg, allow_overspend=True), resume=True,
                   show_progress=False, users=users)
    assert result.steps == 6 and "ULS" in result.relation
    assert run_record.read_ledger(run).value("privacy_unit") == "user (ULS, k = 3)"


def test_the_memory_estimate_takes_whole_users():
    from dpaudit.training.memory import largest_batch

    # users of up to k records sampled whole: the batch's spread grows with k, and a micro batch holds a whole user
    assert largest_batch(64, 16) > largest_batch(64, 4) > largest_batch(64) == int(64 + 4 * 8 + 4)
    rng = np.random.default_rng(0)
    owners = np.repeat(np.arange(250), 16)   # 250 users of 16 records, B = 64: q = 1/62.5
    draw = user_source(owners)(owners.size, 64, 0, rng)
    assert max(len(draw(t)) for t in range(2000)) <= largest_batch(64, 16)
