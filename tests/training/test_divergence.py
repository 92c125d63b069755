"""The divergence watch (training/divergence.py): quiet on noisy but sane losses, trips on a rise."""

import math

import numpy as np

from dpaudit.training.divergence import DivergenceWatch


def _first_trip(losses):
    watch = DivergenceWatch()
    for step, loss in enumerate(losses):
        if watch.update(step, loss):
            return step
    return None


def test_a_falling_or_noisy_loss_never_trips():
    rng = np.random.default_rng(0)
    falling = 10 * np.exp(-np.arange(300) / 100) + 0.5 + rng.normal(0, 0.3, 300)
    assert _first_trip(falling) is None
    assert _first_trip([10.0, None, 9.5, None, 9.8, 10.4, 11.0, 12.0]) is None  # None: an empty batch


def test_the_walk_through_blow_up_trips_and_names_the_rise():
    losses = [10.7, 10.9, 10.6, 12.8, 18.4, 25.0, 30.0]  # issue 32's pretrained run at the tiny model's lr
    watch = DivergenceWatch()
    said = [watch.update(s, x) for s, x in enumerate(losses)]
    assert said.index(next(w for w in said if w)) == 6  # the median of the last three passes 1.75x 10.7
    assert "rose from 10.7" in next(w for w in said if w)
    assert "inf at step 1" in DivergenceWatch().update(0, math.inf)
    assert "nan at step 3" in DivergenceWatch().update(2, math.nan)


def test_a_diverging_run_stops_in_one_line_with_what_the_ledger_counts(tiny_model_dir, tmp_path):
    from cli_helpers import assert_one_line_error, dpaudit

    data = tmp_path / "d.txt"
    data.write_text("".join(f"Carol number {i} sells maps in Oslo.\n" for i in range(40)))
    out = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", tmp_path / "run", "--sigma", "1",
                  "-B", "20", "-T", "30", "--lr", "30", "--stop-on-divergence", "--threads", "1")
    assert_one_line_error(out)
    assert "stopped: the training loss" in out.stderr and "the ledger counts" in out.stderr


def test_a_pretrained_model_gets_its_own_learning_rate_default(tmp_path):
    """The tiny embedded model's lr (5e-3 AdamW) diverges on a pretrained one: any model dpaudit did not build
    gets the pretrained table; a given --lr always wins."""
    from dpaudit.cli.train_commands import make_config
    from dpaudit.training.methods import METHODS

    embedded = tmp_path / "embedded"
    embedded.mkdir()
    (embedded / "dpaudit_model.json").write_text("{}")
    args = dict(eps="1", sigma=None, delta=None, mech="gaussian", clip=None, optimizer="adamw", steps=None,
                batch_size=8, phi=1e-3, direction="rademacher", bf16=False, seed=0, secret_seed=None, accountant=None)
    lr = {(method, trainable, str(model)): make_config(method, lr=None, trainable=trainable, model=model, **args).lr
          for method in ("dp-sgd", "dp-zo") for trainable in ("full", "lora") for model in (None, embedded,
                                                                                          tmp_path / "m.gguf")}
    assert lr["dp-sgd", "full", "None"] == lr["dp-sgd", "full", str(embedded)] == METHODS["dp-sgd"].defaults["lr"]
    assert lr["dp-sgd", "full", str(tmp_path / "m.gguf")] == 5e-5
    assert lr["dp-sgd", "lora", str(tmp_path / "m.gguf")] == 5e-4 and lr["dp-zo", "full", str(tmp_path / "m.gguf")] == 1e-6
    assert make_config("dp-sgd", lr=0.1, trainable="full", model=tmp_path / "m.gguf", **args).lr == 0.1


def test_a_loss_stuck_at_exactly_zero_trips():
    """Issue 36: a left-padded batch masked every target and logged "loss 0" at every step, silently."""
    watch = DivergenceWatch()
    said = [watch.update(s, 0.0) for s in range(5)]
    assert said[:2] == [None, None] and "exactly 0 at 3 steps" in said[2]
    assert watch.why == said[2]
    assert _first_trip([0.0, 0.5, 0.0, 0.4, 0.0, 0.45]) is None  # a 0 now and then is not stuck


def test_steps_with_only_canaries_have_no_loss_and_are_not_a_divergence(tiny_model_dir, tmp_path):
    """White-box canaries are sampled as examples but carry no loss: a step that drew only canaries has no loss
    (nan), which the watch must not read as a divergence (it did: "the training loss is nan at step 1", and
    --stop-on-divergence stopped a sane run)."""
    import json

    from cli_helpers import dpaudit

    data = tmp_path / "d.txt"
    data.write_text("".join(f"Carol number {i} sells maps in Oslo.\n" for i in range(40)))
    out = dpaudit("train", "--model", tiny_model_dir, "-d", data, "-o", tmp_path / "run", "--sigma", "1", "-B", "4",
                  "-T", "12", "--white-box", "400", "--stop-on-divergence", "--secret-seed", "1", "--threads", "1",
                  "--json")
    assert out.returncode == 0, out.stderr[-400:]
    assert not json.loads(out.stdout).get("extra", {}).get("divergence")
