"""Where a gradient probe's canaries sit, and how they enter a step's clipped sum and leave its release.

Canary i is gain x C x s[i, t] on its own coordinate j_i of the trainable parameters (flat indices over the tensors
in order, as the bundled trainers' white-box canaries): at least one on every trainable tensor, the rest spread in
proportion to the tensors' sizes (``place``), so a tensor released without its noise or clipping carries canaries that
show it (audit/noise_check.py reads each tensor's canary columns). A sampled canary enters clipped to the clip norm
the optimizer uses (``add``), or as a per-example row before clipping (``examples``) for a loop that clips itself;
``read`` takes the m canary coordinates of a release, on its device.
"""

from __future__ import annotations

import numpy as np

from dpaudit.core.errors import DPAuditError
from dpaudit.probes.tallies import SIZE_RATIO


class Injector:
    """The gradient canaries of one probe over ``params`` (``canaries.coordinates`` set: ``place``)."""

    def __init__(self, params: list, canaries, clip: float):
        self.params, self.canaries, self.clip = params, canaries, clip
        self.where = locate(params, canaries.coordinates)  # (parameter index, flat offset) of each canary
        self._gather_plan = None  # (device, per-tensor indices, order) of the release's canary coordinates

    def value(self, max_grad_norm: float) -> float:
        return clipped_value(self.canaries.gain, self.clip, max_grad_norm)

    def add(self, slices, sampled, step: int, max_grad_norm: float) -> None:
        """The sampled canaries, each clipped at ``max_grad_norm``, into clipped sums: ``slices`` holds, per
        parameter, (this rank's slice of the sum, its first flat position, the parameter's size); a canary joins
        the one slice holding its coordinate."""
        value, signs = self.value(max_grad_norm), self.canaries.signs(step)
        for i in sampled:
            k, off = self.where[i]
            grad, at, _ = slices[k]
            if at <= off < at + grad.numel():
                grad.view(-1)[off - at] += value * signs[i]

    def gradients(self, sampled, step: int) -> list:
        """One tensor per parameter, zero but at the sampled canaries' coordinates (each clipped to C)."""
        import torch

        grads = [torch.zeros_like(p) for p in self.params]
        self.add([(g, 0, g.numel()) for g in grads], sampled, step, self.clip)
        return grads

    def examples(self, sampled, step: int) -> list:
        """The sampled canaries as per-example gradients before clipping: (k, *shape) per parameter; odd canaries
        SIZE_RATIO times larger (the clipping check, audit/clipping.py)."""
        import torch

        signs = self.canaries.signs(step)
        rows = [torch.zeros((len(sampled), *p.shape), dtype=p.dtype, device=p.device) for p in self.params]
        for r, i in enumerate(sampled):
            k, off = self.where[i]
            rows[k][r].view(-1)[off] = self.canaries.gain * self.clip * signs[i] * (SIZE_RATIO if i % 2 else 1.0)
        return rows

    def read(self, slices, scale: float, all_sum=None):
        """The release's m canary coordinates (``scale`` times): gathered on the release's device where one process
        holds whole tensors (a tensor when ``keeps_rows``, else numpy), else read slice by slice and put together
        by ``all_sum`` (a numpy vector summed over the ranks)."""
        if all_sum is None and all(at == 0 and grad.numel() == n for grad, at, n in slices):
            row = self.gather([grad for grad, _, _ in slices]).double() * scale
            return row if self.keeps_rows(row) else row.numpy()
        row = np.zeros(len(self.where))
        for i, (k, off) in enumerate(self.where):
            grad, at, _ = slices[k]
            if at <= off < at + grad.numel():
                row[i] = float(grad.reshape(-1)[off - at]) * scale
        return np.asarray(all_sum(row) if all_sum else row, float)

    @staticmethod
    def keeps_rows(row) -> bool:
        """Whether a gathered row waits on its device for the block's copy: on a GPU (a copy a step would wait for
        the step to finish)."""
        return row.device.type != "cpu"

    def gather(self, released):
        """The canaries' coordinates of the whole released tensors, in canary order: one index per tensor that
        holds canaries, on the tensors' device (no host synchronisation)."""
        import torch

        device = released[0].device
        plan = self._gather_plan
        if plan is None or plan[0] != device:
            by_tensor: dict = {}
            for i, (k, off) in enumerate(self.where):
                by_tensor.setdefault(k, []).append((i, off))
            order = [i for k in sorted(by_tensor) for i, _ in by_tensor[k]]
            index = [(k, torch.tensor([off for _, off in by_tensor[k]], device=device)) for k in sorted(by_tensor)]
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
            plan = self._gather_plan = (device, index, inverse.to(device))
        _, index, inverse = plan
        values = torch.cat([released[k].reshape(-1)[idx].float() for k, idx in index])
        return values[inverse]


def checked_release(released, clipped, params: list) -> list:
    """A gradient release as given to ``observe`` (one tensor per parameter, in order), detached; refused in one line
    when its tensors, or the clipped sums beside them, do not match the parameters."""
    released = [r.detach() for r in released]
    if len(released) != len(params):
        raise DPAuditError(f"observe() got {len(released)} tensors for {len(params)} parameters")
    wrong = [k for k, (r, p) in enumerate(zip(released, params)) if r.numel() != p.numel()]
    if wrong:
        raise DPAuditError(f"observe() got tensor {wrong[0]} of {released[wrong[0]].numel()} values for a "
                           f"parameter of {params[wrong[0]].numel()}: give the released gradient sums, one "
                           "tensor per parameter, in the parameters' order")
    if clipped is not None and len(clipped) != len(released):
        raise DPAuditError(f"observe() got {len(clipped)} clipped sums for {len(params)} parameters")
    return released


def clipped_value(gain: float, clip: float, max_grad_norm: float) -> float:
    """A canary's clipped size: gain x C brought to the clip norm the optimizer uses."""
    size = gain * clip
    return size * min(1.0, max_grad_norm / size) if max_grad_norm > 0 else 0.0


def place(params: list, m: int, seed: int) -> list[int]:
    """m distinct coordinates (public, from the seed): at least one on every trainable tensor, the rest in proportion
    to the tensors' sizes. The per-sample rows a canary costs do not grow with its tensor (probe_opacus.inject clips
    stand-ins of the canaries' coordinates alone)."""
    sizes = np.array([p.numel() for p in params], np.int64)
    total = int(sizes.sum())
    if m > total:
        raise DPAuditError(f"{m} gradient canaries need as many trainable coordinates; there are {total}")
    if m < sizes.size:
        raise DPAuditError(f"m = {m} gradient canaries cannot cover the {sizes.size} trainable tensors (each "
                           f"carries at least one, so noise missing on any shows); give m >= {sizes.size}")
    counts = per_tensor_counts(sizes, m)
    rng = np.random.default_rng([seed, 2])
    starts = np.cumsum([0] + sizes.tolist())
    return sorted(int(starts[k] + j) for k, n in enumerate(counts)
                  for j in rng.choice(int(sizes[k]), int(n), replace=False))


def locate(params: list, coordinates) -> list[tuple[int, int]]:
    """(parameter index, flat offset) of each canary coordinate."""
    starts = np.cumsum([0] + [p.numel() for p in params])
    where = []
    for j in coordinates:
        k = int(np.searchsorted(starts, j, side="right") - 1)
        where.append((k, j - int(starts[k])))
    return where


def per_tensor_counts(sizes: np.ndarray, m: int) -> np.ndarray:
    """How many of m canaries each tensor carries: one each, the other m - n in proportion to the sizes (largest
    remainders), never more than a tensor's size. Needs n <= m <= sizes.sum()."""
    counts = np.ones(sizes.size, np.int64)
    while counts.sum() < m:
        room = sizes - counts
        share = (m - counts.sum()) * room / room.sum()
        add = np.minimum(np.floor(share).astype(np.int64), room)
        if add.sum() == 0:  # what is left is less than one a tensor: to the largest remainders with room
            order = np.argsort(-(share - np.floor(share)) - (room > 0), kind="stable")
            add[order[:m - counts.sum()]] = 1
            add = np.minimum(add, room)
        counts += add
    return counts
