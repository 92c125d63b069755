"""`dpaudit check CONFIG`: exit 0 when the configured run meets its budget, 1 when not, 2 when unusable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from dpaudit.accounting import calibrate_sigma, default_accountant, epsilon
from dpaudit.accounting.mechanism import resampled
from dpaudit.accounting.result import json_float
from dpaudit.cli.common import (
    DEFAULT_MAX_MEMORY, DEFAULT_TIMEOUT, JsonOpt, MaxMemoryOpt, assumptions, console, emit_json, fmt, shuffle_lines,
    time_budget,
)
from dpaudit.training_config import load_privacy_config

# What the sampler audit's verdict names, as the sampler dpaudit accounts it under (a cyclic pass puts each
# example in one batch an epoch too, so the shuffle bound, which needs no randomness of the permutation, holds)
OBSERVED = (("Poisson", "poisson"), ("shuffled epochs", "shuffle"), ("a cyclic pass", "shuffle"),
            ("fixed-size batches drawn without replacement", "fixed"), ("balls-in-bins", "balls-in-bins"))


def check(
    config: Annotated[Path, typer.Argument(help="Training config (YAML or TOML) with the privacy keys.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds the check may take (exit 2 past it).")] = DEFAULT_TIMEOUT,
    max_memory: MaxMemoryOpt = DEFAULT_MAX_MEMORY,
    sampler_log: Annotated[Optional[Path], typer.Option(
        "--sampler-log", help="A log of the run's batch indices (one batch a line): gate the sampler too. The "
                              "config is accounted for its `sampling:` (default poisson), so a log that looks like "
                              "another sampler fails (exit 1).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Gate a training config on its privacy budget (for CI and pre-commit): exit 0 within budget, 1 over it (or
    a claim accounted for another sampler than the one the run uses), 2 when the config is unusable (no sigma
    stated, ambiguous, malformed) or the check ran out of time."""
    cfg = load_privacy_config(config)
    with time_budget(timeout, "dpaudit check", max_memory):
        report, passed = _judge(cfg, config)
        if sampler_log is not None:
            from dpaudit.audit.sampler import analyse_batches, read_log

            sampled = analyse_batches(read_log(sampler_log), dataset_size=cfg.dataset_size,
                                      sample_rate=cfg.sampling_rate)
            observed = next((name for start, name in OBSERVED if sampled.looks_like.startswith(start)), None)
            consistent = observed == cfg.sampling
            report["sampler"] = {"log": str(sampler_log), **sampled.to_dict(), "observed_sampling": observed,
                                 "config_sampling": cfg.sampling, "consistent_with_config": consistent}
            passed = passed and consistent
            report["passed"] = passed
    sampler = report.get("sampler")
    if as_json:
        emit_json(report)
        if not passed:
            raise typer.Exit(1)
        return
    if sampler is not None:
        style = "green" if sampler["consistent_with_config"] else "bold red"
        said = (escape(sampler["verdict"]) if cfg.sampling == "poisson" else
                f"looks like {escape(sampler['looks_like'])}; the config accounts {cfg.sampling} sampling")
        console.print(f"[{style}]sampler[/{style}] {escape(sampler['log'])}: {said}", highlight=False)
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
    noise_words = (f"sigma = {fmt(report['sigma'])}" if len(report["phases"]) == 1 else
                   f"{len(report['phases'])} phases (sigma {', '.join(fmt(x['sigma']) for x in report['phases'])})")
    if passed:
        how = "calibrated" if cfg.sigma is None else "configured"
        console.print(f"[bold green]PASS[/bold green] {escape(str(config))}: {how} {noise_words} "
                      f"spends eps <= {fmt(report['epsilon'])} <= target {cfg.target_epsilon:g} "
                      f"(delta = {cfg.delta:g}, {report['accountant']})")
    elif sampler is not None and not sampler["consistent_with_config"] and report["epsilon"] <= cfg.target_epsilon:
        console.print(f"[bold red]FAIL[/bold red] {escape(str(config))}: its eps <= {fmt(report['epsilon'])} was "
                      f"accounted for {cfg.sampling} sampling, which its sampler is not")
    else:
        hint = ("" if report["minimal_sigma"] is None else
                f"; every sigma x {fmt(report['minimal_sigma'])} would meet it" if report["minimal_sigma_is_multiplier"]
                else f"; sigma >= {fmt(report['minimal_sigma'])} would meet it")
        console.print(f"[bold red]FAIL[/bold red] {escape(str(config))}: {noise_words} spends eps <= "
                      f"{fmt(report['epsilon'])}, over the target {cfg.target_epsilon:g} by "
                      f"{fmt(report['epsilon'] - cfg.target_epsilon, 4)} (delta = {cfg.delta:g}, "
                      f"{report['accountant']}){hint}")
    if not passed:
        raise typer.Exit(1)


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
        "neighboring": spent.neighboring.value, "sampling_rate": cfg.sampling_rate,
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
        lower = shuffled.get("lower_bound_chua") if shuffled else None
        report["claim"] = {"accounted_as": claim, "epsilon": json_float(claimed.epsilon),
                           "accountant": claimed.accountant,
                           "understated_by": json_float(spent.epsilon / claimed.epsilon) if claimed.epsilon else None,
                           "understated_by_at_least": (json_float(lower / claimed.epsilon)
                                                       if isinstance(lower, float) and claimed.epsilon
                                                       and lower > claimed.epsilon else None)}
        passed = False
        report["passed"] = False
    return report, passed
