"""Launched by tests/test_distributed.py under torchrun: one short training run, same seeds on every rank."""

import sys
from pathlib import Path

from dpaudit.training.runner import TrainConfig, train

TEXTS = [f"Carol number {i} sells {'maps' if i % 2 else 'tea'} in Oslo." for i in range(40)]

if __name__ == "__main__":
    model, run, method = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    lr = 1e-3 if method == "dp-zo" else 1e-2
    cfg = TrainConfig(method=method, target_epsilon=4.0, steps=6, batch_size=12, lr=lr, secret_seed=11)
    train(model, TEXTS, run, cfg, show_progress=False)
