"""`dpaudit audit checkpoint|scores`: membership inference on canaries, eps lower bounds, and a verdict."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.table import Table

from dpaudit.audit.analysis import AuditResult, analyse
from dpaudit.audit.report import prepare_folder, write_report
from dpaudit.canaries.manifest import load_manifest
from dpaudit.cli.common import ForceOpt, JsonOpt, console, emit_json
from dpaudit.errors import DPAuditError

app = typer.Typer(no_args_is_help=True, help="Membership-inference audits against a claimed eps.")

ClaimedOpt = Annotated[Optional[float], typer.Option("--claimed-eps", help="The eps the training claims.")]
AuditDeltaOpt = Annotated[float, typer.Option("--delta", help="The delta the training claims.")]
AlphaOpt = Annotated[float, typer.Option("--alpha", help="1 - confidence of the eps lower bounds.")]
GuessesOpt = Annotated[Optional[list[int]], typer.Option(
    "--guesses", "-k", help="Guess counts r to try (repeatable), fixed in advance; alpha is split over them. "
                            "Default: 2%, 5%, 10%, 20%, 50%, 100% of m.")]
ReportOpt = Annotated[Optional[Path], typer.Option("--report", help="Write report.json/.md, roc.png, scores.csv here.")]


def present(result: AuditResult, context: dict, as_json: bool, *, report: Path | None = None, force: bool = False,
            scores=None, members=None, extra: dict | None = None) -> None:
    """Print (or emit) the audit, write the report folder, and exit 1 on a violation."""
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
            table.add_row(k, str(v))
        table.add_row("canaries", f"m = {result.m} ({result.members} members)")
        table.add_row("AUC", f"{result.roc.auc:.4f}")
        for k, v in d["tpr_at_fpr"].items():
            table.add_row(f"TPR at FPR {float(k):.1%}", f"{v:.4f}")
        o = d["one_run"]
        table.add_row("eps lower bound (one run)",
                      f"{o['epsilon_lower_bound']:.4f}  [m={o['m']}, r={o['r']}, delta={o['delta']:g}, "
                      f"alpha={o['alpha']:g}, ceiling {o['ceiling_at_r']:.3f}]")
        table.add_row("eps lower bound (Clopper-Pearson)", f"{result.clopper_pearson_epsilon:.4f}")
        console.print(table)
        style = "bold red" if result.violation else "bold green"
        console.print(f"[{style}]{result.verdict}[/{style}]", highlight=False)
        if files:
            console.print(f"report: {Path(files['markdown']).parent}", highlight=False)
    if result.violation:
        raise typer.Exit(1)


def read_scores(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DPAuditError(f"scores file not found: {path}")
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


def audit_scores(
    scores_file: Annotated[Path, typer.Argument(help="CSV with columns score,member (higher score = member).")],
    claimed_eps: ClaimedOpt = None,
    delta: AuditDeltaOpt = 0.0,
    alpha: AlphaOpt = 0.05,
    guesses: GuessesOpt = None,
    report: ReportOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Audit precomputed canary scores; exit 1 if the empirical eps exceeds the claimed eps."""
    scores, members = read_scores(scores_file)
    result = analyse(scores, members, claimed_epsilon=claimed_eps, delta=delta, alpha=alpha, guess_counts=guesses)
    present(result, {"scores": str(scores_file)}, as_json, report=report, force=force, scores=scores, members=members)


def audit_checkpoint(
    model: Annotated[Path, typer.Option("--model", help="Local Hugging Face causal-LM directory (or a .gguf file).")],
    canaries: Annotated[Path, typer.Option("--canaries", "-c", help="Canary manifest (JSON).")],
    claimed_eps: ClaimedOpt = None,
    delta: AuditDeltaOpt = 0.0,
    alpha: AlphaOpt = 0.05,
    guesses: GuessesOpt = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Canaries per forward pass.")] = 32,
    report: ReportOpt = None,
    force: ForceOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Score each canary's secret token on a checkpoint, then audit; exit 1 on a violation."""
    from dpaudit.audit.scoring import score_checkpoint
    from dpaudit.models.loading import load_causal_lm

    manifest = load_manifest(canaries)
    if report is not None:
        prepare_folder(report, force)  # fail before the slow part
    lm, tok = load_causal_lm(model)
    scores, members = score_checkpoint(lm, tok, manifest, str(model), batch_size=batch_size,
                                       show_progress=not as_json)
    result = analyse(scores, members, claimed_epsilon=claimed_eps, delta=delta, alpha=alpha, guess_counts=guesses)
    present(result, {"model": str(model), "canaries": str(canaries)}, as_json, report=report, force=True,
            scores=scores, members=members)


app.command("scores")(audit_scores)
app.command("checkpoint")(audit_checkpoint)
