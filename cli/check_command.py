"""`dpaudit check CONFIG`: exit 0 when the configured run meets its budget, 1 when not, 2 when unusable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional
from itertools import islice

import typer
from rich.markup import escape

from dpaudit.accounting import calibrate_sigma, default_accountant, epsilon
from dpaudit.accounting.mechanism import resampled
from dpaudit.accounting.result import json_float
from dpaudit.cli.common import (
    DEFAULT_MAX_MEMORY, DEFAULT_TIMEOUT, JsonOpt, MaxMemoryOpt, assumptions, console, emit_json, fmt, shuffle_lines,
    time_budget,
)
from dpaudit.accounting.config import load_privacy_config
from dpaudit.core.errors import DPAuditError


def check(
    config: Annotated[Path, typer.Argument(help="Training config (YAML or TOML) with the privacy keys.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds the check may take (exit 2 past it).")] = DEFAULT_TIMEOUT,
    max_memory: MaxMemoryOpt = DEFAULT_MAX_MEMORY,
    sampler_log: Annotated[Optional[Path], typer.Option(
        "--sampler-log", help="A log of the run's batch indices (one batch a line): gate the sampler too. The "
                              "config is accounted for its `sampling:` (default poisson), so a log that looks like "
                              "another sampler fails (exit 1).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Also name the keys of a flat training config that "
                                                             "are not privacy keys (ignored).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Gate a training config on its privacy budget (for CI and pre-commit): exit 0 within budget, 1 over it (or
    a claim accounted for another sampler than the one the run uses), 2 when the config is unusable (no sigma
    stated, ambiguous, malformed) or the check ran out of time."""
    cfg = load_privacy_config(config)
    with time_budget(timeout, "dpaudit check", max_memory):
        report, passed = _judge(cfg, config)
        if sampler_log is not None:
            report["sampler"] = _gate_sampler(sampler_log, cfg)
            passed = passed and report["sampler"]["consistent_with_config"]
            report["passed"] = passed
    sampler = report.get("sampler")
    if cfg.ignored_keys:
        report["ignored_keys"] = list(cfg.ignored_keys)
    if as_json:
        emit_json(report)
        if not passed:
            raise typer.Exit(1)
        return
    if verbose and cfg.ignored_keys:
        console.print(f"ignored (not privacy keys): {escape(', '.join(report['ignored_keys']))}", highlight=False)
    if sampler is not None:
        style = "green" if sampler["consistent_with_config"] else "bold red"
        console.print(f"[{style}]sampler[/{style}] {escape(sampler['log'])}: {escape(sampler['verdict'])}",
                      highlight=False)
    for line in report.get("shuffle_lines", []):
        console.print(f"  {line}", highlight=False)
    claim = report.get("claim")
    if claim is not None:
        ratio, least = claim["understated_by"], claim.get("understated_by_at_least")
        how = (f"understated by up to {fmt(ratio, 3)}x" + (f", by at least {fmt(least, 3)}x (the lower bound)"
                                                          if least else "")
               if isinstance(ratio, float) and ratio > 1 else "not understated here, but accounted for another sampler")
        console.print(f"[bold red]FAIL[/bold red] {escape(str(config))}: its claim was accounted as {claim['accounted_as']} "
                      f"sampling (eps <= {fmt(claim['epsilon'])}), but it runs {cfg.sampling} sampling, which spends "
                      f"eps <= {fmt(report['epsilon'])} ({report['neighboring']} neighbours): {how}", highlight=False)
        raise typer.Exit(1)
    noise_words = (f"sigma = {fmt(report['phases'][0]['sigma'])}" if len(report["phases"]) == 1 else
                   f"{len(report['phases'])} phases (sigma {', '.join(fmt(x['sigma']) for x in report['phases'])})")
    whose = "" if not cfg.event.unit.user_level else f"a user's ({cfg.event.unit.short()}) "
    if passed:
        how = "calibrated" if cfg.sigma is None else "configured"
        console.print(f"[bold green]PASS[/bold green] {escape(str(config))}: {how} {noise_words} "
                      f"spends {whose}eps <= {fmt(report['epsilon'])} <= target {cfg.target_epsilon:g} "
                      f"(delta = {cfg.delta:g}, {report['accountant']})")
    elif sampler is not None and not sampler["consistent_with_config"] and report["epsilon"] <= cfg.target_epsilon:
        console.print(f"[bold red]FAIL[/bold red] {escape(str(config))}: its eps <= {fmt(report['epsilon'])} was "
                      f"accounted for {cfg.sampling} sampling, which its sampler is not")
    else:
        hint = ("" if report["minimal_sigma"] is None else
                f"; every sigma x {fmt(report['minimal_sigma'])} would meet it" if report["minimal_sigma_is_multiplier"]
                else f"; sigma >= {fmt(report['minimal_sigma'])} would meet it")
        console.print(f"[bold red]FAIL[/bold red] {escape(str(config))}: {noise_words} spends {whose}eps <= "
                      f"{fmt(report['epsilon'])}, over the target {cfg.target_epsilon:g} by "
                      f"{fmt(report['epsilon'] - cfg.target_epsilon, 4)} (delta = {cfg.delta:g}, "
                      f"{report['accountant']}){hint}")
    if not passed:
        raise typer.Exit(1)


def _gate_sampler(log: Path, cfg) -> dict:
    """The sampler log against the config, phase by phase: the log's first T1 batches are tested against the
    first phase's sampler, p and N, the next T2 against the second's, and so on (alpha split over the phases,
    Bonferroni). A log with more batches than the config's steps fails: the run released steps the config does
    not account. A log with fewer is tested as far as it goes, and says so (it vouches for no later step)."""

    from dpaudit.audit.sampler import ALPHA, analyse_as, read_log

    phases = cfg.event.phases
    batches = iter(read_log(log))
    alpha = ALPHA / len(phases)
    parts, logged, consistent = [], 0, True
    for i, m in enumerate(phases):
        seen = [0]

        def window(steps=m.steps):  # streamed: a phase's batches are never all held at once
            for batch in islice(batches, steps):
                seen[0] += 1
                yield batch

        try:
            verdict, ok, observed = analyse_as(window(), m.sampling, m.dataset_size or cfg.dataset_size,
                                               m.sampling_rate, m.batch_size, alpha)
        except DPAuditError as exc:
            logged += seen[0]
            if seen[0] < 2:
                parts.append({"phase": i + 1, "steps_logged": seen[0], "verdict": "not tested (fewer than 2 batches)"})
                continue
            raise DPAuditError(f"sampler log {log}, phase {i + 1}: {exc}") from None
        logged += seen[0]
        window_steps = seen[0]
        consistent = consistent and ok
        parts.append({"phase": i + 1, **verdict.to_dict(), "steps_logged": window_steps, "observed_sampling": observed,
                      "config_sampling": m.sampling, "consistent_with_config": ok})
    extra = sum(1 for _ in batches)
    steps = sum(m.steps for m in phases)
    if extra:
        consistent = False
        said = (f"the log holds {logged + extra} batches, more than the {steps} steps the config accounts: the run "
                "released steps its eps does not count")
    elif logged < steps:
        said = f"the log covers {logged} of the config's {steps} steps (it vouches for none after)"
    else:
        said = f"the log's {logged} batches are the config's {steps} steps"
    wrong = [p for p in parts if p.get("consistent_with_config") is False]
    what = "; ".join(
        f"phase {p['phase']} ({p['steps_logged']} batches): " + (
            p["verdict"] if p.get("consistent_with_config") is None else
            f"looks like {p['looks_like']}, the config accounts {p['config_sampling']} sampling at p = {p['sample_rate']:.4g}"
            if not p["consistent_with_config"] else f"{p['config_sampling']} at p = {p['sample_rate']:.4g}, consistent")
        for p in (wrong or parts))
    return {"log": str(log), "verdict": f"{said}; {what}", "steps_logged": logged + extra, "steps_config": steps,
            "alpha": ALPHA, "phases": parts, "consistent_with_config": consistent,
            **({k: parts[0][k] for k in ("looks_like", "observed_sampling", "config_sampling") if k in parts[0]}
               if len(parts) == 1 else {})}


QUICK = ("pld", "analytic", "pure", "pure-prv", "rdp")  # accountants fast enough to suggest a sigma on failure


def _judge(cfg, config: Path) -> tuple[dict, bool]:
    """Account the configured sigma (never calibrate it away); calibrate only when the config asks to, or,
    on a failure, to suggest the minimal sigma with a fast accountant. With phases, sigma is the multiplier of
    every phase's sigma. A claim accounted for another sampler (``claim_accounted_as``) fails, saying by how
    much it understates."""
    phased = len(cfg.event.phases) > 1
    if cfg.sigma is None:  # `calibrate: true`
        probe = cfg.event
        name = cfg.accountant or default_accountant(probe, cfg.delta)
        needed = calibrate_sigma(probe, cfg.target_epsilon, cfg.delta, name)
        spent, passed, sigma, minimal = needed.result, True, needed.sigma, needed.sigma
        probe = probe.with_sigma(needed.sigma)
    else:
        probe = cfg.event
        name = cfg.accountant or default_accountant(probe, cfg.delta)
        spent = epsilon(probe, cfg.delta, name)
        passed, sigma, minimal = spent.epsilon <= cfg.target_epsilon, cfg.sigma, None
        if not passed and name in QUICK:
            minimal = calibrate_sigma(probe, cfg.target_epsilon, cfg.delta, name).sigma
    lines, shuffled = shuffle_lines(probe, cfg.delta, spent)
    report = {
        "command": "check", "config": str(config), "passed": passed, "mechanism": cfg.mechanism,
        "sigma": sigma, "sigma_from_config": cfg.sigma is not None, "sampling": cfg.sampling,
        "neighboring": spent.neighboring.value, "unit": probe.unit.to_json(), "sampling_rate": cfg.sampling_rate,
        "steps": cfg.steps, "phases": [{"sigma": m.sigma, "sampling_rate": m.sampling_rate, "steps": m.steps,
                                        "sampling": m.sampling} for m in probe.phases],
        "delta": cfg.delta, "target_epsilon": cfg.target_epsilon,
        "epsilon": json_float(spent.epsilon), "excess_epsilon": json_float(max(0.0, spent.epsilon - cfg.target_epsilon)),
        "minimal_sigma": minimal, "minimal_sigma_is_multiplier": phased, "accountant": name,
        "assumptions": assumptions(probe, cfg.delta, spent),
        **({"shuffle": shuffled, "shuffle_lines": lines} if shuffled else {}),
    }
    claim = cfg.claim_accounted_as
    if claim is not None and claim != cfg.sampling:
        claimed = epsilon(resampled(probe, claim), cfg.delta)
        lower = shuffled.get("lower_bound") if shuffled else None
        report["claim"] = {"accounted_as": claim, "epsilon": json_float(claimed.epsilon),
                           "accountant": claimed.accountant,
                           "understated_by": json_float(spent.epsilon / claimed.epsilon) if claimed.epsilon else None,
                           "understated_by_at_least": (json_float(lower / claimed.epsilon)
                                                       if isinstance(lower, float) and claimed.epsilon
                                                       and lower > claimed.epsilon else None)}
        passed = False
        report["passed"] = False
    return report, passed
