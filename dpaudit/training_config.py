"""The privacy part of a training config (YAML or TOML) that `dpaudit check` gates on."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

from dpaudit.accounting.mechanism import Mechanism, check_delta, check_epsilon, sampling_rate_from, steps_from
from dpaudit.errors import DPAuditError

KNOWN_KEYS = {
    "mechanism", "sigma", "noise_multiplier", "sampling_rate", "batch_size", "dataset_size",
    "steps", "epochs", "delta", "target_epsilon", "accountant",
}


@dataclass(frozen=True)
class PrivacyConfig:
    mechanism: str
    sigma: float | None  # None: the config asks dpaudit to calibrate it
    sampling_rate: float
    steps: int
    delta: float
    target_epsilon: float
    accountant: str | None

    def schedule(self, sigma: float) -> Mechanism:
        return Mechanism(self.mechanism, sigma, self.sampling_rate, self.steps)


def _read(path: Path) -> dict:
    if not path.is_file():
        raise DPAuditError(f"config {path} not found")
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DPAuditError(f"config {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {first}") from None
    if not isinstance(data, dict):
        raise DPAuditError(f"config {path} must be a mapping of keys to values")
    # A full training config may keep the privacy keys in a `privacy` (or `dpaudit`) section.
    for section in ("dpaudit", "privacy"):
        if isinstance(data.get(section), dict):
            return data[section]
    return data


def _number(data: dict, key: str, kind=float):
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, str):  # YAML reads 1e-5 as a string
        try:
            value = float(value)
        except ValueError:
            raise DPAuditError(f"config key {key!r} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DPAuditError(f"config key {key!r} must be a finite number, got {value!r}")
    if kind is int:
        if value != int(value):
            raise DPAuditError(f"config key {key!r} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def load_privacy_config(path: Path) -> PrivacyConfig:
    data = _read(Path(path))
    unknown = sorted(set(data) - KNOWN_KEYS)
    if unknown:
        raise DPAuditError(f"unknown config key(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_KEYS))}")
    mechanism = data.get("mechanism", "gaussian")
    if mechanism not in ("gaussian", "laplace"):
        raise DPAuditError(f"config mechanism must be gaussian or laplace, got {mechanism!r}")
    if "sigma" in data and "noise_multiplier" in data:
        raise DPAuditError("config gives both sigma and noise_multiplier; keep one")
    sigma = _number(data, "sigma") if "sigma" in data else _number(data, "noise_multiplier")
    target = _number(data, "target_epsilon")
    if target is None:
        raise DPAuditError("config needs target_epsilon")
    check_epsilon(target)
    delta = _number(data, "delta")
    if delta is None:
        delta = 0.0 if mechanism == "laplace" else None
        if delta is None:
            raise DPAuditError("config needs delta for the gaussian mechanism")
    check_delta(delta, allow_zero=mechanism == "laplace")
    p = sampling_rate_from(_number(data, "batch_size", int), _number(data, "dataset_size", int),
                           _number(data, "sampling_rate"))
    steps = steps_from(_number(data, "steps", int), _number(data, "epochs"), p)
    accountant = data.get("accountant")
    if accountant is not None and not isinstance(accountant, str):
        raise DPAuditError(f"config accountant must be a name, got {accountant!r}")
    config = PrivacyConfig(mechanism, sigma, p, steps, delta, target, accountant)
    if sigma is not None:
        config.schedule(sigma)  # validates sigma
    return config
