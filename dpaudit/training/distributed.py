"""torch.distributed for the trainers (launched with torchrun): gloo on CPU, NCCL on GPU.

Every rank draws the same Poisson batch and the same noise from the shared secret seed, evaluates its
shard of the batch, and the ranks sum what is data-dependent: one float per DP-ZO step, the clipped
gradient sum for DP-SGD (Opacus' DistributedDPOptimizer, noise added once, on rank 0). The released
quantities, and hence the accounting, are exactly those of the single-process run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn
import logging
import sys

import numpy as np

from dpaudit.core.errors import DPAuditError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"
    owns_group: bool = False  # setup_world joined the process group, so close() leaves it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, indices: np.ndarray) -> np.ndarray:
        """This rank's share of a batch: every size-th example, starting at rank."""
        return indices[self.rank::self.size]

    def sum(self, value):
        """``value`` (a float, or a numpy vector) added over the ranks, in float64."""
        if self.size == 1:
            return value
        import torch
        import torch.distributed as dist

        t = torch.as_tensor(np.atleast_1d(value), dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) if np.ndim(value) == 0 else t.cpu().numpy()

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Leave the process group this run joined (every rank, after its last collective); a group the
        caller made is the caller's to close. This does not end gloo's worker threads: torch still holds the
        group (DTensor's caches still reference the sharded model's DeviceMesh, which keeps its groups), so
        its backend lives until the interpreter exits (measured with torch 2.13: two ``pt_gloo_runloop``
        threads remain after ``destroy_process_group`` and ``gc.collect``). See ``exit_process``."""
        if self.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def launch_rank() -> int:
    """The global rank torchrun gave this process (its RANK); 0 for a process that torchrun did not start."""
    return int(os.environ.get("RANK", "0"))


_joined = False  # setup_world joined a process group in this process


def joined_a_group() -> bool:
    return _joined


def exit_process(code: int) -> NoReturn:
    """End a process that joined a process group, skipping the interpreter's finalization.

    A C++ thread of torch (gloo's workers hold tensors that Python owns) that takes the GIL while the
    interpreter finalizes is ended by CPython with ``pthread_exit``, whose unwinding through a ``noexcept``
    frame calls ``std::terminate``: "terminate called without an active exception", SIGABRT, and torchrun
    reports a finished run as failed (pytorch/pytorch#38228, #190489). It failed CI twice, and one of about
    400 2-process sharded bf16 runs here; ``close`` alone did not stop it. Everything a run writes is
    already on disk (atomic renames), so once the standard streams and logging are flushed nothing is left
    for finalization to do but that race. Used by the CLI and by scripts that call ``train`` under torchrun.
    """

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be written there
            pass
    os._exit(code)


def setup_world() -> World:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK); one process otherwise."""
    import torch

    cuda = torch.cuda.is_available()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda and local >= torch.cuda.device_count():
        raise DPAuditError(f"process with LOCAL_RANK {local} has no GPU of its own ({torch.cuda.device_count()} visible): "
                           "start at most one process per GPU, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU")
    device = f"cuda:{local}" if cuda else "cpu"
    if size == 1:
        return World(0, 1, device)
    import torch.distributed as dist

    global _joined
    owns = not dist.is_initialized()
    if owns:
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    _joined = True
    return World(dist.get_rank(), dist.get_world_size(), device, owns)
