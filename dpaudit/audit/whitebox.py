"""White-box scores from a run's transcript (torch-free): what the auditor computes from the releases.

Canary i's score is the correlation of the released noisy sums with its public sign pattern s[i, t],
in units of C: a member sampled at step t adds +C (after clipping) to s[i, t] x release_t, everything
else (noise, data, other canaries) enters with a random sign. Over T steps a member's score is about
N(pT, T v) and a non-member's N(0, T v): a sum of many canary-aligned signals, so the continuous
Gaussian audit applies.
- DP-SGD: release_t[i] is the released noisy gradient sum at canary i's coordinate (the transcript).
- DP-ZO: release_t = 2 phi B x s_t, the noisy sum behind the logged scalar, shared by all canaries.
  A second statistic replays, for each step, the noise a generator seeded with that step's *public*
  seed would draw, and subtracts it: it finds nothing in a correct run (the noise is secret) and the
  whole sum when a run's noise is public. alpha is split over the two statistics (Bonferroni).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
import json

import numpy as np

from dpaudit.core import limits as budget, run_folder, run_record
from dpaudit.core.errors import DPAuditError, PrivacyViolation
from dpaudit.core.run_record import ProbeRecord, RunRecord
from dpaudit.accounting.calibrate import calibrate_sigma
from dpaudit.accounting.matrix.strategy import banded_coefs, parse
from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.noises import noise
from dpaudit.audit import correlated, family, noise_check
from dpaudit.audit.analysis import analyse
from dpaudit.audit.ceiling import run_ceiling
from dpaudit.audit.clipping import CLIP_SHARE, check, read_tally
from dpaudit.audit.family import likelihood_ratio_step
from dpaudit.audit.noise_check import NOISE_SHARE
from dpaudit.audit.rate_check import RateCheck
from dpaudit.audit.sampler import analyse_batches
from dpaudit.audit.whitebox_canaries import TRANSCRIPT, WhiteBoxCanaries, step_signs
from dpaudit.core.run_folder import HEALTH, OUTSIDE_DP, read_json


@dataclass(frozen=True)
class Released:
    """What the white-box audit reads of a folder: a bundled run's record (run_config.json), or a probe's
    description (probe.json), and the release the folder holds."""
    release: str | None
    record: RunRecord | None = None
    probe: ProbeRecord | None = None

    @classmethod
    def of(cls, run_dir: Path) -> Released:
        if run_folder.is_probe_folder(run_dir):
            spec = run_record.read_probe(run_dir)
            return cls(release=PROBE_RELEASES[spec.kind], probe=spec)
        record = run_record.read(run_dir)
        return cls(release=record.release, record=record)

    @property
    def clip(self) -> float | None:
        return self.probe.clip if self.probe is not None else self.record.settings.clip

    @property
    def mechanism(self) -> str | None:
        """The run's noise (None for a probe: it does not say)."""
        return self.record.settings.mechanism if self.record is not None else None


PROBE_RELEASES = {"gradient": "gradient-transcript", "scalar": "scalar-sums", "pipeline": "pipeline-rows"}


# The robust reading. The alignment score's variance is estimated from the scores, so a few huge entries (one
# step set to 50 at 3 of 200 coordinates) inflate it and hid a VIOLATION of 43.1. A second statistic
# clips every release entry to median +- ROBUST_CUT robust standard deviations (1.4826 x the median absolute
# deviation): a function of the transcript applied alike to every canary, blind to membership, so its scores are
# as valid for the one-run bounds as the raw ones. It is a second statistic (alpha split, Bonferroni), not a
# replacement, because a canary entry above the cut (a run that skips clipping plants gain x C) must still show
# in the raw one.
ROBUST = "alignment, outlying releases clipped"
ROBUST_CUT = 8.0  # robust standard deviations


BLOCK_VALUES = 1 << 21  # transcript values scored at a time (a few float64 copies of them are held)


LIKELIHOOD = "likelihood ratio"  # family.likelihood_ratio of each step's x, at the transcript's robust scale


def _alignment_scores(releases: np.ndarray, canaries, clip: float, rate: float | None = None
                      ) -> tuple[dict[str, np.ndarray], float]:
    """The raw and the robust alignment of every canary, reading the (memory-mapped) releases a block of steps at
    a time, so memory is O(block), not O(transcript) (a 100 MB transcript took 850 MB). The robust cut
    comes from an evenly strided sample of at most 2^20 entries (a function of the transcript, blind to
    membership, like the cut itself). With the Poisson ``rate``, a third statistic: each canary's log-likelihood
    ratio under the run's family at the entries' robust scale (family.py). Also returns that scale, in units of C."""

    steps, m = releases.shape
    block = max(1, BLOCK_VALUES // m)
    budget.current().require(6 * 8 * block * m + 8 * (1 << 20), "the white-box transcript audit")
    stride = max(1, steps * m // (1 << 20))
    sample = np.asarray(releases.reshape(-1)[::stride], float)
    centre, cut = _robust_cut(sample)
    scale = cut / ROBUST_CUT / clip
    likely = rate is not None and scale > 0
    raw, robust, llr = np.zeros(m), np.zeros(m), np.zeros(m)
    for start in range(0, steps, block):
        part = np.asarray(releases[start:start + block], float)
        signs = np.stack([step_signs(canaries.seed, t, m) for t in range(start, start + part.shape[0])])
        raw += (signs * part).sum(0)
        robust += (signs * (np.clip(part, centre - cut, centre + cut) if cut > 0 else part)).sum(0)
        if likely:
            llr += likelihood_ratio_step(signs * part / clip, rate, scale).sum(0)
    stats = {"alignment": raw / clip, ROBUST: robust / clip}
    return ({**stats, LIKELIHOOD: llr} if likely else stats), scale


PIPELINE = "row movement"
PIPELINE_ROBUST = "row movement, outlying steps clipped"
PIPELINE_LIKELIHOOD = "row movement, likelihood ratio"
# The largest lag-1 correlation of the standardised steps at which they are read as independent releases (the run's
# family, family.py): momentum or Adam's first moment gives beta (0.9 by default); plain SGD gives 0, within
# 1 / sqrt(m T) (0.003 at m 500, T 200). Validity is tested just inside it (tests/audit/test_pipeline_scores.py).
INDEPENDENT = 0.05
PULL = 1.0  # the likelihood ratio's pull, in noise units: PULL / sigma, sigma the claim's at the run's p and T


def _pipeline_scores(moves: np.ndarray, rate: float | None = None, pull: float | None = None
                     ) -> tuple[dict[str, np.ndarray], float]:
    """A pipeline probe's scores: each step's row movements standardised across the m canaries (minus their
    median, over 1.4826 x their median absolute deviation: the noise's scale that step, whatever the learning
    rate or optimizer made of it), summed over the steps; the same with every standardised entry clipped to
    +-ROBUST_CUT; given the rate and a pull, the sum of each standardised step's likelihood ratio at that pull
    (family.standardised_likelihood_ratio). Functions of the released rows that treat every canary alike, blind to
    membership. Also returns the lag-1 correlation of the standardised steps (each canary's mean removed): near 0
    where each step's movement is that step's release alone, near beta under momentum."""
    m = moves.shape[1]
    block = max(1, BLOCK_VALUES // m)
    raw, robust, llr = np.zeros(m), np.zeros(m), np.zeros(m)
    cross, squares, first, previous = np.zeros(m), np.zeros(m), None, None
    for start in range(0, moves.shape[0], block):
        part = np.asarray(moves[start:start + block], float)
        centre = np.median(part, axis=1, keepdims=True)
        scale = 1.4826 * np.median(np.abs(part - centre), axis=1, keepdims=True)
        z = np.divide(part - centre, scale, out=np.zeros_like(part), where=scale > 0)  # a still step says nothing
        raw += z.sum(0)
        robust += np.clip(z, -ROBUST_CUT, ROBUST_CUT).sum(0)
        if rate is not None and pull is not None:
            llr += family.pull_likelihood_ratio_step(z, rate, pull).sum(0)
        joined = z if previous is None else np.vstack([previous, z])
        cross += (joined[1:] * joined[:-1]).sum(0)
        squares += (z * z).sum(0)
        first = z[0] if first is None else first
        previous = z[-1:]
    stats = {PIPELINE: raw, PIPELINE_ROBUST: robust}
    if rate is not None and pull is not None:
        stats[PIPELINE_LIKELIHOOD] = llr
    return stats, (_lag_one(raw, cross, squares, first, previous[0], moves.shape[0]) if first is not None else 0.0)


def _lag_one(sums, cross, squares, first, last, steps: int) -> float:
    """The pooled lag-1 correlation of the standardised steps, each canary's own mean removed (a member's mean pull
    is not a correlation of its steps), from the running sums of one pass, plus 1 / T: removing the mean biases the
    estimate of independent steps to -1 / T (0.025 at T = 40)."""
    if steps < 3:
        return 0.0
    mean = sums / steps
    lagged = cross - mean * (2 * sums - first - last) + (steps - 1) * mean ** 2
    spread = squares - steps * mean ** 2
    total = float(spread.sum())
    return float(lagged.sum()) / total + 1.0 / steps if total > 0 else 0.0


@lru_cache(maxsize=64)
def claim_pull(claimed_epsilon, delta: float, rate: float, steps: int) -> float | None:
    """The likelihood ratio's pull for a pipeline transcript: PULL / sigma, sigma the claim's at the run's p and T
    (public: the claim and the schedule), or None without a claim (delta > 0) or at p = 1."""
    if claimed_epsilon is None or not delta > 0 or rate >= 1:
        return None
    return PULL / calibrate_sigma(Mechanism("gaussian", 1.0, rate, steps), float(claimed_epsilon), delta,
                                  rtol=0.02).sigma


def pipeline_models(rate: float, steps: int, pull: float | None) -> dict:
    """{statistic: family.ScoreModel} of a pipeline transcript's statistics, in noise units (family.py)."""
    models = {PIPELINE: family.standardised_linear(rate, steps),
              PIPELINE_ROBUST: family.standardised_clipped(rate, steps, ROBUST_CUT)}
    if pull is not None:
        models[PIPELINE_LIKELIHOOD] = family.standardised_likelihood_ratio(rate, steps, pull)
    return models


def _pipeline_family(rows, sampler, stats: dict, facts: dict, mechanism, claimed_epsilon, delta: float):
    """(stats, {statistic: family.ScoreModel}, facts) for a PipelineProbe's transcript: read through the run's
    family (the standardised steps, family.py) where it is the run's: its member canaries' sampler audit passed
    at the rate the run is accounted with, Gaussian noise, and steps that are independent releases (lag-1
    correlation at most INDEPENDENT: a memoryless optimizer, such as SGD without momentum). Then the likelihood
    ratio at the claim's sigma joins the statistics. Otherwise today's Gaussian reading, and the facts say why."""
    why, correlation = None, facts["steps' lag-1 correlation"]
    if sampler is None:
        why = "the batches were not logged and tested (observe(batch=) and the sample rate)"
    elif not sampler.poisson_accounting_valid:
        why = "the canaries' sampler audit failed"
    elif (mechanism or "gaussian") != "gaussian":
        why = f"{mechanism} noise"
    elif abs(correlation) > INDEPENDENT:
        why = (f"its steps are correlated (lag 1: {correlation:.3f} > {INDEPENDENT}: momentum or "
               "Adam, so a step's movement is not that step's release)")
    if why is not None:
        return stats, {}, {**facts, "run's family": f"not read through it: {why}; the Gaussian reading"}
    rate, steps = float(sampler.sample_rate), int(facts["steps"])
    pull = claim_pull(claimed_epsilon, delta, rate, steps)
    if pull is not None:
        stats = _pipeline_scores(rows, rate, pull)[0]
    read = f"Poisson-subsampled Gaussian at p = {rate:.4g} (the sampler audit's), T = {steps}, steps standardised by " \
           "their noise"
    return stats, pipeline_models(rate, steps, pull), {**facts, "run's family": read}


def _robust_cut(values: np.ndarray) -> tuple[float, float]:
    centre = float(np.median(values))
    return centre, ROBUST_CUT * 1.4826 * float(np.median(np.abs(values - centre)))


def public_noise(seeds: np.ndarray, kind: str, scale: float) -> np.ndarray:
    """The noise each step's public seed would give (what a trainer that misuses it adds)."""

    draw = noise(kind).draw
    return np.array([draw(np.random.default_rng(int(s)), scale) for s in seeds])


def _outside_without_releases(run_dir: Path) -> None:
    """A probe folder with no release whose health check saw the model trained outside DP (the DP optimizer never
    stepped, yet tensors moved): VIOLATION (``PrivacyViolation``), never the refusal of an empty transcript."""

    try:
        health = run_record.read_health(run_dir)
    except (DPAuditError, OSError):
        return
    outside = [tensor for kind, tensor, _ in (health.findings if health is not None else ()) if kind in OUTSIDE_DP]
    if outside:
        raise PrivacyViolation(f"VIOLATION: the DP optimizer released no step ({run_dir}), yet {len(outside)} "
                               f"trainable tensors moved outside it (no clipping, no noise): {', '.join(outside[:3])}; "
                               f"health: {run_dir / HEALTH}")


def _transcript_rows(run_dir: Path, m: int) -> np.ndarray:
    """A transcript of m floats a step (gradient probes and trainers, pipeline probes), memory-mapped: (steps, m)."""

    path = run_dir / TRANSCRIPT
    size = path.stat().st_size if path.is_file() else 0
    if size % (4 * m):
        raise DPAuditError(f"{path} is truncated")
    if size == 0:
        _outside_without_releases(run_dir)
        raise DPAuditError(f"{run_dir} has no released steps to audit")
    return np.memmap(path, dtype="<f4", mode="r", shape=(size // (4 * m), m))


def transcript_scores(run_dir: Path, meta: Released | None = None
                      ) -> tuple[dict[str, np.ndarray], np.ndarray, str, dict]:
    """({statistic: scores}, members, score name, facts) for a white-box run folder (``meta``: what
    ``Released.of`` read of it, when the caller has read it)."""

    run_dir = Path(run_dir)
    meta = meta if meta is not None else Released.of(run_dir)
    canaries = WhiteBoxCanaries.load(run_dir)
    release = meta.release
    clip = None
    if release != "pipeline-rows":
        if meta.clip is None:
            raise DPAuditError(f"{run_dir}: its run does not say its clip norm C; refusing to audit it")
        clip = float(meta.clip)
    probe = meta.probe
    if probe is not None:
        if canaries.run_id != probe.run_id or canaries.m != probe.m:
            raise DPAuditError(f"{run_dir}: the canary manifest and probe.json come from different probe runs")
    rate = _poisson_rate(meta)
    strategy = _bandmf(meta)
    scale = None
    if release == "pipeline-rows":  # a PipelineProbe: each step's movement of the canaries' own rows
        rows = _transcript_rows(run_dir, canaries.m)
        (stats, correlation), name = _pipeline_scores(rows), "white-box-pipeline"
        steps = len(rows)
    elif release == "scalar-sums":  # a probe of scalar releases: one noisy sum a step
        sums = np.fromfile(run_dir / TRANSCRIPT, dtype="<f4").astype(float) if (run_dir / TRANSCRIPT).is_file() \
            else np.zeros(0)
        steps = len(sums)
        signs = np.stack([step_signs(canaries.seed, t, canaries.m) for t in range(steps)]) if steps else None
        stats = {"correlation": signs.T @ sums / clip} if steps else {}
        if steps:
            stats, scale = _scalar_likelihood(stats, signs, sums / clip, rate)
        name = "white-box-dp-zo"
    elif release == "gradient-transcript" and strategy is not None:  # correlated noise: read along C
        rows = _transcript_rows(run_dir, canaries.m)
        stats, scale, steps = _bandmf_scores(rows, canaries, clip, rate, strategy, len(rows))
        name = "white-box-dp-sgd"
    elif release == "gradient-transcript":
        rows = _transcript_rows(run_dir, canaries.m)
        (stats, scale), name = _alignment_scores(rows, canaries, clip, rate), "white-box-dp-sgd"
        steps = len(rows)
    elif release == "zo-log":
        seeds, scalars = run_folder.zo_log(run_dir)
        steps = len(scalars)
        settings = meta.record.settings
        batch = float(meta.record.expected_batch_size or settings.batch_size)
        sums = scalars * 2 * settings.phi * batch
        signs = np.stack([step_signs(canaries.seed, t, canaries.m) for t in range(steps)])
        stats = {"correlation": signs.T @ sums / clip}
        sigma = meta.record.sigma
        if sigma:
            known = public_noise(seeds, settings.mechanism, clip * sigma)
            stats["correlation, public-seed noise removed"] = signs.T @ (sums - known) / clip
        if settings.mechanism == "gaussian":
            stats, scale = _scalar_likelihood(stats, signs, sums / clip, rate)
        name = "white-box-dp-zo"
    else:
        raise DPAuditError(f"{run_dir}: its method releases nothing a white-box audit reads (only the final model)")
    if steps == 0:
        raise DPAuditError(f"{run_dir} has no released steps to audit")
    facts = {"steps": steps, "white-box canaries": canaries.m}
    if release == "pipeline-rows":
        facts["steps' lag-1 correlation"] = round(correlation, 4)
    if BANDMF in stats:
        facts["BandMF"] = f"{strategy.spec()}: {steps} whole rounds read along the strategy's columns"
    if scale is not None and (LIKELIHOOD in stats or BANDMF in stats):
        facts["likelihood-ratio scale (x C)"] = scale
    return stats, canaries.members, name, facts if release == "pipeline-rows" else {**facts, "canary gain (x C)": canaries.gain}


def _bandmf(meta: Released):
    """A bundled run's BandMF strategy (config noise:), or None."""

    noise = meta.record.settings.noise if meta.record is not None else None
    strategy = parse(noise) if noise is not None else None
    return strategy if strategy is not None and strategy.family == "bandmf" else None


def _bandmf_scores(rows, canaries, clip: float, rate, strategy, steps: int):
    """A BandMF run's canary releases read along the strategy's columns (correlated.py): each canary's independent
    round views, scored by the family's likelihood ratio at (p b, R) at their robust scale. Canary i is in group
    i mod b (the trainer's cyclic batches put it there). Returns (stats, scale, R)."""

    budget.current().require(4 * 8 * steps * canaries.m, "the BandMF white-box audit")
    b = strategy.bands
    signs = np.stack([step_signs(canaries.seed, t, canaries.m) for t in range(steps)])
    views = correlated.round_view(np.asarray(rows, float), signs, banded_coefs(steps, b), np.arange(canaries.m) % b,
                                  clip)
    if views.shape[0] == 0:
        raise DPAuditError(f"a BandMF run of {steps} steps with b = {b} has no whole round to audit (T >= 2b - 1)")
    model, scores = correlated.scored(views, min(1.0, rate * b) if rate else 1.0)
    return {BANDMF: scores}, model.scale, model.steps


BANDMF = "BandMF round views, likelihood ratio"


def _poisson_rate(meta: Released) -> float | None:
    """The rate p < 1 at which the run Poisson-samples its white-box canaries: a probe's own (it samples them), a
    bundled run's (white-box runs are Poisson only); None where the folder does not say it, or at p = 1, where the
    family is G_mu itself (the gaussian bound reads it exactly) and the likelihood ratio is affine in x."""
    if meta.probe is not None:
        rate = meta.probe.sample_rate
    elif meta.record.settings.sampling == "poisson":   # the only runs the bundled trainers plant canaries in
        rate = meta.record.sampling_rate
    else:
        return None
    return float(rate) if rate is not None and 0 < rate < 1 else None


def _scalar_likelihood(stats: dict, signs: np.ndarray, x: np.ndarray, rate: float | None):
    """A scalar release's likelihood-ratio statistic (each canary's signed view of the step's sum, in units of C),
    at the sums' robust scale; (stats, scale), the stats unchanged without a rate."""

    centre = float(np.median(x))
    scale = 1.4826 * float(np.median(np.abs(x - centre)))
    if rate is None or not scale > 0:
        return stats, None
    return {**stats, LIKELIHOOD: likelihood_ratio_step(signs * x[:, None], rate, scale).sum(0)}, scale


def score_models(meta: Released, stats: dict, facts: dict) -> dict:
    """{statistic: family.ScoreModel} for the statistics the gaussian-run bound can read: the linear ones and the
    likelihood ratio, in a Gaussian run whose canaries are Poisson-sampled at a known rate p < 1 (not the robust
    statistic, whose cut depends on the transcript; a pipeline probe's steps are standardised: _pipeline_family)."""

    rate = _poisson_rate(meta)
    if rate is None or (meta.mechanism or "gaussian") != "gaussian" or meta.release == "pipeline-rows":
        return {}
    steps = int(facts["steps"])
    scale = facts.get("likelihood-ratio scale (x C)")
    strategy = _bandmf(meta)
    if strategy is not None:   # the family at (p b, R rounds): correlated.py
        return {BANDMF: family.likelihood_ratio(min(1.0, rate * strategy.bands), steps, scale)} if scale else {}
    models = {}
    for key in stats:
        if key == LIKELIHOOD and scale:
            models[key] = family.likelihood_ratio(rate, steps, scale)
        elif key in ("alignment", "correlation", "correlation, public-seed noise removed"):
            models[key] = family.linear(rate, steps, scale or 1.0)
    return models


def _run_ceiling(meta: Released, steps: int, claimed_epsilon, delta: float):
    """The claim's ceiling from the run's own mechanism (its white-box canaries are sampled like any example), when
    the run folder says it (sigma, Poisson rate, mechanism) and delta > 0; else None (the claim's region)."""
    if meta.record is None or claimed_epsilon is None or not delta:
        return None
    sigma, rate, kind = meta.record.sigma, meta.record.sampling_rate, meta.mechanism
    if not sigma or not rate:
        return None
    strategy = _bandmf(meta)
    if strategy is not None:   # ``steps`` are the rounds, each at rate p b (correlated.py)
        rate = min(1.0, float(rate) * strategy.bands)

    try:
        mech = Mechanism(kind, float(sigma), float(rate), int(steps))
    except (DPAuditError, TypeError, ValueError):
        return None  # a folder this does not describe: the claim's region
    return run_ceiling(mech, delta, claimed_epsilon)


CANARY_BATCHES = "canary_batches.jsonl"  # a PipelineProbe's log: the canaries in each step's batch (0600)


def canary_sampler_audit(run_dir: Path, members: np.ndarray, sample_rate: float, alpha: float):
    """The sampler audit of the member canaries' inclusions in a PipelineProbe's batch log: each member must be in
    each step independently at the accounted rate (audit/sampler.py, with the members as the dataset)."""

    index = {int(i): k for k, i in enumerate(np.flatnonzero(members))}
    batches = []
    with open(Path(run_dir) / CANARY_BATCHES, encoding="utf-8") as fh:
        for line in fh:
            try:
                present = [int(i) for i in json.loads(line)]
            except (ValueError, TypeError):
                raise DPAuditError(f"{Path(run_dir) / CANARY_BATCHES} is not as a probe writes it") from None
            if any(i not in index for i in present):  # a non-member's text was trained on
                raise DPAuditError("a canary that was never inserted was in a batch: the texts the loop trained on are "
                                   "not the ones insert() returned")
            batches.append([index[i] for i in present])
    return analyse_batches(batches, dataset_size=len(index), sample_rate=sample_rate, alpha=alpha)


def _noise_check(run_dir: Path, spec: ProbeRecord, alpha: float):
    """A gradient probe's per-tensor noise check (noise_check.py), or None where the probe does not say the accounted
    noise multiplier (or says 0: nothing to check) or the shapes of the tensors its canaries sit on."""

    sigma, shapes = spec.noise_multiplier, spec.parameter_shapes
    if not sigma or shapes is None:
        return None
    sizes = np.array([int(np.prod(s, dtype=np.int64)) for s in shapes], np.int64)
    names = spec.parameter_names
    if names is None or len(names) != len(shapes):
        names = [f"parameter {k} {tuple(s)}" for k, s in enumerate(shapes)]
    canaries = WhiteBoxCanaries.load(run_dir)
    coords = np.asarray(canaries.coordinates, np.int64)
    if coords.size != canaries.m or (coords.size and (coords.min() < 0 or coords.max() >= sizes.sum())):
        raise DPAuditError(f"{run_dir}: the canaries' coordinates are not inside the probed parameters")
    tensor_of = np.searchsorted(np.cumsum(sizes), coords, side="right")
    rows = _transcript_rows(run_dir, canaries.m)
    tally = noise_check.read_tally(run_dir, spec.run_id)
    if tally is not None and tally["sizes"] != sizes.tolist():
        raise DPAuditError(f"{run_dir}: {noise_check.TALLY} was written for other parameters than probe.json's")
    dtypes = spec.parameter_dtypes
    skipped = {k for k, d in enumerate(dtypes) if d not in ("float32", "float64")} \
        if dtypes is not None and len(dtypes) == len(shapes) else set()
    return noise_check.check(rows, tensor_of, list(names), sigma * spec.clip, alpha, tally, skipped)


def audit_run_folder(run_dir: Path, *, claimed_epsilon: float | None, delta: float, alpha: float = 0.05,
                     headline: str = "auto", sample_rate: float | None = None):
    """The white-box audit of a run folder: (AuditResult of the chosen statistic, scores, members, facts).
    With several statistics each gets alpha / their number, and the larger headline is kept. A PipelineProbe's
    folder with a batch log, given ``sample_rate`` (the rate the run is accounted with): half of alpha goes to the
    sampler audit of its member canaries (``AuditResult.sampler``), half to the statistics."""

    meta = Released.of(Path(run_dir))  # read once
    stats, members, name, facts = transcript_scores(run_dir, meta)
    clipping = None
    spec = meta.probe
    if spec is not None:
        tally = read_tally(run_dir, spec.run_id)
        if tally is not None:  # the canaries entered as examples: the per-example clipping check pays alpha x share
            clipping = check(tally, alpha * CLIP_SHARE)
            alpha = alpha * (1 - CLIP_SHARE)
            facts = {**facts, "per-example clipping check": f"at alpha {clipping.alpha:g} (the rest at {alpha:g})"}
    noise = None
    if spec is not None and spec.kind == "gradient":
        noise = _noise_check(Path(run_dir), spec, alpha * NOISE_SHARE)
        if noise is not None:  # the per-tensor noise check pays alpha x its share
            alpha = alpha - noise.alpha
            facts = {**facts, "per-tensor noise check": f"at alpha {noise.alpha:g} (the rest at {alpha:g})"}
        else:
            facts = {**facts, "per-tensor noise check": "not made: the probe does not know the accounted noise "
                                                        "(attach to an Opacus optimizer, or give noise_multiplier=)"}
    logged = meta.release == "pipeline-rows" and (Path(run_dir) / CANARY_BATCHES).is_file()
    sampler = None
    if logged and sample_rate is not None:
        sampler = canary_sampler_audit(run_dir, members, sample_rate, alpha / 2)
        facts = {**facts, "canaries' sampler audit": f"at alpha {alpha / 2:g} (the bounds at the other half)"}
    elif logged:
        facts = {**facts, "canaries' sampler audit": "not made: the batches were logged; give the sample rate the "
                                                      "run is accounted with to test them"}
    mechanism = meta.mechanism
    ceiling = _run_ceiling(meta, facts["steps"], claimed_epsilon, delta)
    if meta.release == "pipeline-rows":
        stats, models, facts = _pipeline_family(_transcript_rows(Path(run_dir), len(members)), sampler, stats, facts,
                                                mechanism, claimed_epsilon, delta)
    else:
        models = score_models(meta, stats, facts)
    if headline == "gaussian-run":  # asked for by name: the statistics it can read
        stats = {k: v for k, v in stats.items() if k in models} or stats
    share = (alpha / 2 if sampler is not None else alpha) / len(stats)
    results = {k: analyse(v, members, claimed_epsilon=claimed_epsilon, delta=delta, alpha=share, score=name,
                          mechanism=mechanism,
                          headline=headline, ceiling=ceiling, model=models.get(k)) for k, v in stats.items()}
    best = max(results, key=lambda k: results[k].epsilon_lower_bound)
    facts = {**facts, "statistic": best, "statistics tried": len(stats),
             "alpha per statistic": share,
             "other statistics": {k: r.epsilon_lower_bound for k, r in results.items() if k != best}}
    result = results[best]
    result.alpha = alpha + sum(c.alpha for c in (clipping, noise) if c is not None)  # the family-wise level; each
    result.sampler = sampler                                                         # bound inside at its share
    result.clipping, result.noise = clipping, noise
    if spec is not None:
        result.rate = RateCheck.from_spec(spec)
    unprotected = spec.unprotected_parameters if spec is not None else ()
    result.unprotected = tuple(str(n) for n in unprotected)
    return result, stats[best], members, facts
