"""What an accountant offers a search over sigma or T, so that calibration and max-steps know no accountant
by name (the registry hands each accountant's hooks to them).

An accountant whose answer depends on a resolution it refines itself (``pld``: a grid refined until the bound
converges) can make a search far cheaper by fixing that resolution once and evaluating every candidate at it:
any resolution gives a valid bound, so the search stays on the right side, and a final check at the
accountant's own converged resolution can only accept a smaller sigma. Accountants without hooks are
searched as they answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SearchHooks:
    # (event, delta) -> options: the cheapest valid evaluation (loose), to move a start near the answer
    coarse: Callable
    # (event, delta) -> options: the refinement's first rung (valid; what brackets in T are read on)
    first: Callable
    # (anchor event, delta) -> (event -> options): the resolution the accountant converges to at the anchor,
    # carried to other events of the same schedule
    resolution: Callable
    # (event, delta, options) -> float: an estimate *below* the true eps on those options (brackets only)
    below: Callable | None = None
    # (template, target eps, delta) -> sigma: a start near the answer (e.g. a cheaper sampler's calibration)
    start: Callable | None = None
    overshoot: float = 1.1   # the bracket's first step past the target: less where the start is known to be close
