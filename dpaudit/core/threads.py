"""How many CPU threads torch may use: the cores this process may run on and its CPU quota allow, never
more, less the cores other processes are keeping busy right now (torch's threads wait for each other
at every parallel region, so one thread on a taken core stalls them all: on a shared 2-core machine a
step took 40-60 s instead of about 4 s in one measurement; benchmarks/threads.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path
import resource
import time

from dpaudit.core.errors import DPAuditError


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


def _cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _usable(cpus: set[int]) -> int:
    quota = cpu_quota()
    return len(cpus) if quota is None else min(len(cpus), max(1, math.floor(quota)))


def default_threads() -> int:
    cpus = _cpus()
    return max(1, min(_usable(cpus), round(len(cpus) - busy_cores(set(cpus)))))


class Governor:
    """Re-picks the thread count while a command runs (when the user gave no --threads): a core another
    process takes mid-run is left to it. Each ``adapt()`` reads how busy the cores were since the last call,
    less this process's own CPU time, without sleeping (the start-up sample above cannot see load that
    arrives later; benchmarks/threads.py --late)."""

    def __init__(self) -> None:
        self.cpus = _cpus()
        self.usable = _usable(self.cpus)
        self._last = self._snapshot()

    def _snapshot(self):
        own = resource.getrusage(resource.RUSAGE_SELF)
        try:
            times = _cpu_times(self.cpus)
        except (OSError, ValueError):
            times = {}
        return times, time.monotonic(), own.ru_utime + own.ru_stime

    def adapt(self) -> int | None:
        """The thread count now in force if it changed, else None."""
        before, t0, own0 = self._last
        after, t1, own1 = now = self._snapshot()
        if t1 - t0 < 0.5 or not after:  # too short to tell: the interval runs on to the next call
            return None
        self._last = now
        busy = sum((b1 - before[c][0]) / (n1 - before[c][1]) for c, (b1, n1) in after.items()
                   if c in before and n1 > before[c][1])
        others = max(0.0, busy - (own1 - own0) / (t1 - t0))
        n = max(1, min(self.usable, round(len(self.cpus) - others)))
        import torch

        if n == torch.get_num_threads():
            return None
        torch.set_num_threads(n)
        return n


_GOVERNOR: Governor | None = None


def adapt() -> int | None:
    """Called between steps of long work: re-picks the default thread count (a no-op after --threads N)."""
    return _GOVERNOR.adapt() if _GOVERNOR is not None else None


MAX_THREADS_PER_CORE = 4


def set_threads(threads: int | None) -> int:
    """Apply ``threads`` (None: the default above, re-picked by ``adapt()`` as the load changes) to torch;
    returns the number used."""
    global _GOVERNOR
    n = default_threads() if threads is None else threads
    most = MAX_THREADS_PER_CORE * (os.cpu_count() or 1)
    if n < 1 or n > most:  # each thread reserves a stack: 100,000 of them ran out of memory
        raise DPAuditError(f"--threads must be between 1 and {most} ({MAX_THREADS_PER_CORE} a core), got {n}")
    import torch

    torch.set_num_threads(n)
    _GOVERNOR = Governor() if threads is None else None
    return n
