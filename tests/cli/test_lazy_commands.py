"""The CLI loads a command's module only when that command runs or prints its help (cli/common.py: lazy_group):
the listing `dpaudit --help` prints is the one each command would print itself, and printing it loads none."""

import subprocess
import sys

import click
import click.utils
import pytest
import typer.main

from dpaudit.cli import audit_commands, main


def _listed():
    for group, table in ((main.app, main.COMMANDS), (audit_commands.app, audit_commands.RUN)):
        for name, entry in table.items():
            yield group, name, entry


@pytest.mark.parametrize("group,name,entry", list(_listed()), ids=lambda v: v if isinstance(v, str) else "")
def test_each_summary_is_the_commands_own_first_line(group, name, entry):
    command = typer.main.get_command(group)
    loaded = command.get_command(click.Context(command), name)
    assert loaded is not None and loaded.name == name
    for limit in (45, 80, 10_000):
        assert click.utils.make_default_short_help(entry.summary, limit) == loaded.get_short_help_str(limit)


def test_the_top_help_loads_no_command_module():
    code = ("import sys\nfrom dpaudit.cli.main import run\ntry:\n    run(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('LOADED', sorted(m for m in sys.modules if m.startswith('dpaudit.cli.') and m.endswith(('_commands', "
            "'_command'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "calibrate" in out and "canaries" in out
    assert out.strip().splitlines()[-1] == "LOADED []"


def test_an_unknown_command_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "dpaudit.cli.main", "no-such-command"], capture_output=True, text=True)
    assert done.returncode == 2 and "No such command" in done.stderr
