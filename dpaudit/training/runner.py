"""One training run: load a local causal LM, pick the trainable subset, calibrate sigma with the
accounting core, train with DP-ZO or DP-SGD (or their non-private baselines), keep the privacy ledger,
the DP-ZO (seed, scalar) log and checkpoints in the run folder; resume from the last checkpoint."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from dpaudit.core.limits import TimeUp
from dpaudit.core.atomic import atomic_write_json, save_model_folder
from dpaudit.core.errors import DPAuditError, Interrupted
from dpaudit.core import run_folder
from dpaudit.core.progress import progress_bar
from dpaudit.training import checkpoint
from dpaudit.training.directions import DEFAULT_DIRECTION, DIRECTIONS
from dpaudit.training.methods import METHODS
from dpaudit.training.plan import PrivacyPlan


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
    allow_overspend: bool = False        # a resume may spend more than planned (recorded); not part of the plan
    plant_bug: str | None = None         # a planted privacy bug (testing the audit; see training/bugs.py)
    per_sample_grads: str = "ghost"      # dp-sgd: ghost (clipped sums without per-example gradients) or materialise
    micro_batch: int = 0                 # at most this many examples per forward/backward (0: the whole batch)
    max_memory: int | None = None        # refuse a step estimated above this many bytes (training/memory.py)
    shard: bool = False                  # under torchrun: weights, gradients, optimizer state sharded (FSDP2)
    stop_on_divergence: bool = False     # stop (else warn once) when the loss rises well above its start

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise DPAuditError(f"unknown method {self.method!r}; use {' or '.join(METHODS)}")
        if self.mechanism not in ("gaussian", "laplace"):
            raise DPAuditError(f"unknown mechanism {self.mechanism!r}; use gaussian or laplace")
        if self.direction not in DIRECTIONS:
            raise DPAuditError(f"unknown direction {self.direction!r}; use {', '.join(DIRECTIONS)}")
        if self.mechanism not in METHODS[self.method].mechanisms:
            raise DPAuditError("DP-SGD clips an L2 norm and adds Gaussian noise; --mech laplace is for dp-zo"
                               if self.method == "dp-sgd" else f"{self.method} does not add {self.mechanism} noise")
        if not (self.target_epsilon > 0):
            raise DPAuditError(f"target eps must be > 0 (inf for non-private), got {self.target_epsilon}")
        for k, v in METHODS[self.method].defaults.items():
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
        from dpaudit.training.bugs import planted_bug

        self.bug = planted_bug(self.plant_bug, self.method)
        if self.white_box and not self.private:
            raise DPAuditError("a white-box audit needs a private run (give --eps or --sigma)")
        if self.shard:  # the one list of what sharding does not run with (white-box canaries shard: probe.py)
            why = ("LoRA (its adapters are small; plain torchrun data parallelism suits it)" if self.trainable == "lora"
                   else "--per-sample-grads materialise (sharded DP-SGD uses ghost clipping)"
                   if self.method == "dp-sgd" and self.per_sample_grads == "materialise"
                   else "planted bugs" if self.plant_bug else None)
            if why:
                raise DPAuditError(f"--shard does not run with {why}")

    @property
    def private(self) -> bool:
        return self.sigma is not None or math.isfinite(self.target_epsilon)


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
        from dpaudit.accounting.result import json_float

        d = asdict(self)
        d.update(run_dir=str(self.run_dir), model_dir=str(self.model_dir), epsilon=json_float(self.epsilon))
        return d


def _save_checkpoint(run_dir: Path, model, tokenizer, state: dict, trainer_state=None, weights=None) -> None:
    """Write the checkpoint beside the old one, seal it with its checksums, then swap (training/checkpoint.py),
    so a crash leaves one intact copy. ``weights``: the gathered state of a sharded model (same plain format)."""
    import torch

    def write(tmp: Path) -> None:
        try:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
            tokenizer.save_pretrained(tmp)
            if trainer_state is not None:
                torch.save(trainer_state, tmp / checkpoint.OPTIMIZER)
            atomic_write_json(tmp / checkpoint.STATE, state)
        except (OSError, RuntimeError) as exc:  # torch reports a full disk as a RuntimeError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise DPAuditError(f"could not write the checkpoint of step {state['step']} in {run_dir} ({first}); "
                               "the last intact checkpoint is kept, and --resume continues from it") from None

    checkpoint.save(run_dir, state["step"], write)


def train(model_dir: Path, texts: list[str], run_dir: Path, cfg: TrainConfig, *, resume: bool = False,
          show_progress: bool = True) -> TrainResult:
    """Train into ``run_dir``, holding its lock (rank 0 of a distributed run) so no second run writes there."""
    from contextlib import nullcontext

    from dpaudit.core.lock import folder_lock

    main_process = int(os.environ.get("RANK", "0")) == 0
    estimate = preflight(model_dir, cfg, len(texts), texts=texts) if main_process else None
    run_dir = Path(run_dir)
    with folder_lock(run_dir) if main_process else nullcontext():
        return _train(model_dir, texts, run_dir, cfg, resume=resume, show_progress=show_progress,
                      estimate=estimate)


def preflight(model_dir: Path, cfg: TrainConfig, examples: int, warn: bool = True,
              texts: list[str] | None = None) -> int | None:
    """Refusals that need only the model's config, made before any folder is created or weight read:
    a trainable subset the model lacks, and (``cfg.max_memory``) a step estimated not to fit. Returns
    the estimated peak bytes of a step (None when the folder has no config to read). ``warn``: say when
    the estimate is above the free memory (once per run: ``train`` says it, callers checking early don't).
    Given ``texts``, a step is estimated at their longest tokenised length (a batch is cut to its longest
    example, so short texts never fill ``max_length``); without, at ``max_length`` (the side to err on)."""
    import torch

    from dpaudit.core.limits import human_bytes
    from dpaudit.models.hf import MAX_CONFIG_BYTES, meta_model, resolve_model_path
    from dpaudit.training import memory

    folder = resolve_model_path(model_dir)
    if not (folder / "config.json").is_file():
        return None
    if cfg.max_memory:  # the weights alone must fit the budget given (meta_model checks the free memory)
        from dpaudit.models.hf import check_model_size
        from dpaudit.core.safe_json import load_json_file

        check_model_size(folder / "config.json", load_json_file(folder / "config.json", "model config",
                                                                MAX_CONFIG_BYTES), cfg.max_memory)
    model = meta_model(folder)
    if cfg.method == "dp-sgd" and cfg.private and cfg.trainable == "full":
        from dpaudit.training.sgd import check_layers

        check_layers(model)  # a layer DP-SGD cannot clip per example: refused before any canary or weight work
    names = [name for name, _ in model.named_parameters()]
    if cfg.trainable == "bias" and not any(name.endswith(".bias") for name in names):
        raise DPAuditError(f"the model in {model_dir} has no bias terms (Llama-family models have none), so "
                           "--trainable bias (DP-BiTFiT) has nothing to train; use --trainable lora or full")
    total = sum(p.numel() for p in model.parameters())
    if cfg.trainable == "full":
        trainable = total
    elif cfg.trainable == "bias":
        trainable = sum(p.numel() for name, p in model.named_parameters() if name.endswith(".bias"))
    else:  # LoRA on every linear layer
        trainable = sum(cfg.lora_rank * (m.in_features + m.out_features) for m in model.modules()
                        if isinstance(m, torch.nn.Linear))
    shards = int(os.environ.get("WORLD_SIZE", "1")) if cfg.shard else 1
    tokens = cfg.max_length if texts is None else _longest(folder, texts, cfg.max_length)
    settings = dict(shape=memory.ModelShape.of(model.config, total), trainable=trainable, method=cfg.method,
                    tokens=tokens, bf16=cfg.bf16, optimizer=cfg.optimizer,
                    per_sample_grads=cfg.per_sample_grads, private=cfg.private, shards=shards)
    share = math.ceil(memory.largest_batch(cfg.batch_size or examples) / shards)  # this rank's
    at_once = min(cfg.micro_batch, share) if cfg.micro_batch else share
    estimate = memory.process_peak_bytes(examples=at_once, **settings)
    if cfg.max_memory and estimate > cfg.max_memory:
        fits = memory.examples_that_fit(cfg.max_memory, **settings)
        hint = (f"--micro-batch {fits} fits (same batches, noise and accounting)" if fits else
                "not even one example fits: try --trainable lora, --bf16 or --method dp-zo")
        raise DPAuditError(f"a step of {cfg.method} on {at_once} examples x {tokens} tokens needs about "
                           f"{human_bytes(estimate)}, over --max-memory {human_bytes(cfg.max_memory)}; {hint}")
    available = memory.available_bytes() if warn else None
    if not cfg.max_memory and available is not None and estimate > available:
        import sys

        fits = memory.examples_that_fit(available, **settings)
        print(f"warning: a step of {cfg.method} on {at_once} examples x {tokens} tokens needs about "
              f"{human_bytes(estimate)}, more than the {human_bytes(available)} available; "
              + (f"--micro-batch {fits} would fit" if fits else "not even one example would fit"),
              file=sys.stderr, flush=True)
    return estimate


def _longest(folder: Path, texts: list[str], max_length: int) -> int:
    """The longest of ``texts`` in tokens, at most ``max_length`` (the widest batch a run can draw)."""
    from dpaudit.models.hf import load_tokenizer

    try:
        tokenizer = load_tokenizer(folder)
        lengths = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    except Exception:  # noqa: BLE001 - an estimate only: the run itself reports a tokenizer it cannot use
        return max_length
    return max(1, min(max_length, max((len(ids) for ids in lengths), default=1)))


def _has_content(folder: Path) -> bool:
    from dpaudit.core.lock import LOCK, MARKER

    return any(p.name not in (LOCK, MARKER) for p in folder.iterdir())


def _train(model_dir: Path, texts: list[str], run_dir: Path, cfg: TrainConfig, *, resume: bool,
           show_progress: bool, estimate: int | None = None) -> TrainResult:
    import torch

    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training.data import tokenize
    from dpaudit.training.distributed import setup_world
    from dpaudit.training.ledger import PrivacyLedger
    from dpaudit.training.new_tokens import new_token_ids
    from dpaudit.training.batches import poisson_batch, shuffled_batches
    from dpaudit.training.shard import Sharding, full_state_dict, shard_model
    from dpaudit.training.streams import STREAM
    from dpaudit.training.trainable import select_trainable, trainable_parameters
    from dpaudit.audit.whitebox_canaries import WhiteBoxCanaries
    from dpaudit.core.threads import adapt as adapt_threads
    from dpaudit.training.divergence import DivergenceWatch
    from dpaudit.training.methods import TrainerSetup

    world = setup_world()
    run_dir = Path(run_dir)
    start, released_before, previous, previous_ledger, found = 0, 0, None, None, None
    base_model = str(model_dir)
    if resume:
        if cfg.trainable == "lora":
            raise DPAuditError("resuming a LoRA run is not supported; start it again")
        previous = run_folder.run_config(run_dir, required=False)
        if previous is not None:
            before, now = _plan(previous["config"]), _plan(_config_for_state(cfg))
            if before != now:  # names only: values are the user's and are not echoed
                differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
                raise DPAuditError(f"{run_dir} holds a run with another configuration (not as it was started: "
                                   f"{', '.join(differ)}; pass the run's own), or use a new folder")
            base_model = str(previous.get("base_model", base_model))  # the original, never a checkpoint
        previous_ledger = run_folder.ledger(run_dir)
        released_before = _released_steps(run_dir, previous_ledger, cfg)
        if previous_ledger is None and (released_before or any(
                (run_dir / name).exists() for name in (checkpoint.FINAL, checkpoint.TMP, checkpoint.OLD))):
            raise DPAuditError(f"{run_dir} holds steps of a run but no {run_folder.LEDGER}: refusing to resume a run "
                               "whose spending is unknown; start a new run folder")
        if (run_dir / run_folder.MODEL).is_dir():
            raise DPAuditError(f"the run in {run_dir} is complete; there is nothing to resume")
        if world.is_main:  # the newest verified copy, moved to checkpoint/ (hashed once, here)
            found = checkpoint.newest_intact(run_dir)
    elif run_dir.exists() and _has_content(run_dir):
        raise DPAuditError(f"run folder {run_dir} is not empty; pass --resume to continue it or use a new folder")
    world.barrier()  # every rank has checked the folder before rank 0 writes to it
    if resume:
        step = (found[1] if found else None) if world.is_main else checkpoint.intact_step(run_dir / checkpoint.FINAL)
        if step is not None:
            start, model_dir = step, run_dir / checkpoint.FINAL
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)

    if len(texts) < 2:
        raise DPAuditError("the training set needs at least 2 examples")
    sharded = cfg.shard and world.size > 1
    # Sharded bf16: float32 shards (the optimizer's master copy), gathered and computed in bf16.
    model, tokenizer = load_causal_lm(model_dir, dtype=torch.bfloat16 if cfg.bf16 and not sharded else None)
    torch.manual_seed(cfg.seed)
    rows = new_token_ids(tokenizer) if cfg.trainable == "lora" else []  # canary rows train with the adapters
    model = select_trainable(model, cfg.trainable, cfg.lora_rank, rows)
    sharding = None
    if not sharded:
        model = model.to(world.device)
    else:  # fully_shard moves one unit at a time to the device, so the whole model never sits there
        shard_model(model, world.device, world.size, cfg.bf16, cfg.method == "dp-zo")
        sharding = Sharding(world.size, world.sum)
    params = trainable_parameters(model)
    data = tokenize(tokenizer, texts, cfg.max_length)
    n_real = len(data)
    secret = cfg.secret_seed if cfg.secret_seed is not None else _shared_entropy(world)
    canaries = None
    if cfg.white_box:
        canaries = (WhiteBoxCanaries.load(run_dir) if start else
                    WhiteBoxCanaries.make(cfg.white_box, seed=cfg.seed, membership_seed=int(secret)))
        if cfg.method == "dp-sgd" and not canaries.coordinates:
            canaries.place(sum(p.numel() for p in params))
    n = n_real + (len(canaries.member_ids) if canaries else 0)  # member canaries are examples too
    batch_size = cfg.batch_size or n  # 0: every example every step (p = 1)
    if batch_size > n:
        raise DPAuditError(f"batch size {batch_size} exceeds the {n} training examples")
    rate = batch_size / n
    plan = PrivacyPlan.build(kind=cfg.mechanism, rate=rate, steps=cfg.steps, delta=cfg.delta,
                             target_epsilon=cfg.target_epsilon, sigma=cfg.sigma, accountant=cfg.accountant,
                             bug=cfg.bug)
    sigma = plan.sigma
    header = {"method": cfg.method, "private": plan.private, "mechanism": cfg.mechanism if plan.private else None,
              "sigma": sigma, "clip": cfg.clip, "sampling_rate": rate, "steps_planned": cfg.steps,
              "delta": cfg.delta, "target_epsilon": cfg.target_epsilon if math.isfinite(cfg.target_epsilon)
              else "inf", "examples": n, "noise_disabled_unsafely": cfg.unsafe_disable_noise,
              "white_box_canaries": cfg.white_box, "planted_bug": cfg.plant_bug}
    header["world_size"] = world.size
    header["data_sha256"] = _fingerprint(texts)
    if previous_ledger is not None:
        plan, header = _resume_phases(plan, header, previous_ledger, released_before, run_dir)
        sigma = plan.sigma
    # Steps run after the last checkpoint of a killed run are redone with fresh noise, but their
    # outputs (the DP-ZO log, the ledger) may have been seen: they are spent, and stay counted.
    discarded = max(0, released_before - start)
    header["steps_discarded_by_resume"] = discarded
    header["overspend_allowed"] = cfg.allow_overspend
    ledger = PrivacyLedger(run_dir / run_folder.LEDGER, header, plan, cfg.steps + discarded)
    if previous_ledger is not None:
        _never_below(previous_ledger, ledger, released_before, run_dir)
    if plan.phases and ledger.total_epsilon > cfg.target_epsilon and not cfg.allow_overspend:
        raise DPAuditError(f"resuming on other data composes {len(plan.phases)} phases, which spend eps "
                           f"{ledger.total_epsilon:.4g} > the target {cfg.target_epsilon:g}; pass --allow-overspend to "
                           "accept (it is recorded in the ledger)")
    if discarded and ledger.total_epsilon > max(ledger.planned_epsilon, cfg.target_epsilon) and not cfg.allow_overspend:
        raise DPAuditError(f"resuming would spend eps {ledger.total_epsilon:.4g} > the planned "
                           f"{ledger.planned_epsilon:.4g}: {discarded} steps ran after the last checkpoint and count "
                           "again; pass --allow-overspend to accept (it is recorded in the ledger)")
    main = world.is_main  # only rank 0 writes: ledger, log, checkpoints, model
    if main:
        # DP-ZO directions come from the generator of the device the weights live on (CPU and CUDA
        # streams differ), so a replay must draw them on the same kind of device.
        atomic_write_json(run_dir / run_folder.RUN_CONFIG, {"config": _config_for_state(cfg), "base_model": base_model,
                                                        "sigma": sigma, "sampling_rate": rate, "examples": n,
                                                        "expected_batch_size": batch_size,
                                                        "direction_device": params[0].device.type,
                                                        "lora_new_token_rows": rows,
                                                        "direction_stream": STREAM, "sharded": sharded,
                                                        "estimated_peak_bytes": estimate})
        if canaries is not None:
            canaries.save(run_dir)
    rng = np.random.default_rng([int(secret), start])
    batches = None if cfg.private else shuffled_batches(n, batch_size, rng)
    noise_sigma = 0.0 if cfg.unsafe_disable_noise else plan.noise_sigma(cfg.bug)
    trainer = METHODS[cfg.method].build(TrainerSetup(
        cfg=cfg, model=model, params=params, run_dir=run_dir, rate=rate, batch_size=batch_size,
        noise_sigma=noise_sigma, secret=int(secret), start=start, main=main, canaries=canaries, world=world,
        sharding=sharding, rng=rng))
    saved = run_dir / checkpoint.FINAL
    if start and (saved / checkpoint.OPTIMIZER).is_file():
        was_sharded = run_folder.read_json(saved / checkpoint.STATE, "checkpoint state").get("sharded", False)
        if was_sharded != sharded:
            raise DPAuditError(f"the checkpoint in {run_dir} was saved {'with' if was_sharded else 'without'} "
                               "--shard over several processes; resume it the same way")
        try:
            state = torch.load(saved / checkpoint.OPTIMIZER, weights_only=True)
            trainer.load_state_dict(state)
        except Exception as exc:  # sealed by our checksum, so only a file made to look like ours gets here
            raise DPAuditError(f"cannot read the optimizer state in {saved}: {type(exc).__name__}") from None

    last_loss, interrupted_at = None, start
    watch = DivergenceWatch()
    began = time.perf_counter()
    label = f"{cfg.method}{'' if cfg.private else ' (non-private)'}"
    try:
        with progress_bar(cfg.steps - start, label, show_progress and world.is_main) as advance:
            for step in range(start, cfg.steps):
                idx = poisson_batch(n, rate, rng) if cfg.private else next(batches)
                real = idx[idx < n_real]
                sampled = canaries.member_ids[idx[idx >= n_real] - n_real] if canaries else idx[:0]
                batch = {k: v.to(world.device) for k, v in data.batch(world.shard(real)).items()}
                if main:  # written ahead: the step is spent before anything it releases is written
                    ledger.record(step + 1 + discarded, steps_in_model=step)
                interrupted_at = step
                last_loss = trainer.run_step(step, batch, len(idx), sampled)
                interrupted_at = step + 1
                _watch_divergence(watch, step, last_loss if len(idx) else None, cfg, ledger, world)
                if world.size == 1 and step % 10 == 9:
                    adapt_threads()  # a core another process took since is left to it (threads.py)
                advance(1, f"step {step + 1}, loss {last_loss:.4g}, eps spent {ledger.spent(step + 1 + discarded):.4g}")
                due = cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps
                if due and cfg.trainable != "lora":  # LoRA adapters are merged once, at export
                    weights = full_state_dict(model) if sharded else None  # every rank takes part
                    state = trainer.state_dict() if main or sharded else None
                    if main:
                        _save_checkpoint(run_dir, model, tokenizer, {"step": step + 1, "config": _config_for_state(cfg),
                                                                     "sharded": sharded}, state, weights)
    except (KeyboardInterrupt, TimeUp) as exc:
        where = (f"at step {interrupted_at}; the ledger counts {ledger.recorded} steps (eps spent "
                 f"{ledger.spent(ledger.recorded):.4g}); resume with --resume")
        if isinstance(exc, TimeUp):
            raise TimeUp(f"stopped by --timeout {where}") from None
        raise Interrupted(f"interrupted {where}") from None
    finally:
        trainer.close()
    if main:
        ledger.record(cfg.steps + discarded, steps_in_model=cfg.steps)
    seconds = time.perf_counter() - began
    final = run_dir / run_folder.MODEL
    weights = full_state_dict(model) if sharded else None  # every rank takes part
    if main:  # the finished model replaces the resume checkpoint (no second copy of the weights)
        final = _export(run_dir, model, tokenizer, weights)
        checkpoint.remove(run_dir)
    world.barrier()
    return TrainResult(run_dir=run_dir, model_dir=final, private=plan.private, sigma=sigma,
                       epsilon=ledger.total_epsilon, delta=cfg.delta, sampling_rate=rate, steps=cfg.steps,
                       examples=n, seconds=seconds, seconds_per_step=seconds / max(1, cfg.steps - start),
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
        import sys

        print(f"warning: {why}. A learning rate too large (now {cfg.lr:g}) does this, and so does a broken DP step "
              "(clipping skipped, noise too small): training goes on, and the result says so", file=sys.stderr)


# What the ledger accounts: a resume that changes any of them would re-account the steps already taken.
RESUME_IDENTITY = ("method", "mechanism", "sigma", "clip", "delta", "sampling_rate", "examples", "data_sha256")
DATA_KEYS = ("sampling_rate", "examples", "data_sha256")  # a resume on other data: a new phase, composed


def _resume_phases(plan, header: dict, previous: dict, released: int, run_dir: Path):
    """(plan, header) for resuming a run whose ledger says ``previous`` after ``released`` released steps.

    The method, noise, clip and delta must be the ledger's (else refused, naming what differs). Other data
    (another N, p or text) starts a new phase at ledger step ``released``: the steps already released stay
    accounted at the old rate and the rest at the new one, composed in sequence (never re-accounted at the
    new p, which would under-count). The run keeps the ledger's sigma: a calibrated sigma is not calibrated
    again for the new data (that would change the noise of a run already part-spent)."""
    missing = [k for k in RESUME_IDENTITY if k not in previous] if plan.private else []
    if missing:
        raise DPAuditError(f"{run_dir / run_folder.LEDGER} does not say its {', '.join(missing)}: refusing to resume a "
                           "run whose spending is unknown; start a new run folder")
    data_changed = [k for k in DATA_KEYS if k in previous and previous[k] != header[k]]
    if data_changed and plan.private and plan.calibrated and isinstance(previous.get("sigma"), (int, float)):
        plan = replace(plan, mechanism=plan.mechanism.with_sigma(float(previous["sigma"])))
        header = {**header, "sigma": plan.sigma}
    differ = [k for k in RESUME_IDENTITY if k not in DATA_KEYS and k in previous and previous[k] != header[k]]
    if differ or (data_changed and not plan.private):
        raise DPAuditError(f"resuming {run_dir} with another {', '.join(differ or data_changed)} than its ledger "
                           "accounts: the steps already taken would be re-accounted at the new values and eps "
                           "under-counted. Resume with the run's own method, noise, clip and delta (other data is "
                           "composed as a new phase), or start a new run folder")
    phases = [dict(p) for p in previous.get("phases") or [] if isinstance(p, dict)]
    if not phases and data_changed:
        phases = [{"from_step": 0, **{k: previous.get(k) for k in DATA_KEYS}}]
    if data_changed:
        phases.append({"from_step": released, **{k: header[k] for k in DATA_KEYS}})
    if not phases:
        return plan, header
    try:
        steps = [(int(p["from_step"]), float(p["sampling_rate"])) for p in phases]
    except (KeyError, TypeError, ValueError):
        raise DPAuditError(f"{run_dir / run_folder.LEDGER} lists phases it does not describe; refusing to resume "
                           "a run whose spending is unknown") from None
    return plan.in_phases(steps), {**header, "phases": phases}


def _never_below(previous: dict, ledger, released: int, run_dir: Path) -> None:
    """A resumed run never ends having spent less than its old ledger already recorded as spent: the new
    ledger's total (released steps, redone ones and the rest, composed) must reach the old epsilon_spent (else
    the ledger, or the data, is not what the run spent on; issue 36: a stripped ledger resumed at 13.93 below
    the 16.45 already recorded). The old figure is read at a grid point at or after the steps it counted, so a
    total within GRID_SLACK of it is not refused: a legitimate resume on more data near the end of a run can
    come that close."""
    before = previous.get("epsilon_spent")
    if isinstance(before, (int, float)) and not isinstance(before, bool) and math.isfinite(before) and released:
        now = ledger.total_epsilon
        if now < before * (1 - GRID_SLACK):
            raise DPAuditError(f"resuming {run_dir} would spend eps {now:.4g} in all, below the {before:.4g} its "
                               "ledger already recorded: the ledger does not describe the run; refusing to resume a "
                               "run whose spending is unknown (start a new run folder)")


GRID_SLACK = 0.02


def _released_steps(run_dir: Path, ledger: dict | None, cfg: TrainConfig) -> int:
    """Steps whose outputs may have been seen: the ledger's count, or more where the DP-ZO log or the
    white-box transcript holds more (a run written by an older dpaudit released before it counted)."""
    from dpaudit.audit.whitebox_canaries import TRANSCRIPT

    counted = 0
    if ledger is not None:
        counted = ledger.get("steps_executed")
        if type(counted) is not int or counted < 0:
            raise DPAuditError(f"{run_dir / run_folder.LEDGER} does not say how many steps ran; refusing to resume a run whose "
                               "spending is unknown")
    counted = max(counted, run_folder.log_lines(run_dir))
    transcript = run_dir / TRANSCRIPT
    if cfg.white_box and transcript.is_file():
        counted = max(counted, transcript.stat().st_size // (4 * cfg.white_box))
    return counted


def _fingerprint(texts: list[str]) -> str:
    """SHA-256 of the training texts, each prefixed by its length (a resume must train on the same data)."""
    import hashlib

    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _shared_entropy(world) -> int:
    """Fresh OS entropy for batches and noise, the same on every rank (rank 0's, broadcast)."""
    entropy = np.random.SeedSequence().entropy % (2**62)
    if world.size > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([entropy], dtype=torch.int64, device=world.device)
        dist.broadcast(t, src=0)
        entropy = int(t.item())
    return entropy


def _config_for_state(cfg: TrainConfig) -> dict:
    d = asdict(cfg)
    d.pop("secret_seed")  # never written down: it would reveal batches and noise
    d.pop("allow_overspend")  # a permission for this resume, not part of the run's plan
    d["target_epsilon"] = d["target_epsilon"] if math.isfinite(d["target_epsilon"]) else "inf"
    return d


# How a step is computed, not what it computes: a resume may change them.
EXECUTION_ONLY = ("per_sample_grads", "micro_batch", "max_memory", "shard", "stop_on_divergence")


def _plan(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in EXECUTION_ONLY}


def _export(run_dir: Path, model, tokenizer, weights: dict | None = None) -> Path:
    """The fine-tuned model as a plain Hugging Face directory (LoRA merged), for auditing and use.
    ``weights``: the whole state of a sharded model, gathered on this rank."""
    from dpaudit.training.trainable import merged

    return save_model_folder(run_dir / run_folder.MODEL, merged(model), tokenizer, state_dict=weights)
