"""A white-box probe for the user's own DP training: Opacus optimizers, or any PyTorch loop.

The probe plants m canaries where DP acts and reads what DP releases, as the bundled trainers' --white-box
does (audit/whitebox_canaries.py holds the canaries, their signs and the transcript format; audit/whitebox.py
scores it). Each canary is a member with probability 1/2 (membership from fresh OS entropy, written 0600,
never the secret that draws it; ``secret_seed=`` makes it reproducible, for tests and benchmarks only)
and, as a member, is Poisson-sampled at each step with the run's rate p from the probe's own generator
(never the user's torch or numpy state: attaching a probe changes neither the user's batches nor their
noise).

- Gradient canaries (DP-SGD): canary i is gain x C x s[i, t] on its own coordinate j_i: at least one on every
  trainable tensor, the rest spread by size (injector.py), so each tensor's release is read (the per-tensor noise
  check, audit/noise_check.py). Released: each step's noisy gradient sum at the m coordinates (m x 4 bytes a step).
- Scalar canaries (DP-ZO-style releases): canary i adds gain x C x s[i, t], clipped to +-C, to the step's
  clipped sum of scalars. Released: the step's noisy sum (4 bytes a step).

With Opacus, ``WhiteBoxProbe.attach(optimizer)`` attaches through the optimizer's own seams (probe_opacus.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpaudit.audit.clipping import TALLY as CLIP_TALLY
from dpaudit.audit.noise_check import TALLY as NOISE_TALLY
from dpaudit.audit.whitebox import CANARY_BATCHES
from dpaudit.audit.whitebox_canaries import GAIN, MANIFEST, TRANSCRIPT, WhiteBoxCanaries
from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_folder import HEALTH, PROBE
from dpaudit.core.validate import check_canaries, check_number as _check_number
from dpaudit.probes import looks, probe_folder, verdict
from dpaudit.probes.health import for_tensors, unprotected
from dpaudit.probes.injector import Injector, checked_release, clipped_value
from dpaudit.probes.looks import LOOKS, ON_VIOLATION, RUNNING, STOP_ALPHA, WATCH_FIRST  # noqa: F401 - importable here
from dpaudit.probes.probe_opacus import attach
from dpaudit.probes.tallies import ClipTally, NoiseTally
from dpaudit.probes.transcript import BLOCK_ROWS, Transcript

KINDS = ("gradient", "scalar")  # a PipelineProbe (pipeline_probe.py) is the third kind of probe folder
SAMPLING_DOMAIN = 0x77627370  # "wbsp": the canaries' per-step sampling, apart from membership's stream


class WhiteBoxProbe:
    """``WhiteBoxProbe(params, m=..., clip=C, sample_rate=p, out=...)`` for a plain PyTorch DP-SGD loop
    (``kind="scalar"`` for DP-ZO-style scalar releases), or ``WhiteBoxProbe.attach(dp_optimizer, ...)``. ``records``
    > 1: canary users of that many records, each sampled and clipped apart (hold them to a user-level claim)."""

    def __init__(self, params=None, *, m: int = 1000, clip: float, sample_rate: float, out, kind: str = "gradient",
                 gain: float = GAIN, seed: int = 0, resume: bool = False, model=None,
                 secret_seed: int | None = None, noise_multiplier: float | None = None, records: int = 1,
                 _source: str = "plain PyTorch loop"):
        m, params = _checked(kind, m, clip, sample_rate, gain, noise_multiplier, params)
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
            probe_folder.resume(self, m)
        else:
            probe_folder.start(self, m, gain, seed, records)
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
        self.injector: Injector | None = None     # a gradient probe's canaries: where they sit, in and out
        self.step = step                  # the next step to be released
        self._sampler = None              # the canaries' own per-step sampling (None: the trainer samples them)
        self._sampled = np.zeros(0, int)  # the canaries drawn for the step begun
        self._begun: int | None = None    # the step whose canaries were last drawn
        self._examples_step: int | None = None  # the step whose canaries went in as examples (the clipping check)
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

    @property
    def width(self) -> int:
        return self.canaries.m if self.kind == "gradient" else 1

    @property
    def where(self) -> list[tuple[int, int]]:
        """(parameter index, flat offset) of each gradient canary."""
        return self.injector.where if self.injector is not None else []

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
        if sampled is None:  # a canary user's records are sampled apart: Binomial(records, p) copies of its gradient
            members, r = self.canaries.member_ids, self.canaries.records
            sampled = (members[self._sampler.random(members.size) < self.rate] if r == 1
                       else np.repeat(members, self._sampler.binomial(r, self.rate, members.size)))
        self._sampled = np.asarray(sampled, int)
        self._begun = step
        return self._sampled

    def add_to_summed_grad(self, params, max_grad_norm: float) -> None:
        """The step's sampled canaries, each clipped at ``max_grad_norm``, added to ``p.summed_grad`` (Opacus'
        clipped sum, before noise): ghost clipping's route, and the bundled trainer's."""
        self.injector.add([(p.summed_grad, 0, p.numel()) for p in params], self._sampled, self.step, max_grad_norm)

    def add_to_slices(self, slices, max_grad_norm: float) -> None:
        """The same into sharded sums: ``slices`` holds, per parameter, (this rank's slice of the clipped sum,
        its first flat position, the parameter's size); a canary joins the one slice holding its coordinate."""
        self.injector.add(slices, self._sampled, self.step, max_grad_norm)

    def observe_slices(self, step: int, slices, scale: float, all_sum=None) -> None:
        """``observe`` for sharded releases: each rank reads the canary coordinates its slices hold, and
        ``all_sum`` (a numpy vector summed over the ranks) puts the row together; every rank calls it.
        Without ``all_sum`` (one process) the row is gathered in one index a tensor; on a GPU it stays there,
        and rows are copied to the host and written in blocks of ``BLOCK_ROWS`` steps (``flush``), so that a step
        waits for nothing (on the CPU each row is written at its step, as before)."""
        self._record(step, self.injector.read(slices, scale, all_sum))

    def canary_gradients(self, step: int):
        """What to add to the step's clipped gradient sum before noise: one tensor per parameter (zero but
        at the sampled canaries' coordinates, each clipped to C)."""
        self._need("gradient")
        return self.injector.gradients(self.begin(step), step)

    def canary_examples(self, step: int):
        """The sampled canaries as per-example gradients *before* clipping, for a loop that clips per-example
        gradients itself: one tensor per parameter, shaped (k, *parameter shape) for the k canaries sampled
        this step (each gain x C on its coordinate). Put them beside the batch's per-example gradients, so
        your own clipping acts on them (a loop that does not clip then shows); k rows of every parameter:
        where memory is short, add ``canary_gradients`` after your clipping instead.

        Odd canaries' rows are SIZE_RATIO times larger: per-example clipping makes every canary C whatever its
        size, so the audit's clipping check (audit/clipping.py) reads whether the larger ones moved the release
        more: a loop that clips the batch's sum, or clips at a norm above C, or not at all, shows there."""
        self._need("gradient")
        rows = self.injector.examples(self.begin(step), step)
        self._examples_step = step  # this step's release is tallied for the clipping check
        return rows

    def canary_sum(self, step: int) -> float:
        """What to add to the step's clipped sum of scalars before noise (scalar probes)."""
        self._need("scalar")
        sampled, signs = self.begin(step), self.canaries.signs(step)
        return float(clipped_value(self.canaries.gain, self.clip, self.clip) * signs[sampled].sum())

    def observe(self, step: int, released, scale: float = 1.0, clipped=None) -> None:
        """Record the step's release: for gradient probes the noisy gradient sum (one tensor per parameter,
        or anything ``scale`` times which is that sum); for scalar probes the noisy sum. ``clipped`` (gradient
        probes): the step's clipped sums before the noise, canaries included, one tensor per parameter: the release
        minus them is the noise the step added, which the per-tensor noise check then measures on every coordinate
        (without it, on the canaries' coordinates alone)."""
        if self.kind == "scalar":
            return self._record(step, np.array([float(released) * scale]))
        released = checked_release(released, clipped, self.params)
        if clipped is not None:
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
            self._save_tallies()

    def tally_noise(self, released, clipped) -> None:
        """Add each tensor's squared noise this step (``released`` minus ``clipped``, its clipped sum before noise:
        exactly the noise the step drew) to the per-tensor noise tally (tallies.NoiseTally), on the tensors'
        device. audit/noise_check.py tests it against the accounted sigma."""
        if self.noise_multiplier is None or len(released) != len(self.params):
            return
        self.noise_tally.add(released, clipped, self.params[0].device)

    def save_checks(self) -> bool:
        """Flush the transcript and save both tallies beside it; False when this probe writes nothing."""
        if self.transcript is None or not self.transcript.writing:
            return False
        self.flush()
        self._save_tallies()
        return True

    def _save_tallies(self) -> None:
        """The clipping check's tally (0600: made from the members) and the per-tensor noise tally (sums of squared
        noise), beside the transcript."""
        self.clip_tally.save(self.out, self.run_id, self.step)
        self.noise_tally.save(self.out, self.run_id, [p.numel() for p in self.params])

    def save_health(self) -> None:
        """Write the health check's findings beside the transcript."""
        if self.health is not None and self.out.is_dir():
            atomic_write_json(self.out / HEALTH, self.health.to_dict())

    def unprotected_now(self) -> list[str]:
        """The trainable tensors updated outside DP now (probes/health.py: unprotected)."""
        return unprotected(self.health, self.unprotected)

    def _need(self, kind: str) -> None:
        if self.kind != kind:
            raise DPAuditError(f"this is a {self.kind} probe")

    # -- Opacus ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, optimizer, *, m: int = 1000, out, data_loader=None, sample_rate: float | None = None,
               accountant=None, gain: float = GAIN, seed: int = 0, resume: bool = False, model=None,
               secret_seed: int | None = None, records: int = 1) -> "WhiteBoxProbe":
        """Attach to an Opacus ``DPOptimizer`` (any grad_sample_mode, after ``make_private`` or
        ``make_private_with_epsilon``); the user's training loop stays as it is. Given ``data_loader`` (the one
        you train with), the canaries are sampled at its rate and the audit checks the accountant counts that rate;
        given ``model``, it also checks that every trainable tensor is noised by this optimizer. How:
        probe_opacus.py."""
        return attach(cls, optimizer, m=m, out=out, sample_rate=sample_rate, accountant=accountant, gain=gain,
                      seed=seed, resume=resume, model=model, secret_seed=secret_seed, data_loader=data_loader,
                      records=records)

    # -- audits as the run trains -----------------------------------------------------------------------
    def watch(self, *, delta: float, claimed_eps: float | None = None, accountant=None, alpha: float = STOP_ALPHA,
              on_violation: str = "warn", first: int = WATCH_FIRST,
              planned_steps: int | None = None) -> "WhiteBoxProbe":
        """Audit while the run trains: a look at step ``first``, then at every doubling of the steps, each the same
        audit as ``audit()`` on the steps released so far, at levels that sum to ``alpha`` over every look (one more
        at ``planned_steps`` at alpha / 2 when given); at the first VIOLATION ``on_violation`` warns, stops
        (``stop_requested``) or raises. The schedule, its levels and the claim each look is held to: probes/looks.py."""
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
        if self.save_checks():
            self.transcript.close()

    def audit(self, claimed_eps: float | None = None, delta: float | None = None, *, accountant=None,
              alpha: float = 0.05, report: bool | Path = True, claimed_from: str | None = None):
        """The white-box audit of what was released so far: the same result, report and verdict as
        ``dpaudit audit transcript --run OUT`` (probes/verdict.py). ``claimed_eps`` defaults to ``accountant``'s
        (an Opacus accountant: its eps after the steps actually taken, at ``delta``); ``claimed_from`` says where
        a given ``claimed_eps`` came from. ``report``: write it to OUT/report (True), or to the folder given."""
        return verdict.audit(self, claimed_eps, delta, accountant=accountant, alpha=alpha, report=report,
                             claimed_from=claimed_from)

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
        self.injector = Injector(self.params, canaries, self.clip)
        if write:
            self.transcript = Transcript(self.out / TRANSCRIPT, self.width)
            self.transcript.cut(start_step)


def _checked(kind: str, m: int, clip, sample_rate, gain, noise_multiplier, params) -> tuple[int, list]:
    """A probe's arguments refused in one line where they make no sense; (m, the trainable parameters)."""
    if kind not in KINDS:
        raise DPAuditError(f"unknown probe kind {kind!r}; use gradient or scalar")
    _check_number("clip norm C", clip, above=0)
    _check_number("sample rate", sample_rate, above=0, at_most=1)
    _check_number("gain", gain, above=0)
    if noise_multiplier is not None and noise_multiplier != 0:
        _check_number("noise multiplier", noise_multiplier, above=0)
    params = [p for p in (params or []) if p.requires_grad]
    if kind == "gradient" and not params:
        raise DPAuditError("a gradient probe needs the trainable parameters")
    return check_canaries(m), params


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
