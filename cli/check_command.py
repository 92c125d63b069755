"""`dpaudit check CONFIG`: exit 0 when the configured run meets its budget, 1 when not, 2 when unusable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from dpaudit.accounting import calibrate_sigma, default_accountant, epsilon
from dpaudit.accounting.result import json_float
from dpaudit.cli.common import (
    DEFAULT_MAX_MEMORY, DEFAULT_TIMEOUT, JsonOpt, MaxMemoryOpt, assumptions, console, emit_json, fmt, time_budget,
)
from dpaudit.training_config import load_privacy_config


def check(
    config: Annotated[Path, typer.Argument(help="Training config (YAML or TOML) with the privacy keys.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds the check may take (exit 2 past it).")] = DEFAULT_TIMEOUT,
    max_memory: MaxMemoryOpt = DEFAULT_MAX_MEMORY,
    sampler_log: Annotated[Optional[Path], typer.Option(
        "--sampler-log", help="A log of the run's batch indices (one batch a line): gate the sampler too. The "
                              "config is accounted as Poisson sampling, so a sampler that is not Poisson fails "
                              "(exit 1).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Gate a training config on its privacy budget (for CI and pre-commit): exit 0 within budget, 1 over it,
    2 when the config is unusable (no sigma stated, ambiguous, malformed) or the check ran out of time."""
    cfg = load_privacy_config(config)
    with time_budget(timeout, "dpaudit check", max_memory):
        report, passed = _judge(cfg, config)
        if sampler_log is not None:
            from dpaudit.audit.sampler import analyse_batches, read_log

            sampled = analyse_batches(read_log(sampler_log), dataset_size=cfg.dataset_size,
                                      sample_rate=cfg.sampling_rate)
            report["sampler"] = {"log": str(sampler_log), **sampled.to_dict()}
            passed = passed and sampled.poisson_accounting_valid
            report["passed"] = passed
    sampler = report.get("sampler")
    if as_json:
        emit_json(report)
        if not passed:
            raise typer.Exit(1)
        return
    if sampler is not None:
        style = "green" if sampler["poisson_accounting_valid"] else "bold red"
        console.print(f"[{style}]sampler[/{style}] {escape(sampler['log'])}: {escape(sampler['verdict'])}",
                      highlight=False)
    if passed:
        how = "calibrated" if cfg.sigma is None else "configured"
        console.print(f"[bold green]PASS[/bold green] {escape(str(config))}: {how} sigma = {fmt(report['sigma'])} "
                      f"spends eps <= {fmt(report['epsilon'])} <= target {cfg.target_epsilon:g} "
                      f"(delta = {cfg.delta:g}, {report['accountant']})")
    elif sampler is not None and not sampler["poisson_accounting_valid"] and report["epsilon"] <= cfg.target_epsilon:
        console.print(f"[bold red]FAIL[/bold red] {escape(str(config))}: its eps <= {fmt(report['epsilon'])} was "
                      "accounted for Poisson sampling, which its sampler is not")
    else:
        hint = (f"; sigma >= {fmt(report['minimal_sigma'])} would meet it" if report["minimal_sigma"] is not None
                else "")
        console.print(f"[bold red]FAIL[/bold red] {escape(str(config))}: sigma = {fmt(report['sigma'])} spends eps <= "
                      f"{fmt(report['epsilon'])}, over the target {cfg.target_epsilon:g} by "
                      f"{fmt(report['epsilon'] - cfg.target_epsilon, 4)} (delta = {cfg.delta:g}, "
                      f"{report['accountant']}){hint}")
    if not passed:
        raise typer.Exit(1)


QUICK = ("pld", "analytic", "pure", "pure-prv", "rdp")  # accountants fast enough to suggest a sigma on failure


def _judge(cfg, config: Path) -> tuple[dict, bool]:
    """Account the configured sigma (never calibrate it away); calibrate only when the config asks to, or,
    on a failure, to suggest the minimal sigma with a fast accountant."""
    if cfg.sigma is None:  # `calibrate: true`
        probe = cfg.schedule(1.0)
        name = cfg.accountant or default_accountant(probe, cfg.delta)
        needed = calibrate_sigma(probe, cfg.target_epsilon, cfg.delta, name)
        spent, passed, sigma, minimal = needed.result, True, needed.sigma, needed.sigma
    else:
        probe = cfg.schedule(cfg.sigma)
        name = cfg.accountant or default_accountant(probe, cfg.delta)
        spent = epsilon(probe, cfg.delta, name)
        passed, sigma, minimal = spent.epsilon <= cfg.target_epsilon, cfg.sigma, None
        if not passed and name in QUICK:
            minimal = calibrate_sigma(probe, cfg.target_epsilon, cfg.delta, name).sigma
    report = {
        "command": "check", "config": str(config), "passed": passed, "mechanism": cfg.mechanism,
        "sigma": sigma, "sigma_from_config": cfg.sigma is not None, "sampling_rate": cfg.sampling_rate,
        "steps": cfg.steps, "delta": cfg.delta, "target_epsilon": cfg.target_epsilon,
        "epsilon": json_float(spent.epsilon), "excess_epsilon": json_float(max(0.0, spent.epsilon - cfg.target_epsilon)),
        "minimal_sigma": minimal, "accountant": name,
        "assumptions": assumptions(probe, cfg.delta, spent),
    }
    return report, passed
