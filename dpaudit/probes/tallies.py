"""What a probe tallies beside its transcript for the checks the audit makes: the per-example clipping check's
sums by canary size (audit/clipping.py) and the per-tensor noise (audit/noise_check.py). Both are saved whole,
atomically, and read back on a resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpaudit.audit.clipping import TALLY as CLIP_TALLY, read_tally as read_clip_tally
from dpaudit.audit.noise_check import TALLY as NOISE_TALLY, read_tally as read_noise_tally
from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.run_record import stamped

SIZE_RATIO = 8.0  # odd canaries' per-example rows are this much larger (WhiteBoxProbe.canary_examples)
FULL_PRECISION = ("torch.float32", "torch.float64")  # releases the per-tensor noise check measures


class ClipTally:
    """Count, sum and sum of squares of the sampled canaries' signed releases in units of C, by size (row 0: the
    gain x C canaries, row 1: SIZE_RATIO times larger). Made from the members: saved 0600."""

    def __init__(self, values: np.ndarray | None = None):
        self.values = values

    @classmethod
    def resumed(cls, out: Path, run_id: str) -> "ClipTally":
        tally = read_clip_tally(out, run_id)  # up to its last save, never past the transcript's rows
        return cls(None if tally is None else np.array([tally["small"], tally["large"]], float))

    def add(self, signs: np.ndarray, sampled: np.ndarray, row: np.ndarray, clip: float) -> None:
        if sampled.size == 0:
            return
        x = signs[sampled] * np.asarray(row, float)[sampled] / clip
        big = sampled % 2 == 1
        if self.values is None:
            self.values = np.zeros((2, 3))
        for c, chosen in enumerate((~big, big)):
            self.values[c] += (chosen.sum(), x[chosen].sum(), (x[chosen] ** 2).sum())

    def save(self, out: Path, run_id: str, steps: int) -> None:
        if self.values is None:
            return
        atomic_write_json(Path(out) / CLIP_TALLY, private=True, data=stamped(CLIP_TALLY, {
            "run_id": run_id, "size_ratio": SIZE_RATIO, "steps": steps,
            "small": [float(v) for v in self.values[0]], "large": [float(v) for v in self.values[1]]}))


class NoiseTally:
    """Each tensor's summed squared noise (a release minus its clipped sum) and the steps measured: what earlier
    attempts saved (``prior``) and this one's, kept on the tensors' device until saved (no host synchronisation)."""

    def __init__(self, prior: np.ndarray | None = None, prior_steps: np.ndarray | None = None):
        self.prior, self.prior_steps = prior, prior_steps
        self.squares = self.steps = None   # this attempt's, on the device

    @classmethod
    def resumed(cls, out: Path, run_id: str) -> "NoiseTally":
        noise = read_noise_tally(out, run_id)  # each tallied step's noise was a real draw: kept
        if noise is None:
            return cls()
        return cls(np.array(noise["squares"], float), np.array(noise["steps"], float))

    def add(self, released, clipped, device) -> None:
        import torch

        # 16-bit releases are not measured: rounding the clipped sum plus noise can swallow the noise where the sum is
        # large (a post-processing, still DP), which would read as noise missing (noise_check.py)
        measured = [r is not None and c is not None and str(r.dtype) in FULL_PRECISION
                    for r, c in zip(released, clipped)]
        squares = torch.stack([torch.linalg.vector_norm(r.reshape(-1).float() - c.reshape(-1).float()).to(device) ** 2
                               if ok else torch.zeros((), device=device)
                               for r, c, ok in zip(released, clipped, measured)]).double()
        counts = torch.tensor(measured, dtype=torch.float64, device=device)
        if self.squares is None:
            self.squares, self.steps = squares, counts
        else:
            self.squares, self.steps = self.squares + squares, self.steps + counts

    def save(self, out: Path, run_id: str, sizes: list[int]) -> None:
        """Sums of squared noise beside the transcript (nothing of the members)."""
        if self.squares is None and self.prior is None:
            return
        squares = np.zeros(len(sizes)) if self.prior is None else self.prior
        steps = np.zeros(len(sizes)) if self.prior is None else self.prior_steps
        if self.squares is not None:
            squares, steps = squares + self.squares.cpu().numpy(), steps + self.steps.cpu().numpy()
        atomic_write_json(Path(out) / NOISE_TALLY, stamped(NOISE_TALLY, {
            "run_id": run_id, "steps": [int(n) for n in steps], "sizes": list(sizes),
            "squares": [float(v) for v in squares]}))
