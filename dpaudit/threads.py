"""How many CPU threads torch may use: the cores this process may run on and its CPU quota allow, never
more, less the cores other processes are keeping busy right now (torch's threads wait for each other
at every parallel region, so one thread on a taken core stalls them all: on a shared 2-core machine a
step took 40-60 s instead of about 4 s in issue 13's measurement; benchmarks/threads.py)."""

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


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies of each CPU in ``cpus``, from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]
            out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))  # idle and iowait are not busy
    return out


def busy_cores(cpus: set[int], interval: float = 0.1) -> float:
    """How many of ``cpus`` other processes keep busy, sampled over ``interval`` seconds (0 if unknown)."""
    import time

    try:
        before = _cpu_times(cpus)
        time.sleep(interval)
        after = _cpu_times(cpus)
    except (OSError, ValueError):
        return 0.0
    busy = 0.0
    for cpu, (b1, t1) in after.items():
        b0, t0 = before.get(cpu, (b1, t1))
        if t1 > t0:
            busy += (b1 - b0) / (t1 - t0)
    return busy


def default_threads() -> int:
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    usable = len(cpus)
    quota = cpu_quota()
    if quota is not None:
        usable = min(usable, max(1, math.floor(quota)))
    return max(1, min(usable, round(len(cpus) - busy_cores(set(cpus)))))


def set_threads(threads: int | None) -> int:
    """Apply ``threads`` (None: the default above) to torch; returns the number used."""
    n = default_threads() if threads is None else threads
    if n < 1:
        raise DPAuditError(f"--threads must be >= 1, got {n}")
    import torch

    torch.set_num_threads(n)
    return n
