"""Entry point: the typer app, and the one place where errors become one line and exit 2."""

from __future__ import annotations

import sys

import typer

from dpaudit.errors import DPAuditError
from dpaudit.cli import accounting_commands, audit_commands, canary_commands, check_command, train_commands
from dpaudit.cli.common import err_console

app = typer.Typer(
    name="dpaudit", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="Calibrate the noise of DP training, prove budgets in CI, and audit what leaked.",
)
app.command("calibrate")(accounting_commands.calibrate)
app.command("epsilon")(accounting_commands.epsilon_cmd)
app.command("delta")(accounting_commands.delta_cmd)
app.command("max-steps")(accounting_commands.max_steps_cmd)
app.command("compare")(accounting_commands.compare)
app.command("plot")(accounting_commands.plot)
app.command("check")(check_command.check)
app.add_typer(canary_commands.app, name="canaries")
audit_commands.app.command("run")(train_commands.audit_run)
app.add_typer(audit_commands.app, name="audit")
app.command("train")(train_commands.train_cmd)
app.command("replay")(train_commands.replay_cmd)

USAGE_ERROR = 2


def run(argv: list[str] | None = None) -> None:
    """Console-script entry: user errors and library refusals print one line and exit 2."""
    try:
        app(args=argv, standalone_mode=True)
    except DPAuditError as exc:
        err_console.print(f"[bold red]error:[/bold red] {exc}", highlight=False)
        sys.exit(USAGE_ERROR)
    except (ValueError, OverflowError, ZeroDivisionError, FloatingPointError, MemoryError) as exc:
        err_console.print(f"[bold red]error:[/bold red] cannot answer this query: {type(exc).__name__}: {exc}",
                          highlight=False)
        sys.exit(USAGE_ERROR)


if __name__ == "__main__":
    run()
