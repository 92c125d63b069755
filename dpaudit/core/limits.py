"""What an accounting answer may cost: a memory budget and a deadline, known before anything is allocated.

Accountants read the active ``Budget`` (a context variable, so a calibration's many evaluations share
one deadline) and estimate their grid or sample size against it *before* allocating: over budget, they
fall back to a valid coarser bound and say so, or refuse with one line that names the limit and what
would fit. The CLI sets it from ``--max-memory`` / ``--timeout``; Python callers pass ``max_memory``.
"""

from __future__ import annotations

import contextvars
import math
import re
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from dpaudit.core.errors import DPAuditError

DEFAULT_MAX_MEMORY = 2 * 1024**3  # bytes
DEFAULT_TIMEOUT = 60.0  # seconds, for a command
PROCESS_BASELINE = 160 * 1024**2  # what the interpreter and libraries hold before an accountant allocates

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3,
          "t": 1024**4, "tb": 1024**4}


class OverBudget(DPAuditError):
    """Refused: the answer would not fit the memory or time budget; ``needed`` bytes, when known."""

    def __init__(self, message: str, needed: float = math.nan) -> None:
        super().__init__(message)
        self.needed = needed


class TimeUp(DPAuditError):
    """Refused: the command's --timeout passed (a training run says what its ledger counts)."""


@dataclass(frozen=True)
class Budget:
    max_memory: int = DEFAULT_MAX_MEMORY
    deadline: float | None = None  # time.monotonic() value; None: no deadline
    explicit: bool = False         # max_memory was given (--max-memory), not the accountants' default

    def seconds_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    @property
    def available(self) -> float:
        """Bytes an accountant may allocate: the budget less the process baseline."""
        return max(0.0, self.max_memory - PROCESS_BASELINE)

    def fits(self, nbytes: float) -> bool:
        """Would ``nbytes`` more, on top of the process baseline, stay within the budget?"""
        return nbytes <= self.available

    def require(self, nbytes: float, what: str, fits_instead: str = "") -> None:
        if not self.fits(nbytes):
            hint = f"; {fits_instead}" if fits_instead else ""
            raise OverBudget(f"{what} needs about {human_bytes(nbytes)}, over the memory budget of "
                             f"{human_bytes(self.max_memory)} (--max-memory){hint}", needed=nbytes)


_ACTIVE: contextvars.ContextVar[Budget] = contextvars.ContextVar("dpaudit_budget", default=Budget())


def current() -> Budget:
    return _ACTIVE.get()


@contextmanager
def limits(max_memory: int | str | None = None, timeout: float | None = None):
    """Run the block under a memory budget (bytes, or '2G'-style text; None: keep the current one) and a
    deadline ``timeout`` s away (a nested deadline never extends the outer one)."""
    outer = current()
    memory = outer.max_memory if max_memory is None else parse_memory(max_memory)
    deadline = outer.deadline
    if timeout is not None:
        if not (timeout > 0 and math.isfinite(timeout)):
            raise DPAuditError(f"timeout must be a positive number of seconds, got {timeout}")
        mine = time.monotonic() + timeout
        deadline = mine if deadline is None else min(deadline, mine)
    token = _ACTIVE.set(Budget(memory, deadline, outer.explicit or max_memory is not None))
    try:
        yield current()
    finally:
        _ACTIVE.reset(token)


@contextmanager
def alarm(seconds: float | None, what: str):
    """Stop the block with one refusal (DPAuditError) once ``seconds`` have passed: SIGALRM interrupts the
    work wherever it is. Only the main thread can take signals; elsewhere (and for ``None``) the deadline
    is only planned within and checked by ``check_deadline``."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if not (seconds > 0 and math.isfinite(seconds)):
        raise DPAuditError(f"--timeout must be a positive number of seconds, got {seconds}")

    def expired(signum, frame):
        raise TimeUp(f"{what} ran past its time budget of {seconds:g} s (--timeout); nothing was decided")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def enforced(max_memory: int | str | None, timeout: float | None, what: str):
    """``limits`` and ``alarm`` together: the budget accountants plan within, and a deadline that stops."""
    with limits(max_memory=max_memory, timeout=timeout), alarm(timeout, what):
        yield


def check_deadline(what: str) -> None:
    """Refuse once the deadline in force has passed (loops call this; worker pools cannot take SIGALRM)."""
    if current().seconds_left() < 0:
        raise TimeUp(f"{what} ran past its time budget (--timeout); nothing was decided")


def available_bytes() -> int | None:
    """Memory this process may still use: MemAvailable, or less under a cgroup (v2) limit."""
    found = []
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = open("/sys/fs/cgroup/memory.max", encoding="ascii").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current", encoding="ascii").read())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def parse_memory(value: int | float | str) -> int:
    """Bytes from 2147483648, '2G', '512MB', '1.5g'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise DPAuditError(f"memory budget must be a size like 2G, 512M or a number of bytes, got {value!r}")
        number, unit = float(m.group(1)), m.group(2).lower()
    nbytes = number * _UNITS[unit]
    if not (math.isfinite(nbytes) and nbytes >= 256 * 1024**2):
        raise DPAuditError(f"memory budget must be at least 256M (the process itself holds ~160M), got {value!r}")
    return int(nbytes)


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
