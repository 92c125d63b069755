"""The audit report folder: report.json, report.md, roc.png (linear and log FPR) and scores.csv.

Every file is written atomically; an existing non-empty folder is only reused with --force.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from dpaudit.atomic import atomic_write_json, atomic_write_text, guard_new_folder
from dpaudit.audit.analysis import AuditResult


def prepare_folder(folder: Path, force: bool) -> Path:
    folder = Path(folder)
    guard_new_folder(folder, force)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def markdown(result: AuditResult, context: dict) -> str:
    d = result.to_dict()
    o, cp = d["one_run"], d["clopper_pearson"]
    lines = [
        "# dpaudit membership-inference audit", "",
        f"**Verdict:** {d['verdict']}", "",
        *(f"- {k}: {v}" for k, v in context.items()),
        f"- canaries: m = {result.m} ({result.members} members, {result.nonmembers} non-members)",
        f"- score: {d['score']}", "",
        "| metric | value |", "|---|---|",
        f"| AUC | {result.roc.auc:.4f} |",
        *(f"| TPR at FPR {float(k):.1%} | {v:.4f} |" for k, v in d["tpr_at_fpr"].items()),
        f"| one-run eps lower bound | {o['epsilon_lower_bound']:.4f} (m={o['m']}, r={o['r']}, "
        f"delta={o['delta']:g}, alpha={o['alpha']:g}; ceiling at this r: {o['ceiling_at_r']:.3f}) |",
        f"| Clopper-Pearson eps lower bound | {cp['epsilon_lower_bound']:.4f} (delta={cp['delta']:g}, "
        f"alpha={cp['alpha']:g}; {cp['note']}) |", "",
        f"Guess counts r tried (fixed in advance): {o['guess_counts_tried']}; alpha split by Bonferroni "
        f"({o['alpha_per_guess_count']:.3g} each).", "",
        "| r | correct | one-run eps | Clopper-Pearson eps |", "|---|---|---|---|",
        *(f"| {b['r']} | {b['correct']} | {b['one_run_epsilon']:.4f} | {b['clopper_pearson_epsilon']:.4f} |"
          for b in d["per_guess_count"]),
        "", "![ROC](roc.png)", "",
    ]
    return "\n".join(lines)


def scores_csv(scores: np.ndarray, members: np.ndarray) -> str:
    buf = io.StringIO()
    buf.write("score,member\n")
    for s, m in zip(scores, members):
        buf.write(f"{float(s)!r},{int(bool(m))}\n")
    return buf.getvalue()


def write_report(folder: Path, result: AuditResult, scores, members, context: dict) -> dict[str, Path]:
    from dpaudit.plots import roc_plot

    folder = Path(folder)
    payload = {**result.to_dict(), "context": context}
    return {
        "json": atomic_write_json(folder / "report.json", payload),
        "markdown": atomic_write_text(folder / "report.md", markdown(result, context)),
        "roc": roc_plot(result.roc.fpr, result.roc.tpr, result.roc.auc, folder / "roc.png"),
        "scores": atomic_write_text(folder / "scores.csv", scores_csv(np.asarray(scores), np.asarray(members))),
    }
