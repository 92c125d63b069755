"""One progress display for all long work (accounting, scoring, training), on stderr so --json stays clean:
a rich bar on a terminal; in logs and pipes (CI, nohup) one plain line every few seconds with the count,
the rate, the ETA and whatever the caller adds (loss, eps spent)."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

LOG_EVERY_S = 5.0


@contextmanager
def progress_bar(total: int, description: str, enabled: bool = True) -> Iterator[Callable[..., None]]:
    """Yields ``advance(n=1, note=None)``."""
    if not enabled:
        yield lambda n=1, note=None: None
        return
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        yield _log_lines(total, description)
        return
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1, note=None: bar.advance(task, n)


def _log_lines(total: int, description: str) -> Callable[..., None]:
    start = last = time.monotonic()
    done = 0

    def advance(n: int = 1, note: str | None = None) -> None:
        nonlocal done, last
        done += n
        now = time.monotonic()
        if now - last < LOG_EVERY_S and done < total:
            return
        last = now
        rate = done / max(now - start, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        extra = f", {note}" if note else ""
        print(f"{description}: {done}/{total} ({100 * done / max(total, 1):.0f}%), {rate:.3g}/s, "
              f"ETA {eta:.0f} s{extra}", file=sys.stderr, flush=True)

    return advance
