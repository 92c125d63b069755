"""What a run claimed (eps, delta, sigma, p, T, method), read from the folder an audited file sits in.

An audit's delta must be the run's: a smaller one inflates the bound. A model in <run>/model has the
run's run_config.json and privacy_ledger.json beside it; a scores.csv in a report folder has report.json.
Files are small JSON written by dpaudit; anything unreadable counts as "no claim here". ``group_claim``: what the
claim says of a canary inserted several times.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dpaudit.core import run_folder, run_record
from dpaudit.core.errors import DPAuditError

MAX_BYTES = 1 << 20


def _json(path: Path) -> dict | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _record(folder: Path, probe: bool = False):
    """The folder's run record (its probe record), or None (absent or unreadable: no claim here)."""

    try:
        if probe:
            return run_record.read_probe(folder) if (folder / run_folder.PROBE).is_file() else None
        return run_record.read(folder, required=False)
    except (DPAuditError, OSError):
        return None


def _ledger(folder: Path):
    """The run's ledger, or None (absent or unreadable: the run claims no eps here)."""
    try:
        return run_record.read_ledger(folder)
    except (DPAuditError, OSError):
        return None


def _name(score) -> str | None:
    """The score's name in a report.json ({"name": ...}); anything else (a hand-edited file) is no name."""
    name = score.get("name") if isinstance(score, dict) else None
    return name if isinstance(name, str) else None


def _number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def run_claims(path: Path) -> dict | None:
    """The claims of the run that produced ``path`` (a model folder or a scores file), or None: the nearest
    folder that holds a claim wins, the audited folder itself first (a run or probe folder given as it is), then
    the folder it sits in (<run>/model, <report>/scores.csv), then that one's parent. A claim in a parent never
    overrides the folder's own (a run_config.json claiming eps 1000 beside a probe folder turned its
    VIOLATION into "consistent")."""
    path = Path(path)
    folders = ((path,) if path.is_dir() else ()) + (path.parent, path.parent.parent)
    for folder in folders:
        record = _record(folder)
        if record is not None:
            cfg, ledger = record.settings, _ledger(folder)
            return {"source": str(folder), "method": cfg.method, "delta": cfg.delta,
                    "epsilon": ledger.claimed_epsilon if ledger is not None else None,
                    "sigma": record.sigma, "sampling rate p": record.sampling_rate, "steps": cfg.steps,
                    "mechanism": cfg.mechanism, "white_box": bool(cfg.white_box),
                    **({"privacy unit": "user", "records per user": cfg.records_per_user}
                       if cfg.unit == "user" else {})}
        probe = _record(folder, probe=True)
        if probe is not None:
            return {"source": str(folder), "delta": probe.delta, "epsilon": probe.claimed_epsilon,
                    "white_box": True, "claimed eps from": probe.claimed_epsilon_source}
        report = _json(folder / "report.json")
        if report and "delta" in report:
            return {"source": str(folder), "delta": _number(report.get("delta")),
                    "epsilon": _number(report.get("claimed_epsilon")),
                    "score": _name(report.get("score"))}
    return None


def group_claim(epsilon: float | None, delta: float, copies: int) -> tuple[float | None, float, str | None]:
    """The claim an audit may hold canaries inserted ``copies`` times each to: (eps, delta)-DP of one example gives
    (k eps, k e^((k - 1) eps) delta)-DP of a group of k (Dwork & Roth 2014, Lemma 2.2, applied k times), and a
    canary repeated k times is such a group. Returns (eps, delta, a line saying so), the claim unchanged for k = 1.
    Comparing a repeated canary's bound with the one-example claim would flag a correct run."""
    if copies <= 1 or epsilon is None:
        return epsilon, delta, None
    group_delta = copies * math.exp(min(700.0, (copies - 1) * epsilon)) * delta
    return copies * epsilon, group_delta, (
        f"each member canary is inserted {copies} times, so the audit holds the run to group privacy of {copies} "
        f"examples: eps {copies} x {epsilon:.4g} = {copies * epsilon:.4g}, delta {copies} e^({copies - 1} eps) delta = "
        f"{group_delta:.3g}")


def held_claim(epsilon: float | None, delta: float, copies: int, m: int) -> tuple[float | None, float, str | None]:
    """The claim m canaries, each member inserted ``copies`` times, are held to: ``group_claim``'s, or eps None (and
    the run's delta) when its delta is at least 1/m, a claim so weak it allows leaking a canary outright, which no
    audit of m canaries can test (the bound is then reported without a verdict)."""
    eps, group_delta, line = group_claim(epsilon, delta, copies)
    if eps is not None and group_delta * m >= 1:
        return None, delta, (f"{line}: too weak for {m} canaries to test (delta >= 1/m); the bound is reported "
                             "without a verdict")
    return eps, group_delta, line

