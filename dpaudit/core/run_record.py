"""A run folder's run_config.json, and a probe folder's probe.json, as typed, versioned records: the interface
between training (which writes them) and everything that reads a run back (--resume, replay, the white-box audit,
the claim, checkpoint scoring).

The file's format is declared here, field by field, not derived from the trainer's own configuration class: a
renamed training option cannot change the file silently (``settings_of`` in training/resume.py names every field,
so a renamed one fails there). Reading a file goes through ``upgrade``, the one migration from every earlier
format to this one (``FORMAT``), then through each field's check: a value of the wrong type or out of range is
refused in one line naming the key (the value is never echoed). Nothing outside this module reads the file's
keys.

Formats: 1, written before this record (no "format" key; older runs lack keys added since, each taking the value
those runs had: the fields' defaults); 2, "dpaudit-run/2".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_folder import (
    HEALTH as HEALTH_FILE, LEDGER as LEDGER_FILE, PROBE as PROBE_FILE, RUN_CONFIG as FILE, read_json,
)
from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.validate import check_number

FORMAT = "dpaudit-run/2"
RELEASES = ("gradient-transcript", "scalar-sums", "zo-log", "pipeline-rows")


@dataclass(frozen=True)
class RunSettings:
    """The training configuration a run was started with (no secret seed: it would reveal batches and noise; no
    --allow-overspend: a permission for one resume, not the run's plan). Defaults: the value a run that did not
    record the key had."""
    method: str = "dp-sgd"
    target_epsilon: float = 1.0          # math.inf: a non-private baseline
    delta: float = 1e-5
    sigma: float | None = None           # given (eps reported) or None (calibrated to target_epsilon)
    mechanism: str = "gaussian"
    clip: float | None = None
    lr: float | None = None
    optimizer: str = "adamw"
    steps: int | None = None
    batch_size: int = 64
    phi: float = 1e-3
    direction: str = "rademacher"
    trainable: str = "full"
    lora_rank: int = 8
    bf16: bool = False
    seed: int = 0
    max_length: int = 64
    accountant: str | None = None
    save_every: int = 0
    unsafe_disable_noise: bool = False
    white_box: int = 0
    canary_records: int = 1
    sampling: str = "poisson"            # runs before the key existed drew Poisson batches
    plant_bug: str | None = None
    per_sample_grads: str = "ghost"
    micro_batch: int = 0
    max_memory: int | None = None
    shard: bool = False
    stop_on_divergence: bool = False
    noise: str | None = None
    unit: str = "example"                # runs before the key existed accounted one example
    records_per_user: int | None = None
    user_sampling: str | None = None

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_epsilon"] = d["target_epsilon"] if math.isfinite(d["target_epsilon"]) else "inf"
        return d

    @classmethod
    def from_json(cls, data, where: str) -> RunSettings:
        if not isinstance(data, dict):
            raise DPAuditError(f"{where}: its config is not a table")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise DPAuditError(f"{where}: its config has keys this dpaudit does not know ({', '.join(unknown[:5])}); "
                               "upgrade dpaudit")
        values = {k: _SETTING_CHECKS[k](k, v, where) for k, v in data.items()}
        return cls(**values)


@dataclass(frozen=True)
class RunRecord:
    """run_config.json: the settings, and what the run resolved when it started."""
    settings: RunSettings
    base_model: str = ""                 # the model the run started from (never a checkpoint)
    sigma: float | None = None           # the noise multiplier the run used (None: non-private)
    sampling_rate: float | None = None   # p, over ``examples`` (member white-box canaries included)
    examples: int | None = None
    expected_batch_size: float | None = None  # what the noisy sum is divided by: B, or under ULS q x users
    direction_device: str = "cpu"        # DP-ZO: the kind of device whose generator drew the directions
    direction_stream: str = "sequential"  # DP-ZO: how the directions were drawn (training/streams.py)
    lora_new_token_rows: tuple[int, ...] = ()
    sharded: bool = False
    estimated_peak_bytes: int | None = None
    release: str | None = None           # what the folder holds of each step (RELEASES; None: the final model only)
    format: str = field(default=FORMAT)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "settings"}
        d["lora_new_token_rows"] = list(self.lora_new_token_rows)
        return {**d, "config": self.settings.to_json(), "format": FORMAT}

    @classmethod
    def from_json(cls, data, where: str) -> RunRecord:
        data = upgrade(data, where)
        unknown = sorted(set(data) - set(_RECORD_CHECKS) - {"config"})
        if unknown:
            raise DPAuditError(f"{where} has keys this dpaudit does not know ({', '.join(unknown[:5])}); upgrade it")
        values = {k: _RECORD_CHECKS[k](k, v, where) for k, v in data.items() if k != "config"}
        return cls(settings=RunSettings.from_json(data["config"], where), **values)


# Earlier formats -> this one ------------------------------------------------------------------------------------

_BEFORE_RELEASE = {"dp-sgd": "gradient-transcript", "dp-zo": "zo-log"}  # runs written before "release" was said


def upgrade(data, where: str) -> dict:
    """A run_config.json of any format dpaudit wrote, as a dictionary of this format's keys."""
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise DPAuditError(f"{where} is not a run config dpaudit wrote")
    version = data.get("format", 1)
    if version == FORMAT:
        return data
    if version != 1:
        raise DPAuditError(f"{where} has format {str(version)[:40]!r}, unknown to this dpaudit; upgrade it")
    # format 1 kept whatever a version wrote: keys dropped since are dropped here
    known = {f.name for f in fields(RunRecord)} - {"settings", "format"}
    old = {k: v for k, v in data.items() if k in known}
    settings = {f.name for f in fields(RunSettings)}
    old["config"] = {k: v for k, v in data["config"].items() if k in settings}
    if "release" not in old:
        old["release"] = _BEFORE_RELEASE.get(data["config"].get("method"))
    return {**old, "format": FORMAT}


# Field checks: (key, value, where) -> the value, or one line naming the key ---------------------------------------

def _bad(key: str, where: str, what: str):
    return DPAuditError(f"{where}: {key} is not {what}")


def _string(key, v, where, *, optional=False, limit=4096):
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise _bad(key, where, "a string" + (" or null" if optional else ""))
    return v


def _number(key, v, where, *, optional=False, low=-math.inf, low_open=False, high=math.inf, inf=False):
    if v is None and optional:
        return None
    if inf and v == "inf":
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) \
            or not (math.isfinite(v) or inf) or v < low or (low_open and v == low) or v > high:
        raise _bad(key, where, "a number in range")
    return float(v)


def _integer(key, v, where, *, optional=False, low=0):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _bad(key, where, f"an integer >= {low}")
    return v


def _flag(key, v, where, *, optional=False):
    if v is None and optional:
        return None
    if not isinstance(v, bool):
        raise _bad(key, where, "true or false")
    return v


def _s(**kw):
    return lambda k, v, w: _string(k, v, w, **kw)


def _n(**kw):
    return lambda k, v, w: _number(k, v, w, **kw)


def _i(**kw):
    return lambda k, v, w: _integer(k, v, w, **kw)


def _f(**kw):
    return lambda k, v, w: _flag(k, v, w, **kw)


def _rows(key, v, where):
    if not isinstance(v, list) or len(v) > 10_000_000 or not all(type(i) is int and i >= 0 for i in v):
        raise _bad(key, where, "a list of token ids")
    return tuple(v)


def _release(key, v, where):
    if v is not None and v not in RELEASES:
        raise _bad(key, where, f"one of {', '.join(RELEASES)}")
    return v


_SETTING_CHECKS = {
    "method": _s(), "target_epsilon": _n(low=0, low_open=True, inf=True), "delta": _n(low=0, high=1),
    "sigma": _n(optional=True, low=0), "mechanism": _s(), "clip": _n(optional=True, low=0, low_open=True),
    "lr": _n(optional=True, low=0, low_open=True), "optimizer": _s(), "steps": _i(optional=True, low=1),
    "batch_size": _i(), "phi": _n(low=0, low_open=True), "direction": _s(), "trainable": _s(),
    "lora_rank": _i(low=1), "bf16": _flag, "seed": _i(low=-2**63), "max_length": _i(low=1),
    "accountant": _s(optional=True), "save_every": _i(), "unsafe_disable_noise": _flag, "white_box": _i(),
    "canary_records": _i(low=1),
    "sampling": _s(), "plant_bug": _s(optional=True), "per_sample_grads": _s(), "micro_batch": _i(),
    "max_memory": _i(optional=True), "shard": _flag, "stop_on_divergence": _flag, "noise": _s(optional=True),
    "unit": _s(), "records_per_user": _i(optional=True, low=1), "user_sampling": _s(optional=True),
}
_RECORD_CHECKS = {
    "base_model": _s(), "sigma": _n(optional=True, low=0), "sampling_rate": _n(optional=True, low=0, low_open=True,
                                                                             high=1),
    "examples": _i(optional=True, low=1), "expected_batch_size": _n(optional=True, low=0),
    "direction_device": _s(), "direction_stream": _s(), "lora_new_token_rows": _rows, "sharded": _flag,
    "estimated_peak_bytes": _i(optional=True), "release": _release, "format": _s(),
}


# The file -------------------------------------------------------------------------------------------------------

def read(folder: Path, required: bool = True) -> RunRecord | None:
    """The folder's run record (None when absent and not ``required``)."""
    path = Path(folder) / FILE
    data = read_json(path, "run config")
    if data is None:
        if required:
            raise DPAuditError(f"{folder} is not a run folder (no {FILE})")
        return None
    return RunRecord.from_json(data, str(path))


def write(folder: Path, record: RunRecord) -> None:
    atomic_write_json(Path(folder) / FILE, record.to_json())


# probe.json -----------------------------------------------------------------------------------------------------

PROBE_FORMAT = "dpaudit-probe/2"
PROBE_KINDS = ("gradient", "scalar", "pipeline")   # a WhiteBoxProbe's gradient sums or scalar sums, a
# PipelineProbe's row movements


@dataclass(frozen=True)
class ProbeRecord:
    """probe.json: what a WhiteBoxProbe or PipelineProbe watched (written at attach, completed by the audit)."""
    kind: str
    run_id: str
    m: int
    clip: float | None = None            # none for a pipeline probe: its canaries are the user's examples
    sample_rate: float | None = None
    gain: float | None = None
    source: str = ""
    canaries_bypass: str | None = None
    transcript: str = "whitebox_transcript.f32"
    floats_per_step: int | None = None
    unprotected_parameters: tuple[str, ...] = ()
    parameter_shapes: tuple[tuple[int, ...], ...] | None = None   # gradient probes: the probed tensors
    parameter_names: tuple[str, ...] | None = None
    parameter_dtypes: tuple[str, ...] | None = None
    noise_multiplier: float | None = None  # the accounted noise, where the probe knows it
    membership: str = ""
    optimizer: str | None = None
    expected_batch_size: float | None = None
    loader_rate: float | None = None     # the rate read from the data loader (audit/rate_check.py)
    loader_rate_source: str | None = None
    accounted_rate: float | None = None  # the rate the accountant counted
    accounted_rate_source: str | None = None
    claimed_epsilon: float | None = None
    delta: float | None = None
    claimed_epsilon_source: str | None = None
    format: str = field(default=PROBE_FORMAT)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("unprotected_parameters", "parameter_names", "parameter_dtypes"):
            d[key] = list(d[key]) if d[key] is not None else None
        if self.parameter_shapes is not None:
            d["parameter_shapes"] = [list(s) for s in self.parameter_shapes]
        return {**d, "format": PROBE_FORMAT}

    @classmethod
    def from_json(cls, data, where: str) -> ProbeRecord:
        """Checked: a clip, rate, gain or m no probe writes is refused (a clip of -1 turned a VIOLATION into
        "consistent"). Format 1 (before this record) had no schema: keys this one does not know are dropped."""
        if not isinstance(data, dict) or data.get("format") not in ("dpaudit-probe/1", PROBE_FORMAT) \
                or data.get("kind") not in PROBE_KINDS:
            raise DPAuditError(f"{where} is not a dpaudit probe description")
        if data["format"] == "dpaudit-probe/1":
            data = {k: v for k, v in data.items() if k in _PROBE_CHECKS}
        unknown = sorted(set(data) - set(_PROBE_CHECKS))
        if unknown:
            raise DPAuditError(f"{where} has keys this dpaudit does not know ({', '.join(unknown[:5])}); upgrade it")
        try:
            record = cls(**{k: _PROBE_CHECKS[k](k, v, where) for k, v in data.items() if k != "format"})
            if record.kind != "pipeline":
                check_number("clip norm C", record.clip, above=0)
                check_number("sample rate", record.sample_rate, above=0, at_most=1)
                check_number("gain", record.gain, above=0)
        except DPAuditError as exc:
            raise DPAuditError(f"{where} is not as a probe writes it ({exc}); refusing to audit it") from None
        return record


def _names(key, v, where):
    if not isinstance(v, list) or len(v) > 1_000_000 or not all(isinstance(n, str) and len(n) < 4096 for n in v):
        raise _bad(key, where, "a list of names")
    return tuple(v)


def _shapes(key, v, where):
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > 1_000_000 or not all(
            isinstance(s, list) and len(s) <= 16 and all(type(d) is int and d >= 0 for d in s) for s in v):
        raise _bad(key, where, "a list of tensor shapes")
    return tuple(tuple(s) for s in v)


def _optional(check):
    return lambda k, v, w: None if v is None else check(k, v, w)


def _kind(key, v, where):
    if v not in PROBE_KINDS:
        raise _bad(key, where, f"one of {', '.join(PROBE_KINDS)}")
    return v


_PROBE_CHECKS = {
    "kind": _kind, "run_id": _s(limit=200), "m": _i(low=2), "clip": _n(optional=True),
    "sample_rate": _n(optional=True), "gain": _n(optional=True), "source": _s(), "canaries_bypass": _s(optional=True),
    "transcript": _s(limit=200), "floats_per_step": _i(optional=True, low=1), "unprotected_parameters": _names,
    "parameter_shapes": _shapes, "parameter_names": _optional(_names), "parameter_dtypes": _optional(_names),
    "noise_multiplier": _n(optional=True, low=0), "membership": _s(), "optimizer": _s(optional=True),
    "expected_batch_size": _n(optional=True, low=0), "loader_rate": _n(optional=True, low=0, low_open=True),
    "loader_rate_source": _s(optional=True), "accounted_rate": _n(optional=True, low=0, low_open=True),
    "accounted_rate_source": _s(optional=True), "claimed_epsilon": _n(optional=True, low=0),
    "delta": _n(optional=True, low=0, high=1), "claimed_epsilon_source": _s(optional=True), "format": _s(),
}


def read_probe(folder: Path) -> ProbeRecord:
    """The folder's probe.json, checked."""
    path = Path(folder) / PROBE_FILE
    data = read_json(path, "probe description")
    if data is None:
        raise DPAuditError(f"{folder} holds no dpaudit probe ({PROBE_FILE})")
    return ProbeRecord.from_json(data, str(path))


def write_probe(folder: Path, record: ProbeRecord) -> None:
    atomic_write_json(Path(folder) / PROBE_FILE, record.to_json())


# The other files a run or probe folder holds, each read by its own module (the canary manifest by
# audit/whitebox_canaries.py, the tallies by audit/clipping.py and audit/noise_check.py), carry a version too: format 1
# was written without the key; a file of a format this dpaudit does not know is refused, never read as another.
SIDE_FORMATS = {
    "whitebox_canaries.json": "dpaudit-whitebox-canaries/2",
    "clipping_check.json": "dpaudit-clip-tally/2",
    "noise_tally.json": "dpaudit-noise-tally/2",
    "checkpoint_manifest.json": "dpaudit-checkpoint-manifest/2",
    "running.jsonl": "dpaudit-look/2",  # each line, a look
}


def stamped(name: str, data: dict) -> dict:
    """``data`` as the file ``name`` is written now: with its format."""
    return {"format": SIDE_FORMATS[name], **data}


def unstamped(name: str, data, where) -> dict:
    """A side file's contents read back without its format key: format 1 (no key) or the current one."""
    if not isinstance(data, dict):
        raise DPAuditError(f"{where} is not a JSON object")
    version = data.get("format", 1)  # the one place a side file's keys are looked up loosely: its version
    if version not in (1, SIDE_FORMATS[name]):
        raise DPAuditError(f"{where} is of a format this dpaudit does not know; upgrade it")
    return {k: v for k, v in data.items() if k != "format"}


# -- privacy_ledger.json -------------------------------------------------------------------------------------------
LEDGER_FORMAT = "dpaudit-ledger/2"
_UNKNOWN = "refusing to read a ledger whose spending is unknown"


def _ledger_phases(key, v, where):
    """Each phase: from_step, sampling_rate (the rate its steps are accounted at), examples, data_sha256."""
    if v is None:
        return None
    bad = DPAuditError(f"{where} lists phases it does not describe; {_UNKNOWN}")
    if not isinstance(v, list) or len(v) > 10_000:
        raise bad
    for p in v:
        if not (isinstance(p, dict) and set(p) <= {"from_step", "sampling_rate", "examples", "data_sha256"}
                and type(p.get("from_step")) is int and p["from_step"] >= 0):
            raise bad
        try:
            _number("sampling_rate", p.get("sampling_rate"), where, low=0, low_open=True, high=1)
            _integer("examples", p.get("examples"), where, optional=True)
            _string("data_sha256", p.get("data_sha256"), where, optional=True)
        except DPAuditError:
            raise bad from None
    return tuple(dict(p) for p in v)


def _ledger_attempts(key, v, where):
    """As written (lists of [first step, end, parent]); training/resume.correlated_attempts checks each."""
    if v is not None and not (isinstance(v, list) and len(v) <= 10_000):
        raise DPAuditError(f"{where} does not list the attempts of this correlated-noise run; {_UNKNOWN}")
    return v


_LEDGER_STRINGS = ("method", "mechanism", "planted_bug", "data_sha256", "sampling", "noise", "accountant", "relation",
                   "privacy_unit")
_LEDGER_NUMBERS = ("sigma", "clip", "sampling_rate", "delta", "target_epsilon", "noise_std", "epsilon_spent",
                   "epsilon_planned", "epsilon_total", "epsilon_overspend")
_LEDGER_COUNTS = ("steps_planned", "examples", "white_box_canaries", "world_size", "steps_discarded_by_resume",
                  "steps_executed", "steps_in_model")
_LEDGER_FLAGS = ("private", "noise_disabled_unsafely", "overspend_allowed")
_LEDGER_CHECKS = {  # every key a ledger says, each optional: a key it does not say reads None
    **{k: _s(optional=True) for k in _LEDGER_STRINGS}, **{k: _n(optional=True, inf=True) for k in _LEDGER_NUMBERS},
    **{k: _i(optional=True) for k in _LEDGER_COUNTS}, **{k: _f(optional=True) for k in _LEDGER_FLAGS},
    "phases": _ledger_phases, "attempts": _ledger_attempts,
}


@dataclass(frozen=True)
class LedgerRecord:
    """privacy_ledger.json as read back (training/ledger.py writes it ahead of every step): each key the ledger says,
    typed; a key it does not say (an older run's, or one a tampered file lost) reads None, and whoever needs it
    refuses (training/resume.py: a resume whose spending is unknown). Format 1: no "format" key (keys no run writes
    are dropped); 2: "dpaudit-ledger/2" (unknown keys refused)."""

    said: tuple  # ((key, value), ...) in the file's order, values typed

    def value(self, key: str):
        """The ledger's value of ``key`` (one of its known keys), or None where it does not say it."""
        if key not in _LEDGER_CHECKS:
            raise KeyError(key)
        return dict(self.said).get(key)

    def says(self, key: str) -> bool:
        return self.value(key) is not None

    @property
    def steps_executed(self) -> int | None:
        return self.value("steps_executed")

    @property
    def claimed_epsilon(self) -> float | None:
        """eps the run claims: its total (the steps a resume redid included), else its plan; None when infinite."""
        eps = self.value("epsilon_total") if self.says("epsilon_total") else self.value("epsilon_planned")
        return eps if eps is not None and math.isfinite(eps) else None

    @classmethod
    def from_json(cls, data, where) -> "LedgerRecord":
        if not isinstance(data, dict):
            raise DPAuditError(f"{where} is not a JSON object; {_UNKNOWN}")
        version = data.get("format", 1)
        if version not in (1, LEDGER_FORMAT):
            raise DPAuditError(f"{where} is of a format this dpaudit does not know; upgrade it")
        unknown = sorted(set(data) - set(_LEDGER_CHECKS) - {"format"})
        if unknown and version != 1:
            raise DPAuditError(f"{where} has keys this dpaudit does not know ({', '.join(unknown[:5])}); upgrade it")
        return cls(tuple((k, _LEDGER_CHECKS[k](k, v, where)) for k, v in data.items() if k in _LEDGER_CHECKS))


def ledger_json(data: dict) -> dict:
    """What training/ledger.py writes: ``data`` with the ledger's format."""
    return {"format": LEDGER_FORMAT, **data}


def read_ledger(folder: Path) -> LedgerRecord | None:
    """The folder's privacy ledger, typed; None where there is none."""
    where = Path(folder) / LEDGER_FILE
    data = read_json(where, "privacy ledger")
    return None if data is None else LedgerRecord.from_json(data, where)


# -- checkpoint/trainer_state.json -----------------------------------------------------------------------------------
STATE_FORMAT = "dpaudit-checkpoint/2"


@dataclass(frozen=True)
class CheckpointState:
    """A checkpoint's trainer_state.json: the step it holds, whether it was saved sharded, the correlated-noise attempt
    that wrote it, and the run's settings (informational: a resume reads run_config.json). Format 1: no "format" key
    (its settings are read where they still parse, else left out); 2: "dpaudit-checkpoint/2"."""

    step: int
    settings: RunSettings | None = None
    sharded: bool = False
    attempt: int | None = None

    def to_json(self) -> dict:
        return {"format": STATE_FORMAT, "step": self.step,
                **({"config": self.settings.to_json()} if self.settings is not None else {}),
                "sharded": self.sharded, **({"attempt": self.attempt} if self.attempt is not None else {})}

    @classmethod
    def from_json(cls, data, where) -> "CheckpointState":
        if not isinstance(data, dict) or data.get("format", 1) not in (1, STATE_FORMAT):
            raise DPAuditError(f"{where} is not a checkpoint state this dpaudit wrote")
        version = data.get("format", 1)
        unknown = sorted(set(data) - {"format", "step", "config", "sharded", "attempt"})
        if unknown and version != 1:
            raise DPAuditError(f"{where} has keys this dpaudit does not know ({', '.join(unknown[:5])}); upgrade it")
        step, sharded, attempt = data.get("step"), data.get("sharded", False), data.get("attempt")
        if type(step) is not int or step < 1 or not isinstance(sharded, bool) or not (
                attempt is None or (type(attempt) is int and attempt >= 0)):
            raise DPAuditError(f"{where} is not a checkpoint state this dpaudit wrote")
        settings = None
        if "config" in data:
            try:
                settings = RunSettings.from_json(data["config"], str(where))
            except DPAuditError:
                if version != 1:
                    raise
        return cls(step, settings, sharded, attempt)


def read_checkpoint_state(path: Path) -> CheckpointState:
    data = read_json(Path(path), "checkpoint state")
    if data is None:
        raise DPAuditError(f"{path} is missing: the checkpoint is not intact")
    return CheckpointState.from_json(data, path)


# -- health.json (probes/health.py) -----------------------------------------------------------------------------
HEALTH_FORMAT = "dpaudit-health/1"


@dataclass(frozen=True)
class HealthRecord:
    """A probe's health check (probes/health.py: UpdateHealth): the DP steps it checked, how often, and its findings
    (kind, tensor, the line it printed); why the update size was not checked, if it was not."""

    dp_steps: int
    every: int
    findings: tuple = ()          # ((kind, tensor, line), ...)
    update_size_unchecked: str | None = None

    def to_json(self) -> dict:
        return {"format": HEALTH_FORMAT, "dp_steps": self.dp_steps, "every": self.every,
                "findings": [{"kind": k, "tensor": n, "line": line} for k, n, line in self.findings],
                "update_size_unchecked": self.update_size_unchecked}

    @classmethod
    def from_json(cls, data, where) -> "HealthRecord":
        bad = DPAuditError(f"{where} is not a health check this dpaudit wrote")
        if not isinstance(data, dict) or data.get("format") != HEALTH_FORMAT:
            raise bad
        findings, unchecked = data.get("findings"), data.get("update_size_unchecked")
        if type(data.get("dp_steps")) is not int or type(data.get("every")) is not int \
                or not isinstance(findings, list) or len(findings) > 1_000_000 \
                or not (unchecked is None or isinstance(unchecked, str)):
            raise bad
        if not all(isinstance(f, dict) and all(isinstance(f.get(k), str) for k in ("kind", "tensor", "line"))
                   for f in findings):
            raise bad
        return cls(data["dp_steps"], data["every"], tuple((f["kind"], f["tensor"], f["line"]) for f in findings),
                   unchecked)


def read_health(folder: Path) -> HealthRecord | None:
    """The folder's health.json, typed; None where there is none."""
    where = Path(folder) / HEALTH_FILE
    data = read_json(where, "health check")
    return None if data is None else HealthRecord.from_json(data, where)


# -- the Hugging Face Trainer's accountant ledger (integrations/hf_opacus.py) ------------------------------------
ACCOUNTANT_FORMAT = "dpaudit-hf-accountant/1"


def accountant_ledger_json(history: list) -> dict:
    """What the Trainer writes ahead of each step: every attempt's (noise multiplier, sample rate, steps)."""
    return {"format": ACCOUNTANT_FORMAT, "history": [list(h) for h in history], "released": sum(h[2] for h in history)}


def read_accountant_history(path: Path) -> list | None:
    """The history the ledger at ``path`` counts, typed; None where there is no ledger; refused when it is not one
    dpaudit wrote (a resume never goes on without the steps earlier attempts released)."""
    data = read_json(Path(path), "accountant ledger")
    if data is None:
        return None
    history = data.get("history") if isinstance(data, dict) and data.get("format") == ACCOUNTANT_FORMAT else None
    if not isinstance(history, list) or not all(
            isinstance(h, list) and len(h) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in h) and h[2] >= 0 and float(h[1]) > 0
            for h in history):
        raise DPAuditError(f"{path} is not an accountant ledger dpaudit wrote; refusing to resume without the steps "
                           "earlier attempts released")
    return [(float(h[0]), float(h[1]), int(h[2])) for h in history]


# -- the allocation secret (balls-in-bins runs: the key a resume needs to draw the same allocation) -------------
SECRET_FORMAT = "dpaudit-allocation-secret/2"


def allocation_secret_json(secret: int) -> dict:
    return {"format": SECRET_FORMAT, "secret": secret}


def read_allocation_secret(path: Path) -> int | None:
    """The secret a run's allocation was drawn with (format 1: no "format" key), or None where none was kept."""
    data = read_json(Path(path), "allocation secret")
    if data is None:
        return None
    secret = data.get("secret") if data.get("format", 1) in (1, SECRET_FORMAT) else None
    if secret is not None and (isinstance(secret, bool) or not isinstance(secret, int)) or (
            secret is None and data.get("format", 1) != 1):
        raise DPAuditError(f"{path} is not an allocation secret dpaudit wrote")
    return secret
