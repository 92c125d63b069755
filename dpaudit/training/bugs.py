"""Planted privacy bugs: the audit's own test targets. Real-world DP mistakes, each one flag away.

Hidden from --help, refused unless DPAUDIT_ALLOW_BUGS=1, and recorded in run_config.json, so a run
with a bug can never pass for a correct one. Every bug lives here: as data the privacy plan reads (the noise
actually added, the direction calibrated), and as mixins that override one seam of a trainer's DP step
(dp_step.py for DP-SGD, zo.ZOTrainer for DP-ZO), put in front of the trainer's class by ``planted``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dpaudit.core.errors import DPAuditError

ENV = "DPAUDIT_ALLOW_BUGS"


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    releases: tuple[str, ...] = ("gradient-transcript", "zo-log")  # the methods it applies to, by what they release
    noise_scale: float = 1.0       # noise std multiplied by this (the claim is not)
    skip_clipping: bool = False    # per-example clipping skipped
    actual_batch: bool = False     # noisy sum divided by the realised batch size, not the expected one
    public_noise: bool = False     # noise drawn from the public per-step seed (the log reveals it)
    remove_only: bool = False      # sigma calibrated on the remove direction alone
    example_level: bool = False    # a user-level run accounted (calibrated and claimed) one record at a time
    per_user: bool = False         # a ULS run that clips each record, not each user's gradient as one


BUGS = {b.name: b for b in (
    Bug("noise-x0.5", "noise standard deviation halved", noise_scale=0.5),
    Bug("noise-x0.1", "noise standard deviation divided by 10", noise_scale=0.1),
    Bug("no-clip", "per-example clipping skipped", skip_clipping=True),
    Bug("actual-batch", "noisy sum divided by the realised batch size instead of the expected B", actual_batch=True),
    Bug("public-noise-seed", "noise drawn from the public per-step seed, so the log reveals it", ("zo-log",),
        public_noise=True),
    Bug("remove-only", "sigma calibrated with the remove direction only (add/remove max ignored)", remove_only=True),
    Bug("example-level-claim", "a user-level run (--unit user, k records a user) accounted at the example level: its "
        "eps quoted as if it covered users", example_level=True),
    Bug("uls-example-clipping", "a ULS run (users sampled, accounted as one clipped unit each) that clips each record "
        "instead of each user's gradient: a user of k records moves the sum by up to k C", per_user=True),
)}
NO_BUG = Bug("none", "no planted bug")


class NoClipping:
    """Examples clipped at an infinite norm: a clip factor of 1 for every example (the ``clip_norm`` seam of both
    trainers; the noise is still scaled by C)."""

    def clip_norm(self) -> float:
        return float("inf")


class RealisedBatch:
    """The noisy sum divided by the realised batch size (``realised_batch``, set each step), not the expected B."""

    def divisor(self) -> float:
        return max(1, self.realised_batch or 0)


class ExampleClipping:
    """ULS with each record clipped on its own (``clips_per_user`` of both trainers): a user's records add up to
    k C, where the accountant counts C."""

    def clips_per_user(self) -> bool:
        return False


class PublicNoise:
    """The noise drawn from the step's public seed, which the (seed, scalar) log reveals."""

    def noise_rng(self, seed: int):
        return np.random.default_rng(seed)


def seams(bug: Bug | None) -> tuple[type, ...]:
    """The mixins that plant ``bug`` (none for no bug, or one that acts through the privacy plan only)."""
    if bug is None:
        return ()
    return tuple(mixin for flag, mixin in ((bug.skip_clipping, NoClipping), (bug.actual_batch, RealisedBatch),
                                           (bug.public_noise, PublicNoise), (bug.per_user, ExampleClipping))
                 if flag)


def planted(cls: type, bug: Bug | None) -> type:
    """``cls`` with ``bug``'s seam overrides in front (``cls`` itself when there are none)."""
    mixins = seams(bug)
    return type("".join(m.__name__ for m in mixins) + cls.__name__, (*mixins, cls), {}) if mixins else cls


def planted_bug(name: str | None, method, methods: dict) -> Bug:
    """The bug to plant in a run of ``method`` (a methods.Method; ``methods``: every record, to name those it
    applies to), after the gate: unknown names and an unset DPAUDIT_ALLOW_BUGS are refused."""
    if not name:
        return NO_BUG
    if os.environ.get(ENV) != "1":
        raise DPAuditError(f"--plant-bug is for testing the audit; set {ENV}=1 to allow it")
    if name not in BUGS:
        raise DPAuditError(f"unknown bug {name!r}; use {', '.join(BUGS)}")
    bug = BUGS[name]
    if method.release not in bug.releases:
        names = [m.name for m in methods.values() if m.release in bug.releases]
        raise DPAuditError(f"bug {name} applies to {' and '.join(names)}, not {method.name}")
    return bug
