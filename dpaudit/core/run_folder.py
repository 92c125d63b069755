"""A run folder's layout: the one module that knows its file names and how to read them back.

    run_config.json        the run's configuration (no secret seed), base model, sigma, p, N (run_record.py)
    privacy_ledger.json    accountant, relation, steps executed (written ahead), eps spent
    zo_steps.jsonl         DP-ZO: the (seed, scalar) log, one step a line
    whitebox_canaries.json white-box canaries (0600: membership), whitebox_transcript.f32 (DP-SGD releases)
    allocation_secret.json balls-in-bins: the secret each epoch's allocation is drawn from (0600; read back by
                           --resume, removed when the run finishes)
    probe.json             a WhiteBoxProbe's folder instead of a run's (probes/probe.py)
    checkpoint/            sealed resume checkpoint (training/checkpoint.py), model/ the finished model

Readers cap sizes and turn anything malformed into one DPAuditError (torch-free: the auditors use them).
"""

from __future__ import annotations

from pathlib import Path
import json

import numpy as np

from dpaudit.core.errors import DPAuditError
from dpaudit.core.safe_json import count_newlines, load_json_file

RUN_CONFIG = "run_config.json"
LEDGER = "privacy_ledger.json"
ZO_LOG = "zo_steps.jsonl"
PROBE = "probe.json"
HEALTH = "health.json"  # a probe's health check of the update (probes/health.py)
OUTSIDE_DP = ("moved-outside", "stepped-outside")  # its findings that mean updates without clipping or noise
ALLOCATION_SECRET = "allocation_secret.json"
MODEL = "model"
MAX_JSON = 16 << 20


def read_json(path: Path, what: str) -> dict | None:
    """A run file dpaudit wrote, or None when it is absent; one line when it is not ours."""

    path = Path(path)
    if not path.exists():
        return None
    data = load_json_file(path, what, max_bytes=MAX_JSON)
    if not isinstance(data, dict):
        raise DPAuditError(f"{path} is not a {what} dpaudit wrote")
    return data


def ledger(folder: Path) -> dict | None:
    return read_json(Path(folder) / LEDGER, "privacy ledger")


def is_probe_folder(folder: Path) -> bool:
    return (Path(folder) / PROBE).is_file() and not (Path(folder) / RUN_CONFIG).is_file()


def zo_log(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """(seeds, scalars) of a DP-ZO run's log."""

    path = Path(folder) / ZO_LOG
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        return np.array([r["seed"] for r in rows], dtype=np.uint64), np.array([r["scalar"] for r in rows], float)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise DPAuditError(f"{folder} has no readable DP-ZO log: {type(exc).__name__}") from None


def log_lines(folder: Path) -> int:
    """Lines in the DP-ZO log, counted in blocks (what a run released, whatever its ledger says)."""

    path = Path(folder) / ZO_LOG
    return count_newlines(path, "DP-ZO log") if path.is_file() else 0


def truncate_log(path: Path, steps: int) -> None:
    """Keep the first ``steps`` lines of the DP-ZO log (a resumed run rewrites what followed)."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()[:steps]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
