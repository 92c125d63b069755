"""Options and output shared by the commands: one place for the schedule flags and --json."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import os
import sys
import typing
from contextlib import contextmanager
from typing import Annotated, Optional

import click
import click.utils
import typer
import typer.core
import typer.main
from rich.console import Console

from dpaudit.accounting.matrix.strategy import error_summary, parse
from dpaudit.accounting.mechanism import Mechanism, event, parse_phase, schedule, with_unit  # noqa: F401 - schedule: the commands import it here
from dpaudit.accounting.unit import EXAMPLE, Unit, unit_from  # noqa: F401 - unit_from: likewise
from dpaudit.accounting.samplers import SAMPLINGS
from dpaudit.accounting.noises import NOISES, noise, resolve_delta  # noqa: F401 - resolve_delta: likewise
from dpaudit.core.errors import DPAuditError
from dpaudit.core import limits as budget

class LazyCommand(typing.NamedTuple):
    """A command whose module is imported only when it runs or prints its own help: ``module`` under dpaudit.cli,
    ``attr`` a command function or a typer sub-app, ``summary`` the line its group's help shows (a test keeps it
    equal to the command's own first line)."""

    module: str
    attr: str
    summary: str


def lazy_group(table: dict[str, LazyCommand]) -> type:
    """A typer group class whose commands in ``table`` load on first use. `dpaudit --help` and the closed forms
    stay within the start-up budget (benchmarks/startup.py) while each command module imports what it uses at
    its top (the pattern of click's "lazily loading subcommands")."""

    class LazyGroup(typer.core.TyperGroup):
        lazy = table

        def list_commands(self, ctx: click.Context) -> list[str]:
            return [*super().list_commands(ctx), *(n for n in self.lazy if n not in self.commands)]

        def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
            if name in self.commands or name not in self.lazy:
                return super().get_command(ctx, name)
            entry = self.lazy[name]
            found = getattr(importlib.import_module(f"dpaudit.cli.{entry.module}"), entry.attr)
            if not isinstance(found, typer.Typer):
                single = typer.Typer(rich_markup_mode=None, add_completion=False)
                single.command(name)(found)
                found = single
            command = typer.main.get_command(found)
            command.name = name
            self.commands[name] = command
            return command

        def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
            names = [n for n in self.list_commands(ctx) if n in self.lazy or not self.commands[n].hidden]
            if not names:
                return
            limit = formatter.width - 6 - max(map(len, names))  # as click's own listing cuts each line
            rows = [(n, click.utils.make_default_short_help(self.lazy[n].summary, limit)
                     if n in self.lazy and n not in self.commands else self.commands[n].get_short_help_str(limit))
                    for n in names]
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    return LazyGroup


# On a terminal, rich fits the text to the window; elsewhere (a pipe, a log, CI) nothing is wrapped or cut:
# a value split across lines, a truncated path or a canary broken mid-token would be copied wrong.
_TTY = sys.stdout.isatty()


def reader_gone() -> None:
    """The reader of stdout closed the pipe (``dpaudit check c.yaml | head -1``): what it did not read is dropped
    (stdout now goes to the null device) and the command goes on to its own exit code. A closed pipe is not a
    verdict; rich's default exits 1, the "over budget" code, with nothing said."""

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


class _Console(Console):
    def on_broken_pipe(self) -> None:
        self.quiet = True
        reader_gone()


console = _Console(soft_wrap=not _TTY, width=None if _TTY else 100_000)
err_console = _Console(stderr=True, soft_wrap=True)  # an error stays one line, however long


class WholeNumber(click.ParamType):
    """An integer, also written in scientific notation or with underscores where that is exact (``-T 1e6``,
    ``-N 60_000``): the docs write schedules so. ``1.5`` or ``1e400`` is refused."""

    name = "integer"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            self.fail(f"{value!r} is not a valid integer", param, ctx)
        if not math.isfinite(number) or number != math.floor(number) or abs(number) > 2 ** 53:
            self.fail(f"{value!r} is not a whole number (scientific notation is taken where it is exact: 1e6)",
                      param, ctx)
        return int(number)


WHOLE = WholeNumber()
MechOpt = Annotated[str, typer.Option("--mech", help=f"Noise mechanism: {', '.join(NOISES)}.")]
DeltaOpt = Annotated[Optional[float], typer.Option(
    "--delta", help="Target delta. Default: 1e-5 for gaussian; 0 (pure eps-DP) for laplace.")]
POpt = Annotated[Optional[float], typer.Option("--p", help="Poisson sampling rate p = B/N.")]
BatchOpt = Annotated[Optional[int], typer.Option("--batch-size", "-B", click_type=WHOLE,
                                                 help="Expected batch size B (with -N).")]
DatasetOpt = Annotated[Optional[int], typer.Option("--dataset-size", "-N", click_type=WHOLE,
                                                   help="Dataset size N (with -B).")]
StepsOpt = Annotated[Optional[int], typer.Option("--steps", "-T", click_type=WHOLE,
                                                 help="Number of steps T (1e6 is taken: exact whole numbers).")]
EpochsOpt = Annotated[Optional[float], typer.Option("--epochs", help="Epochs (T = epochs / p).")]
UnitOpt = Annotated[str, typer.Option(
    "--unit", help="Privacy unit: example (one record; default) or user (all of one user's records, at most "
                   "--records-per-user k of them). A user-level answer names the user as the neighbour.")]
RecordsOpt = Annotated[Optional[int], typer.Option(
    "--records-per-user", click_type=WHOLE, help="--unit user: k, the most records one user contributes (a run caps "
                                                 "each user's records at k).")]
UserSamplingOpt = Annotated[Optional[str], typer.Option(
    "--user-sampling", help="--unit user: els (default; records sampled at p as usual, a step holds Binomial(k, p) "
                            "of a user's records) or uls (users sampled at p, each user's contribution clipped as "
                            "one).")]
AccountantOpt = Annotated[Optional[str], typer.Option(
    "--accountant", "-a", help="pld, prv, mc, pure, pure-prv, rdp or analytic. Default: the tightest exact "
                               "route (analytic for one release, pure for laplace at delta=0, else pld).")]
SamplingOpt = Annotated[str, typer.Option(
    "--sampling", help=f"Batch sampler: {', '.join(SAMPLINGS)} (fixed and shuffle need -B and -N; each is "
                       "accounted under its own neighbouring relation, said in the answer).")]
PhaseOpt = Annotated[Optional[list[str]], typer.Option(
    "--phase", help="A phase of the schedule, repeated for several: sigma=S,p=P,steps=T (or B=,N=; epochs=E; "
                    "sampling=...; mech=...). Phases are composed in sequence; instead of --sigma/--p/-T.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON only.")]
NoiseOpt = Annotated[Optional[str], typer.Option(
    "--noise", help="Correlated noise: bandmf,b=B (banded matrix factorisation; cyclic Poisson batches are "
                    "amplified: every example sampled at p B = B_batch b / N, the N mod b leftovers included; for "
                    "jax_privacy's sampler, which drops them and samples each group at B_batch / floor(N / b), give "
                    "-N b floor(N / b)), blt,theta=T1:T2,omega=W1:W2[,order=fixed] or blt,buffers=D (theta and "
                    "omega searched for "
                    "the schedule); default independent (DP-SGD). sigma is "
                    "then relative to the strategy's sensitivity.")]
McSamplesOpt = Annotated[Optional[int], typer.Option(
    "--mc-samples", help="mc accountant: composed samples per direction (default: sized to ~2e8 draws).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="mc accountant: random seed.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", help="CPU threads for torch (default: the cores this process may use, within its CPU quota).")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output file.")]


McWorkersOpt = Annotated[int, typer.Option("--mc-workers", help="mc accountant: processes (0 = every core).")]
McBackendOpt = Annotated[str, typer.Option("--mc-backend", help="mc accountant: numpy, or torch (uses a GPU if present).")]


def accountant_options(accountant: str | None, mc_samples: int | None, seed: int, progress: bool,
                       workers: int = 1, backend: str = "numpy", tilt: bool = False):
    """The typed options of the accountant the flags are for (None: its defaults)."""
    if accountant == "mc":
        from dpaudit.accounting.montecarlo import MonteCarloSettings

        return MonteCarloSettings(samples=mc_samples, seed=seed, progress=progress, workers=workers, backend=backend,
                                  tilt=tilt)
    return None


def assumptions(mech: Mechanism, delta: float, result) -> list[str]:
    """What an answer assumed, in words; the accountant named is the one that answered (an accounting
    result's ``accountant``), with the one asked for where they differ (a fallback)."""
    requested = result.details.get("requested")
    answered = result.accountant + (f" ({requested} was asked for; see the guarantee)"
                                    if requested and requested != result.accountant else "")
    kinds = sorted({m.kind for m in mech.phases})
    return [
        f"mechanism: {', '.join(kinds)}; {'; '.join(noise(k).scale_text for k in kinds)}; "
        "sensitivity (clip norm) C = 1 unit",
        ("one release: no subsampling, one step (p = 1, T = 1)" if mech.is_single_release
         else mech.sampling_words() + (" (p: the users' rate)" if mech.unit.algorithm == "ULS" else "")),
        *([f"privacy unit: {mech.unit.words()}"] if mech.unit.user_level else []),
        f"delta = {delta:g}" + (" (pure eps-DP)" if delta == 0 else ""),
        f"accountant: {answered}; neighbouring relation: {result.relation}",
    ] + _noise_lines(mech, result)


def _noise_lines(mech, result) -> list[str]:
    """Correlated noise: the strategy, and the error it buys at this sigma (what a user chooses a strategy on)."""
    if not isinstance(mech, Mechanism) or mech.strategy is None:
        return []
    from dpaudit.accounting.matrix.toeplitz import MAX_OPTIMISE

    err = error_summary(mech, result.accountant)
    error = (f"not computed (the banded strategy is optimised up to T = {MAX_OPTIMISE:,})" if err["expected_error"] is None
             else f"{err['expected_error']:.4g} C^2 per coordinate")
    return [f"noise: {mech.strategy.words()}; sigma is relative to its sensitivity",
            f"noise added: std {err['noise_std']:.4g} C per step; expected squared error of the last prefix sum "
            f"{error} (compare strategies at one eps: dpaudit compare --eps E --noise independent --noise SPEC)"]


def event_from(mech: str, sigma: float | None, p, batch_size, dataset_size, steps, epochs, sampling: str,
               phases: list[str] | None, noise_spec: str | None = None, unit: Unit = EXAMPLE):
    """The event a command describes: one schedule from the flags, or the --phase list composed in sequence
    (each phase's sigma defaults to --sigma, or 1 when calibrating: then it is the phase's share), accounted for
    ``unit`` (``unit_from`` of --unit, --records-per-user, --user-sampling)."""
    if not phases and steps is None and epochs is None and (p is not None or batch_size is not None):
        note_after("note: no -T/--steps or --epochs given: one step (T = 1) is accounted")
    return with_unit(event(mech, sigma, p, batch_size, dataset_size, steps, epochs, sampling,
                           [parse_phase(text) for text in phases] if phases else None,
                           ("--sigma", "--phase sigma=...,p=...,steps=...", "--p/-B/-N/-T/--epochs/--sampling"),
                           strategy=parse(noise_spec)), unit)


def shuffle_lines(event, delta: float, result) -> tuple[list[str], dict]:
    """For a shuffled or balls-in-bins schedule: the lower bound and the Poisson figure beside the upper bound,
    as lines for people and a mapping for --json; nothing for other samplers."""
    from dpaudit.accounting.shuffle import context_for

    ctx = context_for(event, delta, result)
    if ctx is None:
        return [], {}
    data = ctx.to_json(result.epsilon)
    lines = [f"lower bound ({ctx.lower_bound_words}): eps >= {fmt(ctx.lower_bound)}"
             if ctx.lower_bound is not None else f"lower bound: none ({ctx.lower_bound_note})",
             f"accounted as Poisson sampling (p = B/N, {ctx.poisson_accountant}) it would read eps <= "
             f"{fmt(ctx.poisson_epsilon)}"
             + (f": understated by up to {result.epsilon / ctx.poisson_epsilon:.3g}x (this upper bound)"
                if 0 < ctx.poisson_epsilon < result.epsilon
                else f" ({ctx.poisson_epsilon / result.epsilon:.4g}x this upper bound)" if result.epsilon > 0 else "")
             + (f", by at least {ctx.lower_bound / ctx.poisson_epsilon:.3g}x (the lower bound)"
                if ctx.lower_bound is not None and 0 < ctx.poisson_epsilon < ctx.lower_bound else "")]
    return lines, data


_NOTES: list[str] = []


def note_after(text: str) -> None:
    """A note for stderr once the command has answered (cli/main.py prints them): a refusal stays one line."""
    _NOTES.append(text)


def print_notes() -> None:
    while _NOTES:
        err_console.print(_NOTES.pop(0), highlight=False)


def drop_notes() -> None:
    """Forget notes a refused command left (a caller that runs several commands in one process)."""
    _NOTES.clear()


def emit_json(data: dict) -> None:
    try:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        reader_gone()


def emit(summary: dict, as_json: bool, text: str) -> None:
    """A command's result: the summary as JSON for machines, or one line of text for people."""
    if as_json:
        emit_json(summary)
    else:
        console.print(text, highlight=False)


@contextmanager
def time_budget(seconds: float | None, what: str, max_memory: str | None = None):
    """Refuse (exit 2, one line) instead of hanging: SIGALRM interrupts the work after ``seconds``. The
    accountants see the same deadline and memory budget (dpaudit.core.limits) and plan within it."""

    if seconds is not None and not (seconds > 0 and math.isfinite(seconds)):
        raise DPAuditError(f"--timeout must be a positive number of seconds, got {seconds}")
    with budget.enforced(max_memory, seconds, what):
        yield


TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", help="Seconds this command may take; past it: one line, exit 2, nothing decided.")]
MaxMemoryOpt = Annotated[str, typer.Option(
    "--max-memory", help="Memory the accountant may use (e.g. 2G, 512M). Over it: a valid coarser bound "
                         "(named in the answer) or one line, exit 2.")]
DEFAULT_TIMEOUT = 60.0
LONG_TIMEOUT = 600.0  # data and canary commands
MODEL_TIMEOUT = 3600.0  # commands that run a model over data (scoring, replay)
DEFAULT_MAX_MEMORY = "2G"


OptionalTimeoutOpt = Annotated[Optional[float], typer.Option(
    "--timeout", help="Seconds this command may take (default: no limit); past it: one line, exit 2.")]
ModelMaxMemoryOpt = Annotated[Optional[str], typer.Option(
    "--max-memory", help="Memory this command may use (e.g. 8G; default: the free memory); a model or input "
                         "estimated over it is refused before it is read.")]


def bounded(what: str, default: float | None = DEFAULT_TIMEOUT, memory: str | None | bool = DEFAULT_MAX_MEMORY):
    """Give a command --timeout (default ``default`` s; None: no limit unless given) and --max-memory
    (default ``memory``; None: the free memory; False: the command has its own), and run it inside both."""
    def wrap(fn):
        @functools.wraps(fn)
        def command(*args, timeout: float | None = default, **kwargs):
            if memory is False:  # the command's own --max-memory is its to read
                with time_budget(timeout, what, None):
                    return fn(*args, **kwargs)
            max_memory = kwargs.pop("max_memory", None)
            with time_budget(timeout, what, max_memory if max_memory is not None else memory or None):
                return fn(*args, **kwargs)

        hints = typing.get_type_hints(fn, include_extras=True)  # typer reads these, resolved
        sig = inspect.signature(fn)
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
        time_opt = TimeoutOpt if default is not None else OptionalTimeoutOpt
        extra = [inspect.Parameter("timeout", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                   annotation=time_opt)]
        added = {"timeout": time_opt}
        if memory is not False:
            memory_opt = MaxMemoryOpt if memory else ModelMaxMemoryOpt
            extra.append(inspect.Parameter("max_memory", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                           default=memory or None, annotation=memory_opt))
            added["max_memory"] = memory_opt
        command.__signature__ = sig.replace(parameters=[*params[:-1], *extra, params[-1]])
        command.__annotations__ = {**hints, **added}
        del command.__wrapped__  # typer must see the signature above, not the function's own
        return command
    return wrap


def fmt(x: float, digits: int = 6) -> str:
    return f"{x:.{digits}g}" if x == x and abs(x) != float("inf") else str(x)
