"""A probe's audit of what it has released so far: the claim it is held to, then the same audit, report and verdict
as ``dpaudit audit transcript --run OUT`` (audit/whitebox.py).

The claim is, in order: the eps given; else the accountant's after the steps it counted (an Opacus accountant that
counted none: eps 0; one whose noise multiplier is 0: no claim, since eps is infinite). Where the accountant is given,
the sampling rates it counted are read from it and written to probe.json, so the audit compares them with the rate the
canaries were sampled at (audit/rate_check.py) instead of trusting either.
"""

from __future__ import annotations

from pathlib import Path

from dpaudit.audit.report import write_report
from dpaudit.audit.whitebox import audit_run_folder
from dpaudit.core.errors import DPAuditError
from dpaudit.core.lock import remove_folder
from dpaudit.probes import probe_folder
from dpaudit.probes.opacus_seams import accounted_rate


def audit(probe, claimed_eps: float | None, delta: float | None, *, accountant, alpha: float,
          report: bool | Path, claimed_from: str | None):
    """The white-box audit of what was released so far: the same result, report and verdict as
    ``dpaudit audit transcript --run OUT``. ``claimed_eps`` defaults to ``accountant``'s (an Opacus
    accountant: its eps after the steps actually taken, at ``delta``); ``claimed_from`` says where a given
    ``claimed_eps`` came from (a caller that took it from an accountant names it, as its own report does).
    ``report``: write it to OUT/report (True), or to the folder given (a look's own)."""
    probe.save_checks()
    if delta is None:
        raise DPAuditError("give the delta the run claims (the bound depends on it; 0 would inflate it)")
    accountant = accountant if accountant is not None else probe.accountant
    source = claimed_from or "given"
    if probe.health is not None:  # first: read by the audit whatever the claim turns out to be
        probe.health.look(probe.step)  # the moves up to now, whatever the last checked step saw
        probe.save_health()  # read by the audit (nothing released, yet moved outside DP: VIOLATION, whitebox.py)
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
    if accountant is not None and probe.kind == "gradient":  # the rates it counted, read now (rate_check.py)
        rate, rate_source = accounted_rate(accountant)
        if rate is not None:
            counted = {"accounted_rate": rate, "accounted_rate_source": rate_source}
    probe_folder.write_spec(probe, claimed_epsilon=claimed_eps, delta=delta, claimed_epsilon_source=source, **counted)
    result, scores, members, facts = audit_run_folder(probe.out, claimed_epsilon=claimed_eps, delta=delta,
                                                      alpha=alpha, sample_rate=probe._sampler_rate(accountant))
    if report:
        folder = report if isinstance(report, Path) else probe.out / "report"
        remove_folder(folder)
        alarm = probe.alarm
        context = {"probe": probe.source, "claimed eps": claimed_eps, "claimed eps from": source,
                   "delta": delta, **probe._context(),
                   **{k: v for k, v in facts.items() if not isinstance(v, dict)},
                   **({"a look during the run": f"{alarm.verdict} (report: {probe.alarm_report})"}
                      if alarm is not None and folder != probe.alarm_report.parent else {})}
        write_report(folder, result, scores, members, context)
    return result
