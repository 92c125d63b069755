"""``from dpaudit.samplers import BallsInBinsSampler, PoissonSampler``: batch samplers that draw what dpaudit
accounts (training/samplers.py), one line to switch a shuffling DataLoader to."""

from dpaudit.training.samplers import BallsInBinsSampler, PoissonSampler

__all__ = ["BallsInBinsSampler", "PoissonSampler"]
