"""Planted privacy bugs: the audit's own test targets. Real-world DP mistakes, each one flag away.

Hidden from --help, refused unless DPAUDIT_ALLOW_BUGS=1, and recorded in run_config.json, so a run
with a bug can never pass for a correct one. Every bug lives here, as data the trainers read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dpaudit.core.errors import DPAuditError

ENV = "DPAUDIT_ALLOW_BUGS"


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    methods: tuple[str, ...] = ("dp-sgd", "dp-zo")
    noise_scale: float = 1.0       # noise std multiplied by this (the claim is not)
    skip_clipping: bool = False    # per-example clipping skipped
    actual_batch: bool = False     # noisy sum divided by the realised batch size, not the expected one
    public_noise: bool = False     # noise drawn from the public per-step seed (the log reveals it)
    remove_only: bool = False      # sigma calibrated on the remove direction alone


BUGS = {b.name: b for b in (
    Bug("noise-x0.5", "noise standard deviation halved", noise_scale=0.5),
    Bug("noise-x0.1", "noise standard deviation divided by 10", noise_scale=0.1),
    Bug("no-clip", "per-example clipping skipped", skip_clipping=True),
    Bug("actual-batch", "noisy sum divided by the realised batch size instead of the expected B", actual_batch=True),
    Bug("public-noise-seed", "noise drawn from the public per-step seed, so the log reveals it", ("dp-zo",),
        public_noise=True),
    Bug("remove-only", "sigma calibrated with the remove direction only (add/remove max ignored)", remove_only=True),
)}
NO_BUG = Bug("none", "no planted bug")


def planted_bug(name: str | None, method: str) -> Bug:
    """The bug to plant, after the gate: unknown names and an unset DPAUDIT_ALLOW_BUGS are refused."""
    if not name:
        return NO_BUG
    if os.environ.get(ENV) != "1":
        raise DPAuditError(f"--plant-bug is for testing the audit; set {ENV}=1 to allow it")
    if name not in BUGS:
        raise DPAuditError(f"unknown bug {name!r}; use {', '.join(BUGS)}")
    bug = BUGS[name]
    if method not in bug.methods:
        raise DPAuditError(f"bug {name} applies to {' and '.join(bug.methods)}, not {method}")
    return bug
