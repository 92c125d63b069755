"""`dpaudit audit run`: canaries -> insert -> extend the model -> train privately -> score -> report.

Everything lands in one output folder: base_model/ (the embedded default, when no model is given),
canaries.json, train_data.jsonl, extended_model/ (the base plus the canaries' tokens: config and tokenizer, no
weights of its own; models/extension.py), run/ (ledger, logs, checkpoint, model) and report/.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
import hashlib
import statistics
import sys

import torch
from scipy.stats import norm

from dpaudit.audit.claims import held_claim
from dpaudit.canaries.manifest import NEW_TOKEN_PREFIX, load_manifest
from dpaudit.core.atomic import atomic_write_json, atomic_write_text
from dpaudit.audit.analysis import AuditResult, analyse
from dpaudit.audit.report import prepare_folder, write_report
from dpaudit.core.lock import folder_lock, remove_folder
from dpaudit.training.runner import TrainConfig, TrainResult, privacy_plan, train
from dpaudit.accounting.mechanism import Mechanism
from dpaudit.accounting.noises import noise
from dpaudit.audit.ceiling import run_ceiling
from dpaudit.audit.gdp import mu_from_epsilon
from dpaudit.audit.power import power_note
from dpaudit.audit.whitebox import audit_run_folder
from dpaudit.canaries.generate import make_canaries, redraw_membership, shared_prefix
from dpaudit.canaries.hf import extend_model
from dpaudit.canaries.insert import insert_canaries
from dpaudit.core.errors import DPAuditError
from dpaudit.core.run_folder import read_json
from dpaudit.core.texts import detect_format, read_texts
from dpaudit.models.corpus import sentences
from dpaudit.models.embedded import build_embedded_default, is_embedded
from dpaudit.models.extension import files_stamp, save_extension
from dpaudit.models.hf import resolve_model_path
from dpaudit.models.loading import load_causal_lm
from dpaudit.training.methods import METHODS
from dpaudit.training.preflight import StepCheck, check_model
from dpaudit.workflows.scoring import score_checkpoint, score_for


@dataclass(frozen=True)
class BlackBoxRecipe:
    """What a black-box DP-SGD audit run trains when the user does not say, chosen for exposure: the claim is the
    same whatever trains, so the run may make the final model show as much of each canary as it can.

    On the embedded default: only the canaries' own rows train (``new-tokens``: each member's whole clipped
    gradient lands on its row, along the hidden state of its prefix, which the frozen body keeps fixed), in full
    batches (p = 1: the claim is mu-GDP, and a member is in every step), for 3 steps of plain SGD at a rate
    that keeps each secret's logit within about 0.1 nats of linear in the releases. The secret's logit is then
    the sum of every release along its row's direction, and the loss drop from the base model (``loss-vs-base``:
    the rows start equal, so the base loss is the prefix's difficulty alone) reads it. Measured (seeds 1-3,
    claimed eps 4, m = 1000, secret membership): headline median 1.750, where the recipe before gave 0.400.
    A pretrained model takes the same recipe at the rate that moves each secret's logit as far a step as lr 5 does
    on the embedded default (``sgd_exposure``: its hidden states are longer, 46 against 10.3 on
    SmolLM2-135M), micro-batched to fit the memory. Measured on SmolLM2-135M-Instruct (claimed eps 4, m = 1000,
    seeds 1-3): headline median 1.252 and AUC 0.716 in 6 minutes a run, where its recipe before (the embedding
    rows, Poisson batches of 64, AdamW at the pretrained rate, T = 300) gave 0.079 and 0.491 in 46 minutes."""
    trainable: str
    batch_size: int
    steps: int | None = None      # None: the method's default
    optimizer: str = "adamw"
    lr: float | None = None       # None: the method's default for the model and subset, or from the model (below)
    logit_step: float | None = None  # DP-SGD, the rate from the model: a member raises its secret's logit this much
    logit_noise: float | None = None  # DP-ZO, the rate and phi from the model (``zo_exposure``)
    examples: int = 1000          # synthetic examples when no data is given
    body_drift: float | None = None  # DP-SGD where the user trains the body too: canaries behind one shared prefix
    #                                  and, without --lr, the rate from the model (``drift_rate``)


# Where the user trains the body too (full, LoRA or the embeddings: subsets that train the canaries' rows as well),
# every canary has one shared prefix and its new row starts at the base's expected output row after it
# (canaries/hf.expected_row), so a canary's clipped gradient starts on its own row, not on the shared body. The rate
# (unless given) then keeps the body near where it started: the noise's random walk moves each weight by BODY_DRIFT
# of the base's typical weight over the run (``drift_rate``; LoRA's adapters move the body less than that), so each
# canary's hidden state, along which its row learns, stays put. The user's whole-model AdamW recipe on the embedded
# default (B 64, T 300, claimed eps 4, m 1000; benchmarks/user_recipe.py, secret seeds 1-5): median bound 0.969 (96 %
# of a perfect canary's 1.014) at this rate (1.9e-4), where random prefixes with zero rows at lr 1e-2 read 0.263.
# With the shared prefix at lr 1e-2 seeds 1-2 read 0.145 and 0.0: the noise walks each weight 0.17 over the run,
# three times its size, so the hidden state a row learned along is gone by the end.
BODY_DRIFT = 1 / 16
BODY_SUBSETS = ("full", "lora", "embeddings")   # they train the canaries' rows too (training/trainable.py)

EMBEDDED_RECIPE = BlackBoxRecipe("new-tokens", batch_size=0, steps=3, optimizer="sgd", lr=5.0, body_drift=BODY_DRIFT)
# lr 5 on the embedded default is a logit step of 5 x C x |h| / N = 5 x 1 x 10.3 / ~1500 = 0.034 nats (sgd_exposure)
PRETRAINED_RECIPE = BlackBoxRecipe("new-tokens", batch_size=0, steps=3, optimizer="sgd", logit_step=0.034,
                                   body_drift=BODY_DRIFT)
# DP-ZO: all members share one released scalar a step, so each step adds the other members' clipped differences to a
# member's noise (white_box_canaries, below): a member's logit separates by about sqrt(2/pi) mu / sqrt(1 + M mu^2 / T)
# with M members. Steps drown them out (at eps 4: 0.48 predicted at T 300, 0.69 at T 3000); only the canaries' rows
# train, so the other examples only cost forwards (100 of them), and each step's losses come from one forward's trunk
# outputs (training/frozen_trunk.py: T 3000 on the embedded default in about 2 minutes on 2 cores).
ZERO_ORDER_RECIPE = BlackBoxRecipe("new-tokens", batch_size=0, steps=3000, logit_noise=1.5, examples=100)
OTHER_RECIPE = BlackBoxRecipe("full", batch_size=0, examples=64)  # white-box runs: full batches of 64 examples
# White-box DP-SGD on the embedded default: AdamW at the method's 5e-3 random-walks the weights under the noise of a
# small claim (eps 1: the loss rose 0.73 -> 5.3 over 300 steps, and the run read "training diverged"). The audit
# reads the releases on the canaries' own coordinates, so the rate does not move it: secret seed 1 read 0.5862 at
# both 5e-3 and 5e-4 (AUC 0.5616); at 5e-4 the loss does not rise.
WHITE_BOX_SGD_RECIPE = BlackBoxRecipe("full", batch_size=0, lr=5e-4, examples=64)


def black_box_recipe(per_example_gradients: bool, white_box: bool, pretrained: bool) -> BlackBoxRecipe:
    """The defaults of an audit run: the recipes above for a black-box run; full training for a white-box one."""
    if white_box:
        return WHITE_BOX_SGD_RECIPE if per_example_gradients and not pretrained else OTHER_RECIPE
    if not per_example_gradients:
        return ZERO_ORDER_RECIPE
    return PRETRAINED_RECIPE if pretrained else EMBEDDED_RECIPE


@dataclass(frozen=True)
class ResolvedRecipe:
    """An audit run's training choices: the user's where given, else the recipe's (``resolve_recipe``)."""
    batch_size: int
    examples: int
    trainable: str
    optimizer: str
    steps: int | None
    lr: float | None
    logit_step: float | None     # set: the DP-SGD rate comes from the extended model (``sgd_exposure``)
    logit_noise: float | None    # set: the DP-ZO rate (and phi, unless given) come from it (``zo_exposure``)
    phi: float
    phi_from_model: bool
    shared_prefix: bool = False  # canaries behind one shared prefix, rows at the expected row (``BODY_DRIFT``)
    body_drift: float | None = None  # set: the rate comes from the model's weights (``drift_rate``)


def resolve_recipe(recipe: BlackBoxRecipe, *, batch_size: int | None = None, examples: int | None = None,
                   trainable: str | None = None, optimizer: str | None = None, steps: int | None = None,
                   lr: float | None = None, phi: float | None = None) -> ResolvedRecipe:
    """What an audit run trains: each choice the user gave (not None), the recipe's for the rest. The recipe's rate
    fits its own subset and optimizer only, so a user's other subset or optimizer takes the method's default rate,
    except where a DP-SGD run trains the body (``BODY_SUBSETS``: the canaries behind one shared prefix, the rate
    from the model, ``BODY_DRIFT``); phi from the model only where the recipe reads it and the user gave none."""
    trainable = trainable or recipe.trainable
    optimizer = optimizer or recipe.optimizer
    logit_step = logit_noise = body_drift = None
    shared = recipe.body_drift is not None and trainable in BODY_SUBSETS
    if lr is None and trainable == recipe.trainable and optimizer == recipe.optimizer:
        lr, logit_step, logit_noise = recipe.lr, recipe.logit_step, recipe.logit_noise
    elif lr is None and shared:
        body_drift = recipe.body_drift
    return ResolvedRecipe(
        batch_size=recipe.batch_size if batch_size is None else batch_size,
        examples=recipe.examples if examples is None else examples, trainable=trainable, optimizer=optimizer,
        steps=recipe.steps if steps is None else steps, lr=lr, logit_step=logit_step, logit_noise=logit_noise,
        phi=1e-3 if phi is None else phi, phi_from_model=phi is None and logit_noise is not None,
        shared_prefix=shared, body_drift=body_drift)


USER_HELD_OUT = 4  # held-out records of a black-box canary user by default: the user-inference score averages them


@dataclass
class AuditRunSettings:
    canaries: int = 500
    repeats: int = 1              # copies of each member canary; with held_out, records of each canary user
    held_out: int = 0             # > 0: canary users (``repeats`` records with distinct prefixes, one secret) and this
    #                               many held-out records each, scored by user inference beside the per-record score
    examples: int = 1000          # synthetic examples when no dataset is given
    seed: int = 0
    prefix_length: int = NEW_TOKEN_PREFIX
    alpha: float = 0.05
    logit_step: float | None = None  # set: the DP-SGD rate comes from the extended model (``sgd_exposure``)
    logit_noise: float | None = None  # set: the DP-ZO rate and phi come from the extended model (``zo_exposure``)
    phi_from_model: bool = False      # DP-ZO's phi too (the user did not set one)
    shared_prefix: bool = False       # every canary behind one prefix, its row at the expected row (``BODY_DRIFT``)
    body_drift: float | None = None   # set: the rate comes from the model's weights (``drift_rate``)

    @property
    def fitted(self) -> bool:
        """The recipe reads the model (its rate, and the micro batch unless given: ``_fitted_to_the_model``)."""
        return self.logit_step is not None or self.logit_noise is not None or self.body_drift is not None


def sgd_exposure(h: float, examples: int, clip: float, logit_step: float) -> float:
    """The plain-SGD rate at which one member's clipped gradient raises its secret's logit by ``logit_step`` nats a
    step, for new-token canaries in full batches. The member's gradient lies on its own new row, along h, the final
    hidden state at its prefix (|h|: ``prefix_hidden_norm``), so clipped it is C h / |h|; DP-SGD divides the noisy
    sum by the expected batch, N at p = 1; the logit h . w then moves by lr C |h| / N. So lr = logit_step N / (C |h|).
    Any rate keeps the claim; this one keeps the logit near linear in the releases (5 on the embedded
    default, whose |h| is 10.3)."""
    return logit_step * examples / (clip * h)


def zo_exposure(h: float, examples: int, rate: float, members: float, clip: float, noise_std: float, steps: int,
                logit_noise: float, phi: float | None = None) -> tuple[float, float]:
    """(lr, phi) of a DP-ZO run on new-token rows. A step moves row i by -lr s z_i, s = (clipped sum + noise) / (2 phi
    B), so the secret's logit h . w_i moves by -lr s (z_i . h), z_i . h ~ N(0, |h|^2). phi = 2 C / |h| (unless
    given): a member's own difference, 2 phi (1 - q) z_i . h (q: the secret's probability), then reaches the clip C
    unless |N(0, 1)| < 1/4, and the other new rows' logits move by about 2 C nats (0.1 at DP-ZO's default C). The
    clipped sum has the noise's variance and about C^2 for each member in the batch (p M of them; each difference
    is +-C, independent of row i's), so over T steps the logit's spread is lr |h| C sqrt(T (sigma_noise^2 + p M)) /
    (2 phi p N); lr sets it to ``logit_noise`` nats, where the loss of a rare secret stays linear in its logit.
    ``noise_std``: the noise's standard deviation over C. On the embedded default (|h| 10.3, N 597, C 0.05, T 300,
    sigma 18.7 at eps 4, M 497): phi 0.0097, lr 0.067."""
    phi = 2 * clip / h if phi is None else phi
    spread = h * clip * math.sqrt(steps * max(noise_std ** 2 + rate * members, 1.0))  # at least one C^2 a step
    return logit_noise * 2 * phi * rate * examples / spread, phi


def drift_rate(scale: float, steps: int, drift: float, step_noise: float) -> float:
    """The rate at which the noise's random walk moves each trained weight by ``drift`` x ``scale`` over ``steps``
    steps (``scale``: ``weight_scale``). Where the noise outweighs each coordinate's gradient, a step moves a weight
    by lr x ``step_noise`` in standard deviation: 1 for AdamW (it divides each coordinate by its running scale, the
    noise's own), the noise's standard deviation over the expected batch for SGD (sigma C / B); over T steps the walk
    reaches lr x ``step_noise`` x sqrt(T) (AdamW's momentum averages the steps, keeping their sum). So
    lr = drift x scale / (step_noise sqrt(T)). Any rate keeps the claim."""
    return drift * scale / (step_noise * math.sqrt(steps))


def weight_scale(model) -> float:
    """The median root mean square of the model's weight matrices (2-D tensors, the embeddings included)."""
    return statistics.median(float(p.detach().float().pow(2).mean().sqrt())
                             for p in model.parameters() if p.dim() == 2)


def prefix_hidden_norm(model, tokenizer, manifest) -> float:
    """|h|: the median norm of the final hidden state at (up to) 64 canaries' prefixes."""

    norms = []
    model.eval()
    with torch.no_grad():
        for c in manifest.canaries[:64]:
            ids = tokenizer(c.prefix, return_tensors="pt")["input_ids"].to(model.device)
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
            norms.append(float(hidden[0, -1].float().norm()))
    return statistics.median(norms)


GRADIENT_CANARIES = 5000      # white-box DP-SGD's default m (white_box_canaries)
TRANSCRIPT_BYTES = 256 << 20  # ... held to a transcript of this size where T is long


def white_box_canaries(cfg: TrainConfig, alpha: float = 0.05) -> int:
    """How many white-box canaries to plant.

    DP-SGD: each canary on its own coordinate, so canaries never interfere and more only sharpens the bound (the
    standard error of mu is about 2 / sqrt(m)): ``GRADIENT_CANARIES`` (5000), fewer where the transcript (m float32 a
    step) would pass ``TRANSCRIPT_BYTES``, never below 1000. Measured (embedded default, p = 1, T = 300, claimed
    eps 1, secret seeds 1-6): median headline 0.60 at m = 1000, 0.77 at m = 5000, for 25-30 % more wall time.
    DP-ZO: all canaries share one released scalar a step. With full batches (p = 1, the white-box
    default) the mechanism is mu-GDP with mu = sqrt(T) / sigma, so the noise adds T / mu^2 C^2 of variance
    over T steps and the other m/2 member canaries m T / 2 C^2 more: a member's score separates by
    mu / sqrt(1 + m mu^2 / (2 T)), estimated from m scores with standard error about 2 / sqrt(m). We take
    the m on a grid that maximises mu / sqrt(1 + m mu^2 / (2 T)) - 2 z_alpha / sqrt(m), with mu the claim's.
    """

    if METHODS[cfg.method].canaries == "gradient":
        return max(1000, min(GRADIENT_CANARIES, TRANSCRIPT_BYTES // (4 * max(1, cfg.steps))))

    if cfg.sigma is not None:
        mu = math.sqrt(cfg.steps) / cfg.sigma
    elif math.isfinite(cfg.target_epsilon) and cfg.delta > 0:
        mu = mu_from_epsilon(cfg.target_epsilon, cfg.delta)
    else:
        return 500
    z = float(norm.isf(alpha))
    grid = [50, 100, 200, 300, 400, 500, 700, 1000, 1500, 2000, 3000, 5000]
    return max(grid, key=lambda m: mu / math.sqrt(1 + m * mu * mu / (2 * cfg.steps)) - 2 * z / math.sqrt(m))


def embedded_default(folder: Path, seed: int = 0) -> Path:
    """Build the embedded default model once into ``folder`` (reused when already there)."""

    if is_embedded(folder):
        return folder
    return build_embedded_default(folder, seed=seed)


def run_audit(out: Path, cfg: TrainConfig, settings: AuditRunSettings, *, force: bool = False,
              **kwargs) -> tuple[AuditResult, TrainResult, dict]:
    """The whole audit in ``out`` (a non-empty folder only with --force, and only one dpaudit made), holding
    the folder's lock so a second run into the same folder is refused."""

    # The model's pre-flight, once, before the folder exists (its check goes on to train, grown by the canaries'
    # rows); where the recipe sets the micro batch (_fitted_to_the_model), only a step it cannot make fit (one
    # example at a time) is refused here. The embedded default is checked once built (in the folder).
    step = check_model(kwargs["model"], cfg) if kwargs.get("model") is not None else None
    if step is not None:
        fits = settings.fitted and not cfg.micro_batch
        step.estimate(dataclasses.replace(cfg, micro_batch=1) if fits else cfg, settings.examples, warn=False)
    out = prepare_folder(out, force)
    with folder_lock(out):
        return _run_audit(out, cfg, settings, step=step, **kwargs)


def _run_audit(out: Path, cfg: TrainConfig, settings: AuditRunSettings, *, model: Path | None = None,
               data: Path | None = None, data_format: str | None = None, field: str = "text",
               show_progress: bool = True, step: StepCheck | None = None) -> tuple[AuditResult, TrainResult, dict]:

    base = model if model is not None else embedded_default(out / "base_model", settings.seed)
    step = step or check_model(base, cfg)  # the embedded default's, once it is built
    power = _power_note(cfg, settings, cfg.white_box or settings.canaries)
    if cfg.white_box:
        return _white_box(out, cfg, settings, base, data, data_format, field, show_progress, power, step)
    stamp = _extension_stamp(base, settings)
    manifest = _reusable_canaries(out, stamp)
    lm = tok = None
    if manifest is None:  # made and extended again: the stamp goes first, so a crash leaves nothing to reuse
        (out / REUSE_STAMP).unlink(missing_ok=True)
        lm, tok = load_causal_lm(base)
        users = dict(records=settings.repeats, held_out=settings.held_out) if settings.held_out else {}
        template = shared_prefix(tok, settings.seed) if settings.shared_prefix else None
        manifest = make_canaries(tok, settings.canaries, seed=settings.seed, prefix_length=settings.prefix_length,
                                 template=template, name_or_path=str(base), membership_seed=cfg.secret_seed, **users)
    else:  # the same secrets and extended model; membership is drawn afresh for every run (canaries/generate.py)
        manifest = redraw_membership(manifest, cfg.secret_seed)
    manifest.save(out / "canaries.json")
    if settings.shared_prefix:
        power = {**power, "canary prefix": f"one shared prefix ({manifest.canaries[0].prefix[:20]!r}), each "
                                           "secret's row starting at the base's expected row after it: the body "
                                           "trains, and each canary's gradient starts on its own row"}
    if data is None:
        data = out / "public_data.jsonl"
        atomic_write_text(data, "".join(json.dumps({"text": s}) + "\n"
                                        for s in sentences(settings.examples, seed=settings.seed + 1)))
        data_format, field = "jsonl", "text"
    fmt = detect_format(Path(data), data_format)
    train_file = out / f"train_data.{fmt}"
    insert_canaries(manifest, data, train_file, fmt=fmt, field=field,
                    repeats=1 if settings.held_out else settings.repeats, seed=settings.seed, force=True)
    fitted = settings.fitted  # the recipe reads |h|
    if lm is not None:  # the extended model is the base plus zero rows: its folder holds no weights of its own
        extend_model(lm, tok, manifest)
        save_extension(out / EXTENDED, base, lm, tok, list(manifest.secrets))
        made = {"canaries_sha256": _public_key(manifest)}
        if fitted:  # measured while the model is loaded (reloading SmolLM2-135M for it took 3.7 s on 2 CPU cores)
            made[HIDDEN_NORM] = prefix_hidden_norm(lm, tok, manifest)
            made[WEIGHT_SCALE] = weight_scale(lm)
        del lm
        atomic_write_json(out / REUSE_STAMP, {**stamp, **made})
    texts = read_texts(train_file, fmt, field)
    if step is not None:
        step = step.grown(out / EXTENDED).with_texts(texts, cfg.max_length)
    if fitted:
        cfg, why = _fitted_to_the_model(out / EXTENDED, cfg, settings, manifest, texts,
                                        _stamped(out, HIDDEN_NORM), step, _stamped(out, WEIGHT_SCALE))
        power = {**power, **why}
    remove_folder(out / "run")
    result = train(out / EXTENDED, texts, out / "run", cfg, show_progress=show_progress, step=step)
    score = score_for(cfg.trainable)
    scores, members = score_checkpoint(result.model_dir, manifest, score=score, base=out / EXTENDED,
                                       show_progress=show_progress)
    claimed = result.epsilon if math.isfinite(result.epsilon) else None
    # a member canary's copies are one canary user's records: a user-level claim covers up to k of them
    copies = 1 if cfg.privacy_unit.user_level else settings.repeats
    claimed, delta, group = held_claim(claimed, cfg.delta, copies, len(members))
    audited = dict(claimed_epsilon=claimed, delta=delta, mechanism=cfg.mechanism if cfg.private else None,
                   ceiling=_ceiling(cfg, result, claimed, group))
    if settings.held_out:   # two scores, each at alpha / 2 (Bonferroni): the larger bound holds at alpha
        audit, scores, score, beside = _user_audits(result.model_dir, manifest, out / EXTENDED, scores, members,
                                                    score, settings.alpha, audited, show_progress)
    else:
        audit, beside = analyse(scores, members, alpha=settings.alpha, score=score, **audited), {}
    reused = {} if tok is not None else {
        "canaries": "reused with the extended model from an earlier run in this folder (same base model files, "
                    "canary count, seed and prefix length)"}
    if group:
        reused["claim audited"] = group
    return _finish(out, cfg, base, audit, result, scores, members, {**reused, **beside, **power})


def _user_audits(model_dir: Path, manifest, extended: Path, record_scores, members, record_score: str, alpha: float,
                 audited: dict, show_progress: bool):
    """Canary users audited two ways, each at alpha / 2: the per-record score of each user's first record, and user
    inference over its held-out records (Kandpal et al. 2023; ``score_checkpoint``'s "user-inference"). Returns the
    audit with the larger bound (a valid bound at alpha, by the union bound: the choice is paid for), its scores and
    score name, and the other's bound for the report."""

    user_scores, _ = score_checkpoint(model_dir, manifest, score="user-inference", base=extended,
                                      show_progress=show_progress)
    audits = {name: (analyse(s, members, alpha=alpha / 2, score=name, **audited), s)
              for name, s in ((record_score, record_scores), ("user-inference", user_scores))}
    best = max(audits, key=lambda name: audits[name][0].epsilon_lower_bound)
    other = next(name for name in audits if name != best)
    bounds = {f"{name} bound (alpha/2)": round(audits[name][0].epsilon_lower_bound, 4) for name in audits}
    return audits[best][0], audits[best][1], best, {
        **bounds, "bound reported": f"{best}: the larger of the two bounds, each at alpha/2 (the choice is paid "
                                    f"for); {other}'s is beside it"}


def _fitted_to_the_model(extended: Path, cfg: TrainConfig, settings: AuditRunSettings, manifest,
                         texts, h: float | None = None, step: StepCheck | None = None,
                         scale: float | None = None) -> tuple[TrainConfig, dict]:
    """``cfg`` at the recipe's rate for this model (DP-SGD: ``sgd_exposure``, or ``drift_rate`` where the body
    trains; DP-ZO: ``zo_exposure``, phi too unless the user set it) and, unless the user set one, at a micro batch
    that fits the memory (full batches of a pretrained model: 1500 examples of a 135M model are ~45 GB at once).
    Returns the report's lines on it. ``h``, ``scale``: |h| (``prefix_hidden_norm``) and ``weight_scale`` when
    already measured; else the extended model is loaded for them. ``step``: the run's pre-flight check of the
    extended model and ``texts`` (else one is made)."""

    if h is None or scale is None:
        lm, tok = load_causal_lm(extended)
        h, scale = prefix_hidden_norm(lm, tok, manifest), weight_scale(lm)
        del lm
    n = len(texts)
    where = f"|h| = {h:.3g} at the canaries' prefixes, N = {n}, C = {cfg.clip:g}"
    rate = (cfg.batch_size or n) / n
    if settings.body_drift is not None:
        step_noise = 0.0 if not cfg.private else 1.0 if cfg.optimizer == "adamw" else \
            _noise_std(cfg, rate, n) * cfg.clip / (rate * n)
        why = {}  # no noise (the non-private baseline): the method's rate
        if step_noise > 0:
            lr = drift_rate(scale, cfg.steps, settings.body_drift, step_noise)
            why = {"learning rate": f"{lr:.4g}, from the model: the noise walks each weight {settings.body_drift:g} "
                                    f"of the weights' typical size ({scale:.3g}) over {cfg.steps} steps of "
                                    f"{cfg.optimizer}, so the hidden state along which each canary's row learns "
                                    "stays put"}
            cfg = dataclasses.replace(cfg, lr=lr)
    elif settings.logit_step is not None:
        lr = sgd_exposure(h, n, cfg.clip, settings.logit_step)
        why = {"learning rate": f"{lr:.4g}, from the model: a member raises its secret's logit by "
                                f"{settings.logit_step:g} nats a step ({where})"}
        cfg = dataclasses.replace(cfg, lr=lr)
    else:
        noise = _noise_std(cfg, rate, n)
        members = len(manifest.canaries) * manifest.inclusion_probability * settings.repeats
        lr, phi = zo_exposure(h, n, rate, members, cfg.clip, noise, cfg.steps, settings.logit_noise,
                              None if settings.phi_from_model else cfg.phi)
        why = {"learning rate": f"{lr:.4g}, from the model: the noise and the other members move a secret's logit "
                                f"by {settings.logit_noise:g} nats (standard deviation) over the run ({where}, "
                                f"noise {noise:.3g} C, {members:g} members expected)",
               "phi": f"{phi:.4g}" + (", from the model: 2 C / |h|, so a member's own loss difference reaches the "
                                      "clip" if settings.phi_from_model else " (given)")}
        cfg = dataclasses.replace(cfg, lr=lr, phi=phi)
    if not cfg.micro_batch:
        step = step or check_model(extended, cfg)
        if step is not None and step.tokens is None:
            step = step.with_texts(texts, cfg.max_length)
        cfg = dataclasses.replace(cfg, micro_batch=step.micro_batch_that_fits(cfg, n) if step else cfg.micro_batch)
    return cfg, why


def _noise_std(cfg: TrainConfig, rate: float, n: int) -> float:
    """The standard deviation of a step's noise over C, from the sigma train() will use (calibrated the same way;
    at p = 1 a closed form) and the noise's own std_per_sigma; 0 for the non-private baseline."""

    return privacy_plan(cfg, rate, n).noise_sigma(cfg.bug) * noise(cfg.mechanism).std_per_sigma


def _ceiling(cfg, result, claimed, group):
    """The most TPR the claim allows, from the run's own mechanism (its sigma, Poisson rate and steps, as the
    ledger accounted them); a group claim (repeated canaries) or no claim: the analysis' default (the region)."""
    if claimed is None or group or not cfg.private or result.sigma is None:
        return None

    return run_ceiling(Mechanism(cfg.mechanism, result.sigma, result.sampling_rate, result.steps), cfg.delta, claimed)


EXTENDED = "extended_model"          # the base plus the canaries' tokens, as an extension folder (models/extension.py)
REUSE_STAMP = "extended_model.json"  # what canaries.json and extended_model/ were made from
HIDDEN_NORM = "prefix_hidden_norm"   # in the stamp: |h| of the extended model at the canaries' prefixes
WEIGHT_SCALE = "weight_scale"        # ... and its weights' typical size (``weight_scale``)
_MADE = ("canaries_sha256", HIDDEN_NORM, WEIGHT_SCALE)  # the stamp's entries that were made, not compared


def _stamped(out: Path, key: str) -> float | None:
    """A number the stamp holds (None when absent or unreadable: it is then measured again)."""

    try:
        value = (read_json(out / REUSE_STAMP, "canary extension stamp") or {}).get(key)
    except (DPAuditError, OSError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def _extension_stamp(base: Path, settings: AuditRunSettings) -> dict:
    """What the canaries and the extended model depend on: the base model's files (the folder it resolves to,
    its files' names, sizes and modification times: a changed file is a new model) and the canary settings (count,
    seed, prefix length, a shared prefix).
    The same stamp is the same secrets and prefixes; membership is drawn afresh for each run."""

    folder = resolve_model_path(base).resolve()  # a hub cache's snapshot, a GGUF's converted folder
    return {"format": 3, "base": str(Path(base).resolve()), "folder": str(folder), "files": files_stamp(folder),
            "canaries": settings.canaries, "seed": settings.seed, "prefix_length": settings.prefix_length,
            **({"prefix": "shared"} if settings.shared_prefix else {}),
            **({"users": [settings.repeats, settings.held_out]} if settings.held_out else {})}


def _reusable_canaries(out: Path, stamp: dict):
    """The manifest of an earlier run in ``out`` whose canaries and extended model match ``stamp`` (else
    every `audit run --model` would make and extend them again: 3-5 minutes on a 270M model), or None. Anything unreadable or changed (the manifest's hash is in the stamp) is made again."""

    try:
        old = read_json(out / REUSE_STAMP, "canary extension stamp")
        if not old or {k: v for k, v in old.items() if k not in _MADE} != stamp \
                or not (out / EXTENDED / "config.json").is_file():
            return None
        manifest = load_manifest(out / "canaries.json")
        return manifest if old.get("canaries_sha256") == _public_key(manifest) else None
    except (DPAuditError, OSError):
        return None


def _public_key(manifest) -> str:
    """A hash of what the extended model depends on: the canaries' secrets and prefixes, not their membership."""

    public = [[c.secret, c.prefix] for c in manifest.canaries] + [manifest.tokenizer.fingerprint]
    return hashlib.sha256(json.dumps(public).encode()).hexdigest()


def _power_note(cfg: TrainConfig, settings: AuditRunSettings, m: int) -> dict:
    """Said before training (stderr) and in the report: when m canaries cannot refute the claim the run targets
    (held to group privacy for repeated canaries) whatever the run leaks, and the smallest m that could."""

    if cfg.sigma is not None or not math.isfinite(cfg.target_epsilon):
        return {}  # the claim is known only once sigma is accounted (or there is none)
    repeats = 1 if cfg.white_box or cfg.privacy_unit.user_level else settings.repeats
    claimed, delta, _ = held_claim(cfg.target_epsilon, cfg.delta, repeats, m)
    note = power_note(m, claimed, delta, settings.alpha) if claimed is not None else None
    if note is None:
        return {}
    print(f"dpaudit: warning: {note}", file=sys.stderr)
    return {"audit power (before training)": note}


def _white_box(out: Path, cfg: TrainConfig, settings: AuditRunSettings, base: Path, data, data_format, field,
               show_progress: bool, power: dict, step: StepCheck | None):
    """Train with white-box canaries planted, then audit the transcript (no model scoring needed)."""

    if data is None:
        texts = sentences(settings.examples, seed=settings.seed + 1)
    else:
        fmt = detect_format(Path(data), data_format)
        texts = read_texts(Path(data), fmt, field)
    remove_folder(out / "run")
    users = [str(i) for i in range(len(texts))] if cfg.uls else None   # the synthetic data: one record a user
    result = train(base, texts, out / "run", cfg, show_progress=show_progress, step=step, users=users)
    audit, scores, members, facts = audit_run_folder(out / "run", claimed_epsilon=result.epsilon,
                                                     delta=cfg.delta, alpha=settings.alpha)
    return _finish(out, cfg, base, audit, result, scores, members, {**facts, **power})


def _claim(cfg: TrainConfig, result: TrainResult) -> str:
    """The target as the user gave it, and what the accountant certifies for the sigma used."""
    if cfg.sigma is None and math.isfinite(cfg.target_epsilon):
        return f"{cfg.target_epsilon:g} (target; accounted {result.epsilon:.4g})"
    return f"{result.epsilon:.4g} (accounted for sigma {cfg.sigma:g})"


def _finish(out: Path, cfg: TrainConfig, base: Path, audit: AuditResult, result: TrainResult, scores, members,
            extra: dict):
    claimed = result.epsilon if math.isfinite(result.epsilon) else None
    context = {
        "method": cfg.method + ("" if result.private else " (non-private baseline)"),
        "claimed eps": _claim(cfg, result) if claimed is not None else "inf (no DP)",
        "delta": cfg.delta, "sigma": float(f"{result.sigma:.6g}") if result.sigma else "none (non-private)",
        "mechanism": cfg.mechanism if result.private else "none (non-private)",
        "accountant": result.accountant or "none (non-private)", "relation": result.relation,
        "sampling rate p": round(result.sampling_rate, 6), "steps": result.steps, "examples": result.examples,
        "trainable": cfg.trainable, "model": str(base),
        "noise": "DISABLED (unsafe test setting)" if cfg.unsafe_disable_noise else "on" if result.private else "off",
        "audit": f"white box, {cfg.white_box} canaries" if cfg.white_box else "black box (new-token canaries)",
        **({"PLANTED BUG": cfg.plant_bug} if cfg.plant_bug else {}),
        **({"training diverged": result.extra["divergence"]} if result.extra.get("divergence") else {}),
        **{k: v for k, v in extra.items() if not isinstance(v, dict)},
    }
    remove_folder(out / "report")
    files = write_report(out / "report", audit, scores, members, context)
    summary = {**audit.to_dict(), "context": context, "training": result.to_dict(),
               "report_files": {k: str(v) for k, v in files.items()}}
    atomic_write_json(out / "summary.json", summary)
    return audit, result, summary
