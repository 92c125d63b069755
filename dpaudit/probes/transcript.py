"""A probe's transcript: one row of ``width`` float32 a released step, appended to whitebox_transcript.f32.

Rows on a GPU wait on the device and are copied to the host in blocks of ``BLOCK_ROWS`` steps (a copy a step would
wait for the step to finish); rows on the host are written at their step. Each row may carry the canaries sampled
at its step, handed back when the row is written (the clipping check's tally reads the row then)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

BLOCK_ROWS = 64  # steps whose rows wait on the device before one copy to the transcript (``flush``)


class Transcript:
    def __init__(self, path: Path, width: int, write: bool = True):
        self.path, self.width = Path(path), width
        self._fh = open(self.path, "ab") if write else None
        self._pending: list = []          # rows not yet written (numpy, or tensors on their device)
        self._pending_drawn: list = []    # per pending row: (step, sampled canaries) to tally, or None

    @property
    def writing(self) -> bool:
        return self._fh is not None and not self._fh.closed

    @property
    def rows(self) -> int:
        """Rows in the file (complete ones)."""
        return (self.path.stat().st_size if self.path.exists() else 0) // (4 * self.width)

    def cut(self, rows: int) -> None:
        """Keep the file's first ``rows`` rows (a resumed run rewrites what followed; a crash mid-row left a row
        that was never complete)."""
        if self.path.exists() and self.path.stat().st_size > rows * self.width * 4:
            with open(self.path, "r+b") as fh:
                fh.truncate(rows * self.width * 4)

    def add(self, row, drawn) -> bool:
        """Keep the step's row; True when it is time to ``flush`` (a host row, or a full block on the device)."""
        self._pending.append(row)
        self._pending_drawn.append(drawn)
        return isinstance(row, np.ndarray) or len(self._pending) >= BLOCK_ROWS

    def flush(self, on_row=None) -> bool | None:
        """Write the kept rows (one copy to the host for those on a device) and flush the file; ``on_row(step,
        sampled, row)`` for each row that carries its sampled canaries. Returns whether any row was on a device
        (None: nothing was written)."""
        if not self._pending or not self.writing:
            return None
        import torch

        on_device = [r for r in self._pending if not isinstance(r, np.ndarray)]
        host = iter(torch.stack(on_device).cpu().numpy()) if on_device else iter(())
        for r, drawn in zip(self._pending, self._pending_drawn):
            row = np.asarray(r if isinstance(r, np.ndarray) else next(host))
            self._fh.write(row.astype("<f4").tobytes())
            if drawn is not None and on_row is not None:
                on_row(*drawn, row)
        self._fh.flush()
        self._pending.clear()
        self._pending_drawn.clear()
        return bool(on_device)

    def close(self) -> None:
        if self.writing:
            self._fh.close()
