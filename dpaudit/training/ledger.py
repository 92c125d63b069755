"""The privacy ledger of a run: what it claims, which accountant and relation, and the eps spent so far.

Written ahead: a step is counted (the file rewritten atomically) before anything it releases is written,
so a run killed at any point over-counts by at most one step and never under-counts; a resumed run keeps
counting the steps a kill made it redo. eps is computed
ahead of time at a grid of step counts; after t steps the ledger reports eps at the first grid point
>= t, an upper bound because eps grows with the number of steps.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from pathlib import Path

from dpaudit.accounting.result import json_float
from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.run_record import ledger_json

GRID_POINTS = 25


class PrivacyLedger:
    def __init__(self, path: Path, header: dict, plan, total_steps: int):
        """``plan``: the run's PrivacyPlan (the same one the noise was taken from); ``total_steps`` counts
        the steps a resume redid. ``epsilon_planned`` stays the plan's (its T steps); ``epsilon_total`` is
        what the run spends with the redone steps, and any excess is written down as an overspend."""
        self.path = Path(path)
        self.header = header
        self.grid: list[int] = []
        self.eps: list[float] = []
        self.relation = "none: non-private run (eps = infinity)"
        self.recorded = 0  # steps_executed as last written
        if plan.private:
            total = total_steps
            self.grid = sorted({max(1, math.ceil(total * k / GRID_POINTS)) for k in range(1, GRID_POINTS + 1)})
            results = [plan.epsilon_at(t) for t in self.grid]
            self.eps = [r.epsilon for r in results]
            self.relation = results[-1].relation
            self.accountant = results[-1].accountant
            self.planned = (results[-1].epsilon if total == plan.mechanism.steps and not plan.attempts
                            else replace(plan, attempts=()).epsilon_at(plan.mechanism.steps).epsilon)
        else:
            self.accountant = None
            self.planned = math.inf

    @property
    def planned_epsilon(self) -> float:
        """eps of the plan as made (T steps)."""
        return self.planned

    @property
    def total_epsilon(self) -> float:
        """eps the run spends when it finishes, the steps a resume redid included."""
        return self.eps[-1] if self.eps else math.inf

    def spent(self, steps_done: int) -> float:
        if not self.grid:
            return math.inf
        if steps_done <= 0:
            return 0.0
        return self.eps[min(bisect.bisect_left(self.grid, steps_done), len(self.grid) - 1)]

    def record(self, steps_executed: int, **extra) -> None:
        """Write the count down (the trainer calls this before a step releases anything: write-ahead)."""
        atomic_write_json(self.path, ledger_json({
            **self.header, "accountant": self.accountant, "relation": self.relation,
            "steps_executed": steps_executed, "epsilon_spent": json_float(self.spent(steps_executed)),
            "epsilon_planned": json_float(self.planned_epsilon), "epsilon_total": json_float(self.total_epsilon),
            "epsilon_overspend": json_float(max(0.0, self.total_epsilon - self.planned_epsilon)), **extra,
        }))
        self.recorded = steps_executed
