"""The training methods: the protocol every trainer keeps, and each method registered once.

A run (``runner.train``) owns everything around the steps: sampling, the write-ahead ledger, checkpoints,
the run folder. A trainer owns one step and its optimizer state, behind four calls:

    run_step(step, batch, n_sampled, sampled_canaries) -> mean loss   one DP step (batch: this rank's share)
    state_dict() -> dict | None                                        what a checkpoint keeps beyond the weights
    load_state_dict(state)                                             its inverse, on --resume
    close()                                                            ends the run (transcripts closed, memory freed)

``METHODS`` maps a method's name to its record: defaults, the noises it can add, the kind of white-box canary it
takes, what it releases, the facts the run's checks and estimates need, and how its trainer is built from a
``TrainerSetup``. The CLI's choices, the run's checks, the memory estimate, sharding, replay and the white-box
audit read the record, never the name, so a new method is one record (``register_method``) plus the file of
its trainer; tests/training/test_extension.py adds one from a temporary module and trains with it. Trainer modules are
imported only when one is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from dpaudit.accounting.matrix.strategy import banded_coefs
from dpaudit.core import run_folder
from dpaudit.core.errors import DPAuditError
from dpaudit.training import streams
from dpaudit.probes.probe import WhiteBoxProbe
from dpaudit.training.bugs import planted
from dpaudit.training.sgd import FirstOrderTrainer
from dpaudit.training.streams import attempt_seed, step_key
from dpaudit.training.zo import ZOSettings, ZOTrainer


class Trainer(Protocol):
    def run_step(self, step: int, batch, n_sampled: int, sampled_canaries) -> float: ...

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrainerSetup:
    """What a run hands a method's builder."""
    cfg: Any                 # runner.TrainConfig
    model: Any
    params: list
    run_dir: Any
    rate: float              # the Poisson sampling rate p
    batch_size: float        # the expected batch size: records, or under ULS users (the noisy sum's divisor)
    noise_sigma: float       # the noise multiplier actually added (0 when noise is disabled)
    secret: int              # the run's secret seed (noise keys)
    start: int               # first step of this (re)start
    main: bool               # rank 0: the one that writes
    canaries: Any            # training.whitebox.WhiteBoxCanaries or None
    world: Any               # training.distributed.World
    sharding: Any            # training.shard.Sharding or None
    rng: Any                 # numpy Generator: batches (and DP-ZO's noise)
    stream: str = ""         # how DP-ZO draws z (streams.py; run_config.json's direction_stream)
    released: int = 0        # steps the ledger counted before this (re)start (streams.attempt_seed)
    strategy: Any = None     # the plan's correlated-noise strategy, resolved (a searched BLT's theta and omega found)


@dataclass(frozen=True)
class Method:
    name: str
    defaults: dict
    mechanisms: tuple[str, ...]   # noises its release can take
    canaries: str                 # white-box canary kind: "scalar" (one released sum) or "gradient"
    build: Callable[[TrainerSetup], Trainer]
    # Learning rates for a pretrained model (any model dpaudit did not build), by trainable subset: the
    # defaults above were tuned on the tiny embedded model and blow a pretrained one up.
    pretrained_lr: dict | None = None
    # What the run folder holds of each step's release (core/run_record.RELEASES): "gradient-transcript" (the
    # white-box canaries' coordinates of each noisy gradient sum), "zo-log" (the (seed, scalar) log, from which
    # the run replays), or None (only the final model).
    release: str | None = None
    zeroth_order: bool = False          # forward passes only, around weights perturbed between them (memory, sharding)
    per_example_gradients: bool = False  # clips per-example gradients (--per-sample-grads; layers it cannot clip)
    noise_note: str = ""                # why a noise it does not add is refused, for people

    def refuse_noise(self, kind: str) -> str:
        return self.noise_note or f"{self.name} does not add {kind} noise; it adds {' or '.join(self.mechanisms)}"

    def default_lr(self, trainable: str, pretrained: bool) -> float:
        table = self.pretrained_lr or {}
        return table.get(trainable, table.get("full", self.defaults["lr"])) if pretrained else self.defaults["lr"]


def _dp_zo(s: TrainerSetup) -> Trainer:
    cfg = s.cfg
    zo = ZOSettings(lr=cfg.lr, phi=cfg.phi, clip=cfg.clip if cfg.private else None,
                    noise=cfg.mechanism if cfg.private and s.noise_sigma > 0 else None, sigma=s.noise_sigma,
                    direction=cfg.direction, micro_batch=cfg.micro_batch,
                    stream=s.stream or streams.default_stream(s.params[0].device))
    log_path = s.run_dir / run_folder.ZO_LOG
    if s.main:
        run_folder.truncate_log(log_path, s.start)
    return planted(ZOTrainer, cfg.bug)(s.model, s.params, zo, run_seed=cfg.seed, expected_batch=s.batch_size,
                                       private=cfg.private, rng=s.rng, log_path=log_path if s.main else None,
                                       canaries=s.canaries, clip=cfg.clip, all_sum=s.world.sum, sharding=s.sharding,
                                       per_user=cfg.uls)


def _dp_sgd(s: TrainerSetup) -> Trainer:
    cfg = s.cfg
    probe = None if s.canaries is None else WhiteBoxProbe.for_run(
        s.params, s.canaries, clip=cfg.clip, sample_rate=s.rate, out=s.run_dir, start_step=s.start, write=s.main)
    return FirstOrderTrainer(s.model, s.params, lr=cfg.lr, private=cfg.private, clip=cfg.clip, sigma=s.noise_sigma,
                             expected_batch_size=s.batch_size,
                             # fresh for each (re)start: a step redone after --resume must not reuse the
                             # noise its first attempt released with another batch
                             noise_seed=step_key(*attempt_seed(s.secret, s.start, s.released)),
                             optimizer=cfg.optimizer, world_size=s.world.size, probe=probe, bug=cfg.bug,
                             per_sample_grads=cfg.per_sample_grads, micro_batch=cfg.micro_batch,
                             sharding=s.sharding, per_user=cfg.uls and cfg.private, **_noise_filter(s))


def _noise_filter(s: TrainerSetup) -> dict:
    """The run's correlated noise for the trainer: BandMF's strategy (the max-error-optimal banded Toeplitz
    coefficients at T, norm 1) as ``noise_coefs``, BLT's as ``noise_blt`` (theta, omega); {} for independent noise."""
    strategy, cfg = s.strategy, s.cfg
    if strategy is None:
        return {}
    if strategy.family == "blt":
        if not strategy.theta:   # the plan resolves blt,buffers=d; unresolved, the buffers would add plain noise
            raise RuntimeError("the BLT strategy reached the trainer without its theta and omega")
        return {"noise_blt": (strategy.theta, strategy.omega)}

    return {"noise_coefs": banded_coefs(cfg.steps, strategy.bands)}


# Defaults tuned on the embedded default (see docs/trainers.md); every one can be overridden.
METHODS: dict[str, Method] = {
    "dp-zo": Method("dp-zo", {"lr": 3e-5, "clip": 0.05, "steps": 3000}, ("gaussian", "laplace"), "scalar", _dp_zo,
                    pretrained_lr={"full": 1e-6, "lora": 1e-5}, release="zo-log", zeroth_order=True),
    "dp-sgd": Method("dp-sgd", {"lr": 5e-3, "clip": 1.0, "steps": 300}, ("gaussian",), "gradient", _dp_sgd,
                     pretrained_lr={"full": 5e-5, "bias": 1e-3, "lora": 5e-4}, release="gradient-transcript",
                     per_example_gradients=True,
                     noise_note="DP-SGD clips an L2 norm and adds Gaussian noise; --mech laplace is for dp-zo"),
}


def register_method(method: Method) -> None:
    """Add a method (Opacus' registry style: outside code can extend it). Refuses a name already taken."""

    if method.name in METHODS:
        raise DPAuditError(f"a method named {method.name!r} exists already")
    METHODS[method.name] = method


def method(name: str) -> Method:
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise DPAuditError(f"unknown method {name!r}; use {' or '.join(METHODS)}") from None
