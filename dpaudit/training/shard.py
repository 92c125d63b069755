"""ZeRO-3 data parallelism (``--shard``) on PyTorch FSDP2 (``fully_shard``): each of W ranks keeps
1/W of every weight, of its gradient and of its optimizer state; a layer's weights are gathered just
before it runs and freed after, forward and backward.

What is released does not change (Bu et al. 2023, "Zero redundancy distributed learning with
differential privacy", DP-ZeRO): the clipped sum of a Poisson batch plus one Gaussian draw (DP-SGD),
or one noisy scalar (DP-ZO). Each rank clips its own examples on gathered layers (per-example norms
need only the layer's inputs and output gradients, which a rank has in full), the clipped sums are
reduce-scattered, and each rank adds the noise of its own slice, drawn from the position-addressable
stream (streams.py) that a single process draws whole. So the noisy update, the DP-ZO log and the
accounting are those of one process; only float summation order differs.

FSDP2 shards dimension 0 of every parameter in ``torch.chunk`` pieces: rank r holds rows
[r * ceil(n / W), ...), a contiguous run of the flattened parameter, which is what ``local_slices``
reports. Ranks gather weights in every forward and backward, so every rank runs the same number of
passes each step (``Sharding.passes``), padding with placeholder chunks when its share is smaller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Sharding:
    size: int                           # ranks sharing each weight (the world size)
    sum: Callable                       # a float or a numpy vector added over the ranks (World.sum)

    def passes(self, sampled: int, micro_batch: int) -> int:
        """Forward (and backward) passes every rank runs for a batch of ``sampled`` examples: those of
        the largest share (rank 0's, ceil(sampled / W)), at least one."""
        most = math.ceil(sampled / self.size)
        return max(1, math.ceil(most / micro_batch) if micro_batch else 1)


def local_slices(params):
    """(local tensor, position of its first element in the flattened parameter, parameter's size)
    for each parameter: the whole tensor when it is not sharded."""
    for p in params:
        if not _is_dtensor(p):
            yield p, 0, p.numel()
            continue
        from torch.distributed.tensor import Shard

        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"expected parameters sharded on dimension 0, got {p.placements}")
        local = p.to_local()
        rows = p.shape[0]
        per = math.ceil(rows / p.device_mesh.size())
        first = min(p.device_mesh.get_local_rank() * per, rows)
        if local.shape[0] != max(0, min(per, rows - first)):
            raise ValueError(f"unexpected shard of {tuple(p.shape)}: {tuple(local.shape)} rows from {first}")
        yield local, first * (p.numel() // rows if rows else 0), p.numel()


def _is_dtensor(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def layer_classes(model) -> set[str]:
    """The repeated blocks to shard one by one: transformers' ``_no_split_modules`` names them."""
    return set(getattr(model, "_no_split_modules", None) or ())


def shard_model(model, device: str, world_size: int, bf16: bool, weights_change_between_forwards: bool) -> None:
    """fully_shard each repeated block, then the rest (embeddings, tied output layer, final norm) as
    one unit. ``bf16``: weights gathered and computed in bf16 while the shards (the optimizer's
    master copy) stay float32, and gradients are reduced in float32; no loss scaling.
    ``weights_change_between_forwards`` (DP-ZO perturbs the shards between its two forwards): the root
    unit is freed after each forward too; FSDP2 otherwise keeps it gathered for the backward, and the
    second forward would run on the first one's weights."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.split(":")[0], (world_size,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    blocks = layer_classes(model)
    units = [m for m in model.modules() if type(m).__name__ in blocks]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy,
                reshard_after_forward=True if weights_change_between_forwards else None)
    for unit in [*units, model]:
        unit.set_gradient_divide_factor(1.0)  # sums over the ranks, not means: the clipped sum
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


def full_state_dict(model) -> dict:
    """The whole model's weights on CPU, on rank 0 (empty elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer's state with whole tensors keyed by parameter name, on rank 0; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gathered(slices: list, params) -> list:
    """Whole tensors (on rank 0; every rank calls) from each rank's slices of ``params`` (``slices[i]`` the rank's
    local part of parameter i, as ``local_slices`` cuts it): each rank places its slice in a zero tensor and the
    ranks sum them (the slices do not overlap). Memory: one parameter at a time, whole, on every rank."""
    import torch
    import torch.distributed as dist

    out = []
    for part, (local, first, numel), p in zip(slices, local_slices(params), params):
        whole = torch.zeros(numel, dtype=part.dtype)
        whole[first:first + part.numel()] = part.detach().reshape(-1).cpu()
        if dist.is_available() and dist.is_initialized():
            dist.reduce(whole, dst=0)
        out.append(whole.view(tuple(p.shape)))
    return out


def sliced(whole: list, params) -> list:
    """This rank's slices (as ``local_slices`` cuts them) of whole tensors of ``params``."""
    return [w.reshape(-1)[first:first + local.numel()].view_as(local).to(local.device)
            for w, (local, first, _) in zip(whole, local_slices(params))]


def load_optimizer_state(model, optimizer, state: dict) -> None:
    """Each rank keeps its slices of a state saved by ``full_optimizer_state``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
