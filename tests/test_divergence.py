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
