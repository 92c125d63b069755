"""A white-box probe for the user's own DP training: Opacus optimizers, or any PyTorch loop.

The probe plants m canaries where DP acts and reads what DP releases, as the bundled trainers' --white-box
does (audit/whitebox_canaries.py holds the canaries, their signs and the transcript format; audit/whitebox.py
scores it). Each canary is a member with probability 1/2 (membership from fresh OS entropy, written 0600,
never the secret that draws it; ``secret_seed=`` makes it reproducible, for tests and benchmarks only)
and, as a member, is Poisson-sampled at each step with the run's rate p from the probe's own generator
(never the user's torch or numpy state: attaching a probe changes neither the user's batches nor their
noise).

- Gradient canaries (DP-SGD): canary i is gain x C x s[i, t] on its own coordinate j_i: at least one on every
  trainable tensor, the rest spread by size (``_place``), so each tensor's release is read (the per-tensor noise
  check, audit/noise_check.py). Released: each step's noisy gradient sum at the m coordinates (m x 4 bytes a step).
- Scalar canaries (DP-ZO-style releases): canary i adds gain x C x s[i, t], clipped to +-C, to the step's
  clipped sum of scalars. Released: the step's noisy sum (4 bytes a step).

With Opacus, ``WhiteBoxProbe.attach(optimizer)`` attaches through the optimizer's own seams (probe_opacus.py).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import numpy as np

from dpaudit.audit.clipping import TALLY as CLIP_TALLY
from dpaudit.audit.noise_check import TALLY as NOISE_TALLY
from dpaudit.audit.whitebox_canaries import GAIN, TRANSCRIPT, WhiteBoxCanaries
from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_folder import HEALTH, PROBE
from dpaudit.core.run_record import ProbeRecord, read_probe, write_probe
from dpaudit.core.validate import check_canaries, check_number as _check_number
from dpaudit.probes import looks
from dpaudit.probes.looks import LOOKS, ON_VIOLATION, RUNNING, STOP_ALPHA, WATCH_FIRST  # noqa: F401 - importable here
from dpaudit.probes.tallies import SIZE_RATIO, ClipTally, NoiseTally
from dpaudit.probes.transcript import BLOCK_ROWS, Transcript
from dpaudit.audit.report import write_report
from dpaudit.audit.whitebox import CANARY_BATCHES, audit_run_folder
from dpaudit.audit.whitebox_canaries import MANIFEST
from dpaudit.core.lock import MARKER, mark, remove_folder
from dpaudit.probes.health import for_tensors
from dpaudit.probes.probe_opacus import accounted_rate, attach

KINDS = ("gradient", "scalar")  # a PipelineProbe (pipeline_probe.py) is the third kind of probe folder
SAMPLING_DOMAIN = 0x77627370  # "wbsp": the canaries' per-step sampling, apart from membership's stream


class WhiteBoxProbe:
    """``WhiteBoxProbe(params, m=..., clip=C, sample_rate=p, out=...)`` for a plain PyTorch DP-SGD loop
    (``kind="scalar"`` for DP-ZO-style scalar releases), or ``WhiteBoxProbe.attach(dp_optimizer, ...)``."""

    def __init__(self, params=None, *, m: int = 1000, clip: float, sample_rate: float, out, kind: str = "gradient",
                 gain: float = GAIN, seed: int = 0, resume: bool = False, model=None,
                 secret_seed: int | None = None, noise_multiplier: float | None = None,
                 _source: str = "plain PyTorch loop"):
        if kind not in KINDS:
            raise DPAuditError(f"unknown probe kind {kind!r}; use gradient or scalar")
        _check_number("clip norm C", clip, above=0)
        _check_number("sample rate", sample_rate, above=0, at_most=1)
        _check_number("gain", gain, above=0)
        m = check_canaries(m)
        if noise_multiplier is not None and noise_multiplier != 0:
            _check_number("noise multiplier", noise_multiplier, above=0)
        params = [p for p in (params or []) if p.requires_grad]
        if kind == "gradient" and not params:
            raise DPAuditError("a gradient probe needs the trainable parameters")
        # Given the model, every trainable tensor must be among the noised ones (a LoRA group left out of the
        # DP optimizer is trained without clipping or noise: the audit reports it as a violation).
        noised = {id(p) for p in params}
        named = {id(p): n for n, p in model.named_parameters()} if model is not None else {}

        self._declare(
            kind=kind, clip=clip, rate=sample_rate, out=out, params=params, source=_source, secret_seed=secret_seed,
            noise_multiplier=None if noise_multiplier is None else float(noise_multiplier),
            names=[named.get(id(p), f"parameter {k} {tuple(p.shape)}") for k, p in enumerate(params)],
            unprotected=[] if model is None or kind != "gradient" else [
                name for name, p in model.named_parameters() if p.requires_grad and id(p) not in noised],
            # the update's health check (probes/health.py): a plain loop's probe looks every EVERY steps, at begin
            health=for_tensors(params, model, bracketed=False) if kind == "gradient" else None)
        # Membership and the canaries' sampling are secret: fresh OS entropy, never written. ``secret_seed``
        # makes both reproducible, for tests and benchmarks only (whoever knows it knows the members).
        self._sampler = np.random.default_rng(np.random.SeedSequence(secret_seed, spawn_key=(SAMPLING_DOMAIN,)))
        refuse_links(self.out)
        if resume:
            self._resume(m)
        else:
            self._start(m, gain, seed)
        self.transcript = Transcript(self.out / TRANSCRIPT, self.width)

    def _declare(self, *, kind: str, clip, rate, out, params: list, source: str, secret_seed: int | None = None,
                 noise_multiplier: float | None = None, names: list | None = None, unprotected: list | None = None,
                 health=None, canaries: WhiteBoxCanaries | None = None, step: int = 0) -> None:
        """Every field of a probe, set once (each constructor calls this first, then fills in its own)."""
        self.kind, self.out, self.params, self.source = kind, Path(out), list(params), source
        self.clip = None if clip is None else float(clip)
        self.rate = None if rate is None else float(rate)
        self.secret_seed = secret_seed
        # sigma, the noise the claim is accounted with (std sigma x C on the released sum): the per-tensor noise
        # check (audit/noise_check.py) holds every tensor's canary releases to it; None: not checked
        self.noise_multiplier = noise_multiplier
        self.names, self.unprotected = list(names or []), list(unprotected or [])
        self.health = health              # the update's health check (probes/health.py), or None
        self.bypass = None                # how the canaries pass the optimizer's own clipping (probe_opacus.py)
        self.accountant = None            # an attached optimizer's accountant (the claim of a watch or audit)
        self.canaries = canaries
        self.run_id = canaries.run_id if canaries is not None else None
        self.where: list[tuple[int, int]] = []   # (parameter index, flat offset) of each gradient canary
        self.step = step                  # the next step to be released
        self._sampler = None              # the canaries' own per-step sampling (None: the trainer samples them)
        self._sampled = np.zeros(0, int)  # the canaries drawn for the step begun
        self._begun: int | None = None    # the step whose canaries were last drawn
        self._examples_step: int | None = None  # the step whose canaries went in as examples (the clipping check)
        self._gather_plan = None          # (device, per-tensor indices, order) of the release's canary coordinates
        self.transcript: Transcript | None = None
        self.clip_tally, self.noise_tally = ClipTally(), NoiseTally()
        self._watch: looks.Watch | None = None
        self.alarm = self.alarm_report = None   # the first look that read VIOLATION, and its report
        self.stop_requested = False

    @classmethod
    def for_run(cls, params, canaries: WhiteBoxCanaries, *, clip: float, sample_rate: float, out, start_step: int,
                write: bool = True) -> "WhiteBoxProbe":
        """The bundled DP-SGD trainer's probe (``train --white-box``): the same injection and reading as a
        user's, on canaries the run made (membership from its secret seed, coordinates over every trainable
        tensor) and sampled as members of its dataset (``begin(step, sampled)``). The run folder's
        run_config.json describes it (no probe.json); a resumed run rewrites the steps after its checkpoint,
        so the transcript is cut back to ``start_step`` rows. ``write`` False: a rank that writes nothing."""
        return _RunProbe(params, canaries, clip=clip, sample_rate=sample_rate, out=out, start_step=start_step,
                         write=write)

    # -- folder ------------------------------------------------------------------------------------------
    def _start(self, m: int, gain: float, seed: int) -> None:
        if self.out.exists() and any(p.name != MARKER for p in self.out.iterdir()):
            raise DPAuditError(f"{self.out} is not empty; give the probe a new folder, resume=True to continue the "
                               "probe written there, or delete the folder to start over (a probe left by a crashed "
                               "script is resumed with resume=True, or removed)")
        self.out.mkdir(parents=True, exist_ok=True)
        mark(self.out)
        membership = self.secret_seed if self.secret_seed is not None else int.from_bytes(os.urandom(8), "little")
        self.canaries = WhiteBoxCanaries.make(m, seed=seed, membership_seed=membership)
        self.canaries.gain = float(gain)
        if self.kind == "gradient":
            self.canaries.coordinates = self._place(m)
            self.where = self._locate(self.canaries.coordinates)
        self.run_id = self.canaries.run_id = uuid.uuid4().hex
        self.canaries.save(self.out)
        self._write_spec()

    def _resume(self, m: int) -> None:
        spec = read_probe(self.out)
        self.canaries = WhiteBoxCanaries.load(self.out)
        if spec.kind != self.kind or spec.m != m or self.canaries.m != m:
            raise DPAuditError(f"{self.out} holds a {spec.kind} probe with m = {spec.m}; resume it as it was")
        if self.canaries.run_id != spec.run_id:
            raise DPAuditError(f"{self.out}: its canary manifest belongs to another probe run")
        self.run_id = spec.run_id
        if spec.clip != self.clip or spec.sample_rate != self.rate:
            raise DPAuditError(f"{self.out} was probing clip {spec.clip} at sample rate {spec.sample_rate}; "
                               "resume it with the same clip norm and sample rate")
        shapes = spec.parameter_shapes
        if self.kind == "gradient" and shapes is not None and shapes != tuple(map(tuple, _shapes(self.params))):
            raise DPAuditError(f"{self.out} was probing parameters of other shapes; resume it with the same model")
        if self.kind == "gradient":
            if max(self.canaries.coordinates) >= sum(p.numel() for p in self.params):
                raise DPAuditError(f"{self.out} was probing other parameters; resume it with the same model")
            self.where = self._locate(self.canaries.coordinates)
        transcript = Transcript(self.out / TRANSCRIPT, self.width, write=False)
        self.step = transcript.rows
        transcript.cut(self.step)  # a crash mid-row: that row was never complete, so its release was not read
        self.clip_tally = ClipTally.resumed(self.out, self.run_id)
        self.noise_tally = NoiseTally.resumed(self.out, self.run_id)

    def _place(self, m: int) -> list[int]:
        """m distinct coordinates (public, from the seed; flat indices into the parameters in order, as the
        bundled trainers'): at least one on every trainable tensor, the rest spread in proportion to the tensors'
        sizes, so a tensor released without its noise or clipping carries canaries that show it (audit/
        noise_check.py reads each tensor's canary columns). The per-sample rows a canary costs do not grow with
        its tensor (probe_opacus.inject clips stand-ins of the canaries' coordinates alone)."""
        sizes = np.array([p.numel() for p in self.params], np.int64)
        total = int(sizes.sum())
        if m > total:
            raise DPAuditError(f"{m} gradient canaries need as many trainable coordinates; there are {total}")
        if m < sizes.size:
            raise DPAuditError(f"m = {m} gradient canaries cannot cover the {sizes.size} trainable tensors (each "
                               f"carries at least one, so noise missing on any shows); give m >= {sizes.size}")
        counts = per_tensor_counts(sizes, m)
        rng = np.random.default_rng([self.canaries.seed, 2])
        starts = np.cumsum([0] + sizes.tolist())
        return sorted(int(starts[k] + j) for k, n in enumerate(counts)
                      for j in rng.choice(int(sizes[k]), int(n), replace=False))

    def _locate(self, coordinates: list[int]) -> list[tuple[int, int]]:
        """(parameter index, flat offset) of each canary coordinate."""
        starts = np.cumsum([0] + [p.numel() for p in self.params])
        where = []
        for j in coordinates:
            k = int(np.searchsorted(starts, j, side="right") - 1)
            where.append((k, j - int(starts[k])))
        return where

    def _write_spec(self, **extra) -> None:
        """probe.json (core/run_record.ProbeRecord): what the probe watches now, with ``extra`` (the loader's rate at
        attach, the claim at the audit); what an earlier write said and this one does not say is kept."""
        spec = {"kind": self.kind, "run_id": self.run_id, "m": self.canaries.m, "clip": self.clip,
                "sample_rate": self.rate, "gain": self.canaries.gain, "source": self.source,
                "canaries_bypass": self.bypass, "transcript": TRANSCRIPT, "floats_per_step": self.width,
                "unprotected_parameters": tuple(self._unprotected_now()),
                **({"parameter_shapes": tuple(map(tuple, _shapes(self.params))), "parameter_names": tuple(self.names),
                    "parameter_dtypes": tuple(str(p.dtype).replace("torch.", "") for p in self.params),
                    "noise_multiplier": self.noise_multiplier} if self.kind == "gradient" else {}),
                "membership": "from secret_seed (reproducible: tests and benchmarks only)"
                if self.secret_seed is not None else "OS entropy", **extra}
        old = read_probe(self.out) if (self.out / PROBE).exists() else None
        write_probe(self.out, dataclasses.replace(old, **spec) if old is not None else ProbeRecord(**spec))

    @property
    def width(self) -> int:
        return self.canaries.m if self.kind == "gradient" else 1

    @property
    def m(self) -> int:
        return self.canaries.m

    # -- one step ----------------------------------------------------------------------------------------
    def begin(self, step: int, sampled: np.ndarray | None = None) -> np.ndarray:
        """The canaries that join step ``step``: Poisson-sampled at the probe's rate from its own generator, or
        ``sampled`` (canary ids) where the trainer samples them as examples of its dataset."""
        if step != self.step:
            raise DPAuditError(f"the probe expected step {self.step}, got {step}: steps are observed in order, once")
        if self.health is not None and not self.health.bracketed and step and self.health.due(step):
            self.health.look(step)  # a plain loop: moves since the start (an attached probe brackets each step)
            self.save_health()
        self._maybe_look()  # before this step's draw: the transcript and the accountant both hold `step` steps
        if sampled is None:
            members = self.canaries.member_ids
            sampled = members[self._sampler.random(members.size) < self.rate]
        self._sampled = np.asarray(sampled, int)
        self._begun = step
        return self._sampled

    def add_to_summed_grad(self, params, max_grad_norm: float) -> None:
        """The step's sampled canaries, each clipped at ``max_grad_norm``, added to ``p.summed_grad`` (Opacus'
        clipped sum, before noise): ghost clipping's route, and the bundled trainer's."""
        self.add_to_slices([(p.summed_grad, 0, p.numel()) for p in params], max_grad_norm)

    def add_to_slices(self, slices, max_grad_norm: float) -> None:
        """The same into sharded sums: ``slices`` holds, per parameter, (this rank's slice of the clipped sum,
        its first flat position, the parameter's size); a canary joins the one slice holding its coordinate."""
        value, signs = self._value(max_grad_norm), self.canaries.signs(self.step)
        for i in self._sampled:
            k, off = self.where[i]
            grad, at, _ = slices[k]
            if at <= off < at + grad.numel():
                grad.view(-1)[off - at] += value * signs[i]

    def observe_slices(self, step: int, slices, scale: float, all_sum=None) -> None:
        """``observe`` for sharded releases: each rank reads the canary coordinates its slices hold, and
        ``all_sum`` (a numpy vector summed over the ranks) puts the row together; every rank calls it.
        Without ``all_sum`` (one process) the row is gathered in one index a tensor; on a GPU it stays there,
        and rows are copied to the host and written in blocks of ``BLOCK_ROWS`` steps (``flush``), so that a step
        waits for nothing (on the CPU each row is written at its step, as before)."""
        if all_sum is None and all(at == 0 and grad.numel() == n for grad, at, n in slices):
            row = self._gather([grad for grad, _, _ in slices]).double() * scale
            return self._record(step, row if self._keeps_rows(row) else row.numpy())
        row = np.zeros(self.m)
        for i, (k, off) in enumerate(self.where):
            grad, at, _ = slices[k]
            if at <= off < at + grad.numel():
                row[i] = float(grad.reshape(-1)[off - at]) * scale
        self._record(step, np.asarray(all_sum(row) if all_sum else row, float))

    @staticmethod
    def _keeps_rows(row) -> bool:
        """Whether a gathered row waits on its device for the block's copy: on a GPU (a copy a step would wait for
        the step to finish)."""
        return row.device.type != "cpu"

    def _gather(self, released):
        """The canaries' coordinates of the whole released tensors, in canary order: one index per tensor that
        holds canaries, on the tensors' device (no host synchronisation)."""
        import torch

        device = released[0].device
        plan = self._gather_plan
        if plan is None or plan[0] != device:
            by_tensor: dict = {}
            for i, (k, off) in enumerate(self.where):
                by_tensor.setdefault(k, []).append((i, off))
            order = [i for k in sorted(by_tensor) for i, _ in by_tensor[k]]
            index = [(k, torch.tensor([off for _, off in by_tensor[k]], device=device)) for k in sorted(by_tensor)]
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
            plan = self._gather_plan = (device, index, inverse.to(device))
        _, index, inverse = plan
        values = torch.cat([released[k].reshape(-1)[idx].float() for k, idx in index])
        return values[inverse]

    def _value(self, max_grad_norm: float) -> float:
        """A canary's clipped size: gain x C brought to the clip norm the optimizer uses."""
        size = self.canaries.gain * self.clip
        return size * min(1.0, max_grad_norm / size) if max_grad_norm > 0 else 0.0

    def canary_gradients(self, step: int):
        """What to add to the step's clipped gradient sum before noise: one tensor per parameter (zero but
        at the sampled canaries' coordinates, each clipped to C)."""
        import torch

        self._need("gradient")
        self.begin(step)
        grads = [torch.zeros_like(p) for p in self.params]
        self.add_to_slices([(g, 0, g.numel()) for g in grads], self.clip)
        return grads

    def canary_examples(self, step: int):
        """The sampled canaries as per-example gradients *before* clipping, for a loop that clips per-example
        gradients itself: one tensor per parameter, shaped (k, *parameter shape) for the k canaries sampled
        this step (each gain x C on its coordinate). Put them beside the batch's per-example gradients, so
        your own clipping acts on them (a loop that does not clip then shows); k rows of every parameter:
        where memory is short, add ``canary_gradients`` after your clipping instead.

        Odd canaries' rows are SIZE_RATIO times larger: per-example clipping makes every canary C whatever its
        size, so the audit's clipping check (audit/clipping.py) reads whether the larger ones moved the release
        more: a loop that clips the batch's sum, or clips at a norm above C, or not at all, shows there."""
        import torch

        self._need("gradient")
        sampled, signs = self.begin(step), self.canaries.signs(step)
        rows = [torch.zeros((len(sampled), *p.shape), dtype=p.dtype, device=p.device) for p in self.params]
        for r, i in enumerate(sampled):
            k, off = self.where[i]
            rows[k][r].view(-1)[off] = self.canaries.gain * self.clip * signs[i] * (SIZE_RATIO if i % 2 else 1.0)
        self._examples_step = step  # this step's release is tallied for the clipping check
        return rows

    def canary_sum(self, step: int) -> float:
        """What to add to the step's clipped sum of scalars before noise (scalar probes)."""
        self._need("scalar")
        sampled, signs = self.begin(step), self.canaries.signs(step)
        return float(self._value(self.clip) * signs[sampled].sum())

    def observe(self, step: int, released, scale: float = 1.0, clipped=None) -> None:
        """Record the step's release: for gradient probes the noisy gradient sum (one tensor per parameter,
        or anything ``scale`` times which is that sum); for scalar probes the noisy sum. ``clipped`` (gradient
        probes): the step's clipped sums before the noise, canaries included, one tensor per parameter: the release
        minus them is the noise the step added, which the per-tensor noise check then measures on every coordinate
        (without it, on the canaries' coordinates alone)."""
        if self.kind == "scalar":
            return self._record(step, np.array([float(released) * scale]))
        released = [r.detach() for r in released]
        if len(released) != len(self.params):
            raise DPAuditError(f"observe() got {len(released)} tensors for {len(self.params)} parameters")
        wrong = [k for k, (r, p) in enumerate(zip(released, self.params)) if r.numel() != p.numel()]
        if wrong:
            raise DPAuditError(f"observe() got tensor {wrong[0]} of {released[wrong[0]].numel()} values for a "
                               f"parameter of {self.params[wrong[0]].numel()}: give the released gradient sums, one "
                               "tensor per parameter, in the parameters' order")
        if clipped is not None:
            if len(clipped) != len(released):
                raise DPAuditError(f"observe() got {len(clipped)} clipped sums for {len(self.params)} parameters")
            self.tally_noise([r * scale for r in released], [c.detach() for c in clipped])
        self.observe_slices(step, [(r, 0, r.numel()) for r in released], scale)

    def _record(self, step: int, row) -> None:
        """The step's row stored (``_store``), then a watched probe's planned final look if it is due."""
        self._store(step, row)
        self.final_look()

    def _store(self, step: int, row) -> None:
        """The step's row (numpy, or a tensor on the release's device, kept until ``flush``)."""
        if step != self.step:
            raise DPAuditError(f"the probe expected the release of step {self.step}, got step {step}")
        if self._begun != step:  # a release without its canaries would make the audit vacuous
            raise DPAuditError(f"observe({step}) came before the canaries of step {step} were drawn: call "
                               f"canary_gradients({step}) (canary_sum, canary_examples) and add them before the "
                               "noise, then observe the release")
        if self.transcript is not None and self.transcript.writing:
            drawn = (step, self._sampled.copy()) if self._examples_step == step else None
            if self.transcript.add(row, drawn):
                self.flush()
        self.step += 1

    def flush(self) -> None:
        """Write the rows kept on the device to the transcript (one copy to the host) and flush the file: at every
        BLOCK_ROWS steps, at a checkpoint, before an audit and at close; the tallies are saved with them."""
        if self.transcript is None:
            return
        on_device = self.transcript.flush(lambda step, sampled, row: self.clip_tally.add(
            self.canaries.signs(step), sampled, row, self.clip))
        if on_device is not None and (self.step % BLOCK_ROWS == 0 or on_device):
            self.save_tally()
            self.save_noise_tally()

    def tally_noise(self, released, clipped) -> None:
        """Add each tensor's squared noise this step (``released`` minus ``clipped``, its clipped sum before noise:
        exactly the noise the step drew) to the per-tensor noise tally (tallies.NoiseTally), on the tensors'
        device. audit/noise_check.py tests it against the accounted sigma."""
        if self.noise_multiplier is None or len(released) != len(self.params):
            return
        self.noise_tally.add(released, clipped, self.params[0].device)

    def save_noise_tally(self) -> None:
        """Write the per-tensor noise tally beside the transcript (sums of squared noise; nothing of the members)."""
        self.noise_tally.save(self.out, self.run_id, [p.numel() for p in self.params])

    def save_tally(self) -> None:
        """Write the clipping check's tally beside the transcript (0600: it is made from the members)."""
        self.clip_tally.save(self.out, self.run_id, self.step)

    def save_health(self) -> None:
        """Write the health check's findings beside the transcript."""
        if self.health is not None and self.out.is_dir():
            atomic_write_json(self.out / HEALTH, self.health.to_dict())

    def _unprotected_now(self) -> list[str]:
        """The trainable tensors updated outside DP: those the DP optimizer does not hold, less those the health
        check has seen never move (nothing leaks from a tensor left where it started), plus any the check saw move
        outside the DP step. Before the first checked step: every tensor the optimizer does not hold."""
        health = self.health
        if health is None or health.steps == 0:
            return list(self.unprotected)
        still = set(health.untouched_others)
        return [n for n in self.unprotected if n not in still] + [n for n in health.outside
                                                                  if n not in self.unprotected]

    def _need(self, kind: str) -> None:
        if self.kind != kind:
            raise DPAuditError(f"this is a {self.kind} probe")

    # -- Opacus ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, optimizer, *, m: int = 1000, out, data_loader=None, sample_rate: float | None = None,
               accountant=None, gain: float = GAIN, seed: int = 0, resume: bool = False, model=None,
               secret_seed: int | None = None) -> "WhiteBoxProbe":
        """Attach to an Opacus ``DPOptimizer`` (any grad_sample_mode, after ``make_private`` or
        ``make_private_with_epsilon``); the user's training loop stays as it is. Given ``data_loader`` (the one
        you train with), the canaries are sampled at its rate and the audit checks the accountant counts that rate;
        given ``model``, it also checks that every trainable tensor is noised by this optimizer. How:
        probe_opacus.py."""

        return attach(cls, optimizer, m=m, out=out, sample_rate=sample_rate, accountant=accountant, gain=gain,
                      seed=seed, resume=resume, model=model, secret_seed=secret_seed, data_loader=data_loader)

    # -- audits as the run trains -----------------------------------------------------------------------
    def watch(self, *, delta: float, claimed_eps: float | None = None, accountant=None, alpha: float = STOP_ALPHA,
              on_violation: str = "warn", first: int = WATCH_FIRST,
              planned_steps: int | None = None) -> "WhiteBoxProbe":
        """Audit while the run trains (probes/looks.py): a look at step ``first``, then at every doubling of the
        steps (16, 32, 64, ...), each the same audit as ``audit()`` on the steps released so far, held to the claim
        for those steps (``claimed_eps`` if given, else the accountant's eps after them, the optimizer's when
        attached). Look j is made at level alpha / (j (j + 1)), which sums to alpha over every look however long the
        run: a union bound, so a correct run raises a false alarm with probability <= alpha in all. Each look is a
        line of ``running.jsonl`` in the probe's folder. At the first look that reads VIOLATION the report is
        written and ``on_violation`` acts: "warn" prints one line; "stop" also sets ``stop_requested`` (the Hugging
        Face callback then stops the Trainer; a plain loop checks it); "raise" raises ``PrivacyViolation``. The
        end-of-run ``audit()`` is a separate test at its own alpha.

        Given ``planned_steps`` (the Hugging Face callback passes the Trainer's ``max_steps``), one more look is
        made at that step, at level alpha / 2, and the looks before it share the other half (look j at
        alpha / (2 j (j + 1))): still alpha over every look, and the last look, over the whole planned run, is
        nearly as strong as the end-of-run audit (alpha / 2 against alpha) instead of seeing only the steps up to
        the last doubling. Looks after it (a run that goes on) keep to the first half's series."""
        self._watch = looks.start(self.out, self.step, delta=delta, claimed_eps=claimed_eps, accountant=accountant,
                                  alpha=alpha, on_violation=on_violation, first=first, planned_steps=planned_steps,
                                  has_claim=claimed_eps is not None or accountant is not None
                                  or self.accountant is not None)
        self.alarm, self.stop_requested = None, False
        return self

    def _maybe_look(self) -> None:
        """At ``begin``: a look of the alpha series when the steps reach the next doubling (or the planned end)."""
        if self._watch is None or self.alarm is not None or self.transcript is None:
            return
        final = looks.due(self._watch, self.step)
        if final is not None:
            looks.look(self, self._watch, final)

    def final_look(self, counted: bool = False) -> None:
        """The planned run's last look (``watch(planned_steps=)``), made once its release is recorded: from
        ``_record`` when the claim is a given number, or once the accountant has counted the step (``counted``:
        the attached Opacus optimizer's ``step``, after its accountant hook)."""
        if self._watch is None or self.alarm is not None or self.transcript is None:
            return
        if looks.due(self._watch, self.step, final_only=True, counted=counted):
            looks.look(self, self._watch, True)

    # -- the audit ---------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.transcript is not None and self.transcript.writing:
            self.flush()
            self.save_tally()
            self.save_noise_tally()
            self.transcript.close()

    def audit(self, claimed_eps: float | None = None, delta: float | None = None, *, accountant=None,
              alpha: float = 0.05, report: bool | Path = True, claimed_from: str | None = None):
        """The white-box audit of what was released so far: the same result, report and verdict as
        ``dpaudit audit transcript --run OUT``. ``claimed_eps`` defaults to ``accountant``'s (an Opacus
        accountant: its eps after the steps actually taken, at ``delta``); ``claimed_from`` says where a given
        ``claimed_eps`` came from (a caller that took it from an accountant names it, as its own report does).
        ``report``: write it to OUT/report (True), or to the folder given (a look's own)."""

        if self.transcript is not None and self.transcript.writing:
            self.flush()
            self.save_tally()
            self.save_noise_tally()
        if delta is None:
            raise DPAuditError("give the delta the run claims (the bound depends on it; 0 would inflate it)")
        accountant = accountant if accountant is not None else self.accountant
        source = claimed_from or "given"
        if self.health is not None:  # first: read by the audit whatever the claim turns out to be
            self.health.look(self.step)  # the moves up to now, whatever the last checked step saw
            self.save_health()  # read by the audit (nothing released, yet moved outside DP: VIOLATION, whitebox.py)
        history = getattr(accountant, "history", None)  # Opacus: [(noise multiplier, sample rate, steps)]
        if claimed_eps is None and isinstance(history, list) and not history:
            claimed_eps, source = 0.0, f"{type(accountant).__name__}: it counted no step, so eps 0"
        elif claimed_eps is None and isinstance(history, list) and any(h[0] == 0 for h in history):
            source = "none: the run's noise multiplier is 0, so its eps is infinite (no DP); audited without a claim"
        elif claimed_eps is None and accountant is not None:
            try:
                claimed_eps = float(accountant.get_epsilon(delta=delta))
            except Exception as exc:  # noqa: BLE001 - e.g. Opacus' prv at noise 0 overflows
                raise DPAuditError(f"the accountant could not give eps ({type(exc).__name__}); pass claimed_eps= "
                                   "(the eps this run claims)") from None
            taken = sum(int(h[2]) for h in history) if isinstance(history, list) else None
            source = f"{type(accountant).__name__}.get_epsilon(delta={delta:g})" + (
                f" after the {taken} steps taken" if taken is not None else "")
        counted = {}
        if accountant is not None and self.kind == "gradient":  # the rates it counted, read now (rate_check.py)

            rate, rate_source = accounted_rate(accountant)
            if rate is not None:
                counted = {"accounted_rate": rate, "accounted_rate_source": rate_source}
        self._write_spec(claimed_epsilon=claimed_eps, delta=delta, claimed_epsilon_source=source, **counted)
        result, scores, members, facts = audit_run_folder(self.out, claimed_epsilon=claimed_eps, delta=delta,
                                                          alpha=alpha, sample_rate=self._sampler_rate(accountant))
        if report:
            folder = report if isinstance(report, Path) else self.out / "report"
            remove_folder(folder)
            alarm = self.alarm
            context = {"probe": self.source, "claimed eps": claimed_eps, "claimed eps from": source,
                       "delta": delta, **self._context(),
                       **{k: v for k, v in facts.items() if not isinstance(v, dict)},
                       **({"a look during the run": f"{alarm.verdict} (report: {self.alarm_report})"}
                          if alarm is not None and folder != self.alarm_report.parent else {})}
            write_report(folder, result, scores, members, context)
        return result

    def _sampler_rate(self, accountant) -> float | None:
        """The rate the canaries' logged inclusions are tested at (a PipelineProbe given the batches:
        pipeline_probe.py); None: no sampler audit."""
        return None

    def _context(self) -> dict:
        """What the report says of where the canaries enter."""
        health = self.health
        return {"sampling rate p": self.rate, "clip C": self.clip,
                "canaries bypass": self.bypass or "nothing: the optimizer's own clipping acts on them",
                **(health.lines() if health is not None else {})}


class _RunProbe(WhiteBoxProbe):
    """The bundled trainer's probe (``WhiteBoxProbe.for_run``): no folder of its own to start or resume (the run
    folder holds the canaries), no health or noise check (the trainer's DP step is its own, training/dp_step.py)."""

    def __init__(self, params, canaries: WhiteBoxCanaries, *, clip: float, sample_rate: float, out, start_step: int,
                 write: bool):
        self._declare(kind="gradient", clip=clip, rate=sample_rate, out=out, params=params, source="dpaudit train",
                      canaries=canaries, step=start_step)
        self.where = self._locate(canaries.coordinates)
        if write:
            self.transcript = Transcript(self.out / TRANSCRIPT, self.width)
            self.transcript.cut(start_step)


def refuse_links(folder: Path) -> None:
    """A probe folder, and each file a probe writes or appends to there, must not be a symbolic link (the probe
    would write through it, truncating a file outside the folder on resume): refused when the probe starts, never
    mid-run."""

    folder = Path(folder)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise DPAuditError(f"{folder} is not a plain folder (a symbolic link or a file); give the probe a folder path")
    for name in (TRANSCRIPT, RUNNING, CLIP_TALLY, NOISE_TALLY, HEALTH, PROBE, MANIFEST, CANARY_BATCHES, "report",
                 LOOKS):
        if (folder / name).is_symlink():
            raise DPAuditError(f"{folder / name} is a symbolic link; a probe writes only plain files in its folder")


def per_tensor_counts(sizes: np.ndarray, m: int) -> np.ndarray:
    """How many of m canaries each tensor carries: one each, the other m - n in proportion to the sizes (largest
    remainders), never more than a tensor's size. Needs n <= m <= sizes.sum()."""
    counts = np.ones(sizes.size, np.int64)
    while counts.sum() < m:
        room = sizes - counts
        share = (m - counts.sum()) * room / room.sum()
        add = np.minimum(np.floor(share).astype(np.int64), room)
        if add.sum() == 0:  # what is left is less than one a tensor: to the largest remainders with room
            order = np.argsort(-(share - np.floor(share)) - (room > 0), kind="stable")
            add[order[:m - counts.sum()]] = 1
            add = np.minimum(add, room)
        counts += add
    return counts


def _shapes(params) -> list[list[int]]:
    return [list(p.shape) for p in params]

