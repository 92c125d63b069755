"""The resume policy: what a run folder must hold for ``--resume`` to continue it, and what a resumed run may
change. A resume continues from the newest intact checkpoint with the run's own plan; steps released after that
checkpoint are spent and stay counted (redone with fresh noise); other data is composed as a new phase, never
re-accounted at the new rate; a folder whose spending cannot be read is refused, never guessed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
import hashlib

from dpaudit.core import run_folder, run_record
from dpaudit.core.run_record import LedgerRecord, RunSettings, read_ledger
from dpaudit.core.errors import DPAuditError
from dpaudit.training import checkpoint
from dpaudit.training.batches import source
from dpaudit.accounting.matrix.bandmf import check_attempts
from dpaudit.audit.whitebox_canaries import TRANSCRIPT
from dpaudit.core.lock import LOCK, MARKER


@dataclass
class Opening:
    """Where a (re)started run begins: its first step, the weights to load, and the old ledger's facts."""
    start: int = 0
    model_dir: Path | str = ""
    base_model: str = ""               # the original model, never a checkpoint
    previous_ledger: LedgerRecord | None = None
    released_before: int = 0           # steps whose outputs may have been seen


def open_run(run_dir: Path, model_dir, cfg, resume: bool, world) -> Opening:
    """Check the folder (empty for a new run; a resumable run of the same plan for --resume) and find where to
    start; rank 0 moves the newest verified checkpoint into place. Every rank returns the same opening."""
    opening = Opening(model_dir=model_dir, base_model=str(model_dir))
    found = None
    if resume:
        found = _check_resumable(run_dir, cfg, opening, world)
    elif run_dir.exists() and has_content(run_dir):
        raise DPAuditError(f"run folder {run_dir} is not empty; pass --resume to continue it or use a new folder")
    world.barrier()  # every rank has checked the folder before rank 0 writes to it
    if resume:
        step = (found[1] if found else None) if world.is_main else checkpoint.intact_step(run_dir / checkpoint.FINAL)
        if step is not None:
            opening.start, opening.model_dir = step, run_dir / checkpoint.FINAL
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    return opening


def _check_resumable(run_dir: Path, cfg, opening: Opening, world):
    if cfg.trainable == "lora":
        raise DPAuditError("resuming a LoRA run is not supported; start it again")
    previous = run_record.read(run_dir, required=False)
    if previous is not None:
        before, now = plan_of(previous.settings), plan_of(settings_of(cfg))
        if before != now:  # names only: values are the user's and are not echoed
            differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
            raise DPAuditError(f"{run_dir} holds a run with another configuration (not as it was started: "
                               f"{', '.join(differ)}; pass the run's own), or use a new folder")
        opening.base_model = previous.base_model or opening.base_model
    opening.previous_ledger = read_ledger(run_dir)
    opening.released_before = released_steps(run_dir, opening.previous_ledger, cfg)
    if opening.previous_ledger is None and (opening.released_before or any(
            (run_dir / name).exists() for name in (checkpoint.FINAL, checkpoint.TMP, checkpoint.OLD))):
        raise DPAuditError(f"{run_dir} holds steps of a run but no {run_folder.LEDGER}: refusing to resume a run "
                           "whose spending is unknown; start a new run folder")
    if (run_dir / run_folder.MODEL).is_dir():
        raise DPAuditError(f"the run in {run_dir} is complete; there is nothing to resume")
    return checkpoint.newest_intact(run_dir) if world.is_main else None  # the newest verified copy, hashed once


def check_spending(ledger, plan, opening: Opening, discarded: int, cfg, run_dir: Path) -> None:
    """A resumed run's refusals on what it would spend: below what its old ledger recorded (the ledger does not
    describe the run), or above the target or the plan without --allow-overspend."""
    if opening.previous_ledger is not None:
        never_below(opening.previous_ledger, ledger, opening.released_before, run_dir)
    if plan.phases and ledger.total_epsilon > cfg.target_epsilon and not cfg.allow_overspend:
        raise DPAuditError(f"resuming on other data composes {len(plan.phases)} phases, which spend eps "
                           f"{ledger.total_epsilon:.4g} > the target {cfg.target_epsilon:g}; pass --allow-overspend to "
                           "accept (it is recorded in the ledger)")
    if discarded and ledger.total_epsilon > max(ledger.planned_epsilon, cfg.target_epsilon) and not cfg.allow_overspend:
        raise DPAuditError(f"resuming would spend eps {ledger.total_epsilon:.4g} > the planned "
                           f"{ledger.planned_epsilon:.4g}: {discarded} steps ran after the last checkpoint and count "
                           "again; pass --allow-overspend to accept (it is recorded in the ledger)")


# What the ledger accounts: a resume that changes any of them would re-account the steps already taken.
RESUME_IDENTITY = ("method", "mechanism", "sigma", "clip", "delta", "sampling_rate", "examples", "data_sha256")
DATA_KEYS = ("sampling_rate", "examples", "data_sha256")  # a resume on other data: a new phase, composed


def resume_phases(plan, header: dict, previous: LedgerRecord, released: int, run_dir: Path):
    """(plan, header) for resuming a run whose ledger says ``previous`` after ``released`` released steps.

    The method, noise, clip and delta must be the ledger's (else refused, naming what differs). Other data
    (another N, p or text) starts a new phase at ledger step ``released``: the steps already released stay
    accounted at the old rate and the rest at the new one, composed in sequence (never re-accounted at the
    new p, which would under-count). The run keeps the ledger's sigma: a calibrated sigma is not calibrated
    again for the new data (that would change the noise of a run already part-spent)."""
    missing = [k for k in RESUME_IDENTITY if not previous.says(k)] if plan.private else []
    if missing:
        raise DPAuditError(f"{run_dir / run_folder.LEDGER} does not say its {', '.join(missing)}: refusing to resume a "
                           "run whose spending is unknown; start a new run folder")
    data_changed = [k for k in DATA_KEYS if previous.says(k) and previous.value(k) != header[k]]
    drawn = source(header["sampling"])  # independent steps: the new data is a phase of its own
    if data_changed and plan.private and (drawn is None or drawn.pattern != "independent"):
        raise DPAuditError(f"resuming {run_dir} on other data is composed as a new phase of Poisson sampling only; "
                           f"this run draws {header['sampling']} batches: start a new run folder")
    if data_changed and plan.private and plan.calibrated and previous.says("sigma"):
        plan = replace(plan, mechanism=plan.mechanism.with_sigma(float(previous.value("sigma"))))
        header = {**header, "sigma": plan.sigma}
    differ = [k for k in RESUME_IDENTITY if k not in DATA_KEYS and previous.says(k) and previous.value(k) != header[k]]
    if differ or (data_changed and not plan.private):
        raise DPAuditError(f"resuming {run_dir} with another {', '.join(differ or data_changed)} than its ledger "
                           "accounts: the steps already taken would be re-accounted at the new values and eps "
                           "under-counted. Resume with the run's own method, noise, clip and delta (other data is "
                           "composed as a new phase), or start a new run folder")
    phases = [dict(p) for p in previous.value("phases") or ()]
    if not phases and data_changed:
        phases = [{"from_step": 0, **{k: previous.value(k) for k in DATA_KEYS}}]
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


def never_below(previous: LedgerRecord, ledger, released: int, run_dir: Path) -> None:
    """A resumed run never ends having spent less than its old ledger already recorded as spent: the new
    ledger's total (released steps, redone ones and the rest, composed) must reach the old epsilon_spent (else
    the ledger, or the data, is not what the run spent on; a stripped ledger resumed at 13.93 below
    the 16.45 already recorded). The old figure is read at a grid point at or after the steps it counted, so a
    total within GRID_SLACK of it is not refused: a legitimate resume on more data near the end of a run can
    come that close."""
    before = previous.value("epsilon_spent")
    if before is not None and math.isfinite(before) and released:
        now = ledger.total_epsilon
        if now < before * (1 - GRID_SLACK):
            raise DPAuditError(f"resuming {run_dir} would spend eps {now:.4g} in all, below the {before:.4g} its "
                               "ledger already recorded: the ledger does not describe the run; refusing to resume a "
                               "run whose spending is unknown (start a new run folder)")


GRID_SLACK = 0.02


def released_steps(run_dir: Path, ledger: LedgerRecord | None, cfg) -> int:
    """Steps whose outputs may have been seen: the ledger's count, or more where the DP-ZO log or the
    white-box transcript holds more (a run written by an older dpaudit released before it counted)."""

    counted = 0
    if ledger is not None:
        counted = ledger.steps_executed
        if counted is None:
            raise DPAuditError(f"{run_dir / run_folder.LEDGER} does not say how many steps ran; refusing to resume a "
                               "run whose spending is unknown")
    counted = max(counted, run_folder.log_lines(run_dir))
    transcript = run_dir / TRANSCRIPT
    if cfg.white_box and transcript.is_file():
        counted = max(counted, transcript.stat().st_size // (4 * cfg.white_box))
    return counted


def fingerprint(texts: list[str]) -> str:
    """SHA-256 of the training texts, each prefixed by its length (a resume must train on the same data)."""

    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def settings_of(cfg) -> RunSettings:
    """The run record's settings of ``cfg`` (a TrainConfig), field by field: a TrainConfig field renamed without
    the record fails here, never changing the file's format silently (core/run_record.py)."""
    return RunSettings(**{f.name: getattr(cfg, f.name) for f in fields(RunSettings)})


# How a step is computed, not what it computes: a resume may change them.
EXECUTION_ONLY = ("per_sample_grads", "micro_batch", "max_memory", "shard", "stop_on_divergence")


def plan_of(settings: RunSettings) -> dict:
    """What a resume must keep of a run's settings."""
    return {k: v for k, v in asdict(settings).items() if k not in EXECUTION_ONLY}


def has_content(folder: Path) -> bool:
    return any(p.name not in (LOCK, MARKER) for p in folder.iterdir())


MAX_ATTEMPTS = 1000  # resumes one correlated-noise run folder records (the ledger header lists each)


def correlated_attempts(previous: LedgerRecord | None, released: int, start: int, writer, run_dir: Path) -> list:
    """The attempts of a correlated-noise run resumed at ``start`` (accounting/matrix/bandmf.py: a resumed attempt
    continues its parent's last b - 1 noises, so the coins drawn there move its rows too): the old ledger's list,
    its last attempt closed at the ``released`` steps the ledger counts, and the new one, whose parent is the attempt
    that wrote the checkpoint it resumes (``writer``, from the checkpoint's state; None when it starts over)."""
    where = run_dir / run_folder.LEDGER
    listed = previous.value("attempts") if previous is not None else None
    if listed is None:   # a ledger from before resumes were recorded: one attempt from step 0 (it had no checkpoint)
        listed = [[0, None, None]] if released else []
    if not isinstance(listed, list) or len(listed) >= MAX_ATTEMPTS or not all(
            isinstance(a, list) and len(a) == 3 for a in listed):
        raise DPAuditError(f"{where} does not list the attempts of this correlated-noise run; refusing to resume a "
                           "run whose spending is unknown")
    attempts, done = [], 0
    for i, (first, end, parent) in enumerate(listed):
        last = i == len(listed) - 1
        if last and end is None and type(first) is int:
            end = first + released - done
        if not (type(first) is int and type(end) is int and 0 <= first <= end
                and (parent is None or type(parent) is int)):
            raise DPAuditError(f"{where} does not say which steps each attempt of this correlated-noise run "
                               "released; refusing to resume a run whose spending is unknown")
        attempts.append((first, end, parent))
        done += end - first
    if done != released:
        raise DPAuditError(f"{where} lists attempts that released {done} steps but counts {released}; refusing to "
                           "resume a run whose spending is unknown")
    if start and (type(writer) is not int or not 0 <= writer < len(attempts)):
        raise DPAuditError(f"the checkpoint in {run_dir} does not say which attempt of this correlated-noise run "
                           "wrote it (its noise state continues that attempt); start the run again")
    attempts.append((start, None, writer if start else None))

    check_attempts([(f, e if e is not None else f, p) for f, e, p in attempts])
    return attempts
