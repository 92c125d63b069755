"""The audit report folder: report.json, report.md, roc.png (linear and log FPR) and scores.csv.

Every file is written atomically; an existing non-empty folder is only reused with --force.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from dpaudit.core.atomic import atomic_write_json, atomic_write_text, guard_new_folder
from dpaudit.audit.analysis import AuditResult
from dpaudit.core.lock import mark
from dpaudit.core.plots import roc_plot


def prepare_folder(folder: Path, force: bool) -> Path:
    folder = Path(folder)
    guard_new_folder(folder, force)
    folder.mkdir(parents=True, exist_ok=True)
    mark(folder)
    return folder


_MARKDOWN_SPECIAL = set("\\`*_{}[]()<>#+!|~")


def md(value) -> str:
    """A value from a file, a path or a user's flag, made inert in Markdown: one line, every Markdown
    character escaped (no fake headings, bold verdict lines, links, HTML or table cells), and a leading
    = + - @ defused so a spreadsheet that imports the table never reads a formula."""
    if not isinstance(value, str):
        return md(str(value)) if value is not None else "-"
    text = " ".join(value.split())
    text = "".join("\\" + c if c in _MARKDOWN_SPECIAL else c for c in text)
    if text[:1] in ("=", "@") or (text[:1] == "-" and text[1:2] not in ("", ".") and not text[1].isdigit()):
        text = "'" + text
    return text


def _num(x) -> str:
    return x if isinstance(x, str) else "-" if x is None else f"{x:.4f}"


def _kv(bound: dict) -> str:
    return "-" if bound["k"] is None else f"{bound['k']}, {bound['v']}"


def decided_by(parts: dict, violated: dict) -> dict:
    """The bound that decides a verdict made of several audits (``parts``: {name: AuditResult}; ``violated``:
    {name: whether it reads VIOLATION}): the first part that reads VIOLATION, else the part with the largest bound;
    each part's bound beside it. What report.json's epsilon_lower_bound and the headline then say."""
    name = next((n for n in parts if violated[n]), None) or max(parts, key=lambda n: parts[n].epsilon_lower_bound)
    eps = parts[name].epsilon_lower_bound
    return {"from": name, "bound": parts[name].headline, "epsilon_lower_bound": eps if np.isfinite(eps) else "inf",
            "parts": {n: (r.epsilon_lower_bound if np.isfinite(r.epsilon_lower_bound) else "inf")
                      for n, r in parts.items()}}


def markdown(result: AuditResult, context: dict, verdict: tuple[str, bool] | None = None,
             decided: dict | None = None) -> str:
    d = result.to_dict()
    head = d["headline"]
    own = (f"{_num(d['epsilon_lower_bound'])} ({head['bound']}, delta = {result.delta:g}, alpha = {result.alpha:g}). "
           f"Why it is valid: {head['why_valid']}. Valid for: {head['valid_for']}.")
    lines = [
        "# dpaudit membership-inference audit", "",
        f"**Verdict:** {verdict[0] if verdict else d['verdict']}", "",
        *([f"- this audit's own verdict (the pooled scores below): {d['verdict']}", ""]
          if verdict and verdict[0] != d["verdict"] else []),
        *([f"**Headline eps lower bound:** {_num(decided['epsilon_lower_bound'])}, from the {decided['from']} "
           f"({decided['bound']}): the bound that decided the verdict; "
           + ", ".join(f"{n} {_num(v)}" for n, v in decided["parts"].items()) + ".", "",
           f"- the {next(iter(decided['parts']))} headline below: {own}", ""] if decided else
          [f"**Headline eps lower bound:** {own}", ""]),
        *_reach(result, d), 
        *(f"- {md(k)}: {md(v)}" for k, v in context.items()),
        f"- canaries: m = {result.m} ({result.members} members, {result.nonmembers} non-members)",
        *([f"- the member canaries' inclusions in the steps' batches (sampler audit at alpha / 2, the eps bounds at "
           f"the other half): {result.sampler.verdict}"] if result.sampler is not None else []),
        *([f"- per-example clipping (canaries of two sizes, at alpha {result.clipping.alpha:g}): "
           f"{result.clipping.verdict}"] if getattr(result, "clipping", None) is not None else []),
        *([f"- per-tensor noise (each tensor's canary releases against the accounted noise, at alpha "
           f"{result.noise.alpha:g}): {result.noise.verdict}"] if getattr(result, "noise", None) is not None else []),
        *([f"- sample rate: {result.rate.verdict}"] if getattr(result, "rate", None) is not None else []),
        *([f"- never-inserted controls among the ROC's non-members: {result.roc.negatives - result.nonmembers} (in the "
           "AUC and TPR only, never in a bound)"] if result.roc.negatives > result.nonmembers else []),
        f"- score: {result.score.name}: {result.score.description}", "",
        "| metric | value | the claim allows at most | share of it |", "|---|---|---|---|",
        f"| AUC | {result.roc.auc:.4f} | | |",
        *(f"| TPR at FPR {float(k):.1%} | {v:.4f}{_interval(d, k)} | {_allowed(d, k)} |" for k, v in
          d["tpr_at_fpr"].items() if k not in d["tpr_at_fpr_withheld"]),
        "", _ceiling_line(d), "",
        "Every bound below holds on its own with probability >= 1 - alpha; only the headline decides the verdict.",
        "", "| bound | eps | mu | guesses (tests paid for) | at | k guesses, v right | ceiling | valid for |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {name}{' (headline)' if name == head['bound'] else ''} | {_num(b['epsilon'])} | {_num(b['mu'])} | "
          f"{b['guesses']} ({b['tests']}) | {b['at'] or '-'} | "
          f"{_kv(b)} | {_num(b['ceiling'])} | {b['valid_for']} |"
          for name, b in d["bounds"].items()),
        "", "Columns: *guesses* is how the guess sets were chosen (fixed before the labels were looked at) and, "
        "in brackets, how many distinct guess sets alpha was split over (equal sets are merged, so this can be "
        "fewer than the grid's counts); *at* is the guess set that gave the bound; *k guesses, v right* its size "
        "and correct guesses; *ceiling* is what the bound would be had all k guesses been right, the most this "
        "audit could certify with that guess set at this m and alpha (where no guess set gave a bound above 0, "
        "the most any of them could have given).",
        "", "![ROC](roc.png)", "",
    ]
    return "\n".join(lines)


def _allowed(d: dict, k: str) -> str:
    row = d.get("claim_ceiling", {}).get("tpr_at_fpr", {}).get(k)
    if row is None:
        return "none | "
    share = f"{row['share']:.0%}" if row["share"] is not None else "-"
    return f"{row['max_tpr']:.4f} | {share}{_above_why(d, k, row)}"


def _above_why(d: dict, k: str, row: dict) -> str:
    """Why a measured TPR above the claim's ceiling is not a violation, said on its own line of the table."""
    if row["share"] is None or row["share"] <= 1 or d["violation"]:
        return ""
    lo_hi = d.get("tpr_interval", {}).get(k)
    negatives = d["canaries"].get("roc_negatives", d["canaries"]["nonmembers"])  # the ROC's: controls included
    controls = negatives - d["canaries"]["nonmembers"]
    inside = (f"the 95 % interval reaches down to {lo_hi[0]:.3f}, below it; " if lo_hi and lo_hi[0] <= row["max_tpr"]
              else "")
    return (f" (above the ceiling, not a violation: {inside}the FPR itself is measured on {negatives} non-members"
            + (f" ({controls} of them never-inserted controls)" if controls > 0 else "") + ", "
            f"so FPR {float(k):.1%} is {float(k) * negatives:.3g} of them; only the headline bound, which pays for "
            "its chance, decides)")


def _ceiling_line(d: dict) -> str:
    c = d.get("claim_ceiling")
    if c is None or c["source"] == "none":
        return f"The claim's ceiling: none ({c['why'] if c else 'no claim'})."
    return (f"The claim's ceiling (\"allows at most\"): the largest TPR at that FPR that any membership test can "
            f"reach against a run meeting the claim, from {c['computed_from']}; an upper bound. The ROC plot shades "
            "the region the claim forbids: a curve inside it is a violation, and the gap to it is what the attack "
            "left on the table.")


def _forbidden(result: AuditResult):
    c = result.ceiling
    return None if c is None or c.tpr is None else (c.fpr, c.tpr)


def _interval(d: dict, k: str) -> str:
    lo_hi = d.get("tpr_interval", {}).get(k)
    return f" (95 % Clopper-Pearson {lo_hi[0]:.3f} to {lo_hi[1]:.3f})" if lo_hi else ""


def _reach(result: AuditResult, d: dict) -> list[str]:
    """In words a reviewer reads: what this audit could have refuted (its power), beside "consistent": the headline
    bound of the same audit on perfect scores (``refutable_ceiling`` in report.json, the oracle the pre-training
    power note uses too), never one guess set's ceiling."""
    ceiling = result.refutable
    if result.violation or ceiling is None:
        return []
    words = f"{ceiling:.3g}" if math.isfinite(ceiling) else "inf"
    claim = result.claimed_epsilon
    beyond = (f" The claim eps = {claim:.4g} is at or above it: this audit could not have refuted it."
              if claim is not None and ceiling <= claim else "")
    return [f"**What this audit can refute:** with m = {result.m} canaries ({result.members} members) at alpha = "
            f"{result.alpha:g}, the headline bound cannot exceed {words}, even with every guess right (the same "
            f"audit on perfect scores): a claim above eps = {words} could not have been refuted by this audit "
            f"whatever the run leaked, and claims near it only by a strong leak.{beyond} \"Consistent\" means no "
            "evidence of leakage beyond the claim, not a proof of privacy (more canaries, or a white-box audit, reach "
            "further).",
            ""]


def scores_csv(scores: np.ndarray, members: np.ndarray) -> str:
    buf = io.StringIO()
    buf.write("score,member\n")
    for s, m in zip(scores, members):
        buf.write(f"{float(s)!r},{int(bool(m))}\n")
    return buf.getvalue()


def write_report(folder: Path, result: AuditResult, scores, members, context: dict,
                 verdict: tuple[str, bool] | None = None, decided: dict | None = None) -> dict[str, Path]:
    """``verdict``: (words, violation) decided beyond ``result`` (a white-box audit beside it, exposure tiers);
    it replaces the result's own verdict at the top, which stays in the report as "this audit's verdict".
    ``decided`` (decided_by): the bound that decided it, which epsilon_lower_bound and the headline then are, with
    each part's bound beside it (this result's own stays as "this audit's epsilon_lower_bound")."""

    folder = Path(folder)
    payload = {**result.to_dict(), "context": context}
    if verdict is not None:
        payload = {**payload, "verdict": verdict[0], "violation": verdict[1], "this audit's verdict": result.verdict}
    if decided is not None:
        payload = {**payload, "epsilon_lower_bound": decided["epsilon_lower_bound"], "verdict_bound": decided,
                   "this audit's epsilon_lower_bound": payload["epsilon_lower_bound"]}
    return {
        "json": atomic_write_json(folder / "report.json", payload),
        "markdown": atomic_write_text(folder / "report.md", markdown(result, context, verdict, decided)),
        "roc": roc_plot(result.roc.fpr, result.roc.tpr, result.roc.auc, folder / "roc.png", score=result.score.name,
                        forbidden=_forbidden(result)),
        "scores": atomic_write_text(folder / "scores.csv", scores_csv(np.asarray(scores), np.asarray(members)),
                                    private=True),  # it holds the membership labels, as the manifest does (0600)
    }
