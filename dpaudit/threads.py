"""How many CPU threads torch may use: the cores this process may run on and its CPU quota allow, never
more (torch's default of every core on the box thrashes a shared 2-core machine: a step took 40-60 s
instead of about 4 s in issue 13's measurement)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from dpaudit.errors import DPAuditError


def cpu_quota() -> float | None:
    """The cgroup v2 CPU quota in cores (cpu.max), or None when there is none."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def default_threads() -> int:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    if quota is not None:
        usable = min(usable, max(1, math.floor(quota)))
    return max(1, usable)


def set_threads(threads: int | None) -> int:
    """Apply ``threads`` (None: the default above) to torch; returns the number used."""
    n = default_threads() if threads is None else threads
    if n < 1:
        raise DPAuditError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)
    return n
