"""Entry point: the typer app, and the one place where errors become one line and exit 2."""

from __future__ import annotations

import os
import sys
import warnings

# Before torch (and its OpenMP runtime) loads: threads waiting at a parallel region sleep instead of
# spinning, so a core another process takes mid-run stalls a step less (benchmarks/threads.py --late).
# A value the user set stays.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer
import typer.core
from rich.markup import escape

from dpaudit import __version__
from dpaudit.core.errors import DPAuditError, Interrupted
from dpaudit.cli.common import LazyCommand, drop_notes, err_console, lazy_group, print_notes

# Plain click help: typer's rich help imports and renders ~0.15 s per call, and escapes brackets
# in plain mode. Start-up is budgeted (benchmarks/startup.py); results still print with rich.
typer.core.HAS_RICH = False

# Each command's module loads when that command runs or prints its help (cli/common.py: lazy_group).
COMMANDS = {
    "calibrate": LazyCommand("accounting_commands", "calibrate", "Smallest noise whose accounted epsilon is <= the "
                             "target (one release when no schedule is given)."),
    "epsilon": LazyCommand("accounting_commands", "epsilon_cmd", "Epsilon (an upper bound) spent by a given noise "
                           "level and schedule, or by phases (--phase, repeated)."),
    "delta": LazyCommand("accounting_commands", "delta_cmd", "delta(eps) for a noise level and schedule: an upper "
                         "bound (pld; mc with probability >= 1 - beta)."),
    "max-steps": LazyCommand("accounting_commands", "max_steps_cmd", "Largest number of steps that stays within the "
                             "target epsilon at a given noise level."),
    "compare": LazyCommand("accounting_commands", "compare", "Every applicable accountant side by side, with timings "
                           "(eps for --sigma, or sigma for --eps); the accountants that do not cover the schedule "
                           "(its sampler, its phases) say why."),
    "plot": LazyCommand("accounting_commands", "plot", "PNG of epsilon against sigma (for a schedule) or against "
                        "steps (for a sigma)."),
    "check": LazyCommand("check_command", "check", "Gate a training config on its privacy budget (for CI and "
                         "pre-commit): exit 0 within budget, 1 over it (or a claim accounted for another sampler than "
                         "the one the run uses), 2 when the config is unusable (no sigma stated, ambiguous, malformed) or "
                         "the check ran out of time."),
    "train": LazyCommand("train_commands", "train_cmd", "Fine-tune a local causal LM with DP-ZO or DP-SGD (sigma "
                         "calibrated to --eps) or a non-private baseline."),
    "replay": LazyCommand("train_commands", "replay_cmd", "Rebuild a DP-ZO model from the base weights and the (seed, "
                          "scalar) log, and compare it with the run's (exit 1 when they differ beyond --tolerance: the "
                          "log does not explain the model)."),
    "canaries": LazyCommand("canary_commands", "app", "Make new-token canaries and put them into data and models."),
    "audit": LazyCommand("audit_commands", "app", "Membership-inference audits against a claimed eps."),
    "model": LazyCommand("model_commands", "app", "Get a plain model folder: the embedded default, or a GGUF file "
                         "converted."),
}

app = typer.Typer(
    name="dpaudit", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
    cls=lazy_group(COMMANDS), help="Calibrate the noise of DP training, prove budgets in CI, and audit what leaked.",
)


def _version(value: bool) -> None:
    if value:
        print(f"dpaudit {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    """Calibrate the noise of DP training, prove budgets in CI, and audit what leaked."""


USAGE_ERROR = 2


def _usage_errors() -> tuple[type, ...]:
    """UsageError of the click that typer runs on: newer typer vendors it as typer._click."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(__import__(module, fromlist=["UsageError"]).UsageError)
        except ImportError:
            pass
    return tuple(found)


def run(argv: list[str] | None = None) -> None:
    """Console-script entry: user errors and library refusals print one line and exit 2; numerical
    warnings from the libraries never reach the terminal on their own (folded into an error line)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            _run(argv, caught)
    except SystemExit as exc:
        distributed = sys.modules.get("dpaudit.training.distributed")  # imported only by a training command
        if distributed is not None and distributed.joined_a_group():  # a torchrun rank: exit without finalizing
            distributed.exit_process(0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1)
        raise


def _fold(message: str, caught: list) -> str:
    seen = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
    return message + (f" (numerical warnings: {'; '.join(seen[:3])})" if seen else "")


INTERNAL_ERROR = 3
INTERRUPTED = 130


def _say(message: str) -> None:
    err_console.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)


def _run(argv, caught) -> None:
    """Exit codes mean one thing: 0 ok; 1 over budget / violation (returned by the command itself); 2 bad
    input or an unusable environment; 3 an internal error (a bug: one line, DPAUDIT_DEBUG=1 for the
    traceback); 130 interrupted (Ctrl-C)."""

    drop_notes()
    try:
        code = app(args=argv, standalone_mode=False)  # click then raises usage errors to us, returns exit codes
    except _usage_errors() as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `dpaudit` / `dpaudit audit`: help, not an error
            if exc.format_message().strip():  # rich help is printed when the error is built; plain help is not
                print(exc.format_message())
            sys.exit(0)
        where = exc.ctx.command_path if exc.ctx is not None else "dpaudit"
        err_console.print(f"[bold red]error:[/bold red] {exc.format_message()} (see '{where} --help')", highlight=False)
        sys.exit(USAGE_ERROR)
    except Interrupted as exc:
        _say(str(exc))
        sys.exit(INTERRUPTED)
    except (typer.Abort, KeyboardInterrupt) as exc:  # click turns Ctrl-C (and an EOF it meets) into Abort
        cause = exc.__context__ if isinstance(exc, typer.Abort) else exc
        if isinstance(cause, KeyboardInterrupt) or isinstance(exc, KeyboardInterrupt):
            _say("interrupted (Ctrl-C); nothing was decided" if not isinstance(cause, Interrupted) else str(cause))
            sys.exit(INTERRUPTED)
        _internal(cause or exc)
    except DPAuditError as exc:
        _say(str(exc))
        sys.exit(USAGE_ERROR)
    except RecursionError:  # a document nested beyond reason (JSON, YAML): its reader ran out of stack
        _say("an input is nested too deeply to read")
        sys.exit(USAGE_ERROR)
    except OSError as exc:  # unwritable folder, disk full, output is a folder...: unusable input, never "violation"
        where = f": {exc.filename}" if exc.filename else ""
        _say((exc.strerror or type(exc).__name__) + where)
        sys.exit(USAGE_ERROR)
    except Exception as exc:  # noqa: BLE001 - the one place an unexpected failure becomes a line and exit 3
        # (a ValueError or an overflow too: input is refused by DPAuditError, core/validate.py, so any other
        # exception is a check dpaudit lacks, never "bad input")
        if os.environ.get("DPAUDIT_DEBUG") == "1":
            raise
        _internal(exc, caught)
    if code == INTERRUPTED:  # typer turns Ctrl-C into a silent exit 130
        _say("interrupted (Ctrl-C); nothing was decided")
    else:
        print_notes()   # notes the command left for after its answer (never beside a one-line error)
    sys.exit(code if isinstance(code, int) else 0)


def _internal(exc: BaseException, caught: list = ()) -> None:
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    said = _fold(f"internal error: {type(exc).__name__}{': ' + first if first else ''}", caught)
    _say(f"{said} (this is a dpaudit bug; DPAUDIT_DEBUG=1 shows the traceback)")
    sys.exit(INTERNAL_ERROR)


if __name__ == "__main__":
    run()
