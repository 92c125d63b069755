"""Divergence: a training loss that rises well above where it started (a learning rate too large for the
model, as 5e-3 AdamW is for a pretrained LM: 10.7 -> 12.8 -> 18.4 on a pretrained LM's walk-through).

Losses of single steps are noisy (Poisson batches, DP noise), so the watch compares medians of ``window``
finite losses: the first ``window`` against the latest ``window``. It trips when the latest median exceeds
``factor`` x the first (and the first is positive), on a loss that is not a finite number, or on ``window``
losses in a row that are exactly 0 (no target token trained: a batch of padding, or every label masked). An
empty Poisson batch has no loss (the runner passes None) and is skipped. Torch-free.

What it is for: a warning, and a line in the report. Never a reason to skip an audit: a broken DP
implementation (clipping skipped, noise too small) is one way training diverges, and it is what an audit exists
to find (a default stop turned planted bugs into "lower your lr", exit 2).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

FACTOR, WINDOW = 1.75, 3  # the README main job (DP-SGD at eps 1, noisy) peaks at 1.37x: no false stop


class DivergenceWatch:
    def __init__(self, factor: float = FACTOR, window: int = WINDOW):
        self.factor, self.window = factor, window
        self.first: list[float] = []
        self.latest: deque[float] = deque(maxlen=window)
        self.zeros = 0
        self.warned = False
        self.why: str | None = None  # what tripped it, kept for the report

    def update(self, step: int, loss: float | None) -> str | None:
        """None while training looks sane; the first time it does not, one sentence saying what rose, from
        what, by which step (later calls say nothing: a run is warned once)."""
        if loss is None or self.warned:
            return None
        why = self._check(step, loss)
        self.warned = why is not None
        self.why = why
        return why

    def _check(self, step: int, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"the training loss is {loss} at step {step + 1}"
        self.zeros = self.zeros + 1 if loss == 0 else 0
        if self.zeros >= self.window:
            return (f"the training loss is exactly 0 at {self.zeros} steps in a row, by step {step + 1}: no target "
                    "token is being trained (padding only, or every label masked)")
        if len(self.first) < self.window:
            self.first.append(loss)
        self.latest.append(loss)
        if len(self.first) < self.window or len(self.latest) < self.window:
            return None
        start, now = statistics.median(self.first), statistics.median(self.latest)
        if start > 0 and now > self.factor * start:
            return (f"the training loss rose from {start:.4g} to {now:.4g} by step {step + 1} (medians of "
                    f"{self.window} steps; more than {self.factor:g}x)")
        return None
