"""`dpaudit check CONFIG`: exit 0 when the configured run meets its budget, 1 when not, 2 when unusable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dpaudit.accounting import calibrate_sigma, default_accountant, epsilon
from dpaudit.accounting.result import json_float
from dpaudit.cli.common import JsonOpt, assumptions, console, emit_json, fmt
from dpaudit.training_config import load_privacy_config


def check(
    config: Annotated[Path, typer.Argument(help="Training config (YAML or TOML) with the privacy keys.")],
    as_json: JsonOpt = False,
) -> None:
    """Gate a training config on its privacy budget (for CI and pre-commit)."""
    cfg = load_privacy_config(config)
    probe = cfg.schedule(cfg.sigma or 1.0)
    name = cfg.accountant or default_accountant(probe, cfg.delta)
    needed = calibrate_sigma(probe, cfg.target_epsilon, cfg.delta, name)
    if cfg.sigma is None:
        spent, passed, sigma = needed.result, True, needed.sigma
    else:
        spent = epsilon(cfg.schedule(cfg.sigma), cfg.delta, name)
        passed, sigma = spent.epsilon <= cfg.target_epsilon, cfg.sigma
    report = {
        "command": "check", "config": str(config), "passed": passed, "mechanism": cfg.mechanism,
        "sigma": sigma, "sigma_from_config": cfg.sigma is not None, "sampling_rate": cfg.sampling_rate,
        "steps": cfg.steps, "delta": cfg.delta, "target_epsilon": cfg.target_epsilon,
        "epsilon": json_float(spent.epsilon), "excess_epsilon": json_float(max(0.0, spent.epsilon - cfg.target_epsilon)),
        "minimal_sigma": needed.sigma, "accountant": name,
        "assumptions": assumptions(probe, cfg.delta, name, spent.relation),
    }
    if as_json:
        emit_json(report)
    elif passed:
        how = "calibrated" if cfg.sigma is None else "configured"
        console.print(f"[bold green]PASS[/bold green] {config}: {how} sigma = {fmt(sigma)} spends eps <= "
                      f"{fmt(spent.epsilon)} <= target {cfg.target_epsilon:g} (delta = {cfg.delta:g}, {name}); "
                      f"minimal sigma {fmt(needed.sigma)}")
    else:
        console.print(f"[bold red]FAIL[/bold red] {config}: sigma = {fmt(sigma)} spends eps <= {fmt(spent.epsilon)}, "
                      f"over the target {cfg.target_epsilon:g} by {fmt(spent.epsilon - cfg.target_epsilon, 4)} "
                      f"(delta = {cfg.delta:g}, {name}); sigma >= {fmt(needed.sigma)} would meet it")
    if not passed:
        raise typer.Exit(1)
