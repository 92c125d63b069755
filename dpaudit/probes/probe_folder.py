"""A probe's folder: started, resumed, and described (probe.json, through core/run_record.ProbeRecord).

The folder is the probe's whole state across processes: the canary manifest (membership secret, 0600), probe.json
(what it watches and what it was told), the transcript, and the checks' tallies beside it. A resumed probe must be the
one that wrote the folder; it continues at the transcript's last complete row.
"""

from __future__ import annotations

import dataclasses
import os
import uuid

from dpaudit.audit.whitebox_canaries import TRANSCRIPT, WhiteBoxCanaries
from dpaudit.core.errors import DPAuditError
from dpaudit.core.lock import MARKER, mark
from dpaudit.core.run_folder import PROBE
from dpaudit.core.run_record import ProbeRecord, read_probe, write_probe
from dpaudit.probes.injector import Injector, place
from dpaudit.probes.tallies import ClipTally, NoiseTally
from dpaudit.probes.transcript import Transcript


def start(probe, m: int, gain: float, seed: int, records: int = 1) -> None:
    """A new probe folder: the canaries made (membership from the secret seed or fresh OS entropy), placed on
    the parameters (a gradient probe), saved with probe.json."""
    if probe.out.exists() and any(p.name != MARKER for p in probe.out.iterdir()):
        raise DPAuditError(f"{probe.out} is not empty; give the probe a new folder, resume=True to continue the "
                           "probe written there, or delete the folder to start over (a probe left by a crashed "
                           "script is resumed with resume=True, or removed)")
    probe.out.mkdir(parents=True, exist_ok=True)
    mark(probe.out)
    membership = probe.secret_seed if probe.secret_seed is not None else int.from_bytes(os.urandom(8), "little")
    probe.canaries = WhiteBoxCanaries.make(m, seed=seed, membership_seed=membership, records=records)
    probe.canaries.gain = float(gain)
    if probe.kind == "gradient":
        probe.canaries.coordinates = place(probe.params, m, probe.canaries.seed)
        probe.injector = Injector(probe.params, probe.canaries, probe.clip)
    probe.run_id = probe.canaries.run_id = uuid.uuid4().hex
    probe.canaries.save(probe.out)
    write_spec(probe)


def resume(probe, m: int) -> None:
    """The probe written in its folder, taken up where its transcript ends (refused unless it is the same probe:
    kind, m, run, clip, rate and parameters)."""
    spec = read_probe(probe.out)
    probe.canaries = WhiteBoxCanaries.load(probe.out)
    if spec.kind != probe.kind or spec.m != m or probe.canaries.m != m:
        raise DPAuditError(f"{probe.out} holds a {spec.kind} probe with m = {spec.m}; resume it as it was")
    if probe.canaries.run_id != spec.run_id:
        raise DPAuditError(f"{probe.out}: its canary manifest belongs to another probe run")
    probe.run_id = spec.run_id
    if spec.clip != probe.clip or spec.sample_rate != probe.rate:
        raise DPAuditError(f"{probe.out} was probing clip {spec.clip} at sample rate {spec.sample_rate}; "
                           "resume it with the same clip norm and sample rate")
    shapes = spec.parameter_shapes
    if probe.kind == "gradient" and shapes is not None and shapes != shapes_of(probe.params):
        raise DPAuditError(f"{probe.out} was probing parameters of other shapes; resume it with the same model")
    if probe.kind == "gradient":
        if max(probe.canaries.coordinates) >= sum(p.numel() for p in probe.params):
            raise DPAuditError(f"{probe.out} was probing other parameters; resume it with the same model")
        probe.injector = Injector(probe.params, probe.canaries, probe.clip)
    transcript = Transcript(probe.out / TRANSCRIPT, probe.width, write=False)
    probe.step = transcript.rows
    transcript.cut(probe.step)  # a crash mid-row: that row was never complete, so its release was not read
    probe.clip_tally = ClipTally.resumed(probe.out, probe.run_id)
    probe.noise_tally = NoiseTally.resumed(probe.out, probe.run_id)


def write_spec(probe, **extra) -> None:
    """probe.json (core/run_record.ProbeRecord): what the probe watches now, with ``extra`` (the loader's rate at
    attach, the claim at the audit); what an earlier write said and this one does not say is kept."""
    spec = {"kind": probe.kind, "run_id": probe.run_id, "m": probe.canaries.m, "clip": probe.clip,
            "sample_rate": probe.rate, "gain": probe.canaries.gain, "source": probe.source,
            "canaries_bypass": probe.bypass, "transcript": TRANSCRIPT, "floats_per_step": probe.width,
            "unprotected_parameters": tuple(probe.unprotected_now()),
            **({"parameter_shapes": shapes_of(probe.params), "parameter_names": tuple(probe.names),
                "parameter_dtypes": tuple(str(p.dtype).replace("torch.", "") for p in probe.params),
                "noise_multiplier": probe.noise_multiplier} if probe.kind == "gradient" else {}),
            "membership": "from secret_seed (reproducible: tests and benchmarks only)"
            if probe.secret_seed is not None else "OS entropy", **extra}
    old = read_probe(probe.out) if (probe.out / PROBE).exists() else None
    write_probe(probe.out, dataclasses.replace(old, **spec) if old is not None else ProbeRecord(**spec))


def shapes_of(params) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p.shape) for p in params)
