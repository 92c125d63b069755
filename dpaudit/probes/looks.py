"""A watched probe's looks: the white-box audit made while the run trains (``WhiteBoxProbe.watch``).

A look at step ``first``, then at every doubling of the steps, each the probe's audit of the steps released so far
at level alpha / (j (j + 1)) for look j: the levels sum to alpha over every look however long the run (a union
bound), so a correct run raises a false alarm with probability <= alpha in all. With a planned length, one more
look at that step takes alpha / 2 and the series the other half. Each look is a line of ``RUNNING``; a look that
reads VIOLATION keeps its report in ``LOOKS``/step-N/ and acts as the user asked (warn, stop, raise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpaudit.core.atomic import atomic_write_text
from dpaudit.core.errors import DPAuditError, PrivacyViolation
from dpaudit.core.run_record import stamped, unstamped
from dpaudit.core.validate import check_alpha, check_count

ON_VIOLATION = ("warn", "stop", "raise")  # what a watched probe does at its first look that reads VIOLATION
WATCH_FIRST = 16  # a watched probe's first look (steps); then one at every doubling of the steps
STOP_ALPHA = 0.01  # the looks' level over a whole run by default: a correct run is stopped in at most 1 % of runs
LOOKS = "looks"  # a look that reads VIOLATION keeps its report here (looks/step-N/), apart from the end-of-run one
RUNNING = "running.jsonl"  # a watched probe's looks, one JSON line each


@dataclass
class Watch:
    """What a watched probe audits against, and where its series of looks stands."""
    delta: float
    claimed: float | None      # the claim given, or None: the accountant's eps after the steps so far
    accountant: Any
    alpha: float
    on: str                    # ON_VIOLATION
    next: int                  # the step of the next look of the series
    look: int                  # looks of the series made (a resumed probe's included)
    final: int | None          # the planned run's last look, until made
    split: bool                # a planned length halves the series' alpha


def start(out: Path, step: int, *, delta: float, claimed_eps, accountant, alpha: float, on_violation: str,
          first: int, planned_steps: int | None, has_claim: bool) -> Watch:
    """The watch of a probe at ``step`` whose folder is ``out`` (a resumed probe goes on with the looks, and the
    alpha, it has spent). ``has_claim``: the probe can get a claim (given, or an accountant).

    A look at step ``first``, then at every doubling of the steps (16, 32, 64, ...), each the same audit as the
    probe's ``audit()`` on the steps released so far, held to the claim for those steps (``claimed_eps`` if given,
    else the accountant's eps after them, the optimizer's when attached). Look j is made at level
    alpha / (j (j + 1)), which sums to alpha over every look however long the run: a union bound, so a correct run
    raises a false alarm with probability <= alpha in all. Each look is a line of ``running.jsonl`` in the probe's
    folder. At the first look that reads VIOLATION the report is written and ``on_violation`` acts: "warn" prints
    one line; "stop" also sets ``stop_requested`` (the Hugging Face callback then stops the Trainer; a plain loop
    checks it); "raise" raises ``PrivacyViolation``. The end-of-run ``audit()`` is a separate test at its own alpha.

    Given ``planned_steps`` (the Hugging Face callback passes the Trainer's ``max_steps``), one more look is made at
    that step, at level alpha / 2, and the looks before it share the other half (look j at alpha / (2 j (j + 1))):
    still alpha over every look, and the last look, over the whole planned run, is nearly as strong as the
    end-of-run audit (alpha / 2 against alpha) instead of seeing only the steps up to the last doubling. Looks after
    it (a run that goes on) keep to the first half's series."""
    if on_violation not in ON_VIOLATION:
        raise DPAuditError(f"on_violation must be one of {', '.join(ON_VIOLATION)}, got {on_violation!r}")
    if not delta or not 0 < float(delta) < 1:
        raise DPAuditError("give the delta the run claims (the bound depends on it)")
    check_alpha(alpha)
    check_count("first", first, 1)
    if planned_steps is not None:
        check_count("planned_steps", planned_steps, 1)
    if not has_claim:
        raise DPAuditError("a watched probe needs the claim: claimed_eps= or an accountant")
    looks, final_done = running_looks(out)
    nxt = first
    while nxt <= step:
        nxt *= 2
    final = None if planned_steps is None or final_done or planned_steps <= step else planned_steps
    return Watch(delta=float(delta), claimed=claimed_eps, accountant=accountant, alpha=alpha, on=on_violation,
                 next=nxt, look=looks, final=final, split=planned_steps is not None)


def running_looks(out: Path) -> tuple[int, bool]:
    """The looks of the alpha series spent so far, and whether the planned run's final look was made."""
    path = Path(out) / RUNNING
    if not path.is_file():
        return 0, False
    if path.is_symlink():
        raise DPAuditError(f"{path} is a symbolic link; refusing to append to it")
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = [line for line in fh.read(1 << 24).splitlines() if line.strip()]
    lines = []
    for k, line in enumerate(text):
        try:
            value = json.loads(line)
            if not isinstance(value, dict):
                raise ValueError
        except ValueError:
            if k != len(text) - 1:
                raise DPAuditError(f"{path}: line {k + 1} is not as a watched probe writes it") from None
            # a kill during the last append: that look was made (its alpha spent) though its line is torn;
            # counted as a look of the series, and the line rewritten whole so the next appends stay readable
            value = {"step": None, "torn": True, "final": False}
            atomic_write_text(path, "".join(json.dumps(stamped(RUNNING, x)) + "\n" for x in lines + [value]))
        else:  # a whole line: format 1 (no key) or this one; another is refused, never taken for a torn line
            value = unstamped(RUNNING, value, f"{path}: line {k + 1}")
        lines.append(value)
    return sum(1 for x in lines if not x.get("final")), any(x.get("final") for x in lines)


def due(watch: Watch, step: int, *, final_only: bool = False, counted: bool = False) -> bool | None:
    """Which look is due at ``step``: True the planned run's final look, False a look of the series, None none.
    ``final_only``: after the step's release is recorded, where only the final look is made, and only once its
    claim covers the step (a given number, or ``counted``: the accountant has counted it; a claim read before it
    counted the step would be the claim for one step fewer, which the transcript would then exceed)."""
    if watch.final is not None and step >= watch.final:
        return True if not final_only or counted or watch.claimed is not None else None
    if not final_only and step >= watch.next:
        return False
    return None


def look(probe, watch: Watch, final: bool):
    """Make the look (``probe.audit`` at its level), log it, and on a VIOLATION write its report and act.
    Returns the look's result when it read VIOLATION, else None."""
    step = probe.step
    if final:  # the planned run's last look: half of alpha
        watch.final, level = None, watch.alpha / 2
        watch.next = max(watch.next, 2 * step)
    else:
        watch.look += 1
        level = watch.alpha / (watch.look * (watch.look + 1)) / (2 if watch.split else 1)
        watch.next = 2 * step
    try:
        result = probe.audit(watch.claimed, watch.delta, accountant=watch.accountant, alpha=level, report=False)
    except DPAuditError as exc:  # e.g. an accountant that cannot answer yet: said in the log, not fatal
        line = {"step": step, "look": watch.look, "alpha": level, "final": final, "error": str(exc)}
        result = None
    else:
        eps = result.epsilon_lower_bound
        line = {"step": step, "look": watch.look, "alpha": level, "final": final,
                "claimed_epsilon": result.claimed_epsilon, "epsilon_lower_bound": eps if eps < 1e300 else "inf",
                "headline": result.headline, "violation": result.violation, "verdict": result.verdict}
    with open(probe.out / RUNNING, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(stamped(RUNNING, line)) + "\n")
    if result is None or not result.violation:
        return None
    folder = probe.out / LOOKS / f"step-{step}"  # kept: the end-of-run report never replaces it
    result = probe.audit(watch.claimed, watch.delta, accountant=watch.accountant, alpha=level,
                         report=folder)  # the same look, its report written
    probe.alarm, probe.alarm_report = result, folder / "report.md"
    which = "the final look" if final else f"look {watch.look}"
    words = f"dpaudit: {result.verdict} ({which} at step {step}, alpha {level:.3g}; report: {probe.alarm_report})"
    if watch.on == "raise":
        raise PrivacyViolation(words, result)
    print(words + (": stopping the run" if watch.on == "stop" else ""), flush=True)
    probe.stop_requested = watch.on == "stop"
    return result
