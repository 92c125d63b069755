"""`dpaudit audit checkpoint|scores`: membership inference on canaries, eps lower bounds, and a verdict."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape
import numpy as np

from dpaudit.core.atomic import refuse_overlap
from dpaudit.audit.headlines import headline_help
from dpaudit.cli.common import (
    LONG_TIMEOUT, MODEL_TIMEOUT, ForceOpt, JsonOpt, LazyCommand, ThreadsOpt, bounded, console, emit_json, lazy_group,
)
from dpaudit.core.errors import DPAuditError, PrivacyViolation
from dpaudit.audit.analysis import analyse
from dpaudit.audit.claims import group_claim, run_claims
from dpaudit.audit.correlated import separation_violations
from dpaudit.audit.guesses import check_scores
from dpaudit.audit.report import prepare_folder, write_report
from dpaudit.audit.sampler import analyse_as, read_log
from dpaudit.audit.whitebox import audit_run_folder
from dpaudit.canaries.manifest import load_manifest
from dpaudit.core.safe_json import count_newlines
from dpaudit.core.threads import set_threads
from dpaudit.core.validate import check_number
from dpaudit.workflows.scoring import run_score, score_checkpoint

if TYPE_CHECKING:
    from dpaudit.audit.analysis import AuditResult

RUN = {"run": LazyCommand("train_commands", "audit_run", "Canaries -> insert -> train (DP-ZO/DP-SGD at --eps) -> "
                          "score -> report; exit 1 on a violation.")}
app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, add_completion=False, cls=lazy_group(RUN),
                  help="Membership-inference audits against a claimed eps.")

ClaimedOpt = Annotated[Optional[float], typer.Option(
    "--claimed-eps", help="The eps the training claims (default: the run's, when the file sits in a run folder).")]
AuditDeltaOpt = Annotated[Optional[float], typer.Option(
    "--delta", help="The delta the training claims. Default: the run's; required when no run folder says it.")]
AlphaOpt = Annotated[float, typer.Option("--alpha", help="1 - confidence of every eps lower bound.")]
GuessesOpt = Annotated[Optional[list[int]], typer.Option(
    "--guesses", "-k", help="Two-sided guess counts r to try (repeatable), fixed in advance; alpha is split over "
                            "them. Default: 2%, 5%, 10%, 20%, 50%, 100% of m.")]
ReportOpt = Annotated[Optional[Path], typer.Option("--report", help="Write report.json/.md, roc.png, scores.csv here.")]
HeadlineOpt = Annotated[str, typer.Option(
    "--headline", help=headline_help())]


def resolve_claims(where: Path, claimed_eps: float | None, delta: float | None) -> tuple[float | None, float, dict]:
    """The audit's claimed eps and delta: given, or the run's; a missing delta is an error, never 0."""

    claims = run_claims(where) or {}
    if delta is None:
        delta = claims.get("delta")
        if delta is None:
            raise DPAuditError(f"give --delta: nothing next to {where} says which delta the run claimed "
                               "(the bound depends on it; 0 would inflate it)")
    if claimed_eps is None:
        claimed_eps = claims.get("epsilon")
    context = {k: v for k, v in claims.items() if v is not None and k not in ("white_box",)}
    return claimed_eps, delta, context


def present(result: AuditResult, context: dict, as_json: bool, *, report: Path | None = None, force: bool = False,
            scores=None, members=None, extra: dict | None = None) -> None:
    """Print (or emit) the audit, write the report folder, and exit 1 on a violation."""
    from rich.table import Table

    files = {}
    if report is not None:
        files = {k: str(v) for k, v in write_report(prepare_folder(report, force), result, scores, members,
                                                     context).items()}
    extra = extra or {}
    files = files or extra.get("report_files", {})
    if as_json:
        emit_json({**result.to_dict(), "context": context, **extra, "report_files": files})
    else:
        d = result.to_dict()
        table = Table(title="membership-inference audit", show_header=False)
        for k, v in context.items():
            table.add_row(k, escape("-" if v is None else str(v)))  # a non-private run has no sigma: "-", not None
        table.add_row("canaries", f"m = {result.m} ({result.members} members)")
        table.add_row("score", escape(result.score.name))
        table.add_row("AUC", f"{result.roc.auc:.4f}")
        allowed = d.get("claim_ceiling", {}).get("tpr_at_fpr", {})
        for k, v in d["tpr_at_fpr"].items():
            if float(k) * result.nonmembers >= 1:  # fewer non-members cannot resolve this FPR
                most = allowed.get(k)
                ceiling = f"  (the claim allows at most {most['max_tpr']:.4f})" if most else ""
                if most and v > most["max_tpr"] and not result.violation:  # as report.md says it
                    negatives = d["canaries"]["roc_negatives"]
                    ceiling += (f": above it, not a violation (the FPR is measured on {negatives} non-members, "
                                f"{float(k) * negatives:.3g} at this FPR; only the headline bound, which pays for its "
                                "chance, decides)")
                table.add_row(f"TPR at FPR {float(k):.1%}", f"{v:.4f}{ceiling}")
        if "claim_ceiling" in d:
            c = d["claim_ceiling"]
            table.add_row("claim's ceiling from", escape(c.get("computed_from") or f"none: {c.get('why')}"))
        for name, b in result.bounds.items():
            mu = f", mu >= {b.mu:.3f}" if b.mu is not None else ""
            where = f", {b.tests} tests" if b.tests > 1 else ""
            mark = " (headline)" if name == result.headline else ""
            table.add_row(f"eps lower bound: {name}{mark}", escape(f"{b.epsilon:.4f}  [delta={b.delta:g}, "
                                                                   f"alpha={b.alpha:g}{where}{mu}]"))
        console.print(table, width=min(console.width, TABLE_WIDTH))  # in a pipe too: long cells wrap inside
        style = "bold red" if result.violation else "bold green"
        console.print(f"[{style}]{escape(result.verdict)}[/{style}]", highlight=False)
        console.print(f"headline: {result.headline}; valid for {escape(result.headline_bound.valid_for)}",
                      highlight=False)
        if files:
            console.print(f"report: {Path(files['markdown']).parent}", highlight=False)
    if result.violation:
        raise typer.Exit(1)


TABLE_WIDTH = 120  # the audit's table, whatever the terminal (a pipe's console is unbounded: lines never wrap)
MAX_SCORES = 1_000_000  # rows of a scores CSV (white-box DP-SGD audits use up to 5000; canary audits up to 1e5)


def read_scores(path: Path):
    """(scores, members) as numpy arrays from a score,member CSV."""

    if not path.is_file():
        raise DPAuditError(f"scores file not found: {path}")

    rows_at_most = count_newlines(path, "scores file") + 1
    if rows_at_most > MAX_SCORES + 1:
        raise DPAuditError(f"{path} has {rows_at_most - 1} rows; an audit takes at most {MAX_SCORES} canaries' scores")
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DPAuditError(f"cannot read scores file {path}: {exc}") from None
    if not rows or not {"score", "member"} <= set(rows[0]):
        raise DPAuditError(f"{path} needs a header with columns score,member and at least one row")
    truth = {"1": True, "0": False, "true": True, "false": False}
    try:
        scores = np.array([float(r["score"]) for r in rows])
        members = np.array([truth[r["member"].strip().lower()] for r in rows])
    except (ValueError, KeyError, AttributeError) as exc:
        raise DPAuditError(f"{path}: every row needs a number score and member 0/1 ({exc})") from None
    return scores, members


@bounded("dpaudit audit scores", LONG_TIMEOUT, None)
def audit_scores(
    scores_file: Annotated[Path, typer.Argument(help="CSV with columns score,member (higher score = member).")],
    claimed_eps: ClaimedOpt = None,
    delta: AuditDeltaOpt = None,
    alpha: AlphaOpt = 0.05,
    guesses: GuessesOpt = None,
    score: Annotated[Optional[str], typer.Option(
        "--score", help="What the score is: neg-loss, loss-vs-base, white-box-dp-sgd, white-box-dp-zo or unnamed "
                        "(default: the report's, else unnamed).")] = None,
    headline: HeadlineOpt = "auto",
    report: ReportOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Audit precomputed canary scores; exit 1 if the empirical eps exceeds the claimed eps."""

    if report is not None:
        refuse_overlap(report, {"scores file": scores_file}, folder_output=True)
    claimed_eps, delta, context = resolve_claims(scores_file, claimed_eps, delta)
    score = score or context.pop("score", None) or "unnamed"  # the report's score, read with its claims
    scores, members = read_scores(scores_file)
    result = analyse(scores, members, claimed_epsilon=claimed_eps, delta=delta, alpha=alpha, guess_counts=guesses,
                     score=score, headline=headline, mechanism=context.get("mechanism"))
    present(result, {"scores": str(scores_file), **context}, as_json, report=report, force=force, scores=scores,
            members=members)


@bounded("dpaudit audit checkpoint", MODEL_TIMEOUT, None)
def audit_checkpoint(
    model: Annotated[Path, typer.Option("--model", help="Local Hugging Face causal-LM directory (or a .gguf file).")],
    canaries: Annotated[Path, typer.Option("--canaries", "-c", help="Canary manifest (JSON).")],
    claimed_eps: ClaimedOpt = None,
    delta: AuditDeltaOpt = None,
    alpha: AlphaOpt = 0.05,
    guesses: GuessesOpt = None,
    score: Annotated[Optional[str], typer.Option(
        "--score", help="neg-loss (-loss of the secret), loss-vs-base (needs --base: the loss drop from the "
                        "base model), or user-inference (canary users with held-out records, needs --base: the "
                        "mean loss drop on each user's records never trained, Kandpal et al. 2023). Default: "
                        "loss-vs-base with --base, or for the model of an `audit run` that trained new-token rows "
                        "only (against its extended model); otherwise neg-loss.")] = None,
    base: Annotated[Optional[Path], typer.Option(
        "--base", help="The model before training (the extended model), for --score loss-vs-base.")] = None,
    headline: HeadlineOpt = "auto",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Canaries per forward pass.")] = 32,
    repeat: Annotated[int, typer.Option(
        "--repeat", "-r", help="Copies of each member canary in the training data (canaries insert --repeat): the "
                               "claim is then held as group privacy of that many examples.")] = 1,
    threads: ThreadsOpt = None,
    report: ReportOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Score each canary's secret on a checkpoint, then audit; exit 1 on a violation."""

    set_threads(threads)
    if report is not None:
        refuse_overlap(report, {"model": model, "canary manifest": canaries, "base model": base}, folder_output=True)
    manifest = load_manifest(canaries)
    members = [c.member for c in manifest.canaries]
    if not any(members) or all(members):  # refuse before the slow scoring, not after it
        check_scores(np.zeros(len(members)), np.array(members, bool))
    claimed_eps, delta, context = resolve_claims(model, claimed_eps, delta)
    if repeat < 1:
        raise DPAuditError(f"--repeat must be >= 1, got {repeat}")

    # what a member adds: its copies, times a canary user's records (read from the manifest); a user-level claim
    # of k records a user covers a canary user of up to k
    records = repeat * (1 + len(manifest.canaries[0].others))
    covered = context.get("privacy unit") == "user" and records <= (context.get("records per user") or 0)
    claimed_eps, delta, group = group_claim(claimed_eps, delta, 1 if covered else records)
    if group:
        context["claim audited"] = group
    if score is None and base is not None:
        score = "loss-vs-base"
    elif score is None:
        score, base, why = run_score(model)
        if why:
            context["score chosen"] = why
    if score not in ("neg-loss", "loss-vs-base", "user-inference"):
        raise DPAuditError(f"a checkpoint is scored with neg-loss, loss-vs-base or user-inference, not {score!r}")
    if (score != "neg-loss") != (base is not None):
        raise DPAuditError(f"--score {score} {'needs' if base is None else 'takes no'} --base (the model before "
                           "training, for loss-vs-base and user-inference)")
    if report is not None:
        prepare_folder(report, force)  # fail before the slow part
    scores, members = score_checkpoint(model, manifest, score=score, base=base, batch_size=batch_size,
                                       show_progress=not as_json)
    result = analyse(scores, members, claimed_epsilon=claimed_eps, delta=delta, alpha=alpha, guess_counts=guesses,
                     score=score, headline=headline, mechanism=context.get("mechanism"))
    present(result, {"model": str(model), "canary manifest": str(canaries), **context}, as_json, report=report,
            force=True, scores=scores, members=members)


@bounded("dpaudit audit transcript", LONG_TIMEOUT, None)
def audit_transcript(
    run: Annotated[Path, typer.Option("--run", help="A run folder trained with --white-box M.")],
    claimed_eps: ClaimedOpt = None,
    delta: AuditDeltaOpt = None,
    alpha: AlphaOpt = 0.05,
    headline: HeadlineOpt = "auto",
    sample_rate: Annotated[float | None, typer.Option(
        "--sample-rate", help="A PipelineProbe folder whose batches were logged: the rate the run is accounted with; "
                              "the member canaries' inclusions are tested against it (half of alpha); where they "
                              "pass and the steps are independent, the scores are read through the run's own "
                              "family.")] = None,
    report: ReportOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """White-box audit of a run's transcript (DP-SGD canary-aligned releases, DP-ZO (seed, scalar) log, a probe's
    folder)."""

    if sample_rate is not None:
        check_number("--sample-rate", sample_rate, above=0, at_most=1)
    if report is not None:
        refuse_overlap(report, {"run": run}, folder_output=True)
    claimed_eps, delta, context = resolve_claims(run, claimed_eps, delta)

    try:
        result, scores, members, facts = audit_run_folder(run, claimed_epsilon=claimed_eps, delta=delta,
                                                          alpha=alpha, headline=headline, sample_rate=sample_rate)
    except PrivacyViolation as exc:  # no release to score, but the model was trained outside DP
        if as_json:
            emit_json({"command": "audit transcript", "run": str(run), "violation": True, "verdict": str(exc)})
        else:
            console.print(f"[bold red]{escape(str(exc))}[/bold red]", highlight=False)
        raise typer.Exit(1) from None
    context.update({k: v for k, v in facts.items() if not isinstance(v, dict)})
    present(result, {"run": str(run), **context}, as_json, report=report, force=force, scores=scores,
            members=members)


@bounded("dpaudit audit sampler", LONG_TIMEOUT, None)
def audit_sampler(
    log: Annotated[Path, typer.Option("--log", help="The run's batches: one a line, a JSON list of example indices "
                                                    "or indices separated by commas or spaces.")],
    dataset_size: Annotated[Optional[int], typer.Option(
        "--dataset-size", "-N", help="Examples in the dataset (default: the largest index + 1).")] = None,
    p: Annotated[Optional[float], typer.Option("--p", help="The sampling rate the run claims (default: estimated "
                                                           "from the batches).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(
        "--batch-size", "-B", help="The batch size B (balls-in-bins: t = N // B steps an epoch).")] = None,
    sampling: Annotated[str, typer.Option(
        "--sampling", help="The sampler the run accounts (poisson, fixed, shuffle, balls-in-bins): exit 0 when the "
                           "log matches it.")] = "poisson",
    alpha: AlphaOpt = 0.05,
    bands: Annotated[Optional[int], typer.Option(
        "--bands", help="A BandMF run (--noise bandmf,b=B): check the cyclic separation its accounting needs, every "
                        "example's participations at least B steps apart (exact; exit 1 naming the first that is "
                        "not).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Test whether a run's batches are what its accounting assumes (Poisson by default, or --sampling NAME);
    exit 1 when they are not, naming what the sampler looks like (Poisson, fixed-size, shuffled epochs, cyclic,
    balls-in-bins, with replacement)."""

    if bands is not None:
        _cyclic_separation(log, bands, as_json)
        return

    verdict, matches, observed = analyse_as(read_log(log), sampling, dataset_size, p, batch_size, alpha)
    if as_json:
        emit_json({"command": "audit sampler", "log": str(log), "sampling": sampling, "matches": matches,
                   "observed_sampling": observed, **verdict.to_dict()})
    else:
        style = "green" if matches else "bold red"
        said = verdict.verdict if sampling == "poisson" else (
            f"{'consistent with' if matches else 'NOT'} {sampling} sampling: the log looks like "
            f"{verdict.looks_like} (alpha = {alpha:g})")
        console.print(f"[{style}]{escape(said)}[/{style}]", highlight=False)
        for name in ("batch sizes", "inclusions per example"):
            t = verdict.tests[name]
            console.print(f"  {name}: dispersion {t['dispersion']:.3g} (1 for Poisson; p too uniform "
                          f"{t['p_too_uniform']:.2g}, too variable {t['p_too_variable']:.2g})", highlight=False)
        most = verdict.tests["most inclusions of one example"]
        console.print(f"  most inclusions of one example: {most['count']} (example {most['example']}; "
                      f"{most['expected']:.3g} expected, p {most['p_value']:.2g})", highlight=False)
        for note in verdict.notes:
            console.print(f"  note: {escape(note)}", highlight=False)
    if not matches:
        raise typer.Exit(1)


def _cyclic_separation(log: Path, bands: int, as_json: bool) -> None:
    """``audit sampler --bands B``: the exact separation check of audit/correlated.py on the log."""

    if bands < 1:
        raise DPAuditError(f"--bands must be >= 1, got {bands}")
    batches = list(read_log(log))
    if not batches:  # nothing to check is no evidence of separation: a refusal, as the Poisson mode's
        raise DPAuditError(f"{log} holds no batch; give the log of the run's batches (one line a step)")
    negative = next(((step, i) for step, batch in enumerate(batches) for i in batch if i < 0), None)
    if negative is not None:
        raise DPAuditError(f"{log}:{negative[0] + 1}: example index {negative[1]} is negative; a log holds the "
                           "examples' indices (0 to N - 1)")
    found = separation_violations(batches, bands)
    if as_json:
        emit_json({"command": "audit sampler", "log": str(log), "bands": bands, "matches": not found,
                   "violations": len(found), "first": list(found[0]) if found else None})
    elif found:
        example, step, earlier = found[0]
        console.print(f"[bold red]VIOLATION: {len(found)} participation(s) closer than b = {bands} steps; the first: "
                      f"example {example} at steps {earlier} and {step}. BandMF's accounting needs every example's "
                      "participations at least b steps apart[/bold red]", highlight=False)
    else:
        console.print(f"[green]every example's participations are at least b = {bands} steps apart (the cyclic "
                      "separation BandMF's accounting needs; the rate within the groups is not tested here)[/green]",
                      highlight=False)
    if found:
        raise typer.Exit(1)


app.command("scores")(audit_scores)
app.command("sampler")(audit_sampler)
app.command("transcript")(audit_transcript)
app.command("checkpoint")(audit_checkpoint)
