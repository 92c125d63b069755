"""One progress bar for all long work (accounting, scoring, training): rich, on stderr, or nothing."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def progress_bar(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(n)``; draws on stderr so that --json output on stdout stays clean."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if not (enabled and console.is_terminal):  # logs and pipes get no bar
        yield lambda n=1: None
        return
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
