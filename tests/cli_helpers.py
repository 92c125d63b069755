"""Run the CLI as a user would: a subprocess, so exit codes and stderr are the real ones."""

import subprocess
import sys


def dpaudit(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dpaudit.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(out):
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
