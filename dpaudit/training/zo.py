"""DP-ZO (Tang et al. 2024, Algorithms 1-2) and its non-private baseline (MeZO-style SPSA).

Per step: a public seed gives a direction z (directions.py: Rademacher +-1 by default, SPSA's classic
perturbation, on the sqrt(d)-sphere with E[z z^T] = I and a third of a Gaussian pass's cost on CPU;
Gaussian, as in the DP-ZO paper; or uniform on the sqrt(d)-sphere as in DPZero);
each example's loss difference l(theta + phi z) - l(theta - phi z) is clipped to [-C, C]; the sum gets
Gaussian N(0, C^2 sigma^2) or Laplace(0, C sigma) noise; theta <- theta - lr * s * z with
s = noisy sum / (2 phi B). Only the scalar s touches the data, so (seed, s) pairs replay the run.
Memory is that of inference: z is regenerated from its seed, chunk by chunk, and never stored.
No library implements this (MeZO's and DP-ZO's code are research scripts), hence written here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
import json

import numpy as np
import torch

from dpaudit.training.data import padded_chunks, per_example_loss, user_means
from dpaudit.training.directions import DEFAULT_DIRECTION, DIRECTIONS, STREAM_KIND
from dpaudit.training.frozen_trunk import loss_function
from dpaudit.training.shard import local_slices
from dpaudit.training.streams import COUNTER, LEGACY, STREAM, add_counter_, add_stream_, counter_square_sum, square_sum
from dpaudit.accounting.noises import noise


@dataclass(frozen=True)
class ZOSettings:
    lr: float
    phi: float = 1e-3               # perturbation scale
    clip: float | None = 1.0        # C; None = no clipping (non-private)
    noise: str | None = "gaussian"  # gaussian, laplace, or None (non-private)
    sigma: float = 0.0              # noise multiplier (Gaussian std / Laplace scale, in units of C)
    direction: str = DEFAULT_DIRECTION
    clip_examples: bool = True      # False only for the planted bug "no-clip" (noise still scaled by C)
    micro_batch: int = 0            # at most this many examples per forward pass (0: the whole batch)
    stream: str = STREAM            # how z is drawn from its seed (streams.py; LEGACY: runs before it)

    @property
    def example_clip(self) -> float | None:
        return self.clip if self.clip_examples else None


def _legacy_chunks(params, seed: int):
    """Runs before streams.STREAM (replay only): z from one generator over the parameters in order."""
    gen = torch.Generator(device=params[0].device).manual_seed(int(seed))
    for p in params:
        yield p, torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)


def direction_scale(params, seed: int, direction: str, stream: str = STREAM, shard_sum=lambda x: x) -> float:
    """1 for Gaussian and Rademacher z (the latter has ||z|| = sqrt(d) already); sqrt(d) / ||g|| to put
    Gaussian g on the sqrt(d)-sphere (one extra regeneration pass). ``shard_sum`` adds the ranks' partial
    sums when each holds a shard of the weights."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; use {', '.join(DIRECTIONS)}")
    if direction != "sphere":
        return 1.0
    if stream == LEGACY:
        sq = sum(float(g.square().sum()) for _, g in _legacy_chunks(params, seed))
        d = sum(p.numel() for p in params)
    elif stream == COUNTER:
        pieces = list(local_slices(params))
        sq = shard_sum(counter_square_sum([t for t, _, _ in pieces], seed, [at for _, at, _ in pieces]))
        d = sum(total for _, _, total in pieces)
    else:
        pieces = list(local_slices(params))
        sq = shard_sum(sum(square_sum(seed, i, local.numel(), at, total, local.device)
                           for i, (local, at, total) in enumerate(pieces)))
        d = sum(total for _, _, total in pieces)
    return math.sqrt(d / sq)


@torch.no_grad()
def add_direction(params, seed: int, factor: float, stream: str = STREAM, direction: str = DEFAULT_DIRECTION) -> None:
    """theta <- theta + factor * z, in place (on this process's shard of each weight, when sharded)."""
    kind = STREAM_KIND.get(direction)
    if kind is None:
        raise ValueError(f"unknown direction {direction!r}; use {', '.join(DIRECTIONS)}")
    if stream == LEGACY and kind == "normal":
        for p, g in _legacy_chunks(params, seed):
            p.add_(g.to(p.dtype), alpha=factor)
        return
    if stream == COUNTER:  # every parameter in one call: one kernel each when compiled (streams.py)
        pieces = list(local_slices(params))
        add_counter_([t for t, _, _ in pieces], seed, factor, kind, [at for _, at, _ in pieces])
        return
    if stream != STREAM:
        raise ValueError(f"direction {direction!r} cannot be drawn from stream {stream!r}")
    for i, (local, at, total) in enumerate(local_slices(params)):
        add_stream_(local, seed, i, factor, at, total, kind)


@torch.no_grad()
def perturbed_losses(model, params, batch, seed: int, phi: float, scale: float, micro_batch: int = 0,
                     stream: str = STREAM, passes: int = 0, direction: str = DEFAULT_DIRECTION,
                     loss_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example l(theta + phi z) and l(theta - phi z). Leaves theta at theta - phi z: the caller's
    update pass restores it (restore and update in one pass over the weights, three passes a step).
    ``passes``: sharded weights are gathered in every forward, so every rank runs exactly this many
    forwards each way (padded_chunks), whatever its share of the batch. ``loss_fn(batch, micro_batch)``:
    the losses without a pass through the model where the run allows it (frozen_trunk.py)."""
    def losses():
        if loss_fn is not None and not passes:
            return loss_fn(batch, micro_batch)
        if not passes:
            return per_example_loss(model, batch, micro_batch)
        out = [(per_example_loss(model, chunk), real) for chunk, real in padded_chunks(batch, micro_batch, passes)]
        return torch.cat([x for x, real in out if real] or [torch.zeros(0)])

    add_direction(params, seed, phi * scale, stream, direction)
    plus = losses()
    add_direction(params, seed, -2 * phi * scale, stream, direction)
    minus = losses()
    return plus, minus


def clipped_sum(diffs: torch.Tensor, clip: float | None) -> float:
    """Sum of the per-example differences, each clipped to [-C, C] (no clipping when C is None)."""
    if clip is not None:
        diffs = diffs.clamp(-clip, clip)
    return float(diffs.double().sum()) if diffs.numel() else 0.0


def privatize(total: float, settings: ZOSettings, denominator: float, rng: np.random.Generator) -> float:
    """s = (clipped sum + noise) / (2 phi B): the only data-dependent quantity of a step. The noise is drawn by
    its own record (accounting/noises: ``noise(kind).draw``), with scale C sigma."""
    if settings.noise is not None:
        total += noise(settings.noise).draw(rng, settings.clip * settings.sigma)
    return total / (2 * settings.phi * denominator)


def noisy_scalar(diffs: torch.Tensor, settings: ZOSettings, denominator: float, rng: np.random.Generator) -> float:
    return privatize(clipped_sum(diffs, settings.example_clip), settings, denominator, rng)


def apply_update(params, seed: int, scalar: float, lr: float, scale: float, stream: str = STREAM,
                 direction: str = DEFAULT_DIRECTION) -> None:
    add_direction(params, seed, -lr * scalar * scale, stream, direction)


def zo_step(model, params, batch, seed: int, settings: ZOSettings, denominator: float,
            rng: np.random.Generator, all_sum=lambda x: x, canary_diffs: torch.Tensor | None = None,
            shard_sum=None, passes: int = 0, loss_fn=None, users: torch.Tensor | None = None) -> tuple[float, float]:
    """One step; returns (s, mean loss around theta on this process's examples: NaN if it had none).

    ``all_sum`` adds the clipped sums of all data-parallel ranks (a few bytes); every rank draws the
    same noise from the same generator, so every rank applies the same update. ``canary_diffs`` are
    the loss differences of the sampled white-box canaries (the same on every rank, so added once),
    clipped like every example's. Sharded weights (``shard_sum`` adds over the ranks, ``passes`` forwards
    each way on every rank): each rank perturbs and updates its own shard with its slice of z. ``users`` (ULS):
    each row's user; a user's differences are averaged into one before clipping.
    """
    stream = settings.stream
    scale = direction_scale(params, seed, settings.direction, stream, shard_sum or (lambda x: x))
    if batch["input_ids"].shape[0] == 0 and not passes:
        plus = minus = torch.zeros(0)
        restore = 0.0
    else:
        plus, minus = perturbed_losses(model, params, batch, seed, settings.phi, scale, settings.micro_batch,
                                       stream, passes, settings.direction, loss_fn)
        restore = settings.phi * scale
    diffs = plus - minus if users is None or not plus.numel() else user_means(plus - minus, users)
    total = all_sum(clipped_sum(diffs, settings.example_clip))
    if canary_diffs is not None:
        total += clipped_sum(canary_diffs, settings.example_clip)
    s = privatize(total, settings, denominator, rng)
    add_direction(params, seed, restore - settings.lr * s * scale, stream, settings.direction)
    return s, float((plus + minus).mean() / 2) if plus.numel() else float("nan")


def public_seed(seed: int, step: int) -> int:
    """The per-step direction seed: public, logged, and derivable from (run seed, step)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


class ZOTrainer:
    """DP-ZO behind the trainer protocol (methods.Trainer): ``run_step`` (one step, returns the loss),
    ``state_dict`` (nothing beyond the weights) and ``close``. Its transcript is the (seed, scalar) log.
    Sampled white-box canaries add their loss differences to the clipped sum. The step's seams, which planted
    bugs override (bugs.py): ``clip_norm`` (each difference clipped to [-C, C]), ``divisor`` (the expected
    batch size B), ``noise_rng`` (the run's secret generator) and ``on_release`` (the log line)."""

    def __init__(self, model, params, settings: ZOSettings, *, run_seed: int, expected_batch: int, private: bool,
                 rng: np.random.Generator, log_path=None, canaries=None, clip: float = 1.0,
                 all_sum=lambda x: x, sharding=None, per_user: bool = False):
        self.model, self.params, self.settings = model, params, settings
        self.settings = replace(settings, clip_examples=self.clip_norm() == settings.clip)
        # Dropout off (as MeZO does): the two forwards of a step must evaluate one function, or their
        # difference is that of two dropout masks, not of theta +- phi z (GPT-2 and OPT checkpoints ship
        # with dropout 0.1; from_pretrained happens to return eval mode, a wrapper may not).
        model.eval()
        self.sharding = sharding  # shard.Sharding when the weights are sharded over the ranks
        # new-token rows alone: the losses from one forward's trunk outputs (frozen_trunk.py), checked there
        self.loss_fn = loss_function(model, params) if sharding is None else None
        self.run_seed, self.expected_batch, self.private = run_seed, expected_batch, private
        self.rng, self.canaries, self.clip, self.all_sum = rng, canaries, clip, all_sum
        self.realised_batch = 0
        self.per_user = per_user   # ULS (the runner's user_source batches carry each row's user)
        self.log = open(log_path, "a", encoding="utf-8") if log_path is not None else None

    # -- the seams ---------------------------------------------------------------------------------------
    def clip_norm(self) -> float | None:
        return self.settings.clip

    def clips_per_user(self) -> bool:
        """ULS: a user's loss differences averaged into one, clipped to [-C, C] as one."""
        return self.per_user

    def divisor(self) -> float:
        return self.expected_batch if self.private else max(1, self.realised_batch)

    def noise_rng(self, seed: int) -> np.random.Generator:
        return self.rng

    def on_release(self, step: int, seed: int, scalar: float) -> None:
        if self.log is not None:
            self.log.write(json.dumps({"step": step, "seed": seed, "scalar": scalar}) + "\n")
            self.log.flush()

    def run_step(self, step: int, batch, n_sampled: int, sampled_canaries) -> float:
        seed = public_seed(self.run_seed, step)
        self.realised_batch = n_sampled
        diffs = None
        per_user = self.clips_per_user()
        if per_user:   # a canary user's records join as one clipped difference
            sampled_canaries = np.unique(sampled_canaries)
        if len(sampled_canaries):
            c = self.canaries
            diffs = torch.as_tensor(c.gain * self.clip * c.signs(step)[sampled_canaries])
        sharded = self.sharding is not None
        scalar, loss = zo_step(self.model, self.params, batch, seed, self.settings, self.divisor(),
                               self.noise_rng(seed), self.all_sum, canary_diffs=diffs,
                               shard_sum=self.sharding.sum if sharded else None,
                               passes=self.sharding.passes(n_sampled, self.settings.micro_batch) if sharded else 0,
                               loss_fn=self.loss_fn, users=batch.get("user") if per_user else None)
        self.on_release(step, seed, scalar)
        return loss

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict) -> None:
        """Nothing to load: a DP-ZO step keeps no optimizer state beyond the weights."""

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def replay(params, steps, lr: float, direction: str, stream: str = STREAM) -> None:
    """Re-apply logged (seed, s) pairs to the base weights: the fine-tuned model, without the data."""
    for seed, s in steps:
        apply_update(params, seed, s, lr, direction_scale(params, seed, direction, stream), stream, direction)
