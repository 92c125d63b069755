"""One training run: load a local causal LM, pick the trainable subset, calibrate sigma with the
accounting core, train with DP-ZO or DP-SGD (or their non-private baselines), keep the privacy ledger,
the DP-ZO (seed, scalar) log and checkpoints in the run folder; resume from the last checkpoint."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
import sys
from contextlib import nullcontext

import numpy as np
import torch

from dpaudit.core.limits import TimeUp
from dpaudit.core.atomic import atomic_write_json, save_model_folder
from dpaudit.core.errors import DPAuditError, Interrupted
from dpaudit.core import run_folder, run_record
from dpaudit.core.progress import progress_bar
from dpaudit.training import checkpoint, streams
from dpaudit.training.directions import DEFAULT_DIRECTION, DIRECTIONS
from dpaudit.training.methods import METHODS, TrainerSetup, method
from dpaudit.training.plan import PrivacyPlan
from dpaudit.training.preflight import StepCheck, preflight  # refusals from the model's config alone (also for callers)
from dpaudit.training.resume import settings_of
from dpaudit.accounting.matrix.strategy import parse
from dpaudit.accounting.noises import NOISES
from dpaudit.accounting.result import json_float
from dpaudit.accounting.unit import unit_from
from dpaudit.core.users import user_indices
from dpaudit.audit.whitebox_canaries import WhiteBoxCanaries
from dpaudit.core.lock import folder_lock
from dpaudit.core.threads import adapt as adapt_threads
from dpaudit.models.loading import load_causal_lm
from dpaudit.training import batches as batch_sources  # cyclic_source through the module: tests stand in for it
from dpaudit.training.batches import SOURCES, shuffled_batches, source
from dpaudit.training.bugs import planted_bug
from dpaudit.training.data import tokenize
from dpaudit.training.distributed import launch_rank, setup_world
from dpaudit.training.divergence import DivergenceWatch
from dpaudit.training.ledger import PrivacyLedger
from dpaudit.training.new_tokens import new_token_ids
from dpaudit.training.resume import check_spending, correlated_attempts, fingerprint, open_run, resume_phases
from dpaudit.training.shard import Sharding, full_state_dict, shard_model
from dpaudit.training.streams import attempt_seed
from dpaudit.training.trainable import merged, select_trainable, trainable_parameters


@dataclass
class TrainConfig:
    method: str = "dp-sgd"
    target_epsilon: float = 1.0          # math.inf: the non-private baseline
    delta: float = 1e-5
    sigma: float | None = None           # given: eps is reported instead of calibrated
    mechanism: str = "gaussian"          # laplace: DP-ZO only
    clip: float | None = None            # C (method default when None)
    lr: float | None = None
    optimizer: str = "adamw"             # first-order methods: adamw or sgd
    steps: int | None = None             # method default when None
    batch_size: int = 64                 # expected batch size B; p = B / N
    phi: float = 1e-3                    # DP-ZO perturbation scale
    direction: str = DEFAULT_DIRECTION   # DP-ZO: rademacher (SPSA), gaussian (the DP-ZO paper) or sphere (DPZero)
    trainable: str = "full"              # full, lora or bias (DP-BiTFiT)
    lora_rank: int = 8
    bf16: bool = False
    seed: int = 0                        # public: init of adapters, DP-ZO directions
    secret_seed: int | None = None       # batch sampling and noise; None = fresh OS entropy
    max_length: int = 64
    accountant: str | None = None
    save_every: int = 0
    unsafe_disable_noise: bool = False   # for audit tests only: claims eps but adds no noise
    white_box: int = 0                   # m white-box canaries planted in the run (0: none)
    canary_records: int = 1              # records a white-box canary (a canary user of r records; 1: an example)
    sampling: str = "poisson"            # how private runs draw batches, and are accounted (training/batches.py)
    allow_overspend: bool = False        # a resume may spend more than planned (recorded); not part of the plan
    plant_bug: str | None = None         # a planted privacy bug (testing the audit; see training/bugs.py)
    per_sample_grads: str = "ghost"      # dp-sgd: ghost (clipped sums without per-example gradients) or materialise
    micro_batch: int = 0                 # at most this many examples per forward/backward (0: the whole batch)
    max_memory: int | None = None        # refuse a step estimated above this many bytes (training/memory.py)
    shard: bool = False                  # under torchrun: weights, gradients, optimizer state sharded (FSDP2)
    stop_on_divergence: bool = False     # stop (else warn once) when the loss rises well above its start
    noise: str | None = None             # correlated noise (accounting/matrix/strategy.py): bandmf,b=B; None: independent
    unit: str = "example"                # the privacy unit: example, or user (accounting/unit.py; the data's
    records_per_user: int | None = None  # user column says whose each record is, capped at k = this: core/users.py)
    user_sampling: str | None = None     # user level: els (records sampled, each clipped) or uls (users sampled,
    #                                      each user's mean gradient clipped as one)
    # resolved from the fields above by __post_init__ (never given; dataclasses.replace resolves them again):
    bug: Any = field(default=None, init=False, repr=False, compare=False)       # the planted bug (training/bugs.py)
    strategy: Any = field(default=None, init=False, repr=False, compare=False)  # ``noise`` parsed, or None
    privacy_unit: Any = field(default=None, init=False, repr=False, compare=False)  # accounting.unit.Unit

    def __post_init__(self) -> None:
        record = method(self.method)
        if self.mechanism not in NOISES:
            known = dict.fromkeys(kind for m in METHODS.values() for kind in m.mechanisms)
            raise DPAuditError(f"unknown mechanism {self.mechanism!r}; use {' or '.join(known)}")
        if self.direction not in DIRECTIONS:
            raise DPAuditError(f"unknown direction {self.direction!r}; use {', '.join(DIRECTIONS)}")
        if self.mechanism not in record.mechanisms:
            raise DPAuditError(record.refuse_noise(self.mechanism))
        if not (self.target_epsilon > 0):
            raise DPAuditError(f"target eps must be > 0 (inf for non-private), got {self.target_epsilon}")
        for k, v in record.defaults.items():
            if getattr(self, k) is None:
                setattr(self, k, v)
        if self.batch_size < 0:
            raise DPAuditError(f"batch size must be >= 1 (or 0: every example every step), got {self.batch_size}")
        for name in ("steps", "max_length"):
            if getattr(self, name) < 1:
                raise DPAuditError(f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        if self.per_sample_grads not in ("ghost", "materialise"):
            raise DPAuditError(f"unknown --per-sample-grads {self.per_sample_grads!r}; use ghost or materialise")
        if self.micro_batch < 0:
            raise DPAuditError(f"micro batch must be >= 1 (or 0: the whole batch at once), got {self.micro_batch}")
        if self.optimizer not in ("adamw", "sgd"):
            raise DPAuditError(f"unknown optimizer {self.optimizer!r}; use adamw or sgd")
        if self.lr <= 0 or self.clip <= 0 or self.phi <= 0:
            raise DPAuditError("lr, clip and phi must be > 0")

        self.bug = planted_bug(self.plant_bug, record, METHODS)
        self.privacy_unit = unit_from(self.unit, self.records_per_user, self.user_sampling)
        if self.uls:   # users sampled, each user's mean gradient (DP-ZO: mean difference) clipped as one
            drawn = source(self.sampling)   # an unknown sampler is refused below
            why = ("Poisson batches (--sampling poisson: each user joins a step with probability q = B / N)"
                   if drawn is not None and drawn.pattern != "independent"
                   else "independent noise (not --noise)" if self.noise else None)
            if why:
                raise DPAuditError(f"ULS training (--user-sampling uls) needs {why}")
            if record.per_example_gradients and self.trainable == "bias":   # DP-BiTFiT's bias route clips records:
                self.per_sample_grads = "materialise"   # users' means are formed from each record's (in the settings)
        if self.bug.per_user and not self.uls:
            raise DPAuditError(f"bug {self.plant_bug} plants in a ULS run (--unit user --user-sampling uls)")
        if self.privacy_unit.user_level and not self.private:
            raise DPAuditError("--unit user is a privacy claim: give --eps or --sigma")
        if self.white_box and not self.private:
            raise DPAuditError("a white-box audit needs a private run (give --eps or --sigma)")
        if self.canary_records < 1 or (self.canary_records > 1 and not self.white_box):
            raise DPAuditError(f"--canary-records is the records of each white-box canary user (>= 1, with "
                               f"--white-box), got {self.canary_records}")
        if self.bug.example_level and not self.privacy_unit.user_level:
            raise DPAuditError("bug example-level-claim plants in a user-level run (--unit user)")
        if self.privacy_unit.user_level and self.canary_records > self.privacy_unit.records:
            raise DPAuditError(f"a canary user of {self.canary_records} records is over the run's cap of "
                               f"{self.privacy_unit.records} a user: its claim does not cover it")

        strategy = parse(self.noise)
        fixed_order = strategy is not None and strategy.family == "blt" and strategy.fixed_order
        drawn = source(self.sampling)
        if drawn is None or (drawn.pattern == "fixed-order" and not fixed_order):
            raise DPAuditError(f"the bundled trainers draw {', '.join(SOURCES)} batches, not {self.sampling!r} "
                               "(account another sampler with the accounting commands; --sampling shuffle is drawn "
                               "for --noise blt,...,order=fixed only: one fixed order)")
        if drawn.pattern != "independent" and (self.white_box or not self.private):
            raise DPAuditError(f"--sampling {self.sampling} is for private runs without white-box canaries (their "
                               "audit assumes Poisson sampling; non-private runs shuffle)")
        self.strategy = _correlated(self, strategy, record)
        if self.canary_records > 1 and self.strategy is not None:
            raise DPAuditError("canary users of several records are audited with independent noise, not --noise")
        if self.shard:  # the one list of what sharding does not run with (white-box canaries shard: probe.py)
            why = ("LoRA (its adapters are small; plain torchrun data parallelism suits it)" if self.trainable == "lora"
                   else "--per-sample-grads materialise (sharded DP-SGD uses ghost clipping)"
                   if record.per_example_gradients and self.per_sample_grads == "materialise"
                   else "planted bugs" if self.plant_bug else None)
            if why:
                raise DPAuditError(f"--shard does not run with {why}")

    @property
    def private(self) -> bool:
        return self.sigma is not None or math.isfinite(self.target_epsilon)

    @property
    def uls(self) -> bool:
        """User-level sampling: users Poisson-sampled, each clipped as one (the trainers' ``clips_per_user``)."""
        return self.privacy_unit.algorithm == "ULS"


def _correlated(cfg: "TrainConfig", strategy, record):
    """The run's noise strategy (``strategy``, parsed from --noise), or None: BandMF under cyclic Poisson batches
    (accounted by bandmf, with amplification), BLT under balls-in-bins epochs or one fixed order (accounted by matrix,
    without: accounting/matrix/single.py); what it does not run with is refused here, each with its reason."""

    if strategy is None:
        return None
    blt = strategy.family == "blt"
    pattern = source(cfg.sampling).pattern
    why = ("a first-order method (--method dp-sgd)" if not record.per_example_gradients
           else "Poisson batches (--sampling poisson: cyclic Poisson in b groups)" if not blt and pattern != "independent"
           else "epochs (--sampling balls-in-bins: each example once an epoch, which its accounting counts; under "
                "Poisson batches any step may hold an example, so its sensitivity would grow with T)"
           if blt and not strategy.fixed_order and pattern != "epochs"
           else "one fixed order (--sampling shuffle: the trainer then passes one permutation every epoch)"
           if blt and strategy.fixed_order and pattern != "fixed-order"
           else "a private run" if not cfg.private
           else None)
    if why:
        raise DPAuditError(f"correlated noise (--noise {strategy.family}) needs {why}")
    return strategy


@dataclass
class TrainResult:
    run_dir: Path
    model_dir: Path
    private: bool
    sigma: float | None
    epsilon: float
    delta: float
    sampling_rate: float
    steps: int
    examples: int
    seconds: float
    seconds_per_step: float
    last_loss: float | None
    accountant: str | None = None
    relation: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(run_dir=str(self.run_dir), model_dir=str(self.model_dir), epsilon=json_float(self.epsilon))
        return d


def _save_checkpoint(run_dir: Path, model, tokenizer, state: run_record.CheckpointState, trainer_state=None,
                     weights=None) -> None:
    """Write the checkpoint beside the old one, seal it with its checksums, then swap (training/checkpoint.py),
    so a crash leaves one intact copy. ``weights``: the gathered state of a sharded model (same plain format)."""

    def write(tmp: Path) -> None:
        try:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            if trainer_state is not None:
                torch.save(trainer_state, tmp / checkpoint.OPTIMIZER)
            atomic_write_json(tmp / checkpoint.STATE, state.to_json())
        except (OSError, RuntimeError) as exc:  # torch reports a full disk as a RuntimeError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise DPAuditError(f"could not write the checkpoint of step {state.step} in {run_dir} ({first}); "
                               "the last intact checkpoint is kept, and --resume continues from it") from None

    checkpoint.save(run_dir, state.step, write)


def train(model_dir: Path, texts: list[str], run_dir: Path, cfg: TrainConfig, *, resume: bool = False,
          show_progress: bool = True, step: StepCheck | None = None, users: list[str] | None = None) -> TrainResult:
    """Train into ``run_dir``, holding its lock (rank 0 of a distributed run) so no second run writes there.
    ``step``: the caller's pre-flight check of this model and these texts (``preflight.check_model``), not made
    again. ``users``: whose each text is (a ULS run samples them; capped at k by core/users.cap_records)."""

    main_process = launch_rank() == 0
    run_dir = Path(run_dir)
    check_run_folder(run_dir, resume)
    estimate = preflight(model_dir, cfg, len(texts), texts=texts, step=step) if main_process else None
    with folder_lock(run_dir) if main_process else nullcontext():
        return _train(model_dir, texts, run_dir, cfg, resume=resume, show_progress=show_progress,
                      estimate=estimate, users=users)


def check_run_folder(run_dir: Path, resume: bool) -> None:
    """What a run folder must be before anything (its lock included) is written there: a plain folder, never a
    symbolic link (a run would write through it); with ``resume``, a folder holding something of a dpaudit run (its
    config, ledger or checkpoint: what it holds is then checked by the resume, resume.py)."""

    if run_dir.is_symlink() or (run_dir.exists() and not run_dir.is_dir()):
        raise DPAuditError(f"{run_dir} is not a plain folder (a symbolic link or a file); give a run folder path")
    traces = (run_folder.RUN_CONFIG, run_folder.LEDGER, checkpoint.FINAL, checkpoint.TMP, checkpoint.OLD)
    if resume and not any((run_dir / name).exists() for name in traces):  # a run's remains go to the resume's checks
        raise DPAuditError(f"{run_dir} holds no dpaudit run to resume (no {run_folder.RUN_CONFIG}); start a run there "
                           "without --resume, in an empty folder")


@dataclass
class _Run:
    """What a run's steps need, assembled once (``_assemble``)."""
    run_dir: Path
    cfg: TrainConfig
    world: Any
    start: int
    model: Any
    tokenizer: Any
    data: Any
    n_real: int
    canaries: Any
    rate: float
    plan: PrivacyPlan
    ledger: Any
    discarded: int                    # steps released after the last checkpoint: spent, and redone
    trainer: Any
    rng: Any
    sharded: bool
    secret: int = 0                   # balls-in-bins batches are drawn from it by epoch (_allocation_secret)
    owners: Any = None                # ULS: each example's user index (member canary users after the data's)

    @property
    def n(self) -> int:  # member canaries are examples too
        return self.n_real + (len(self.canaries.member_records) if self.canaries else 0)


def _train(model_dir: Path, texts: list[str], run_dir: Path, cfg: TrainConfig, *, resume: bool,
           show_progress: bool, estimate: int | None = None, users: list[str] | None = None) -> TrainResult:
    """Open the run folder (resume policy: resume.py), assemble the run, run its steps, finish it."""

    world = setup_world()
    run_dir = Path(run_dir)
    opening = open_run(run_dir, model_dir, cfg, resume, world)
    if len(texts) < 2:
        raise DPAuditError("the training set needs at least 2 examples")
    run = _assemble(opening, texts, run_dir, cfg, world, estimate, users)
    began = time.perf_counter()
    last_loss, watch = _loop(run, show_progress)
    result = _finish(run, last_loss, watch, time.perf_counter() - began)
    world.close()  # after the last collective (_finish's barrier), on every rank
    return result


def _load_model(model_dir, cfg: TrainConfig, world, sharded: bool):
    """(model with its trainable subset selected and placed, tokenizer, LoRA's trainable new-token rows, sharding)."""

    # Sharded bf16: float32 shards (the optimizer's master copy), gathered and computed in bf16.
    model, tokenizer = load_causal_lm(model_dir, dtype=torch.bfloat16 if cfg.bf16 and not sharded else None)
    torch.manual_seed(cfg.seed)
    rows = new_token_ids(tokenizer) if cfg.trainable in ("lora", "new-tokens") else []  # canary rows: own parameters
    model = select_trainable(model, cfg.trainable, cfg.lora_rank, rows)
    if not sharded:
        return model.to(world.device), tokenizer, rows, None
    # fully_shard moves one unit at a time to the device, so the whole model never sits there
    shard_model(model, world.device, world.size, cfg.bf16, weights_change_between_forwards=METHODS[cfg.method].zeroth_order)
    return model, tokenizer, rows, Sharding(world.size, world.sum)


def _assemble(opening, texts: list[str], run_dir: Path, cfg: TrainConfig, world, estimate: int | None,
              users: list[str] | None = None) -> _Run:
    """Model, data, canaries, the privacy plan and its ledger, the run's description, and the trainer."""

    if cfg.uls and (users is None or len(users) != len(texts)):
        raise DPAuditError("a ULS run samples users: give each record's user (train --user-field)")
    if cfg.uls and world.size > 1:
        raise DPAuditError("ULS training runs in one process (several ranks would clip parts of one user apart)")
    sharded = cfg.shard and world.size > 1
    model, tokenizer, rows, sharding = _load_model(opening.model_dir, cfg, world, sharded)
    params = trainable_parameters(model)
    data = tokenize(tokenizer, texts, cfg.max_length)
    secret = cfg.secret_seed if cfg.secret_seed is not None else _shared_entropy(world)
    canaries = None
    if cfg.white_box:
        canaries = (WhiteBoxCanaries.load(run_dir) if opening.start else
                    WhiteBoxCanaries.make(cfg.white_box, seed=cfg.seed, membership_seed=int(secret),
                                          records=cfg.canary_records))
        if METHODS[cfg.method].canaries == "gradient" and not canaries.coordinates:
            canaries.place(sum(p.numel() for p in params))
    n = len(data) + (len(canaries.member_records) if canaries else 0)
    batch_size = batch_of(cfg, n)
    owners = _owners(users, canaries) if cfg.uls else None
    # the noisy sum's divisor: the expected records a step, or under ULS the expected users (q times the users)
    units = batch_size if owners is None else batch_size / n * (int(owners.max()) + 1)
    plan, ledger, discarded = _privacy(opening, texts, run_dir, cfg, world, n, batch_size / n)
    stream = _direction_stream(run_dir, opening.start, params[0].device)
    if world.is_main:  # only rank 0 writes: ledger, log, checkpoints, model
        # DP-ZO directions come from the generator of the device the weights live on (CPU and CUDA
        # streams differ), so a replay must draw them on the same kind of device.
        run_record.write(run_dir, run_record.RunRecord(
            settings=settings_of(cfg), base_model=str(opening.base_model), sigma=plan.sigma,
            sampling_rate=batch_size / n, examples=n, expected_batch_size=units,   # the noisy sum's divisor
            direction_device=params[0].device.type, lora_new_token_rows=tuple(rows), direction_stream=stream,
            sharded=sharded, estimated_peak_bytes=estimate, release=METHODS[cfg.method].release))
        if canaries is not None:
            canaries.save(run_dir)
    rng = np.random.default_rng(attempt_seed(secret, opening.start, opening.released_before))
    trainer = METHODS[cfg.method].build(TrainerSetup(
        cfg=cfg, model=model, params=params, run_dir=run_dir, rate=batch_size / n, batch_size=units,
        noise_sigma=0.0 if cfg.unsafe_disable_noise else plan.noise_sigma(cfg.bug), secret=int(secret),
        start=opening.start, main=world.is_main, canaries=canaries, world=world, sharding=sharding, rng=rng,
        stream=stream, released=opening.released_before, strategy=plan.mechanism.strategy if plan.private else None))
    _load_trainer_state(trainer, run_dir, opening.start, sharded)
    allocation = _allocation_secret(opening, run_dir, cfg, world, int(secret), max(1, n // batch_size))
    return _Run(run_dir=run_dir, cfg=cfg, world=world, start=opening.start, model=model, tokenizer=tokenizer,
                data=data, n_real=len(data), canaries=canaries, rate=batch_size / n, plan=plan, ledger=ledger,
                discarded=discarded, trainer=trainer, rng=rng, sharded=sharded, secret=allocation, owners=owners)


def _owners(users: list[str], canaries) -> np.ndarray:
    """Each example's user index: the data's users in order of appearance, then one user a member canary (its
    ``records`` records, member_records' order)."""
    indices, count = user_indices(users)
    own = np.array(indices, dtype=np.int64)
    if canaries is None:
        return own
    extra = count + np.repeat(np.arange(canaries.member_ids.size), canaries.records)
    return np.concatenate([own, extra])


def _direction_stream(run_dir: Path, start: int, device) -> str:
    """How DP-ZO draws z in this run (streams.py): the device's default for a new run; a resumed run keeps
    the one it began with, so that one replay redraws every step (the first start recorded it)."""

    record = run_record.read(run_dir, required=False) if start else None
    return record.direction_stream if record is not None else streams.default_stream(device)


def _allocation_secret(opening, run_dir: Path, cfg: TrainConfig, world, secret: int, per_epoch: int) -> int:
    """The secret balls-in-bins batches are drawn from (by epoch). It must survive a resume: a fresh one mid-epoch
    redraws the rest of the epoch, so some examples land in two of its steps and others in none, which the
    allocation bound does not cover (N 40, B 4, resumed at step 3: 8 examples twice, 4 never). So a
    run's first start keeps it in the run folder (0600: it tells which step each example is in), --resume reads it
    back, and the finished run removes it. Only the allocation is kept: the noise is fresh on every (re)start (a
    step redone with the noise of its first attempt would release the difference of the two signals).
    With ``secret_seed`` the run is reproducible anyway and nothing is written."""

    drawn = source(cfg.sampling)
    if cfg.secret_seed is not None or not drawn.keeps_secret or not cfg.private:
        return secret
    path = run_dir / run_folder.ALLOCATION_SECRET
    if not opening.start:
        if world.is_main:
            atomic_write_json(path, run_record.allocation_secret_json(secret), private=True)
        return secret
    kept = None
    if world.is_main:
        kept = run_record.read_allocation_secret(path)
    if world.size > 1:
        kept = _broadcast_int(world, -1 if kept is None else kept)
        kept = None if kept == -1 else kept
    if kept is None:
        if drawn.pattern == "fixed-order":   # any new order can put an example in adjacent steps
            raise DPAuditError(f"cannot resume this fixed-order run at step {opening.start}: its order's secret "
                               f"({path.name}) is gone, and a new order would break the separation its accounting "
                               "counts; start the run again")
        if opening.start % per_epoch:
            raise DPAuditError(f"cannot resume this {drawn.words} run at step {opening.start}, mid-epoch: its "
                               f"allocation secret ({path.name}) is gone, and a new one would redraw the rest of the "
                               "epoch; start the run again")
        if world.is_main:   # at an epoch boundary a fresh allocation is as good: keep it for the next resume
            atomic_write_json(path, {"secret": secret}, private=True)
        return secret
    return kept


def batch_of(cfg: TrainConfig, n: int) -> int:
    """The run's expected batch size over its n examples (0: every example every step, p = 1), refused above n."""
    batch_size = cfg.batch_size or n
    if batch_size > n:
        raise DPAuditError(f"batch size {batch_size} exceeds the {n} training examples")
    return batch_size


def check_inputs(cfg: TrainConfig, texts: list[str], run_dir: Path, resume: bool) -> None:
    """``train --check-inputs``: the run's own refusals that need no model (the folder, the batch, the privacy plan
    with its sigma, sampler and noise strategy), so an answer of "usable" is one the run keeps. The examples are
    counted with half the white-box canaries as members (their number is drawn when the run starts)."""
    check_run_folder(Path(run_dir), resume)
    n = len(texts) + (cfg.white_box // 2 * cfg.canary_records if cfg.white_box else 0)
    plan = privacy_plan(cfg, batch_of(cfg, n) / n, n)
    if plan.private:  # the ledger accounts the planned steps before the first (its accountant's refusals)
        plan.epsilon_at(cfg.steps)
        if plan.mechanism.strategy is not None:  # the noise the trainer correlates over the planned steps
            plan.mechanism.strategy.coefs(cfg.steps)


def privacy_plan(cfg: TrainConfig, rate: float, n: int) -> PrivacyPlan:
    """The run's privacy plan: sigma calibrated to the target (or the one given) for its rate, steps and sampler."""
    return PrivacyPlan.build(kind=cfg.mechanism, rate=rate, steps=cfg.steps, delta=cfg.delta,
                             target_epsilon=cfg.target_epsilon, sigma=cfg.sigma, accountant=cfg.accountant,
                             bug=cfg.bug, sampling=cfg.sampling, examples=n, strategy=cfg.strategy,
                             unit=cfg.privacy_unit)


def _privacy(opening, texts: list[str], run_dir: Path, cfg: TrainConfig, world, n: int, rate: float):
    """(plan, ledger, discarded): sigma calibrated (or given) for the run, the ledger that records every step
    before it runs, and, on a resume, the phases and refusals of the resume policy (resume.py)."""

    plan = privacy_plan(cfg, rate, n)
    header = {"method": cfg.method, "private": plan.private, "mechanism": cfg.mechanism if plan.private else None,
              "sigma": plan.sigma, "clip": cfg.clip, "sampling_rate": rate, "steps_planned": cfg.steps,
              "delta": cfg.delta, "target_epsilon": cfg.target_epsilon if math.isfinite(cfg.target_epsilon)
              else "inf", "examples": n, "noise_disabled_unsafely": cfg.unsafe_disable_noise,
              "white_box_canaries": cfg.white_box, "planted_bug": cfg.plant_bug,
              "world_size": world.size, "data_sha256": fingerprint(texts), "sampling": cfg.sampling,
              "privacy_unit": plan.mechanism.unit.short() if plan.private else None,
              **({"noise": plan.mechanism.strategy.spec(), "noise_std": plan.noise_sigma()}
                 if cfg.strategy and plan.private else {})}
    if opening.previous_ledger is not None:
        plan, header = resume_phases(plan, header, opening.previous_ledger, opening.released_before, run_dir)
    if cfg.strategy is not None and plan.private:
        plan, header = _correlated_attempts(plan, header, opening, run_dir)
    # Steps run after the last checkpoint of a killed run are redone with fresh noise, but their
    # outputs (the DP-ZO log, the ledger) may have been seen: they are spent, and stay counted.
    discarded = max(0, opening.released_before - opening.start)
    header["steps_discarded_by_resume"] = discarded
    header["overspend_allowed"] = cfg.allow_overspend
    ledger = PrivacyLedger(run_dir / run_folder.LEDGER, header, plan, cfg.steps + discarded)
    check_spending(ledger, plan, opening, discarded, cfg, run_dir)
    return plan, ledger, discarded


def _correlated_attempts(plan, header: dict, opening, run_dir: Path):
    """(plan, header) of a correlated-noise run: the header lists its attempts (a resume reads them back), and a
    resumed run is accounted along them (accounting/matrix/bandmf.py: resumed_epsilon)."""

    released = opening.released_before if opening.previous_ledger is not None else 0
    if not released and not opening.start:
        return plan, {**header, "attempts": [[0, None, None]]}
    if plan.phases:
        raise DPAuditError(f"resuming the correlated-noise run in {run_dir} on other data is not accounted (its "
                           "resumed rows continue the old data's noise); resume on the same data or start a new run "
                           "folder")
    own = ("matrix", "each attempt one Gaussian release") if plan.mechanism.strategy.family == "blt" else (
        "bandmf", "per coin across its attempts")
    if plan.accountant not in (None, own[0]):
        raise DPAuditError(f"a resumed correlated-noise run is accounted by {own[0]} ({own[1]}), not "
                           f"{plan.accountant}; resume without --accountant or with --accountant {own[0]}")
    writer = None
    if opening.start:
        writer = run_record.read_checkpoint_state(run_dir / checkpoint.FINAL / checkpoint.STATE).attempt
    attempts = correlated_attempts(opening.previous_ledger, released, opening.start, writer, run_dir)
    return replace(plan, attempts=tuple(attempts)), {**header, "attempts": [list(a) for a in attempts]}


def _load_trainer_state(trainer, run_dir: Path, start: int, sharded: bool) -> None:
    """A resumed run's optimizer state, from the checkpoint it resumes."""

    saved = run_dir / checkpoint.FINAL
    if start and getattr(trainer, "correlated", False) and not (saved / checkpoint.OPTIMIZER).is_file():
        raise DPAuditError(f"the checkpoint in {run_dir} holds no noise state of this correlated-noise run; start "
                           "the run again")
    if not (start and (saved / checkpoint.OPTIMIZER).is_file()):
        return
    was_sharded = run_record.read_checkpoint_state(saved / checkpoint.STATE).sharded
    if was_sharded != sharded:
        raise DPAuditError(f"the checkpoint in {run_dir} was saved {'with' if was_sharded else 'without'} "
                           "--shard over several processes; resume it the same way")
    try:
        state = torch.load(saved / checkpoint.OPTIMIZER, weights_only=True)
        trainer.load_state_dict(state)
    except DPAuditError:
        raise
    except Exception as exc:  # sealed by our checksum, so only a file made to look like ours gets here
        raise DPAuditError(f"cannot read the optimizer state in {saved}: {type(exc).__name__}") from None


def _loop(run: _Run, show_progress: bool):
    """The steps: each batch drawn, written ahead in the ledger, run, watched; checkpoints when due.
    Returns (last loss, the divergence watch)."""

    cfg, world, ledger, canaries = run.cfg, run.world, run.ledger, run.canaries
    batches = None if cfg.private else shuffled_batches(run.n, cfg.batch_size or run.n, run.rng)
    # BandMF: cyclic groups, example i in i mod b and canary k in k mod b (the white-box audit reads it there)
    bandmf = cfg.strategy is not None and cfg.strategy.family == "bandmf"
    groups = None if not bandmf else np.concatenate(
        [np.arange(run.n_real), canaries.member_ids if canaries else np.zeros(0, int)]) % cfg.strategy.bands
    drawer = (batch_sources.cyclic_source(cfg.strategy.bands, groups) if bandmf
              else batch_sources.user_source(run.owners) if run.owners is not None else source(cfg.sampling).draw)
    draw = drawer(run.n, cfg.batch_size or run.n, run.secret, run.rng) if cfg.private else None
    last_loss, interrupted_at, watch = None, run.start, DivergenceWatch()
    label = f"{cfg.method}{'' if cfg.private else ' (non-private)'}"
    try:
        with progress_bar(cfg.steps - run.start, label, show_progress and world.is_main) as advance:
            for step in range(run.start, cfg.steps):
                idx = draw(step) if cfg.private else next(batches)
                real = idx[idx < run.n_real]
                sampled = canaries.member_records[idx[idx >= run.n_real] - run.n_real] if canaries else idx[:0]
                mine = world.shard(real)
                batch = {k: v.to(world.device) for k, v in run.data.batch(mine).items()}
                if run.owners is not None:   # ULS: whose each row is (the trainers clip each user as one)
                    batch["user"] = torch.as_tensor(run.owners[real], device=world.device)
                if world.is_main:  # written ahead: the step is spent before anything it releases is written
                    ledger.record(step + 1 + run.discarded, steps_in_model=step)
                interrupted_at = step
                last_loss = run.trainer.run_step(step, batch, len(idx), sampled)
                interrupted_at = step + 1
                # a step with no loss-bearing example here (only canaries, or none: Poisson) has no loss (nan): not a
                # divergence
                _watch_divergence(watch, step, last_loss if len(mine) else None, cfg, ledger, world)
                if world.size == 1 and step % 10 == 9:
                    adapt_threads()  # a core another process took since is left to it (threads.py)
                advance(1, f"step {step + 1}, loss {last_loss:.4g}, eps spent "
                           f"{ledger.spent(step + 1 + run.discarded):.4g}")
                _checkpoint_if_due(run, step)
    except (KeyboardInterrupt, TimeUp) as exc:
        where = (f"at step {interrupted_at}; the ledger counts {ledger.recorded} steps (eps spent "
                 f"{ledger.spent(ledger.recorded):.4g}); resume with --resume")
        if isinstance(exc, TimeUp):
            raise TimeUp(f"stopped by --timeout {where}") from None
        raise Interrupted(f"interrupted {where}") from None
    finally:
        run.trainer.close()
    return last_loss, watch


def _checkpoint_if_due(run: _Run, step: int) -> None:
    cfg = run.cfg
    due = cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps
    if not due or cfg.trainable == "lora":  # LoRA adapters are merged once, at export
        return
    weights = full_state_dict(run.model) if run.sharded else None  # every rank takes part
    state = run.trainer.state_dict() if run.world.is_main or run.sharded else None
    if run.world.is_main:
        # a correlated-noise run's checkpoint says which attempt wrote it: a resume continues that attempt's noises
        attempt = max(0, len(run.plan.attempts) - 1) if cfg.strategy is not None else None
        _save_checkpoint(run.run_dir, run.model, run.tokenizer,
                         run_record.CheckpointState(step + 1, settings_of(cfg), run.sharded, attempt),
                         state, weights)


def _finish(run: _Run, last_loss, watch, seconds: float) -> TrainResult:
    """The ledger closed at the planned steps, the model exported (replacing the resume checkpoint)."""

    cfg, ledger = run.cfg, run.ledger
    if run.world.is_main:
        ledger.record(cfg.steps + run.discarded, steps_in_model=cfg.steps)
    final = run.run_dir / run_folder.MODEL
    weights = full_state_dict(run.model) if run.sharded else None  # every rank takes part
    if run.world.is_main:  # the finished model replaces the resume checkpoint (no second copy of the weights)
        final = _export(run.run_dir, run.model, run.tokenizer, weights)
        checkpoint.remove(run.run_dir)
        (run.run_dir / run_folder.ALLOCATION_SECRET).unlink(missing_ok=True)   # no resume is left to need it
    run.world.barrier()
    return TrainResult(run_dir=run.run_dir, model_dir=final, private=run.plan.private, sigma=run.plan.sigma,
                       epsilon=ledger.total_epsilon, delta=cfg.delta, sampling_rate=run.rate, steps=cfg.steps,
                       examples=run.n, seconds=seconds, seconds_per_step=seconds / max(1, cfg.steps - run.start),
                       last_loss=last_loss, accountant=ledger.accountant, relation=ledger.relation,
                       extra={"divergence": watch.why} if watch.why else {})


def _watch_divergence(watch, step: int, loss: float, cfg: TrainConfig, ledger, world) -> None:
    """Warn once when rank 0's loss diverges (the run goes on, and its result says so); only an explicit
    --stop-on-divergence stops, every rank at that step (under torchrun rank 0's verdict is all-reduced, one
    float a step, so no rank is left waiting in a collective)."""
    why = watch.update(step, loss) if world.is_main else None
    stop = cfg.stop_on_divergence and (world.sum(1.0 if why else 0.0) if world.size > 1 else why is not None)
    if stop:
        raise DPAuditError(f"stopped: {why or 'the training loss diverged on rank 0'}; lower --lr (now {cfg.lr:g}) "
                           f"and start again (the ledger counts {ledger.recorded} steps, eps "
                           f"{ledger.spent(ledger.recorded):.4g})")
    if why:
        print(f"warning: {why}. A learning rate too large (now {cfg.lr:g}) does this, and so does a broken DP step "
              "(clipping skipped, noise too small): training goes on, and the result says so", file=sys.stderr)


def _shared_entropy(world) -> int:
    """Fresh OS entropy for batches and noise, the same on every rank (rank 0's, broadcast)."""
    entropy = np.random.SeedSequence().entropy % (2**62)
    return _broadcast_int(world, entropy) if world.size > 1 else entropy


def _broadcast_int(world, value: int) -> int:
    """Rank 0's integer on every rank."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=world.device)
    dist.broadcast(t, src=0)
    return int(t.item())


def _export(run_dir: Path, model, tokenizer, weights: dict | None = None) -> Path:
    """The fine-tuned model as a plain Hugging Face directory (LoRA merged), for auditing and use.
    ``weights``: the whole state of a sharded model, gathered on this rank."""

    return save_model_folder(run_dir / run_folder.MODEL, merged(model), tokenizer, state_dict=weights)
