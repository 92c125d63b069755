"""Audit a Hugging Face ``Trainer`` or TRL ``SFTTrainer`` fine-tune (PEFT or full) in one callback.

    audit, train_dataset = DPAuditCallback.prepare(tokenizer, train_dataset, m=1000, out="audit-run",
                                                   claimed_eps=8.0, delta=1e-5)
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, callbacks=[audit])
    trainer.train()          # writes audit-run/report/report.md and report.json, with the verdict

What it does, and why each part is there:
- ``prepare`` (before the Trainer exists: the Trainer builds its data loader, and TRL tokenises, at construction)
  makes m canaries, each a member with probability 1/2 from fresh OS entropy (written only to the 0600 manifest
  ``out/canaries.json``), and returns a copy of the dataset with the members inserted, in the dataset's own row
  format (plain text, chat ``messages``, or ``prompt``/``completion``; a ``datasets.Dataset`` or a list of dicts).
  Canary kinds: ``existing`` (default): a random span of the tokenizer's own vocabulary after a random prefix, so
  no vocabulary resize and a LoRA with frozen embeddings still trains it; ``new-token``: one new token behind one
  shared prefix (``audit.extend(model)`` adds the tokens, each row at the base's expected row after the prefix, and
  makes the rows train beside a LoRA's adapters), or behind random prefixes (``prefix="random"``).
- ``on_train_begin`` checks, on the live model and the Trainer's own dataset and collator (never by drawing from
  its data loader, which would move the user's random state), that the canaries will train: new-token rows
  trainable, the secret's labels not masked (-100) after collation, the secret not cut by truncation or packing,
  and the members present in what the Trainer iterates. Each failure is refused in one line naming the cause and
  the fix (``preflight="warn"``: a line in the report instead). When the optimizer is (or wraps) an Opacus
  ``DPOptimizer``, a ``WhiteBoxProbe`` is attached to it (gradient canaries in the privatised release).
- ``on_train_end`` scores each canary on its secret span only (the context before it is context), against the
  base model when one is at hand (``disable_adapter()`` on an unmerged PEFT model, or ``reference=``), audits the
  scores (AUC, TPR at 1 % and 0.1 % FPR with Clopper-Pearson intervals, every eps lower bound, the power line),
  and writes ``out/report/`` with the verdict against the claim; a white-box audit, when there is one, is
  reported beside it and decides the verdict (it sees every release, so it is the stronger test).

Under ZeRO-3 or FSDP (weights sharded), scoring in the callback is skipped: the report folder says which
``dpaudit audit checkpoint`` command scores the saved model instead.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dpaudit.core.errors import DPAuditError, PrivacyViolation
from dpaudit.core.validate import check_canaries
from dpaudit.integrations.hf_preflight import preflight_problems, rows_train
from dpaudit.integrations.hf_rows import canary_row, contexts, row_format as find_format, rows_of
from dpaudit.training.distributed import launch_rank
from dpaudit.audit.analysis import analyse, check_audit_parameters
from dpaudit.audit.claims import held_claim
from dpaudit.audit.power import power_note
from dpaudit.audit.report import decided_by, write_report
from dpaudit.audit.roc import summarise
from dpaudit.canaries.generate import (make_canaries, make_existing_canaries, redraw_membership, shared_prefix,
                                       split_secret)
from dpaudit.canaries.hf import extend_model
from dpaudit.canaries.manifest import CANARY_USER, KINDS, is_canary_user, load_manifest
from dpaudit.core.atomic import atomic_write_json, atomic_write_text
from dpaudit.core.lock import MARKER, mark, remove_folder
from dpaudit.core.run_record import read_probe
from dpaudit.core.safe_json import load_json_file
from dpaudit.integrations.hf_opacus import opacus_trainer as make
from dpaudit.models.loading import load_causal_lm
from dpaudit.probes.probe import ON_VIOLATION, STOP_ALPHA, WhiteBoxProbe
from dpaudit.probes.opacus_seams import hooked_accountant
from dpaudit.probes.probe_opacus import loader_sample_rate
from dpaudit.training.new_tokens import add_new_token_rows, new_token_parameters
from dpaudit.workflows.scoring import secret_losses

try:  # transformers is the `train` extra; the class is defined either way so that the import error is one line
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - the train extra is missing
    TrainerCallback = object

MANIFEST = "canaries.json"
CONTROLS = "controls.json"   # never-inserted canaries: more non-members for the FPR, at no training cost
SETTINGS = "hf_audit.json"
# The white-box probe's canaries: 5000, as `audit run --white-box` plants (at m = 1000 the bound read 66 %
# of a claim of 3.9 on an opacus_trainer run; the noncentral-t limit tightens as 1 / sqrt(m)).
WHITE_BOX_M = 5000
REPORT = "report"
WHITE_BOX = "white-box"
CANARY_BUDGET = 0.05     # inserted member rows at most this share of the dataset's rows
REPEATS = (1, 4, 16)     # exposure tiers (memaudit's, and Carlini et al.'s repeated canaries); see audit_tiers
SECRET_LENGTH = 32       # an existing canary's secret span in tokens: each token adds to the member's loss drop
CONTROLS_DEFAULT = 100   # a TPR at 1 % FPR needs >= 100 non-members to mean anything (memaudit's floor too)
PREFLIGHT = ("refuse", "warn", "off")
# New-token canaries' prefixes: one shared prefix, each row at the base's expected row after it (``extend``), or a
# random 1-token prefix each. Shared by default: a fine-tune trains the body too, and there a canary's clipped
# gradient behind a random prefix went mostly to the body (a median 27 % of its norm on its own row, against 99.9 %
# behind the shared prefix: benchmarks/user_recipe.py --share, and canaries/hf.expected_row for why).
PREFIXES = ("shared", "random")
SAME_START = ("the secret's loss (less the base's, where a base is at hand): every canary is a new token behind one "
              "shared prefix, its row starting at the same expected row, so the base's loss is the same for each and "
              "the loss alone is already calibrated")
HEADLINE_WHY = {
    "loss-vs-base": "the secret's loss drop from the base model: it removes how hard each canary is to begin with, "
                    "so members separate from non-members at far lower leakage than with the loss alone",
    "neg-loss": "the secret's loss on the fine-tuned model (no base model at hand: pass reference=, or keep a PEFT "
                "adapter unmerged, for the base-calibrated score)",
}


@dataclass
class _Settings:
    m: int
    kind: str
    row_format: str          # text, messages, prompt-completion
    text_field: str | None
    repeats: list[int]       # exposure tiers: canary i, when a member, is inserted repeats[i % len(repeats)] times
    claimed_eps: float | None
    delta: float | None
    alpha: float
    preflight: str
    reference: str | None
    regurgitation: bool
    inserted_rows: int
    dataset_rows: int
    white_box_m: int = 0     # the white-box probe's gradient canaries (a DP optimizer seen), 0: none
    on_violation: str = "stop"  # the white-box probe's looks as the run trains (WhiteBoxProbe.watch); "off": none
    user_column: str | None = None       # a user-level dataset: each canary's copies carry one canary user's id there
    records_per_user: int | None = None  # the claim's k (a user-level claim): a canary of at most k copies is one
    #                                      user it covers, held to the claim itself, not to group privacy


class DPAuditCallback(TrainerCallback):
    """A ``transformers.TrainerCallback``; make it with ``DPAuditCallback.prepare``."""

    def __init__(self, out, manifest, settings: _Settings, tokenizer) -> None:
        self.out, self.manifest, self.settings, self.tokenizer = Path(out), manifest, settings, tokenizer
        self.controls = None         # a Manifest of never-inserted canaries, or None
        self.power_notes: dict = {}  # tiers whose canaries cannot refute the claim they are held to (said at prepare)
        self.probe = None
        self.secret_seed = None      # prepare(secret_seed=): the probe's membership reproducible too (tests only)
        self.resumed_at = 0
        self.preflight_notes: list[str] = []
        self.result = None           # the black-box AuditResult, after training (exposure tiers pooled)
        self.tiers: list[Tier] = []  # each exposure tier's audit
        self.white_box = None        # the white-box AuditResult, when a DP optimizer was probed
        self.violation = None        # the verdict, after training: True (VIOLATION), False, or None (not reached)

    # -- before the Trainer ------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, tokenizer, train_dataset, *, m: int = 1000, out, claimed_eps: float | None = None,
                delta: float | None = None, kind: str = "existing", repeats=REPEATS, text_field: str | None = None,
                secret_length: int = SECRET_LENGTH, controls: int = CONTROLS_DEFAULT, prefix: str = "shared",
                canary_budget: float = CANARY_BUDGET, preflight: str = "refuse",
                reference=None, regurgitation: bool = False, alpha: float = 0.05, seed: int = 0,
                secret_seed: int | None = None, white_box_m: int = WHITE_BOX_M, on_violation: str = "stop",
                user_column: str | None = None, records_per_user: int | None = None):
        """(callback, the dataset with the member canaries inserted). ``out`` holds the manifest (0600) and,
        after training, the report; preparing again into the same ``out`` (a resumed Trainer) keeps the same
        canaries and membership. ``repeats``: how many times a member is inserted, an int or exposure tiers (canary
        i in tier i mod len(repeats)), each tier audited against the claim it is held to (group privacy).
        ``controls``: existing-kind canaries never inserted (out/controls.json): extra non-members for the AUC and
        TPR at low FPR, which cost no training tokens; they take no part in an eps bound, whose one-run theorem
        needs each canary's membership to be a fair coin.
        ``secret_seed`` makes membership reproducible, the canaries' and the white-box probe's: tests and
        benchmarks only.
        ``white_box_m``: the gradient canaries of the white-box probe put on a DP optimizer (they cost no rows: 4
        bytes each a step of transcript; 0: no white-box probe). ``on_violation``: the probe audits as the run
        trains (at steps 16, 32, 64, ..., alpha held over every look: ``WhiteBoxProbe.watch``) and, at the first
        look that reads VIOLATION, writes its report and "stop"s the Trainer, "warn"s, or "raise"s; "off": no looks.
        ``user_column`` (a user-level run: ``opacus_trainer(user_column=...)``): each member's copies are one canary
        user, whose id (dpaudit-canary-N) they carry in that column; ``records_per_user``: the claim's k, so a tier
        of at most k copies is held to the user-level claim itself.
        ``prefix`` (``kind="new-token"``): ``"shared"``, one prefix for every canary, each row starting at the base's
        expected row after it (``extend``): the body a fine-tune trains then takes almost none of a canary's
        gradient; or ``"random"``, a random 1-token prefix each, rows at zero."""

        repeats = _tiers(repeats)
        _check_arguments(m, kind, secret_length, canary_budget, preflight, claimed_eps, delta, alpha)

        if prefix not in PREFIXES:
            raise DPAuditError(f"prefix must be one of {', '.join(PREFIXES)}, got {prefix!r}")
        if on_violation not in (*ON_VIOLATION, "off"):
            raise DPAuditError(f"on_violation must be one of {', '.join(ON_VIOLATION)} or off, got {on_violation!r}")
        if isinstance(white_box_m, bool) or not isinstance(white_box_m, int) or white_box_m < 0 or white_box_m == 1:
            raise DPAuditError(f"white_box_m must be 0 (no white-box probe) or an integer >= 2, got {white_box_m!r}")
        if delta * m >= 1:
            raise DPAuditError(f"delta = {delta:g} >= 1/m = {1 / m:.3g}: a claim with delta this large allows leaking "
                               "a canary outright, so no audit of m canaries can bound eps; give the run's delta")
        if isinstance(controls, bool) or not isinstance(controls, int) or controls < 0:
            raise DPAuditError(f"controls must be an integer >= 0, got {controls!r}")
        controls = controls if kind == "existing" else 0  # new-token controls would each need a vocabulary row
        rows, columns, rebuild = rows_of(train_dataset)
        row_format, text_field = find_format(rows, columns, text_field)
        out = Path(out)
        copies = [repeats[i % len(repeats)] for i in range(m)]
        members_expected = sum(copies) / 2
        if members_expected > canary_budget * max(1, len(rows)):
            most = int(2 * canary_budget * len(rows) / (sum(copies) / m))
            raise DPAuditError(f"m = {m} canaries (exposure tiers {repeats}) put about {members_expected:.0f} rows "
                               f"into a dataset of {len(rows)} rows, over the canary budget of {canary_budget:.0%} of "
                               f"its rows; use m <= {most}"
                               + ("" if tuple(repeats) == (1,) else
                                  f", or repeats=1 (single copies: m <= {int(2 * canary_budget * len(rows))})")
                               + ", or raise canary_budget= (a small dataset holds few canaries: see "
                                 "docs/auditing.md, small datasets)")
        if row_format == "messages" and not getattr(tokenizer, "chat_template", None):
            raise DPAuditError("the dataset holds chat messages but the tokenizer has no chat template to render them")
        if (out / MANIFEST).is_file():
            manifest = load_manifest(out / MANIFEST)  # a resumed Trainer: the same canaries and membership
            control = load_manifest(out / CONTROLS) if (out / CONTROLS).is_file() else None
            if len(manifest.canaries) != m or manifest.kind != kind or \
                    (len(control.canaries) if control else 0) != controls or \
                    (kind == "new-token" and (manifest.prefix_kind == "template") != (prefix == "shared")):
                raise DPAuditError(f"{out} holds {len(manifest.canaries)} {manifest.kind} canaries; prepare again with "
                                   "the same m, kind, prefix and controls (a resumed run keeps its canaries), or a new "
                                   "folder")
        else:
            manifest, control = _make(tokenizer, m, kind, seed, secret_seed, secret_length, controls, prefix)
            _new_folder(out)
            manifest.save(out / MANIFEST)
            if control is not None:
                control.save(out / CONTROLS)
        new_rows = [canary_row(c, row_format, text_field, columns, rows) for c, k in zip(manifest.canaries, copies)
                    if c.member for _ in range(k)]
        if user_column is not None:   # a member's copies: one canary user
            owners = [CANARY_USER.format(c.index) for c, k in zip(manifest.canaries, copies) if c.member
                      for _ in range(k)]
            if any(isinstance(r, dict) and is_canary_user(r.get(user_column)) for r in rows):
                raise DPAuditError(f"a row's {user_column!r} is a canary user's id ({CANARY_USER.format('N')})")
            new_rows = [{**row, user_column: owner} for row, owner in zip(new_rows, owners)]
        order = np.random.default_rng([seed, 7]).permutation(len(rows) + len(new_rows))
        both = rows + new_rows
        settings = _Settings(m=m, kind=kind, row_format=row_format, text_field=text_field, repeats=repeats,
                             claimed_eps=claimed_eps, delta=delta, alpha=alpha, preflight=preflight,
                             reference=str(reference) if reference is not None else None,
                             regurgitation=regurgitation, inserted_rows=len(new_rows), dataset_rows=len(rows),
                             white_box_m=white_box_m, on_violation=on_violation, user_column=user_column,
                             records_per_user=records_per_user)

        atomic_write_json(out / SETTINGS, dict(settings.__dict__))
        audit = cls(out, manifest, settings, tokenizer)
        audit.controls = control
        audit.secret_seed = secret_seed   # the white-box probe's membership too (never written: tests only)
        audit.power_notes = _power_notes(copies, repeats, claimed_eps, delta, alpha, records_per_user)
        for line in audit.power_notes.values():
            print(f"dpaudit: warning: {line}")
        return audit, rebuild([both[i] for i in order])

    # -- the model ---------------------------------------------------------------------------------------
    def extend(self, model) -> list[int]:
        """``kind="new-token"``: add the canary tokens to the tokenizer and ``model`` (the embeddings resized, ties
        kept; behind the shared prefix each new output row starts at the base's expected row after it, else at zero)
        and, where the embeddings are frozen (a LoRA), make the canaries' rows train as parameters of their own
        beside the adapters (training/new_tokens.py: plain embedding and linear modules, which ``opacus_trainer``'s
        per-example clipping handles, tied pairs included). Call it after ``get_peft_model`` and before the dataset
        is tokenised. Returns the canaries' token ids. The embeddings were resized, so a PEFT checkpoint saves them
        and these rows with the adapters (peft's ``save_embedding_layers``), and a resumed run gets the rows back;
        ``dpaudit.training.new_tokens.merge(model)`` folds them into the embeddings for export."""
        if self.manifest.kind != "new-token":
            raise DPAuditError("extend() is for kind='new-token' canaries; the existing kind needs no new tokens")
        ids = extend_model(model, self.tokenizer, self.manifest)
        if not rows_train(model, ids):
            add_new_token_rows(model.get_base_model() if hasattr(model, "get_base_model") else model, ids)
        return ids

    # -- the Trainer's events ----------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        self.resumed_at = int(state.global_step or 0)
        tokenizer = kwargs.get("processing_class") or self.tokenizer
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
        if self.settings.preflight != "off":
            problems = preflight_problems(model, tokenizer, self.manifest, self.settings, train_dataloader)
            if problems and self.settings.preflight == "refuse":
                raise DPAuditError(problems[0])
            self.preflight_notes = problems
        dp = _dp_optimizer(optimizer)
        if dp is not None and self.settings.white_box_m >= 2:
            folder = self.out / WHITE_BOX
            resume = folder.is_dir() and any(folder.iterdir())
            trained = [p for group in dp.param_groups for p in group["params"] if p.requires_grad]
            if not trained:
                raise DPAuditError("nothing trains: the DP optimizer holds no trainable parameter (every adapter or "
                                   "layer frozen?); unfreeze what the run should train")
            coordinates = sum(p.numel() for p in trained)
            # one canary on each trainable tensor at least (injector.place), never more than there are coordinates
            m = read_probe(folder).m if resume else min(max(self.settings.white_box_m, len(trained)),
                                                                 coordinates)
            try:  # the canaries at the rate the Trainer's loader samples at, checked against the accountant's
                loader_sample_rate(train_dataloader)
                loader = train_dataloader
            except DPAuditError:  # a loader whose rate cannot be read: the accountant's, and the report says so
                loader = None
            self.probe = WhiteBoxProbe.attach(dp, m=m, out=folder, model=model, resume=resume, data_loader=loader,
                                              accountant=hooked_accountant(dp), secret_seed=self.secret_seed)
            claim = self.settings.claimed_eps
            if self.settings.on_violation != "off" and self.settings.delta and (
                    claim is not None or getattr(self.probe, "accountant", None) is not None):

                # the looks at 1 % over the run (a correct run is stopped at most that often), the end at alpha
                self.probe.watch(delta=self.settings.delta, claimed_eps=claim,
                                 alpha=min(self.settings.alpha, STOP_ALPHA),
                                 on_violation=self.settings.on_violation,
                                 planned_steps=int(state.max_steps) if (state.max_steps or 0) > 0 else None)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        """A watched probe's look read VIOLATION with on_violation="stop": the Trainer stops (the report is written)."""
        if self.probe is not None and getattr(self.probe, "stop_requested", False):
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        """A Trainer checkpoint: the white-box transcript is written up to it (rows wait on the device in blocks)."""
        if self.probe is not None:
            self.probe.flush()
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        tokenizer = kwargs.get("processing_class") or self.tokenizer
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        if _sharded(args):
            atomic_write_text(self.out / "SCORE_LATER.txt", _score_later(args, self.out, self.settings.repeats))
            print(f"dpaudit: the model is sharded (ZeRO-3 / FSDP): scoring is left to the saved checkpoint; see "
                  f"{self.out / 'SCORE_LATER.txt'}")
            return control
        if launch_rank() != 0:
            return control
        steps = int(state.global_step or 0)
        claimed, source = self._claim()
        scores, members, score, control = score_canaries(model, tokenizer, self.manifest, self.settings,
                                                         self.controls)
        self.result, self.tiers = audit_tiers(scores, members, score, self.settings, claimed, control)
        context = self._context(args, state, steps, claimed, source, score)
        context.update(tier_lines(self.tiers, self.result))
        if getattr(self.probe, "health", None) is not None:
            context.update(self.probe.health.lines())  # the update's health check (probes/health.py)
        if self.probe is not None and getattr(self.probe, "canaries", None) is not None:
            try:
                self.white_box = self.probe.audit(claimed, self.settings.delta, report=True, claimed_from=source)
            except DPAuditError as exc:
                context["white-box audit"] = f"not made: {exc}"
            except PrivacyViolation as exc:  # the DP optimizer never stepped, yet the model was trained
                context["white-box audit"] = str(exc)
                print(f"dpaudit: {exc}")
            finally:
                self.probe.close()
            alarm = getattr(self.probe, "alarm", None)
            if alarm is not None:  # a look read VIOLATION (and stopped the run): that is the white-box verdict
                context["white-box look that read VIOLATION"] = f"{alarm.verdict} (report: {self.probe.alarm_report})"
                if self.white_box is None or not self.white_box.violation:
                    self.white_box = alarm
        if self.settings.regurgitation:
            context.update(regurgitation(model, tokenizer, self.manifest, self.settings))
        self.verdict = self._write(self.result, scores, members, context, claimed)
        print(f"dpaudit: {self.verdict} (report: {self.out / REPORT / 'report.md'})")
        return control

    @property
    def exit_code(self) -> int:
        """What a training script exits with, as the dpaudit commands do: ``sys.exit(audit.exit_code)`` after
        ``trainer.train()``. 1: VIOLATION (at the end of the run, or a look that stopped it); 0: consistent with
        the claim; 2: no verdict was reached (no audit ran, or the model is sharded and is scored later)."""
        return 2 if self.violation is None else int(bool(self.violation))

    # -- helpers -----------------------------------------------------------------------------------------
    def _claim(self) -> tuple[float | None, str]:
        if self.settings.claimed_eps is not None:
            return self.settings.claimed_eps, "given to prepare()"
        accountant = getattr(self.probe, "accountant", None)
        if accountant is not None and self.settings.delta is not None:
            sigmas = [h[0] for h in getattr(accountant, "history", None) or []]
            if any(s == 0 for s in sigmas):  # Opacus' accountants overflow at sigma 0: it is no DP at all
                return None, (f"none: the run's noise multiplier is 0, so its eps is infinite (no DP; "
                              f"{type(accountant).__name__} cannot say it); audited without a claim")
            try:
                eps = float(accountant.get_epsilon(delta=self.settings.delta))
            except Exception as exc:  # noqa: BLE001 - an accountant that cannot answer: said, audited without a claim
                return None, f"none: {type(accountant).__name__}.get_epsilon failed ({type(exc).__name__})"
            return eps, f"{type(accountant).__name__}.get_epsilon(delta={self.settings.delta:g}) after the steps taken"
        return None, "none (no claimed_eps, and no Opacus accountant on the optimizer)"

    def _one_start(self) -> bool:
        return self.manifest.kind == "new-token" and self.manifest.prefix_kind == "template"

    def _context(self, args, state, steps, claimed, source, score) -> dict:
        planned = int(state.max_steps or 0)
        return {
            "trainer": f"{trainer_name(args)} callback (dpaudit.integrations.hf)",
            "canary kind": self.settings.kind, "row format": self.settings.row_format,
            "inserted member rows": self.settings.inserted_rows, "dataset rows": self.settings.dataset_rows,
            "steps run": f"{steps} of {planned}" + (" (stopped early)" if planned and steps < planned else ""),
            **({"resumed at step": self.resumed_at} if self.resumed_at else {}),
            "claimed eps": claimed, "claimed eps from": source, "delta": self.settings.delta,
            "headline score": score, "why this score": HEADLINE_WHY[score] if not self._one_start() else SAME_START,
            **({"canary prefix": f"one shared prefix ({self.manifest.canaries[0].prefix[:20]!r}), each secret's row "
                                 "starting at the base's expected row after it"} if self._one_start() else {}),
            **{f"preflight warning {i + 1}": p for i, p in enumerate(self.preflight_notes)},
            **self.power_notes,
        }

    def _write(self, result, scores, members, context, claimed) -> str:
        folder = self.out / REPORT
        remove_folder(folder)
        folder.mkdir(parents=True)
        violation, verdict = (result.violation, result.verdict) if len(self.tiers) == 1 else \
            tiers_verdict(self.tiers, claimed)
        decided = None
        if self.white_box is not None:
            decided = decided_by({"black-box audit": result, "white-box audit": self.white_box},
                                 {"black-box audit": violation, "white-box audit": self.white_box.violation})
            context = {**context, "white-box eps lower bound": round(self.white_box.epsilon_lower_bound, 4),
                       "white-box verdict": self.white_box.verdict, "verdict from": "the white-box audit (it reads every "
                       "privatised release, so it is the stronger test) and the black-box one below: a VIOLATION by "
                       "either is the verdict"}
            verdict = self.white_box.verdict if self.white_box.violation or not violation else verdict
            violation = violation or self.white_box.violation
        else:
            context = {**context, "verdict from": "black-box audit of the canaries' secret spans"}
        write_report(folder, result, scores, members, context, verdict=(verdict, violation), decided=decided)
        self.violation = violation
        bound = decided["epsilon_lower_bound"] if decided else result.epsilon_lower_bound
        return verdict + (f" (eps lower bound {_fmt(bound)} from the {decided['from']})" if decided else "")


def _fmt(x) -> str:
    return x if isinstance(x, str) else f"{x:.4g}"


# -- canaries ---------------------------------------------------------------------------------------------
def _power_notes(copies, repeats, claimed, delta, alpha, records_per_user=None) -> dict:
    """Per tier that tests a claim (group privacy for k copies): a line when its canaries cannot refute it."""

    held = {k: held_claim(claimed, delta, group_of(k, records_per_user), copies.count(k)) for k in repeats}
    tested = [k for k in repeats if held[k][0] is not None]
    notes = {}
    for k in tested:
        note = power_note(copies.count(k), held[k][0], held[k][1], alpha / len(tested))
        if note:
            notes[f"audit power, tier {k}x (before training)"] = note
    return notes


def group_of(copies: int, records_per_user: int | None) -> int:
    """The group a canary of ``copies`` copies is held to: 1 where a user-level claim of k >= copies records a
    user covers it as one user, else the copies (group privacy of an example-level claim)."""
    return 1 if records_per_user is not None and copies <= records_per_user else copies


def _tiers(repeats) -> list[int]:
    tiers = [repeats] if isinstance(repeats, int) and not isinstance(repeats, bool) else repeats
    try:
        tiers = list(tiers)
    except TypeError:
        tiers = [repeats]
    if not tiers or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in tiers) \
            or len(set(tiers)) != len(tiers):
        raise DPAuditError(f"repeats must be an integer >= 1 or distinct ones (exposure tiers), got {repeats!r}")
    return tiers


def _check_arguments(m, kind, secret_length, budget, preflight, claimed_eps, delta, alpha) -> None:
    if kind not in KINDS:
        raise DPAuditError(f"unknown canary kind {kind!r}; use {' or '.join(KINDS)}")
    check_canaries(m)
    if isinstance(secret_length, bool) or not isinstance(secret_length, int) or not 1 <= secret_length <= 256:
        raise DPAuditError(f"secret_length must be an integer in [1, 256] (tokens), got {secret_length!r}")
    if not 0 < budget <= 1:
        raise DPAuditError(f"canary_budget must be in (0, 1], got {budget}")
    if preflight not in PREFLIGHT:
        raise DPAuditError(f"preflight must be one of {', '.join(PREFLIGHT)}, got {preflight!r}")
    if delta is None:
        raise DPAuditError("give the delta the run claims (the bound depends on it; 0 would inflate it)")
    check_audit_parameters(alpha, delta, claimed_eps)


def _make(tokenizer, m: int, kind: str, seed: int, secret_seed: int | None, secret_length: int, controls: int,
          prefix: str = "shared"):
    """(canaries, controls or None): canaries public (from ``seed``), membership secret (OS entropy unless
    ``secret_seed``); controls drawn with them (distinct secrets, the same distribution), never members."""

    template = shared_prefix(tokenizer, seed) if prefix == "shared" else None
    manifest = (make_existing_canaries(tokenizer, m + controls, seed=seed, secret_length=secret_length)
                if kind == "existing" else make_canaries(tokenizer, m, seed=seed, template=template))
    control = None
    if controls:
        control = replace(manifest, canaries=[replace(c, member=False) for c in manifest.canaries[m:]])
        manifest = replace(manifest, canaries=manifest.canaries[:m])
    return redraw_membership(manifest, secret_seed, mixed=True), control


def _new_folder(out: Path) -> None:
    if out.exists() and any(p.name != MARKER for p in out.iterdir()):
        raise DPAuditError(f"{out} is not empty and holds no canary manifest; give prepare() a new folder")
    out.mkdir(parents=True, exist_ok=True)
    mark(out)


def _dp_optimizer(optimizer):
    """The Opacus DPOptimizer the Trainer steps (accelerate wraps it), or None."""
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return None
    seen = 0
    while optimizer is not None and seen < 4:
        if isinstance(optimizer, DPOptimizer):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


def _sharded(args) -> bool:
    """FSDP, or DeepSpeed ZeRO stage 3 (a config dict or the path of one): weights sharded over the ranks."""
    if getattr(args, "fsdp", None):
        return True
    deepspeed = getattr(args, "deepspeed", None)
    if isinstance(deepspeed, (str, os.PathLike)) and Path(deepspeed).is_file():
        deepspeed = load_json_file(Path(deepspeed), "DeepSpeed config")
    stage = (deepspeed or {}).get("zero_optimization", {}).get("stage") if isinstance(deepspeed, dict) else None
    return stage == 3


def _score_later(args, out: Path, repeats: list[int]) -> str:
    repeat = f" --repeat {max(repeats)}" if max(repeats) > 1 else ""
    return ("The weights were sharded (ZeRO-3 / FSDP), so the canaries were not scored in the callback. Score the saved "
            f"model with:\n\n    dpaudit audit checkpoint --model {args.output_dir} -c {out / MANIFEST} --delta <delta> "
            f"--eps <claimed eps>{repeat} --report {out / REPORT}\n" + (
                f"\n--repeat {max(repeats)} holds every canary to the group claim of the most copies any member has "
                f"(exposure tiers {repeats}); valid for all of them, but weaker than the callback's audit of each "
                "tier.\n"
                if repeat else ""))


# -- scoring -----------------------------------------------------------------------------------------------
def score_canaries(model, tokenizer, manifest, settings: _Settings, controls=None):
    """(scores, members, score name, the controls' scores) on ``model``: base-calibrated when a base model is at
    hand (an unmerged PEFT adapter's ``disable_adapter()``, or ``settings.reference``), else -loss."""

    m = len(manifest.canaries)
    if controls is not None:  # one pass over both
        manifest = replace(manifest, canaries=manifest.canaries + controls.canaries)
    pairs = contexts(tokenizer, manifest, settings)
    losses = _losses(model, tokenizer, manifest, pairs)
    base = None
    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
        with model.disable_adapter(), _rows_at_start(model):
            base = _losses(model, tokenizer, manifest, pairs)
    elif settings.reference is not None:
        reference, _ = load_causal_lm(Path(settings.reference))
        base = _losses(reference, tokenizer, manifest, pairs)
        del reference
    score = "loss-vs-base" if base is not None else "neg-loss"
    scores = base - losses if base is not None else -losses
    return scores[:m], np.array([c.member for c in manifest.canaries[:m]]), score, scores[m:]


@contextlib.contextmanager
def _rows_at_start(model):
    """The canaries' own rows (``extend`` on a LoRA) back at their start, zero, for the base's losses: they are no
    adapter, so ``disable_adapter()`` leaves them trained, and a base that kept them would take the signal away."""
    rows = new_token_parameters(model)
    kept = [r.detach().clone() for r in rows]
    with torch.no_grad():
        for r in rows:
            r.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for r, k in zip(rows, kept):
                r.copy_(k)


@dataclass
class Tier:
    copies: int
    held_eps: float | None        # the claim this tier is held to (group privacy), None when it cannot test one
    held_delta: float
    why: str                      # the claim in words, or why the tier is not tested
    result: object = None         # its AuditResult


def audit_tiers(scores, members, score: str, settings: _Settings, claimed: float | None, control=()):
    """(headline AuditResult, tiers). A member of tier k is in the data k times, a group of k examples, so its
    audit is held to group privacy, (k eps, k e^((k-1) eps) delta) (claims.group_claim); comparing it with the
    one-example claim would flag a correct run. A tier whose group delta is >= 1 / (its canaries) can refute no
    claim: its bound is reported without one. The verdict is a VIOLATION when any tested tier's bound exceeds the
    claim it is held to; alpha is split evenly over the tested tiers (Bonferroni), so a correct run reads VIOLATION
    with probability <= alpha. The headline result (AUC, TPR at low FPR, the ROC) pools every tier, as memaudit's
    does; with one tier it is that tier's audit. The controls' scores join the non-members in each ROC (AUC, TPR at
    low FPR), never in a bound."""

    control = np.asarray(control, dtype=float)

    def with_controls(result, pick):
        if result is None or not len(control):
            return result
        return replace(result, roc=summarise(np.concatenate([scores[pick], control]),
                                             np.concatenate([members[pick], np.zeros(len(control), bool)])))

    ks = settings.repeats
    tier_of = np.arange(len(scores)) % len(ks)
    picks = [tier_of == t for t in range(len(ks))]
    tiers = []
    for k, pick in zip(ks, picks):
        n, inside = int(pick.sum()), members[pick]
        eps, delta, line = held_claim(claimed, settings.delta, group_of(k, settings.records_per_user), n)
        if not inside.any() or inside.all():
            eps, delta, line = None, settings.delta, f"{n} canaries, all {'members' if inside.all() else 'non-members'}"
        tiers.append(Tier(k, eps, delta, line or f"held to the claim: eps {claimed}, delta {settings.delta:g}"))
    tested = sum(t.held_eps is not None for t in tiers)
    for tier, pick in zip(tiers, picks):
        if members[pick].any() and not members[pick].all():
            alpha = settings.alpha / tested if tier.held_eps is not None else settings.alpha
            tier.result = with_controls(analyse(scores[pick], members[pick], claimed_epsilon=tier.held_eps,
                                                delta=tier.held_delta, alpha=alpha, score=score), pick)
    if len(tiers) == 1:
        return tiers[0].result, tiers
    everything = np.ones(len(scores), bool)
    return with_controls(analyse(scores, members, delta=settings.delta, alpha=settings.alpha, score=score),
                         everything), tiers


def trainer_name(args) -> str:
    """The trainer a callback runs in, from its arguments' class (a callback never sees the trainer itself):
    TRL's trainers take their own config (SFTConfig -> TRL SFTTrainer), the plain Trainer TrainingArguments."""
    kind = type(args)
    if kind.__module__.split(".")[0] == "trl" and kind.__name__.endswith("Config"):
        return f"TRL {kind.__name__[:-len('Config')]}Trainer"
    return "Hugging Face Trainer"


def tiers_verdict(tiers, claimed) -> tuple[bool, str]:
    """(violation, the verdict in words) over the tested tiers."""
    tested = [t for t in tiers if t.held_eps is not None and t.result is not None]
    for t in tested:
        if t.result.violation:
            return True, f"VIOLATION ({t.copies}x tier): {t.result.verdict}"
    if not tested:
        return False, ("no exposure tier can test the claim (none given, or each tier's group claim is too weak): "
                       "the bounds are reported without a verdict")
    names = ", ".join(f"{t.copies}x at eps {t.held_eps:.4g}" for t in tested)
    if any(t.copies == 1 for t in tested):
        return False, f"consistent with eps = {claimed:.4g} (tiers tested: {names})"
    single = next((t for t in tiers if t.copies == 1), None)
    why = f": the 1x tier was not tested ({single.why})" if single is not None else ": no tier holds single copies"
    return False, (f"consistent with the group claims tested ({names}); the one-example claim eps = {claimed:.4g} was "
                   f"NOT tested{why}")


def tier_lines(tiers, headline) -> dict:
    """Report lines, one per exposure tier (none with a single tier of one copy)."""
    if len(tiers) == 1:
        return {} if tiers[0].copies == 1 else {"claim audited (black-box)": tiers[0].why}
    lines = {"exposure tiers": "each member canary is inserted k times, k by tier; the AUC and TPR above pool them; "
                               "each tier's bound is held to its own (group) claim"}
    for t in tiers:
        r = t.result
        if r is None:
            lines[f"tier {t.copies}x"] = f"not audited: {t.why}"
            continue
        lo, hi = (r.roc.tpr_interval or {}).get(0.01, (None, None))
        ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""
        lines[f"tier {t.copies}x"] = (
            f"m = {r.m} ({r.members} members): AUC {r.roc.auc:.3f}, TPR at 1% FPR {r.roc.tpr_at_fpr.get(0.01, 0):.3f}"
            f"{ci}, eps >= {r.epsilon_lower_bound:.3f} ({r.headline}, alpha {r.alpha:.3g}); {t.why}; "
            f"{r.verdict if t.held_eps is not None else 'no verdict'}")
    return lines


def _losses(model, tokenizer, manifest, pairs):
    return secret_losses(model, tokenizer, manifest, contexts=pairs, show_progress=False)


def regurgitation(model, tokenizer, manifest, settings: _Settings) -> dict:
    """Greedy decoding of each canary's secret length after its context: exact matches, members and non-members."""

    hits = {True: 0, False: 0}
    device = next(model.parameters()).device
    model.eval()
    for c, context in zip(manifest.canaries, contexts(tokenizer, manifest, settings)):
        split = split_secret(tokenizer, context, c.secret)
        if split is None:
            continue
        head, tail = split
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([head], device=device), max_new_tokens=len(tail),
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        hits[c.member] += out[0, len(head):].tolist() == tail
    n_in = sum(c.member for c in manifest.canaries)
    return {"regurgitation (greedy, exact secret)": f"members {hits[True]} of {n_in}, non-members {hits[False]} of "
                                                    f"{len(manifest.canaries) - n_in}"}


def opacus_trainer(trainer_class=None, **kwargs):
    """DP-SGD in the Hugging Face Trainer with Opacus (hf_opacus.py): Poisson sampling, per-example losses, ghost
    clipping, the accountant on the optimizer, so that ``DPAuditCallback`` audits it white-box."""

    return make(trainer_class, **kwargs)
