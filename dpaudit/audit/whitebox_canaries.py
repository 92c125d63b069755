"""White-box canaries: the auditor sees every privatised release, so canaries are planted where DP acts.

Each of m canaries is a member with probability 1/2 and, as a member, joins the dataset and is Poisson
sampled like any example. Its per-example contribution has a sign s[i, t] = +-1 that changes every
step (public, from the canary seed), so the data's steady drift cancels out of the score:
- DP-SGD: a gradient canary, ``gain`` x C times s[i, t] on one coordinate j_i of the trainable parameters
  (distinct coordinates: canaries do not interfere); the trainer's clipping brings it to norm C.
- DP-ZO: a scalar canary, whose loss difference is ``gain`` x C times s[i, t], clipped to +-C by the
  trainer. All canaries share the step's one released scalar.
A canary may be a user of ``records`` records (a user-level audit, accounting/unit.py): a member then joins the
dataset as that many records, each sampled and clipped as an example, so a step holds Binomial(records, p) copies
of its contribution, and its score reads them all. Against a user-level claim covering users of up to k >= records
records, the one-run bound holds as for one record; against an example-level claim, such canaries show what the
claim does not cover.
The transcript holds only canary-aligned numbers: for DP-SGD each step's released noisy sum at the m
coordinates (m floats a step, whitebox_transcript.f32), for DP-ZO the (seed, scalar) log itself. The
secret seed is never written. Scores are computed from the transcript by ``dpaudit.audit.whitebox``.
Gradient canaries enter and are read by ``probes.probe.WhiteBoxProbe``: the bundled trainer's and a user's
loop's go the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.run_record import stamped, unstamped
from dpaudit.core.errors import DPAuditError

# Membership is drawn from the secret seed in its own domain (a SeedSequence spawn key), so it can never
# coincide with a batch or noise stream, which are keyed [secret, step] without one.
MEMBERSHIP_DOMAIN = 0x77626D62  # "wbmb"
GAIN = 10.0  # a canary's pre-clipping size in units of C: clipping must act, or "no-clip" shows
MANIFEST = "whitebox_canaries.json"
TRANSCRIPT = "whitebox_transcript.f32"


def step_signs(seed: int, step: int, m: int) -> np.ndarray:
    """The public sign pattern of step ``step``: one +-1 per canary."""
    return np.random.default_rng([seed, 1, step]).integers(0, 2, m) * 2.0 - 1.0


@dataclass
class WhiteBoxCanaries:
    m: int
    seed: int                       # public: signs and coordinates; membership is stored, not derived
    members: np.ndarray             # bool, (m,)
    gain: float = GAIN
    coordinates: list[int] = field(default_factory=list)  # DP-SGD: flat indices into the trainable parameters
    run_id: str | None = None       # a probe's (probes/probe.py): its transcript and manifest belong together
    records: int = 1                # records a canary (a canary user's; 1: an example)

    @classmethod
    def make(cls, m: int, seed: int, membership_seed: int, records: int = 1) -> "WhiteBoxCanaries":
        if m < 4:
            raise DPAuditError(f"a white-box audit needs at least 4 canaries, got {m}")
        if records < 1:
            raise DPAuditError(f"a canary holds at least one record, got {records}")
        stream = np.random.SeedSequence(membership_seed, spawn_key=(MEMBERSHIP_DOMAIN,))
        members = np.random.default_rng(stream).random(m) < 0.5
        return cls(m=m, seed=seed, members=members, records=records)

    @property
    def member_ids(self) -> np.ndarray:
        return np.flatnonzero(self.members)

    @property
    def member_records(self) -> np.ndarray:
        """The canary id of each record the members add to the dataset (``records`` a member, in id order)."""
        return np.repeat(self.member_ids, self.records)

    def signs(self, step: int) -> np.ndarray:
        return step_signs(self.seed, step, self.m)

    def place(self, n_params: int) -> None:
        """Choose m distinct coordinates (public, from the seed) for gradient canaries."""
        if self.m > n_params:
            raise DPAuditError(f"{self.m} gradient canaries need as many trainable parameters; the model has {n_params}")
        self.coordinates = sorted(int(j) for j in np.random.default_rng([self.seed, 2]).choice(
            n_params, self.m, replace=False))

    def save(self, folder: Path) -> Path:
        """Written 0600: membership is the audit's secret."""
        return atomic_write_json(Path(folder) / MANIFEST, private=True, data=stamped(MANIFEST, {
            "m": self.m, "seed": self.seed, "gain": self.gain, "members": [int(x) for x in self.members],
            "coordinates": self.coordinates, **({"run_id": self.run_id} if self.run_id else {}),
            **({"records": self.records} if self.records != 1 else {})}))

    @classmethod
    def load(cls, folder: Path) -> "WhiteBoxCanaries":
        try:
            d = unstamped(MANIFEST, json.loads((Path(folder) / MANIFEST).read_text()), Path(folder) / MANIFEST)
            return cls(m=int(d["m"]), seed=int(d["seed"]), members=np.array(d["members"], bool),
                       gain=float(d["gain"]), coordinates=[int(j) for j in d["coordinates"]],
                       run_id=str(d["run_id"]) if d.get("run_id") else None, records=int(d.get("records", 1)))
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise DPAuditError(f"{folder} has no readable white-box canary manifest: {exc}") from None
