"""The privacy part of a training config (YAML or TOML) that `dpaudit check` gates on."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
import difflib

import yaml

from dpaudit.accounting.mechanism import (
    Mechanism, Phases, compose_phases, phase_from, schedule, with_unit,
)
from dpaudit.accounting.unit import Unit, unit_from
from dpaudit.accounting.matrix.strategy import parse
from dpaudit.core.validate import check_delta, check_epsilon
from dpaudit.accounting.noises import NOISES
from dpaudit.accounting.samplers import names as sampler_names
from dpaudit.core.errors import DPAuditError

KNOWN_KEYS = {
    "mechanism", "sigma", "noise_multiplier", "sampling_rate", "batch_size", "dataset_size",
    "steps", "epochs", "delta", "target_epsilon", "accountant", "calibrate", "sampling", "phases",
    "claim_accounted_as", "noise", "unit", "records_per_user", "user_sampling",
}
# Opacus' and the Hugging Face DP examples' names for the same privacy keys (make_private_with_epsilon's
# target_delta, its accountants' sample_rate): read as ours, never ignored
ALIASES = {"target_delta": "delta", "sample_rate": "sampling_rate"}
SCHEDULE_KEYS = {"sampling_rate", "batch_size", "steps", "epochs"}  # given per phase when there are phases
# a phase's keys, as the config spells them -> as --phase spells them
PHASE_ALIASES = {"sigma": "sigma", "noise_multiplier": "sigma", "p": "p", "sampling_rate": "p", "steps": "steps",
                 "epochs": "epochs", "sampling": "sampling", "B": "B", "batch_size": "B", "N": "N",
                 "dataset_size": "N", "mechanism": "mech", "mech": "mech"}
MAX_PHASES = 100
SECTIONS = ("dpaudit", "privacy")
MAX_BYTES = 1 << 20     # a privacy config is a few hundred bytes; refuse anything over 1 MiB unread
MAX_DEPTH = 32          # nesting a config never needs; deeper input is refused before it can recurse
MAX_STEPS = 10**9
MAX_INTEGER = 10**12


@dataclass(frozen=True)
class PrivacyConfig:
    mechanism: str
    sigma: float | None  # None: the config asks dpaudit to calibrate it (with phases: their multiplier)
    event: Mechanism | Phases  # the schedule at sigma (or at multiplier 1 when calibrating)
    delta: float
    target_epsilon: float
    accountant: str | None
    dataset_size: int | None = None  # when the config gives it (a sampler log is checked against it)
    claim_accounted_as: str | None = None  # the sampler the config's claim was computed for, when it says
    ignored_keys: tuple[str, ...] = ()  # a flat training config's other keys (model:, learning_rate:), printable

    @property
    def sampling(self) -> str:
        return self.event.sampling

    @property
    def sampling_rate(self) -> float:
        return self.event.sampling_rate

    @property
    def steps(self) -> int:
        return self.event.steps


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors/aliases: a config never needs them, and they make billion-laughs bombs."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise DPAuditError("YAML aliases (*name) are not allowed in a privacy config")
        return super().compose_node(parent, index)


def _nesting(text: str) -> int:
    """An upper bound on bracket/indent nesting, checked before any parser can recurse on it."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    indent = max((len(line) - len(line.lstrip(" ")) for line in text.splitlines() if line.strip()), default=0)
    return max(deepest, indent // 2)


def _read(path: Path) -> tuple[dict, bool]:
    """The privacy mapping of a config, or DPAuditError. Never echoes what the file says."""
    if not path.is_file():
        raise DPAuditError(f"config {path} not found (or not a regular file)")
    if path.stat().st_size > MAX_BYTES:
        raise DPAuditError(f"config {path} is larger than {MAX_BYTES // 1024} KiB; a privacy config is a few lines")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DPAuditError(f"config {path} is not UTF-8 text") from None
    if _nesting(text) > MAX_DEPTH:
        raise DPAuditError(f"config {path} is nested deeper than {MAX_DEPTH} levels")
    kind = "TOML" if path.suffix.lower() == ".toml" else "YAML"
    try:
        data = tomllib.loads(text) if kind == "TOML" else yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise DPAuditError(f"config {path} is not valid {kind}{where}") from None
    except RecursionError:
        raise DPAuditError(f"config {path} is nested too deeply") from None
    if not isinstance(data, dict):
        raise DPAuditError(f"config {path} must be a mapping of keys to values")
    if any(not isinstance(k, str) for k in data):
        raise DPAuditError(f"config {path}: every key must be a name (text)")
    # A full training config may keep the privacy keys in one `privacy` or `dpaudit` section.
    present = [name for name in SECTIONS if name in data]
    if len(present) > 1:
        raise DPAuditError(f"config {path} has both a {present[0]!r} and a {present[1]!r} section; keep one")
    if present:
        section = data[present[0]]
        if not isinstance(section, dict) or any(not isinstance(k, str) for k in section):
            raise DPAuditError(f"config {path}: section {present[0]!r} must be a mapping of names to values")
        stray = sorted(set(data) & KNOWN_KEYS)
        if stray:
            raise DPAuditError(f"config {path} gives privacy key(s) {', '.join(stray)} both at the top and in the "
                               f"{present[0]!r} section; keep them in one place")
        return section, True
    return data, False


def _is_name(key: str) -> bool:
    """A short identifier: safe to print (never a line of some other file)."""
    return key.replace("_", "").isalnum() and len(key) <= 40


def _shown(key: str) -> str:
    """A key name safe to print."""
    return repr(key) if _is_name(key) else "(a key that is not a name)"


def _number(data: dict, key: str, kind=float):
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, str):  # YAML reads 1e-5 as a string
        try:
            value = float(value)
        except ValueError:
            raise DPAuditError(f"config key {key!r} must be a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DPAuditError(f"config key {key!r} must be a finite number")
    if kind is int:
        if value != int(value):
            raise DPAuditError(f"config key {key!r} must be an integer")
        if abs(value) > MAX_INTEGER:
            raise DPAuditError(f"config key {key!r} is beyond {MAX_INTEGER:.0e}")
        return int(value)
    return float(value)


def _ignored(data: dict, sectioned: bool) -> tuple[str, ...]:
    """The keys that are not privacy keys. In a ``privacy:``/``dpaudit:`` section every key must be one (a
    typo there is refused). A flat training config holds the rest of the training setup too (``model:``,
    ``learning_rate:``): those are ignored, except a key that looks like a misspelt privacy key (``detla``,
    ``noise_multipler``), which is refused: ignoring it would account a default in its place."""

    unknown = sorted(set(data) - KNOWN_KEYS)
    if sectioned and unknown:
        raise DPAuditError(f"unknown config key(s) {', '.join(map(_shown, unknown))}; known: "
                           f"{', '.join(sorted(KNOWN_KEYS))}")
    for key in unknown:
        close = difflib.get_close_matches(key.lower(), sorted(KNOWN_KEYS), n=1, cutoff=0.8)
        if close:
            raise DPAuditError(f"config key {_shown(key)} is not a privacy key; did you mean {close[0]!r}? (other "
                               "keys of a flat training config are ignored, but not one this close to a privacy key)")
    return tuple(k if _is_name(k) else "(a key that is not a name)" for k in unknown)


def _canonical(data: dict) -> dict:
    """``data`` with Opacus' names (ALIASES) under ours; both spellings of one key at once are refused."""
    for alias, key in ALIASES.items():
        if alias in data:
            if key in data:
                raise DPAuditError(f"config gives both {alias} and {key}; keep one")
            data = {**{k: v for k, v in data.items() if k != alias}, key: data[alias]}
    return data


def load_privacy_config(path: Path) -> PrivacyConfig:
    data, sectioned = _read(Path(path))
    data = _canonical(data)
    ignored = _ignored(data, sectioned)
    data = {k: v for k, v in data.items() if k in KNOWN_KEYS}
    mechanism = data.get("mechanism", "gaussian")
    if mechanism not in NOISES:
        raise DPAuditError(f"config mechanism must be one of {', '.join(NOISES)}")
    facts = NOISES[mechanism]
    if "sigma" in data and "noise_multiplier" in data:
        raise DPAuditError("config gives both sigma and noise_multiplier; keep one")
    sigma = _number(data, "sigma") if "sigma" in data else _number(data, "noise_multiplier")
    calibrate = data.get("calibrate", False)
    if not isinstance(calibrate, bool):
        raise DPAuditError("config key 'calibrate' must be true or false")
    # Fail closed: a gate judges the sigma the trainer will use. No sigma is unusable, unless the
    # config asks for calibration explicitly (and then a sigma beside it would be ambiguous).
    phases = data.get("phases")
    every_phase_has_sigma = isinstance(phases, list) and bool(phases) and all(
        isinstance(x, dict) and ("sigma" in x or "noise_multiplier" in x) for x in phases)
    if sigma is None and every_phase_has_sigma and not calibrate:
        sigma = 1.0  # the phases' own sigmas, times 1
    if sigma is None and not calibrate:
        raise DPAuditError("config states no noise_multiplier (sigma); a gate must judge the sigma training uses "
                           "(or set calibrate: true to ask for the minimal one)")
    if sigma is not None and calibrate:
        raise DPAuditError("config gives a noise_multiplier and calibrate: true; keep one")
    target = _number(data, "target_epsilon")
    if target is None:
        raise DPAuditError("config needs target_epsilon")
    check_epsilon(target)
    delta = _number(data, "delta")
    if delta is None:
        if not facts.pure_dp:
            raise DPAuditError(f"config needs delta for the {mechanism} mechanism")
        delta = facts.default_delta
    check_delta(delta, allow_zero=facts.pure_dp)
    n = _number(data, "dataset_size", int)
    sampling = _name(data, "sampling", sampler_names(), "poisson")
    claim = _name(data, "claim_accounted_as", sampler_names(), None)
    if "phases" in data:
        if data.get("noise") is not None:
            raise DPAuditError("config noise (correlated) is accounted over one schedule, not phases")
        event = _phases(data, mechanism, sigma, n)
    else:
        rate, batch = _number(data, "sampling_rate"), _number(data, "batch_size", int)
        # p with N and no B: p is the rate, N the dataset's size (what a sampler log is checked against)
        sizes_n = None if rate is not None and batch is None else n
        event = schedule(mechanism, 1.0, rate, batch, sizes_n, _number(data, "steps", int), _number(data, "epochs"),
                         sampling, _strategy(data))
        if sigma is not None:
            event = event.with_sigma(sigma)  # validates sigma
    if event.steps > MAX_STEPS:
        raise DPAuditError(f"config schedule has {event.steps:.3g} steps; dpaudit check accounts up to {MAX_STEPS:.0e}")
    event = with_unit(event, _unit(data))
    accountant = data.get("accountant")
    if accountant is not None and not isinstance(accountant, str):
        raise DPAuditError("config accountant must be a name")
    return PrivacyConfig(mechanism, sigma, event, delta, target, accountant, n, claim, ignored)


def _unit(data: dict) -> Unit:
    """``unit: user`` with ``records_per_user: k`` (and ``user_sampling: els | uls``): the claim is a user's."""
    kind = _name(data, "unit", ("example", "user"), "example")
    records = _number(data, "records_per_user", int)  # its range: Unit's own check
    sampling = _name(data, "user_sampling", ("els", "uls"), None)
    if kind == "example" and (records is not None or sampling is not None):
        raise DPAuditError("config gives records_per_user or user_sampling without unit: user")
    if kind == "user" and records is None:
        raise DPAuditError("config unit: user needs records_per_user (the most records one user contributes)")
    return unit_from(kind, records, sampling)


def _strategy(data: dict):
    """``noise:`` (correlated noise, matrix/strategy.py), parsed with its limits; None: independent."""
    value = data.get("noise")
    if value is not None and not isinstance(value, str):
        raise DPAuditError("config key 'noise' must be a text such as bandmf,b=16")
    return parse(value)


def _name(data: dict, key: str, choices, default):
    """A name from ``choices`` (the value itself is never echoed)."""
    value = data.get(key, default)
    if value is not None and (not isinstance(value, str) or value not in choices):
        raise DPAuditError(f"config key {key!r} must be one of {', '.join(choices)}")
    return value


def _phases(data: dict, mechanism: str, sigma: float | None, n: int | None):
    """A ``phases:`` list: each a mapping of the schedule keys (sigma or noise_multiplier, sampling_rate or
    batch_size with dataset_size, steps or epochs, sampling). A phase without sigma takes the top-level one
    (or, when calibrating, a share of 1); the top-level dataset_size and sampling are the default."""
    phases = data["phases"]
    stray = sorted(SCHEDULE_KEYS & set(data))
    if stray:
        raise DPAuditError(f"config gives phases and top-level {', '.join(stray)}; put them in the phases")
    if not isinstance(phases, list) or not phases:
        raise DPAuditError("config key 'phases' must be a non-empty list of mappings")
    if len(phases) > MAX_PHASES:
        raise DPAuditError(f"config has {len(phases)} phases; dpaudit check accounts up to {MAX_PHASES}")
    parts = []
    for i, phase in enumerate(phases, 1):
        if not isinstance(phase, dict) or any(not isinstance(k, str) for k in phase):
            raise DPAuditError(f"config phase {i} must be a mapping of names to values")
        unknown = sorted(set(phase) - set(PHASE_ALIASES))
        if unknown:
            raise DPAuditError(f"config phase {i}: unknown key(s) {', '.join(map(_shown, unknown))}; known: "
                               f"{', '.join(sorted(PHASE_ALIASES))}")
        spec = {}
        for key in phase:
            name = PHASE_ALIASES[key]
            if name in spec:
                raise DPAuditError(f"config phase {i} gives {name} twice")
            if name == "sampling":
                spec[name] = _name(phase, key, sampler_names(), None)
            elif name == "mech":
                spec[name] = _name(phase, key, tuple(NOISES), None)
            else:
                spec[name] = _number(phase, key, int if name in ("B", "N", "steps") else float)
        if "sampling" in data and "sampling" not in spec:
            spec["sampling"] = data["sampling"]
        if n is not None and "N" not in spec and "B" in spec:
            spec["N"] = n
        try:
            parts.append(phase_from(spec, mechanism, sigma if sigma is not None else 1.0))
        except DPAuditError as exc:
            raise DPAuditError(f"config phase {i}: {exc}") from None
    return compose_phases(parts)
