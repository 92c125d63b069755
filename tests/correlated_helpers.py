"""Shared by the correlated-noise tests: a strategy's dense matrix, CorrelatedNoise (dp_step.py) over given draws
instead of a stream, and a killed run."""

import numpy as np

from dpaudit.training.dp_step import CorrelatedNoise


def dense(coefs, n: int) -> np.ndarray:
    """The n x n lower-triangular Toeplitz matrix of ``coefs`` (zero past them), built entry by entry."""
    coefs = np.asarray(coefs, float)
    full = np.zeros(n)
    full[:min(n, coefs.size)] = coefs[:n]
    return np.array([[full[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])


class _Fixed:
    """The seam below CorrelatedNoise: adds the step's z (given by the test) instead of a stream's."""

    def __init__(self, draws):
        self.draws, self.t = draws, 0

    def draw_noise(self, tensors, std):
        for x in tensors:
            x.add_(self.draws[self.t] * std)
        self.t += 1


class FixedDrawNoise(CorrelatedNoise, _Fixed):
    """CorrelatedNoise whose z_t is ``draws[t]``."""


def killed_run(model_dir, run, monkeypatch, kill_at: int = 5, **kw):
    """A correlated-noise run (sigma 1, T 8, B 8, checkpoints every 2 steps; BandMF b = 3 unless ``kw`` says)
    killed at its ``kill_at``-th step. Returns its config, for the resume."""
    import pytest

    from dpaudit.models.corpus import sentences
    from dpaudit.training.runner import TrainConfig, train
    from dpaudit.training.sgd import FirstOrderTrainer

    cfg = TrainConfig(method="dp-sgd", **{"sigma": 1.0, "steps": 8, "batch_size": 8, "save_every": 2, "secret_seed": 5,
                                          "noise": "bandmf,b=3", "allow_overspend": True, **kw})
    real, calls = FirstOrderTrainer.run_step, []

    def dies(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == kill_at:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(FirstOrderTrainer, "run_step", dies)
        with pytest.raises(Exception, match="interrupted"):
            train(model_dir, sentences(80, seed=3), run, cfg, show_progress=False)
    return cfg
