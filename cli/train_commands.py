"""`dpaudit train`, `dpaudit audit run` and `dpaudit replay`: the bundled trainers from the command line."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Annotated, Optional

import click
import typer

from dpaudit.core.atomic import guard_new_folder, refuse_overlap, save_model_folder
from dpaudit.cli.common import (
    MODEL_TIMEOUT, WHOLE, ForceOpt, JsonOpt, RecordsOpt, ThreadsOpt, UnitOpt, UserSamplingOpt, bounded, console, emit,
    err_console, fmt,
)
from dpaudit.core.errors import DPAuditError
from dpaudit.core.threads import set_threads
from dpaudit.training.directions import DEFAULT_DIRECTION
from dpaudit.accounting.noises import NOISES, resolve_delta
from dpaudit.canaries.manifest import NEW_TOKEN_PREFIX
from dpaudit.cli.audit_commands import present
from dpaudit.core import run_folder, run_record
from dpaudit.core.limits import parse_memory
from dpaudit.core.texts import detect_format, read_texts
from dpaudit.core.users import cap_records, read_user_texts
from dpaudit.models.embedded import is_embedded
from dpaudit.models.gguf import gguf_file_in, scan_header
from dpaudit.models.hf import refuse_remote_code, resolve_model_path
from dpaudit.models.loading import load_causal_lm
from dpaudit.training.distributed import launch_rank
from dpaudit.training.methods import METHODS
from dpaudit.training.runner import TrainConfig, check_inputs as run_checks, train
from dpaudit.workflows.audit_run import (
    USER_HELD_OUT, AuditRunSettings, black_box_recipe, resolve_recipe, run_audit, white_box_canaries,
)
from dpaudit.workflows.replay import default_tolerance, max_weight_difference, replay_run

MethodOpt = Annotated[str, typer.Option("--method", help="dp-zo or dp-sgd.")]
EpsOpt = Annotated[Optional[str], typer.Option(
    "--eps", help="Target eps (sigma is calibrated); 'inf' for the non-private baseline.")]
SigmaOpt = Annotated[Optional[float], typer.Option("--sigma", help="Noise multiplier to use (eps is reported).")]
TrainDeltaOpt = Annotated[Optional[float], typer.Option(
    "--delta", help="Target delta (default: 1e-5 for gaussian; 0, pure eps-DP, for laplace).")]
TrainMechOpt = Annotated[str, typer.Option("--mech", help="Noise: gaussian, or laplace (dp-zo only).")]
ClipOpt = Annotated[Optional[float], typer.Option("--clip", help="C (default: dp-zo 0.05, dp-sgd 1.0).")]
LrOpt = Annotated[Optional[float], typer.Option("--lr", help=(
    "Learning rate. Default: on the embedded model dp-sgd 5e-3 (AdamW), dp-zo 3e-5; on a pretrained model "
    "dp-sgd 5e-5 (LoRA 5e-4, bias 1e-3), dp-zo 1e-6 (LoRA 1e-5)."))]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="dp-sgd: adamw or sgd.")]
TrainNoiseOpt = Annotated[Optional[str], typer.Option(
    "--noise", help="Correlated noise, DP-SGD only: bandmf,b=B (banded matrix factorisation; batches are then "
                    "cyclic Poisson in B groups, accounted with amplification; b = 1 is DP-SGD; memory b - 1 extra "
                    "copies of the trainable parameters) or blt,buffers=D / blt,theta=T1:T2,omega=W1:W2 "
                    "(buffered-linear-Toeplitz, with --sampling balls-in-bins, or shuffle with ,order=fixed; "
                    "accounted without amplification; memory one copy a buffer).")]
TrainStepsOpt = Annotated[Optional[int], typer.Option("--steps", "-T", click_type=WHOLE, help="Training steps (default: dp-sgd 300, dp-zo 3000).")]
TrainBatchOpt = Annotated[int, typer.Option("--batch-size", "-B", help="Expected batch size (p = B/N).")]
PhiOpt = Annotated[float, typer.Option("--phi", help="dp-zo perturbation scale.")]
DirectionOpt = Annotated[str, typer.Option("--direction", help="dp-zo direction: rademacher (+-1, SPSA; a third of a Gaussian pass's cost on CPU), gaussian (the DP-ZO paper's) or sphere (DPZero).")]
TrainableOpt = Annotated[str, typer.Option("--trainable", help="full, lora, bias (DP-BiTFiT), embeddings (the "
                                                               "token embedding rows only) or new-tokens (only the "
                                                               "rows of tokens added to the base vocabulary).")]
Bf16Opt = Annotated[bool, typer.Option("--bf16", help="bf16 weights and activations, no loss scaling.")]
PerSampleGradsOpt = Annotated[str, typer.Option(
    "--per-sample-grads", help="dp-sgd: ghost (clipped sums without per-example gradients, about SGD's memory) "
                               "or materialise (Opacus' per-example gradients; for comparison).")]
MicroBatchOpt = Annotated[int, typer.Option(
    "--micro-batch", help="At most this many examples per forward/backward; a larger Poisson batch is processed "
                          "in chunks with the same noise and accounting (0: the whole batch at once).")]
TrainMaxMemoryOpt = Annotated[Optional[str], typer.Option(
    "--max-memory", help="Refuse to start when a step is estimated to need more (e.g. 8G); the refusal names the "
                         "--micro-batch that fits. Without it, a step estimated above the free memory is a warning.")]
ShardOpt = Annotated[bool, typer.Option(
    "--shard", help="Under torchrun: shard weights, gradients and optimizer state over the processes (ZeRO-3, "
                    "PyTorch FSDP2); same updates, log and accounting as one process.")]
TrainSeedOpt = Annotated[int, typer.Option("--seed", help="Public seed (directions, adapters, canaries).")]
SecretSeedOpt = Annotated[Optional[int], typer.Option(
    "--secret-seed", help="Seed for batches and noise (default: fresh OS entropy; set only for tests).")]
AccountantTrainOpt = Annotated[Optional[str], typer.Option("--accountant", "-a", help="Accountant for sigma.")]
FormatOpt = Annotated[Optional[str], typer.Option("--format", help="Data format: jsonl, txt or csv (default: from the name).")]
FieldOpt = Annotated[str, typer.Option("--field", help="JSONL field or CSV column with the text.")]


def parse_eps(eps: str | None, sigma: float | None) -> float:
    if eps is None:
        if sigma is None:
            raise DPAuditError("give --eps (a number, or inf for no DP) or --sigma")
        return math.inf
    try:
        value = float(eps)
    except ValueError:
        raise DPAuditError(f"--eps must be a number or inf, got {eps!r}") from None
    if sigma is not None:
        raise DPAuditError("give --eps or --sigma, not both")
    return value


DivergenceOpt = Annotated[bool, typer.Option(
    "--stop-on-divergence/--no-stop-on-divergence",
    help="Stop (exit 2) when the training loss rises above 1.75x its start (medians of 3 steps), or is exactly 0 "
         "for 3 steps. Default off: warn once, go on, and say so in the result and the report. A broken DP step "
         "(clipping skipped, noise too small) also diverges, so an audit stopped this way gives no verdict.")]


PlantBugOpt = Annotated[Optional[str], typer.Option(
    "--plant-bug", hidden=True, help="Testing the audit only (needs DPAUDIT_ALLOW_BUGS=1): plant a privacy bug.")]


def _pretrained(model: Path | None) -> bool:
    """Any model dpaudit did not build itself (None: the embedded default, which audit run builds)."""

    return model is not None and not is_embedded(model)


def make_config(method, eps, sigma, delta, mech, clip, lr, optimizer, steps, batch_size, phi, direction, trainable,
                bf16, seed, secret_seed, accountant, max_memory=None, model: Path | None = None, **extra):

    if mech in NOISES:  # an unknown one is refused by TrainConfig, naming it
        delta = resolve_delta(mech, delta)
    if lr is None and method in METHODS:  # the tiny model's defaults would blow a pretrained one up
        lr = METHODS[method].default_lr(trainable, _pretrained(model))

    return TrainConfig(method=method, target_epsilon=parse_eps(eps, sigma), sigma=sigma, delta=delta,
                       mechanism=mech, clip=clip, lr=lr, optimizer=optimizer,
                       steps=steps, batch_size=batch_size, phi=phi,
                       direction=direction, trainable=trainable, bf16=bf16, seed=seed, secret_seed=secret_seed,
                       accountant=accountant, max_memory=parse_memory(max_memory) if max_memory else None, **extra)


# train's flag -> the run record's setting (core/run_record.RunSettings), for --resume
_RESUMED = {"method": "method", "delta": "delta", "mech": "mechanism", "clip": "clip", "lr": "lr",
            "optimizer": "optimizer", "steps": "steps", "batch_size": "batch_size", "phi": "phi",
            "direction": "direction", "trainable": "trainable", "bf16": "bf16", "seed": "seed",
            "accountant": "accountant", "save_every": "save_every", "white_box": "white_box",
            "plant_bug": "plant_bug", "per_sample_grads": "per_sample_grads", "micro_batch": "micro_batch",
            "shard": "shard", "sampling": "sampling", "noise": "noise", "unit": "unit",
            "records_per_user": "records_per_user", "user_sampling": "user_sampling"}


def _resumed_flags(out: Path, flags: dict) -> dict:
    """``flags`` with every one left at its default replaced by the value the run was started with."""

    saved = run_record.read(out, required=False) if out.is_dir() else None
    ctx = click.get_current_context(silent=True)
    if saved is None or ctx is None:
        return flags
    settings = saved.settings
    defaulted = {name for name in flags if ctx.get_parameter_source(name) in (None, click.core.ParameterSource.DEFAULT)}
    for name, key in _RESUMED.items():
        if name in defaulted:
            flags[name] = getattr(settings, key)
    if {"eps", "sigma"} <= defaulted:  # the claim: a target eps (calibrated) or a given sigma
        if settings.sigma is not None:
            flags["eps"], flags["sigma"] = None, settings.sigma
        else:
            flags["eps"], flags["sigma"] = str(settings.target_epsilon), None
    return flags


@bounded("dpaudit train", None, False)
def train_cmd(
    model: Annotated[Path, typer.Option("--model", help="Local causal LM: a Hugging Face folder, a hub-cache folder or a .gguf file.")],
    data: Annotated[Path, typer.Option("--data", "-d", help="Training data: .jsonl, .txt or .csv.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Run folder (ledger, logs, checkpoint, model).")],
    method: MethodOpt = "dp-sgd", eps: EpsOpt = None, sigma: SigmaOpt = None, delta: TrainDeltaOpt = None,
    mech: TrainMechOpt = "gaussian", clip: ClipOpt = None, lr: LrOpt = None, optimizer: OptimizerOpt = "adamw",
    steps: TrainStepsOpt = None, batch_size: TrainBatchOpt = 64, phi: PhiOpt = 1e-3,
    direction: DirectionOpt = DEFAULT_DIRECTION, trainable: TrainableOpt = "full", bf16: Bf16Opt = False,
    per_sample_grads: PerSampleGradsOpt = "ghost", micro_batch: MicroBatchOpt = 0,
    max_memory: TrainMaxMemoryOpt = None, shard: ShardOpt = False,
    seed: TrainSeedOpt = 0, secret_seed: SecretSeedOpt = None, accountant: AccountantTrainOpt = None,
    data_format: FormatOpt = None, field: FieldOpt = "text",
    save_every: Annotated[int, typer.Option("--save-every", help="Checkpoint every k steps (0: at the end).")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its checkpoint.")] = False,
    allow_overspend: Annotated[bool, typer.Option(
        "--allow-overspend", help="With --resume: accept spending more than planned (steps redone after a kill "
                                  "count again); recorded in the ledger.")] = False,
    white_box: Annotated[int, typer.Option(
        "--white-box", help="Plant M white-box canaries and record the canary-aligned transcript "
                            "(audit it with 'dpaudit audit transcript').")] = 0,
    plant_bug: PlantBugOpt = None,
    stop_on_divergence: DivergenceOpt = False,
    threads: ThreadsOpt = None,
    sampling: Annotated[str, typer.Option(
        "--sampling", help="How a private run draws its batches, and is accounted: poisson (rate B/N) or "
                           "balls-in-bins (each example in one random step of each epoch of N // B steps); shuffle "
                           "with --noise blt,...,order=fixed only (one permutation, passed every epoch).")] = "poisson",
    noise: TrainNoiseOpt = None,
    unit: UnitOpt = "example", records_per_user: RecordsOpt = None, user_sampling: UserSamplingOpt = None,
    user_field: Annotated[str, typer.Option(
        "--user-field", help="--unit user: the JSONL field or CSV column that says whose each record is; each "
                             "user's records are capped at --records-per-user (a random k a user, chosen from the "
                             "public --seed and the user's id: never from the texts or other users).")] = "user",
    check_inputs: Annotated[bool, typer.Option(
        "--check-inputs", help="Only check the inputs (model, data, options, run folder) and exit: 0 usable, 2 not. "
                               "Run it before torchrun, which turns every rank's exit 2 into its own 1.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Fine-tune a local causal LM with DP-ZO or DP-SGD (sigma calibrated to --eps) or a non-private baseline. With
    --unit user the claim is a user's (ELS: records sampled and clipped as usual, accounted per user; ULS: users
    sampled, each user's mean gradient clipped as one)."""

    if resume:  # the run folder knows how it was started: only the flags that change need repeating
        given = _resumed_flags(out, dict(method=method, eps=eps, sigma=sigma, delta=delta, mech=mech, clip=clip,
                                         lr=lr, optimizer=optimizer, steps=steps, batch_size=batch_size, phi=phi,
                                         direction=direction, trainable=trainable, bf16=bf16, seed=seed,
                                         accountant=accountant, save_every=save_every, white_box=white_box,
                                         plant_bug=plant_bug, per_sample_grads=per_sample_grads,
                                         micro_batch=micro_batch, shard=shard, sampling=sampling, noise=noise,
                                         unit=unit, records_per_user=records_per_user, user_sampling=user_sampling))
        (method, eps, sigma, delta, mech, clip, lr, optimizer, steps, batch_size, phi, direction, trainable, bf16,
         seed, accountant, save_every, white_box, plant_bug, per_sample_grads, micro_batch, shard,
         sampling, noise, unit, records_per_user, user_sampling) = given.values()
    cfg = make_config(method, eps, sigma, delta, mech, clip, lr, optimizer, steps, batch_size, phi, direction,
                      trainable, bf16, seed, secret_seed, accountant, save_every=save_every, white_box=white_box,
                      plant_bug=plant_bug, allow_overspend=allow_overspend, per_sample_grads=per_sample_grads,
                      micro_batch=micro_batch, max_memory=max_memory, shard=shard, sampling=sampling,
                      stop_on_divergence=stop_on_divergence, model=model, noise=noise, unit=unit,
                      records_per_user=records_per_user, user_sampling=user_sampling)
    refuse_overlap(out, {"model": model, "dataset": data}, folder_output=True)
    set_threads(threads)
    texts, users = _user_texts(data, data_format, field, user_field, cfg, as_json)
    if check_inputs:
        _check_inputs(model, out, texts, resume)

        run_checks(cfg, texts, out, resume)
        emit({"command": "train", "inputs": "usable", "examples": len(texts)}, as_json,
             f"inputs usable: {len(texts)} examples, model {model}, run folder {out}")
        return
    result = train(model, texts, out, cfg, resume=resume, show_progress=not as_json, users=users)
    if launch_rank() != 0:  # under torchrun rank 0 answers: one --json document, not one a rank
        return
    privacy = (f"eps <= {fmt(result.epsilon)} at delta = {result.delta:g} (sigma {fmt(result.sigma)}, "
               f"{result.accountant}, {result.relation})" if result.private else "non-private (eps = inf)")
    emit({"command": "train", **result.to_dict()}, as_json,
         f"trained {result.steps} steps of {method} in {result.seconds:.1f} s; {privacy}; model: {result.model_dir}")


def _user_texts(data: Path, data_format, field: str, user_field: str, cfg, as_json: bool):
    """(texts, users): the training texts and, for a user-level run, whose each is, each user's records capped at
    k (core/users.py), said; users None at the example level."""
    fmt = detect_format(data, data_format)
    if not cfg.privacy_unit.user_level:
        return read_texts(data, fmt, field), None
    capped = cap_records(*read_user_texts(data, fmt, field, user_field), cfg.privacy_unit.records, cfg.seed)
    if not as_json:
        console.print(f"user level: {capped.user_count} users; {capped.dropped} of {capped.read} records dropped by "
                      f"the cap of {cfg.privacy_unit.records} a user", highlight=False)
    return capped.texts, capped.users


def _check_inputs(model: Path, out: Path, texts: list[str], resume: bool) -> None:
    """What `train` refuses before it builds anything, checked without loading weights (``--check-inputs``): the
    model a folder with a config (a GGUF file: its header), the data two examples or more, the run folder empty
    (or, with --resume, a run folder)."""

    gguf = gguf_file_in(Path(model))
    if gguf is not None:
        scan_header(gguf)
    else:
        folder = resolve_model_path(model)
        if not (folder / "config.json").is_file():
            raise DPAuditError(f"no config.json in {folder}: not a Hugging Face model folder")
        refuse_remote_code(folder)
    if len(texts) < 2:
        raise DPAuditError("the training set needs at least 2 examples")
    out = Path(out)
    if resume:
        run_record.read(out)   # refuses a folder that is not a run folder
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DPAuditError(f"{out} is not empty: give a new run folder (or --resume a run)")


@bounded("dpaudit audit run", None, False)
def audit_run(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder.")] = Path("dpaudit-run"),
    method: MethodOpt = "dp-sgd", eps: EpsOpt = "1", sigma: SigmaOpt = None, delta: TrainDeltaOpt = None,
    mech: TrainMechOpt = "gaussian", clip: ClipOpt = None, lr: LrOpt = None,
    optimizer: Annotated[Optional[str], typer.Option(
        "--optimizer", help="dp-sgd: adamw or sgd. Default: sgd for a black-box DP-SGD audit, adamw "
                            "otherwise.")] = None,
    steps: Annotated[Optional[int], typer.Option(
        "--steps", "-T", help="Training steps. Default: 3 for a black-box DP-SGD audit (full batches: the claim "
                              "does not depend on T there); 3000 for a black-box DP-ZO audit (its members share "
                              "one scalar a step: more steps drown each other's share out); otherwise dp-sgd 300, "
                              "dp-zo 3000.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-B", help="Expected batch size (p = B/N; 0 = every example every step). Default: 0, full "
                                   "batches, for a white-box audit and a black-box audit; 64 otherwise.")] = None,
    phi: Annotated[Optional[float], typer.Option(
        "--phi", help="dp-zo perturbation scale. Default: 2 C / |h| for a black-box DP-ZO audit (|h|: the hidden "
                      "state's norm at the canaries' prefixes, so a member's loss difference reaches the clip); "
                      "1e-3 otherwise.")] = None,
    direction: DirectionOpt = DEFAULT_DIRECTION,
    trainable: Annotated[Optional[str], typer.Option(
        "--trainable", help="full, lora, bias, embeddings or new-tokens (the canaries' rows only). Default, "
                            "chosen for exposure (the claim is the same whatever trains): new-tokens for a "
                            "black-box audit (DP-SGD: each canary's whole clipped gradient on its row; DP-ZO: each "
                            "canary's difference moves its own row alone; scored by its loss drop from the base "
                            "model, at a rate set from the model's hidden-state norm, micro-batched to fit the "
                            "memory); full otherwise. Black-box DP-SGD with full, lora or embeddings, its "
                            "canaries behind one shared prefix (see --prefix-length), and no --lr: the rate at "
                            "which the noise walks each weight 1/16 of the weights' typical size over the run, so "
                            "the body a canary's row learns along stays put.")] = None,
    bf16: Bf16Opt = False,
    per_sample_grads: PerSampleGradsOpt = "ghost", micro_batch: MicroBatchOpt = 0,
    max_memory: TrainMaxMemoryOpt = None, shard: ShardOpt = False,
    seed: TrainSeedOpt = 0, secret_seed: SecretSeedOpt = None, accountant: AccountantTrainOpt = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="Local causal LM (default: embedded).")] = None,
    data: Annotated[Optional[Path], typer.Option("--data", "-d", help="Training data (default: synthetic).")] = None,
    data_format: FormatOpt = None, field: FieldOpt = "text",
    canaries: Annotated[Optional[int], typer.Option(
        "--canaries", "-m", help="Number of canaries (default 1000; white-box DP-SGD 5000, fewer where T is long "
                                 "(the transcript within 256 MiB); white-box DP-ZO: chosen to maximise the "
                                 "expected bound).")] = None,
    examples: Annotated[Optional[int], typer.Option(
        "--examples", help="Synthetic sentences when no --data (default 1000; white box 64; black-box DP-ZO 100: "
                           "only the canaries' rows train, so the others only cost forwards).")] = None,
    white_box: Annotated[bool, typer.Option(
        "--white-box", help="Audit what DP protects: canaries planted in every privatised release "
                            "(DP-SGD gradients, DP-ZO scalars), scored from the run's transcript.")] = False,
    plant_bug: PlantBugOpt = None,
    stop_on_divergence: DivergenceOpt = False,
    noise: TrainNoiseOpt = None,
    threads: ThreadsOpt = None,
    repeat: Annotated[int, typer.Option("--repeat", "-r", help="Copies of each member canary; with --held-out (the "
                                                               "default under --unit user), records of each canary user.")] = 1,
    prefix_length: Annotated[Optional[int], typer.Option(
        "--prefix-length", help="Random tokens before each canary's secret (default 1: a longer prefix is more loss "
                                "to learn, whose gradient crowds the secret's row out of the clipped norm). Black-box "
                                "DP-SGD with --trainable full, lora or embeddings: unless this is given (or the "
                                "canaries are users), one shared prefix token, each secret's row starting at the "
                                "base's expected row after it, so a canary's gradient starts on its own row.")] = None,
    unsafe_disable_noise: Annotated[bool, typer.Option(
        "--unsafe-disable-noise", hidden=True, help="Testing only: claim eps but add no noise.")] = False,
    unit: UnitOpt = "example", records_per_user: RecordsOpt = None, user_sampling: UserSamplingOpt = None,
    held_out: Annotated[Optional[int], typer.Option(
        "--held-out", help="Black box: canary users, each of --repeat records (distinct prefixes, one secret) and this "
                           "many held-out records never trained, scored by user inference (Kandpal et al. 2023) "
                           "beside the per-record score, each at alpha/2. Default 4 with --unit user, else 0.")] = None,
    canary_records: Annotated[int, typer.Option(
        "--canary-records", help="--white-box: records of each canary, a canary user (each record sampled and "
                                 "clipped as an example; at most --records-per-user for a user-level claim). Against "
                                 "an example-level claim, users of several records show what it does not cover. "
                                 "Black box: --repeat.")] = 1,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Canaries -> insert -> train (DP-ZO/DP-SGD at --eps) -> score -> report; exit 1 on a violation."""

    if sigma is not None and eps == "1":
        eps = None  # --sigma replaces the default target
    known = METHODS.get(method)  # an unknown method is refused by make_config, one line
    recipe = resolve_recipe(
        black_box_recipe(known is not None and known.per_example_gradients, white_box, _pretrained(model)),
        batch_size=batch_size, examples=examples, trainable=trainable, optimizer=optimizer, steps=steps, lr=lr,
        phi=phi)
    cfg = make_config(method, eps, sigma, delta, mech, clip, recipe.lr, recipe.optimizer, recipe.steps,
                      recipe.batch_size, recipe.phi, direction, recipe.trainable, bf16, seed, secret_seed, accountant,
                      unsafe_disable_noise=unsafe_disable_noise,
                      plant_bug=plant_bug, per_sample_grads=per_sample_grads, micro_batch=micro_batch,
                      max_memory=max_memory, shard=shard, stop_on_divergence=stop_on_divergence, model=model,
                      noise=noise, unit=unit, records_per_user=records_per_user, user_sampling=user_sampling)
    if cfg.uls and not white_box:
        raise DPAuditError("audit run audits a ULS run with --white-box (its canary users join the sampled users); "
                           "black-box canaries are records, sampled at the example level")
    if cfg.privacy_unit.user_level and data is not None:
        raise DPAuditError("audit run --unit user trains on the synthetic data (one record a user) and its canary "
                           "users; for your own data's users, train with `dpaudit train --unit user` and audit the "
                           "checkpoint")
    if cfg.privacy_unit.user_level and repeat > cfg.privacy_unit.records:
        raise DPAuditError(f"--repeat {repeat} makes canary users of {repeat} records, over --records-per-user "
                           f"{cfg.privacy_unit.records}: the user-level claim does not cover them")
    if held_out is None:
        held_out = USER_HELD_OUT if cfg.privacy_unit.user_level and not white_box else 0
    if held_out and white_box:
        raise DPAuditError("--held-out is for black-box canary users; a white-box canary user's records are "
                           "--canary-records")
    if white_box:
        cfg = dataclasses.replace(cfg, white_box=canaries or white_box_canaries(cfg), canary_records=canary_records)
    elif canary_records != 1:
        raise DPAuditError("--canary-records is for --white-box; a black-box canary user's records are --repeat")
    set_threads(threads)
    if repeat > 1 and cfg.private and not cfg.privacy_unit.user_level:
        err_console.print(f"[yellow]note:[/yellow] {repeat} copies per canary: the claimed eps is per example, "
                      "a canary's group guarantee is weaker", highlight=False)
    refuse_overlap(out, {"model": model, "dataset": data}, folder_output=True)
    if prefix_length is not None and not 1 <= prefix_length <= 64:
        raise DPAuditError(f"--prefix-length must be in [1, 64], got {prefix_length}")
    # the shared-prefix layout, and with it the drift rate (measured only with it), unless the canaries are users
    # (each of several prefixes) or the user chose the prefix's length
    shared = recipe.shared_prefix and not held_out and prefix_length is None
    settings = AuditRunSettings(canaries=canaries or 1000, repeats=repeat, held_out=held_out,
                                examples=recipe.examples, seed=seed,
                                prefix_length=prefix_length or NEW_TOKEN_PREFIX, logit_step=recipe.logit_step,
                                logit_noise=recipe.logit_noise, phi_from_model=recipe.phi_from_model,
                                shared_prefix=shared, body_drift=recipe.body_drift if shared else None)
    audit, result, summary = run_audit(out, cfg, settings, model=model, data=data, data_format=data_format,
                                       field=field, force=force, show_progress=not as_json)
    if not as_json:
        console.print(f"trained {result.steps} steps of {method} in {result.seconds:.1f} s "
                      f"({result.seconds_per_step * 1000:.0f} ms/step)", highlight=False)
    present(audit, summary["context"], as_json,
            extra={"training": summary["training"], "report_files": summary["report_files"]})


@bounded("dpaudit replay", MODEL_TIMEOUT, None)
def replay_cmd(
    run: Annotated[Path, typer.Option("--run", help="A DP-ZO run folder (run_config.json, zo_steps.jsonl).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the replayed model.")],
    base: Annotated[Optional[Path], typer.Option("--base", help="Base model (default: the run's).")] = None,
    tolerance: Annotated[Optional[float], typer.Option(
        "--tolerance", help="Largest |weight difference| to the run's model that still matches (default: float "
                            "rounding bounded by the run's length and weights, 4 T 2^-24 max|w|, at least 1e-5 "
                            "float32; 1e-2 bf16). Over it: exit 1.")] = None,
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Rebuild a DP-ZO model from the base weights and the (seed, scalar) log, and compare it with the run's
    (exit 1 when they differ beyond --tolerance: the log does not explain the model)."""

    set_threads(threads)
    refuse_overlap(out, {"run": run, "base model": base}, folder_output=True)
    guard_new_folder(out, force)
    model, tok = replay_run(run, base)
    save_model_folder(out, model, tok)
    diff, verdict = None, "no finished model in the run to compare with"
    if tolerance is None:
        tolerance = default_tolerance(model, len(run_folder.zo_log(run)[0]))
    if (run / "model").is_dir():
        diff = max_weight_difference(model, load_causal_lm(run / "model")[0])
        verdict = (f"matches the run's model (max |difference| {diff:.3g} <= tolerance {tolerance:g})"
                   if diff <= tolerance else
                   f"DIFFERS from the run's model (max |difference| {diff:.3g} > tolerance {tolerance:g}): the "
                   "(seed, scalar) log does not explain the model")
    summary = {"command": "replay", "output": str(out), "max_abs_difference_to_run_model": diff,
               "tolerance": tolerance, "matches": diff is not None and diff <= tolerance, "verdict": verdict}
    emit(summary, as_json, f"replayed into {out}; {verdict}")
    if diff is not None and diff > tolerance:
        raise typer.Exit(1)  # the model holds more than its public log: the run's claim does not hold
