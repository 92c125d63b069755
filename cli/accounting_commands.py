"""`dpaudit calibrate | epsilon | max-steps | compare | plot`: the accounting questions."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Optional

import typer

from dpaudit.accounting import ACCOUNTANTS, calibrate_sigma, default_accountant, epsilon, max_steps
from dpaudit.accounting.calibrate import epsilons_over_steps
from dpaudit.core.validate import check_epsilon
from dpaudit.accounting.noises import noise
from dpaudit.accounting.registry import default_delta_accountant, delta as delta_of
from dpaudit.accounting.result import json_float
from dpaudit.core.atomic import guard_new_file
from dpaudit.core.errors import DPAuditError
from dpaudit.core.threads import set_threads
from dpaudit.cli.common import (
    AccountantOpt, BatchOpt, DatasetOpt, DeltaOpt, EpochsOpt, ForceOpt, JsonOpt, McBackendOpt, McSamplesOpt, McWorkersOpt, MechOpt,
    NoiseOpt, PhaseOpt, POpt, RecordsOpt, SamplingOpt, SeedOpt, StepsOpt, UnitOpt, UserSamplingOpt, accountant_options,
    assumptions, bounded, console, emit_json, event_from, fmt, resolve_delta, schedule, shuffle_lines, unit_from,
    with_unit,
)

SigmaOpt = Annotated[float, typer.Option("--sigma", "-s", help="Noise multiplier (gaussian) or Laplace scale / sensitivity.")]
OptionalSigmaOpt = Annotated[Optional[float], typer.Option(
    "--sigma", "-s", help="Noise multiplier (gaussian) or Laplace scale / sensitivity (or give --phase).")]
EpsOpt = Annotated[float, typer.Option("--eps", "-e", help="Target epsilon.")]


def _one_step_note(m, steps, epochs) -> list[str]:
    """Said, never assumed silently: a sampled schedule without -T / --epochs is one step."""
    if steps is None and epochs is None and m.sampling_rate < 1 and len(m.phases) == 1:
        return ["no -T/--steps or --epochs given: this is ONE step (a single sampled release), not a training run"]
    return []


def _print_assumptions(lines: list[str]) -> None:
    console.print("[bold]Assumptions[/bold]")
    for line in lines:
        console.print(f"  - {line}")


@bounded("dpaudit calibrate")
def calibrate(
    eps: EpsOpt, mech: MechOpt = "gaussian", delta: DeltaOpt = None, p: POpt = None,
    batch_size: BatchOpt = None, dataset_size: DatasetOpt = None, steps: StepsOpt = None,
    epochs: EpochsOpt = None, accountant: AccountantOpt = None,
    rtol: Annotated[float, typer.Option(help="Relative tolerance on sigma (never on the wrong side).")] = 1e-3,
    mc_samples: McSamplesOpt = None, seed: SeedOpt = 0, sampling: SamplingOpt = "poisson", phase: PhaseOpt = None,
    noise_spec: NoiseOpt = None, unit: UnitOpt = "example", records_per_user: RecordsOpt = None,
    user_sampling: UserSamplingOpt = None, as_json: JsonOpt = False,
) -> None:
    """Smallest noise whose accounted epsilon is <= the target (one release when no schedule is given). With
    --phase: the smallest multiplier of every phase's sigma (each phase's sigma=S is its share; default 1). With
    --unit user: the target is a user-level epsilon."""
    check_epsilon(eps)
    d = resolve_delta(mech, delta)
    template = event_from(mech, 1.0, p, batch_size, dataset_size, steps, epochs, sampling, phase, noise_spec,
                          unit_from(unit, records_per_user, user_sampling))
    name = accountant or default_accountant(template, d)
    cal = calibrate_sigma(template, eps, d, name, rtol=rtol, options=accountant_options(name, mc_samples, seed, not as_json))
    calibrated = template.with_sigma(cal.sigma)
    lines = assumptions(calibrated, d, cal.result) + _one_step_note(template, steps, epochs)
    extra, shuffled = shuffle_lines(calibrated, d, cal.result)
    phase_sigmas = [m.sigma for m in calibrated.phases] if len(calibrated.phases) > 1 else None
    if as_json:
        emit_json({
            "command": "calibrate", "mechanism": mech, "sampling": template.sampling, **_noise_json(calibrated, cal.result),
            "sampling_rate": template.sampling_rate,
            "steps": template.steps, "delta": d, "target_epsilon": eps, "accountant": cal.result.accountant,
            "requested_accountant": name, "unit": template.unit.to_json(),
            "sigma": cal.sigma, "epsilon": json_float(cal.result.epsilon),
            "sigma_rejected": cal.sigma_rejected, "epsilon_rejected": json_float(cal.epsilon_rejected),
            "relative_tolerance": rtol, "converged": cal.converged, "evaluations": cal.evaluations,
            "seconds": cal.seconds, **({"phase_sigmas": phase_sigmas} if phase_sigmas else {}),
            **({"shuffle": shuffled} if shuffled else {}),
            "result": cal.result.to_json(), "assumptions": lines,
        })
        return
    noun = noise(template.phases[0].kind).noun
    what = "multiplier of every phase's sigma" if phase_sigmas else noun
    console.print(f"[bold green]{what} = {fmt(cal.sigma)}[/bold green]  gives eps <= {fmt(cal.result.epsilon)} "
                  f"(target {eps:g}) at delta = {d:g}")
    if phase_sigmas:
        console.print("  phase sigmas: " + ", ".join(fmt(x) for x in phase_sigmas))
    console.print(f"  sigma = {fmt(cal.sigma_rejected)} would give eps = {fmt(cal.epsilon_rejected)} > target"
                  f"  ({cal.evaluations} evaluations, {cal.seconds:.2f} s)")
    if not cal.converged:
        console.print("  [yellow]the time budget stopped the search before the tolerance: the smallest sigma lies "
                      "between these two (--timeout)[/yellow]")
    console.print(f"  guarantee: {cal.result.guarantee}")
    for line in extra:
        console.print(f"  {line}")
    _print_assumptions(lines)


McThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", help="CPU threads for torch with --mc-backend torch (the only accounting path that runs torch).")]


def _noise_json(mech, result) -> dict:
    """The strategy and its error, for --json, when the noise is correlated."""
    if getattr(mech, "strategy", None) is None:
        return {}
    from dpaudit.accounting.matrix.strategy import error_summary

    return {"noise": mech.strategy.spec(), **{k: v for k, v in error_summary(mech, result.accountant).items()
                                              if k != "noise"}}


def _torch_threads(backend: str, threads: int | None) -> None:
    if backend == "torch":  # torch is never imported otherwise: the accounting core is torch-free

        set_threads(threads)


@bounded("dpaudit epsilon")
def epsilon_cmd(
    sigma: OptionalSigmaOpt = None, mech: MechOpt = "gaussian", delta: DeltaOpt = None, p: POpt = None,
    batch_size: BatchOpt = None, dataset_size: DatasetOpt = None, steps: StepsOpt = None,
    epochs: EpochsOpt = None, accountant: AccountantOpt = None, mc_samples: McSamplesOpt = None,
    seed: SeedOpt = 0, mc_workers: McWorkersOpt = 1, mc_backend: McBackendOpt = "numpy",
    threads: McThreadsOpt = None, sampling: SamplingOpt = "poisson", phase: PhaseOpt = None,
    noise_spec: NoiseOpt = None, unit: UnitOpt = "example", records_per_user: RecordsOpt = None,
    user_sampling: UserSamplingOpt = None, as_json: JsonOpt = False,
) -> None:
    """Epsilon (an upper bound) spent by a given noise level and schedule, or by phases (--phase, repeated). With
    --unit user, a user's epsilon."""
    _torch_threads(mc_backend, threads)
    d = resolve_delta(mech, delta)
    m = event_from(mech, sigma, p, batch_size, dataset_size, steps, epochs, sampling, phase, noise_spec,
                   unit_from(unit, records_per_user, user_sampling))
    name = accountant or default_accountant(m, d)
    res = epsilon(m, d, name, accountant_options(name, mc_samples, seed, not as_json, mc_workers, mc_backend))
    lines = assumptions(m, d, res) + _one_step_note(m, steps, epochs)
    extra, shuffled = shuffle_lines(m, d, res)
    if as_json:
        emit_json({"command": "epsilon", "sigma": sigma, "sampling": m.sampling, "sampling_rate": m.sampling_rate,
                   "unit": m.unit.to_json(), **_noise_json(m, res),
                   "steps": m.steps, "phases": len(m.phases), **({"shuffle": shuffled} if shuffled else {}),
                   "result": res.to_json(), "assumptions": lines})
        return
    console.print(f"[bold]eps <= {fmt(res.epsilon)}[/bold] at delta = {d:g}  ({res.guarantee})")
    if res.directions:
        console.print("  per direction: " + ", ".join(f"{k} {fmt(v)}" for k, v in res.directions.items()))
    for line in extra:
        console.print(f"  {line}")
    _print_assumptions(lines)


@bounded("dpaudit delta")
def delta_cmd(
    sigma: SigmaOpt, eps: EpsOpt, mech: MechOpt = "gaussian", p: POpt = None, batch_size: BatchOpt = None,
    dataset_size: DatasetOpt = None, steps: StepsOpt = None, epochs: EpochsOpt = None,
    accountant: Annotated[Optional[str], typer.Option(
        "--accountant", "-a", help="pld, analytic (p = 1, Gaussian) or mc (Monte-Carlo). Default: analytic where "
                                   "it is exact, else pld.")] = None,
    mc_samples: McSamplesOpt = None, seed: SeedOpt = 0, mc_workers: McWorkersOpt = 1,
    mc_backend: McBackendOpt = "numpy",
    mc_tilt: Annotated[bool, typer.Option(
        "--mc-tilt", help="mc, Laplace: importance sampling by exponential tilting (tight at small delta).")] = False,
    threads: McThreadsOpt = None, unit: UnitOpt = "example", records_per_user: RecordsOpt = None,
    user_sampling: UserSamplingOpt = None, as_json: JsonOpt = False,
) -> None:
    """delta(eps) for a noise level and schedule: an upper bound (pld; mc with probability >= 1 - beta)."""

    _torch_threads(mc_backend, threads)

    check_epsilon(eps)
    m = with_unit(schedule(mech, sigma, p, batch_size, dataset_size, steps, epochs),
                  unit_from(unit, records_per_user, user_sampling))
    accountant = accountant or default_delta_accountant(m)
    res = delta_of(m, eps, accountant,
                   accountant_options(accountant, mc_samples, seed, not as_json, mc_workers, mc_backend, mc_tilt))
    lines = assumptions(m, 0.0, res)[:2]
    if as_json:
        out = {"upper": res.delta, "guarantee": res.guarantee, **({"estimate": res.estimate} if res.estimate is not None
                                                                   else {}), **res.details}
        out["directions"] = res.directions
        emit_json({"command": "delta", "sigma": sigma, "epsilon": eps, "sampling_rate": m.sampling_rate,
                   "steps": m.steps, "accountant": accountant, "result": out, "assumptions": lines})
        return
    console.print(f"[bold]delta <= {res.delta:.4g}[/bold] at eps = {eps:g}  ({res.guarantee})")
    if res.estimate is not None:
        console.print(f"  estimate: {res.estimate:.4g}")
    _print_assumptions(lines)


@bounded("dpaudit max-steps")
def max_steps_cmd(
    sigma: SigmaOpt, eps: EpsOpt, mech: MechOpt = "gaussian", delta: DeltaOpt = None, p: POpt = None,
    batch_size: BatchOpt = None, dataset_size: DatasetOpt = None, accountant: AccountantOpt = None,
    sampling: SamplingOpt = "poisson", noise_spec: NoiseOpt = None, unit: UnitOpt = "example",
    records_per_user: RecordsOpt = None, user_sampling: UserSamplingOpt = None, as_json: JsonOpt = False,
) -> None:
    """Largest number of steps that stays within the target epsilon at a given noise level. With --unit user, a
    user's epsilon."""
    from dpaudit.accounting.matrix.strategy import parse

    d = resolve_delta(mech, delta)
    template = with_unit(schedule(mech, sigma, p, batch_size, dataset_size, 1, None, sampling, parse(noise_spec)),
                         unit_from(unit, records_per_user, user_sampling))
    ans = max_steps(template, eps, d, accountant)
    lines = assumptions(template.with_steps(ans.steps), d, ans.result)
    if as_json:
        emit_json({"command": "max-steps", "sigma": sigma, "sampling": sampling, "sampling_rate": template.sampling_rate,
                   "unit": template.unit.to_json(),
                   **_noise_json(template.with_steps(ans.steps), ans.result),
                   "target_epsilon": eps, "delta": d, "max_steps": ans.steps, "at_cap": ans.at_cap,
                   "epsilon": json_float(ans.result.epsilon),
                   "epsilon_next": None if ans.epsilon_next is None else json_float(ans.epsilon_next),
                   "epochs": ans.steps * template.sampling_rate, "assumptions": lines})
        return
    more = " (the search cap: it may be more)" if ans.at_cap else ""
    console.print(f"[bold green]max steps T = {ans.steps}{more}[/bold green] "
                  f"(~{ans.steps * template.sampling_rate:.4g} epochs): eps <= {fmt(ans.result.epsilon)}")
    if ans.epsilon_next is not None:
        console.print(f"  T = {ans.steps + 1} would spend eps = {fmt(ans.epsilon_next)} > {eps:g}")
    _print_assumptions(lines)


@bounded("dpaudit compare")
def compare(
    sigma: Annotated[Optional[float], typer.Option("--sigma", "-s", help="Noise level to account.")] = None,
    eps: Annotated[Optional[float], typer.Option("--eps", "-e", help="Or: target eps to calibrate for.")] = None,
    mech: MechOpt = "gaussian", delta: DeltaOpt = None, p: POpt = None, batch_size: BatchOpt = None,
    dataset_size: DatasetOpt = None, steps: StepsOpt = None, epochs: EpochsOpt = None,
    mc_samples: McSamplesOpt = None, seed: SeedOpt = 0,
    include_slow: Annotated[bool, typer.Option(help="With --eps: also calibrate with prv (~40 s per evaluation).")] = False,
    sampling: SamplingOpt = "poisson", phase: PhaseOpt = None,
    noise_spec: Annotated[Optional[list[str]], typer.Option(
        "--noise", help="Compare noise strategies instead of accountants (repeat: --noise independent --noise "
                        "bandmf,b=16 --noise blt,...): each one's sigma at --eps (or eps at --sigma) from its default "
                        "accountant, with the noise it adds and its expected error.")] = None,
    unit: UnitOpt = "example", records_per_user: RecordsOpt = None, as_json: JsonOpt = False,
) -> None:
    """Every applicable accountant side by side, with timings (eps for --sigma, or sigma for --eps); the
    accountants that do not cover the schedule (its sampler, its phases) say why. With --noise: strategies side
    by side instead."""
    if (sigma is None) == (eps is None) and not (phase and eps is None):  # phases carry their own sigmas
        raise DPAuditError("give exactly one of --sigma (compare epsilons) or --eps (compare calibrated sigmas)")
    accounting = eps is None  # compare epsilons at the given noise (else calibrated sigmas)
    d = resolve_delta(mech, delta)
    if sampling == "all":
        _compare_samplers(mech, sigma, d, p, batch_size, dataset_size, steps, epochs, phase, as_json)
        return
    if unit_from(unit, records_per_user).user_level:  # refuses --unit user without k, and k without it
        _compare_units(mech, sigma, eps, d, p, batch_size, dataset_size, steps, epochs, sampling, phase,
                       records_per_user, as_json)
        return
    if eps is not None:
        check_epsilon(eps)
    if noise_spec:
        _compare_strategies(noise_spec, mech, sigma, eps, d, p, batch_size, dataset_size, steps, epochs, sampling,
                            phase, as_json)
        return
    m = event_from(mech, 1.0 if sigma is None else sigma, p, batch_size, dataset_size, steps, epochs, sampling, phase)
    rows = []
    for name, acc in ACCOUNTANTS.items():
        reason = acc.supports(m, d)
        if name == "group" and m.group == 1:
            reason = "group privacy is for --unit user (a group of one record is the record-level answer)"
        elif eps is not None and name == "mc":
            reason = "mc is not calibrated (each evaluation resamples); compare it with --sigma"
        elif eps is not None and name == "prv" and not include_slow:
            reason = "prv calibration takes minutes at T this large; add --include-slow" if m.steps > 1000 else reason
        if reason:
            rows.append({"accountant": name, "skipped": reason})
            continue
        opts = accountant_options(name, mc_samples, seed, not as_json)
        start = time.perf_counter()
        with console.status(f"{name} ...", spinner="dots") if not as_json else nullcontext():
            try:
                if accounting:
                    res = epsilon(m, d, name, opts)
                    value = res.epsilon
                else:
                    cal = calibrate_sigma(m, eps, d, name, options=opts)
                    res, value = cal.result, cal.sigma
            except DPAuditError as exc:  # its budget ran out, or it refused: the row says so, and the last line
                rows.append({"accountant": name, "skipped": str(exc), "cut_short": True})
                continue
        rows.append({"accountant": name, "value": json_float(value), "seconds": time.perf_counter() - start,
                     "relation": res.relation, "guarantee": res.guarantee,
                     "directions": {k: json_float(v) for k, v in res.directions.items()}})
    what = "epsilon" if accounting else "sigma"
    closed = _closed_form_rows(m, eps, d, rows) if eps is not None else []
    from rich.table import Table

    if as_json:
        emit_json({"command": "compare", "quantity": what, "mechanism": mech, "sigma": sigma, "target_epsilon": eps,
                   "sampling_rate": m.sampling_rate, "steps": m.steps, "delta": d, "rows": rows,
                   "closed_forms": closed, "cut_short": [r["accountant"] for r in rows if r.get("cut_short")]})
        return
    table = Table(title=f"{what} by accountant — {m.kind}, {m.sampling}, p={m.sampling_rate:g}, T={m.steps}"
                        + (f" in {len(m.phases)} phases" if len(m.phases) > 1 else "") + f", delta={d:g}")
    for col in ("accountant", what, "time (s)", "guarantee"):
        table.add_column(col)
    for r in rows:
        if "skipped" in r:
            table.add_row(r["accountant"], "—", "—", f"[dim]{r['skipped']}[/dim]")
        else:
            table.add_row(r["accountant"], fmt(float(r["value"])), f"{r['seconds']:.3f}", r["guarantee"])
    console.print(table)
    for r in closed:
        console.print(f"{r['name']}: sigma = {fmt(r['sigma'])}, which spends only eps <= {fmt(r['epsilon'])} "
                      f"({r['accountant']}; target {eps:g}): {r['noise_ratio']:.3g}x the noise of the tight sigma "
                      f"{fmt(r['tight_sigma'])}", highlight=False)
    cut = [r["accountant"] for r in rows if r.get("cut_short")]
    if cut:
        console.print(f"[yellow]cut short (no answer within the budget, or refused): {', '.join(cut)}; "
                      "see their rows (--timeout, --max-memory)[/yellow]", highlight=False)


MAX_STRATEGIES = 12


def _compare_units(mech, sigma, eps, delta, p, batch_size, dataset_size, steps, epochs, sampling, phase, k,
                   as_json) -> None:
    """``--unit user``: ELS, ULS and group privacy for the records' schedule (accounting/user_level.py), eps at
    --sigma or sigma at --eps, with each one's noise per unit of signal relative to ELS's."""
    from rich.table import Table

    from dpaudit.accounting import user_level

    if eps is not None:
        check_epsilon(eps)
    m = event_from(mech, 1.0 if sigma is None else sigma, p, batch_size, dataset_size, steps, epochs, sampling, phase)
    with console.status("ELS, ULS, group privacy ...", spinner="dots") if not as_json else nullcontext():
        found = user_level.rows(m, k, delta, eps)
    what = "epsilon" if eps is None else "sigma"
    if as_json:
        emit_json({"command": "compare", "quantity": what, "unit": "user", "records_per_user": k, "mechanism": mech,
                   "sigma": sigma, "target_epsilon": eps, "sampling_rate": m.sampling_rate, "steps": m.steps,
                   "delta": delta, "rows": [r.to_json() for r in found]})
        return
    table = Table(title=f"user-level {what}: k = {k} records a user, {m.kind}, {m.sampling}, p = {m.sampling_rate:g} "
                        f"(records; ULS: users at the same rate), T = {m.steps}, delta = {delta:g}")
    for col in ("algorithm", "sigma", "user-level eps", "noise / signal vs ELS", "guarantee"):
        table.add_column(col)
    for r in found:
        if r.result is None:
            table.add_row(r.name, "—", "—", "—", f"[dim]{r.why}[/dim]")
            continue
        table.add_row(r.name, fmt(r.sigma), fmt(r.result.epsilon),
                      "—" if r.noise_per_signal is None else f"{r.noise_per_signal:.3g}x", r.result.guarantee)
    console.print(table)
    console.print("noise / signal: the noise std over the expected clipped units a step (ELS and group privacy: "
                  "B records; ULS: B / k users, each clipped as one), relative to ELS's. Lower trains better at "
                  "the same eps; ELS and group privacy run the same training, ELS accounts it tighter.",
                  highlight=False)


def _compare_strategies(specs, mech, sigma, eps, delta, p, batch_size, dataset_size, steps, epochs, sampling, phase,
                        as_json) -> None:
    """One row a noise strategy: sigma at the target eps (or eps at sigma) from its default accountant, the noise
    std it adds per step and the expected squared error of the last prefix sum; the error relative to the first
    row, so a user can choose at one eps."""
    from dpaudit.accounting.matrix.strategy import error_summary

    if len(specs) > MAX_STRATEGIES:
        raise DPAuditError(f"compare at most {MAX_STRATEGIES} strategies at once")
    rows = []
    for spec in specs:
        m = event_from(mech, 1.0 if sigma is None else sigma, p, batch_size, dataset_size, steps, epochs, sampling,
                       phase, spec)
        name = default_accountant(m, delta)
        start = time.perf_counter()
        with console.status(f"{spec} ...", spinner="dots") if not as_json else nullcontext():
            try:
                if eps is None:
                    res = epsilon(m, delta, name)
                else:
                    cal = calibrate_sigma(m, eps, delta, name)
                    res, m = cal.result, m.with_sigma(cal.sigma)
            except DPAuditError as exc:
                rows.append({"noise": spec, "skipped": str(exc)})
                continue
        summary = error_summary(m, res.accountant)
        rows.append({"noise": spec, "strategy": summary.pop("noise"), "accountant": res.accountant, "sigma": m.sigma,
                     "epsilon": json_float(res.epsilon), **summary, "seconds": time.perf_counter() - start,
                     "guarantee": res.guarantee})
    base = next((r.get("expected_error") for r in rows if "skipped" not in r), None)
    for r in rows:
        if "skipped" not in r:
            r["error_vs_first"] = r["expected_error"] / base if base and r["expected_error"] is not None else None
    if as_json:
        emit_json({"command": "compare", "quantity": "strategies", "target_epsilon": eps, "sigma": sigma,
                   "delta": delta, "rows": rows})
        return
    from rich.table import Table

    table = Table(title=f"noise strategies at {'eps = ' + format(eps, 'g') if eps is not None else 'sigma = ' + format(sigma, 'g')}"
                        f", delta={delta:g}")
    for col in ("noise", "accountant", "sigma", "eps", "noise std / step", "expected error (last sum)", "vs first"):
        table.add_column(col)
    for r in rows:
        if "skipped" in r:
            table.add_row(r["noise"], "—", "—", "—", "—", "—", f"[dim]{r['skipped']}[/dim]")
        else:
            table.add_row(r["noise"], r["accountant"], fmt(r["sigma"]), fmt(float(r["epsilon"])), f"{r['noise_std']:.4g} C",
                          "not computed" if r["expected_error"] is None else f"{r['expected_error']:.4g} C^2",
                          "—" if r["error_vs_first"] is None else f"{r['error_vs_first']:.3g}x")
    console.print(table)
    console.print("expected error: of the last released prefix sum of clipped-gradient sums, per coordinate "
                  "(sigma^2 sens^2 x the strategy's error; independent noise: sigma^2 T)", highlight=False)
    for r in rows:   # a searched strategy (blt,buffers=d): what was found, to train with or pin in a config
        if "skipped" not in r and r["strategy"] not in (r["noise"], "independent"):
            console.print(f"{r['noise']}: {r['strategy']}", highlight=False, soft_wrap=True)


def _compare_samplers(mech, sigma, delta, p, batch_size, dataset_size, steps, epochs, phase, as_json) -> None:
    """``--sampling all``: one Gaussian schedule's eps under each sampler (accounting/sampler_table.py)."""
    from rich.table import Table

    from dpaudit.accounting import sampler_table

    if sigma is None or mech != "gaussian" or phase or p is not None or batch_size is None or dataset_size is None:
        raise DPAuditError("--sampling all compares one Gaussian schedule: give --sigma, -B, -N and -T or --epochs "
                           "(not --p, --eps or --phase)")
    shuffled = event_from(mech, sigma, None, batch_size, dataset_size, steps, epochs, "shuffle", None)
    rows = sampler_table.rows(sigma, batch_size, dataset_size, shuffled.steps, delta)
    if as_json:
        emit_json({"command": "compare", "quantity": "epsilon", "sampling": "all", "sigma": sigma,
                   "batch_size": batch_size, "dataset_size": dataset_size, "steps": shuffled.steps, "delta": delta,
                   "rows": [{k: json_float(v) if isinstance(v, float) else v for k, v in r.items()} for r in rows]})
        return
    table = Table(title=f"epsilon by sampler — gaussian, sigma={sigma:g}, B={batch_size}, N={dataset_size}, "
                        f"T={shuffled.steps}, delta={delta:g}")
    for col in ("sampler", "bound", "relation", "accountant", "epsilon", "x Poisson", "time (s)"):
        table.add_column(col)
    for r in rows:
        eps = "—" if r["epsilon"] is None else fmt(r["epsilon"])
        ratio = "—" if r["vs_poisson"] is None else f"{r['vs_poisson']:.3g}"
        table.add_row(r["sampler"], r["bound"] + ("" if r.get("converged", True) else " (not converged)"),
                      r["relation"], r["accountant"], eps if "why" not in r else f"[dim]{r['why']}[/dim]", ratio,
                      f"{r['seconds']:.2f}")
    console.print(table)


def _closed_form_rows(m, eps: float, delta: float, rows: list[dict]) -> list[dict]:
    """Published closed-form sigmas for full-batch schedules (noise(kind).closed_forms, e.g. DPZero's), each with
    the eps it spends under the tight accountant, beside the smallest calibrated sigma of the table."""
    facts = noise(m.kind)
    tight = [float(r["value"]) for r in rows if "value" in r]
    if m.sampling_rate < 1 or not facts.closed_forms or not tight or delta <= 0:
        return []
    out = []
    for name, form in facts.closed_forms.items():
        sigma = form(m.steps, eps, delta)
        spent = epsilon(m.with_sigma(sigma), delta)
        out.append({"name": name, "sigma": sigma, "epsilon": json_float(spent.epsilon), "accountant": spent.accountant,
                    "tight_sigma": min(tight), "noise_ratio": sigma / min(tight)})
    return out


@bounded("dpaudit plot")
def plot(
    out: Annotated[Path, typer.Option("--out", "-o", help="PNG file to write.")],
    vs: Annotated[str, typer.Option("--vs", help="x axis: sigma or steps.")] = "sigma",
    sigma: Annotated[Optional[float], typer.Option("--sigma", "-s", help="Noise level (for --vs steps).")] = None,
    eps: Annotated[Optional[float], typer.Option("--eps", "-e", help="Target eps to mark (and calibrate).")] = None,
    mech: MechOpt = "gaussian", delta: DeltaOpt = None, p: POpt = None, batch_size: BatchOpt = None,
    dataset_size: DatasetOpt = None, steps: StepsOpt = None, epochs: EpochsOpt = None,
    accountant: AccountantOpt = None, points: Annotated[int, typer.Option(help="Points on the curve.")] = 25,
    force: ForceOpt = False, as_json: JsonOpt = False,
) -> None:
    """PNG of epsilon against sigma (for a schedule) or against steps (for a sigma)."""
    import numpy as np

    from dpaudit.core.plots import epsilon_curve

    if vs not in ("sigma", "steps"):
        raise DPAuditError(f"--vs must be sigma or steps, got {vs!r}")
    if not 3 <= points <= 200:
        raise DPAuditError(f"--points must be in [3, 200], got {points}")
    guard_new_file(out, force)
    d = resolve_delta(mech, delta)
    m = schedule(mech, 1.0 if sigma is None else sigma, p, batch_size, dataset_size, steps, epochs)
    marker = None
    if vs == "sigma":
        if eps is not None:
            marker = calibrate_sigma(m, eps, d, accountant).sigma
        centre = marker if marker is not None else 1.0 if sigma is None else sigma
        xs = list(np.geomspace(centre / 4, centre * 4, points))
        ys = [epsilon(m.with_sigma(float(x)), d, accountant).epsilon for x in xs]
        label = noise(mech).axis_label
    else:
        if sigma is None:
            raise DPAuditError("--vs steps needs --sigma")
        xs = sorted({int(x) for x in np.geomspace(1, m.steps, points)})
        ys = [r.epsilon for r in epsilons_over_steps(m, xs, d, accountant)]
        label = "steps T"
    title = f"{mech}, p={m.sampling_rate:g}, " + (f"T={m.steps}" if vs == "sigma" else f"sigma={sigma:g}") + f", delta={d:g}"
    epsilon_curve(xs, ys, x_label=label, title=title, path=out, target=eps, marker=marker)
    if as_json:
        emit_json({"command": "plot", "out": str(out), "x": [float(x) for x in xs], "epsilon": [json_float(y) for y in ys],
                   "calibrated_sigma": marker})
    else:
        console.print(f"wrote {out}")
