"""The planted-bug zoo through `dpaudit audit run --white-box` with its defaults (issue 36): a guard that stops
training (divergence, a timeout, a refusal) must never turn a planted privacy bug into exit 2. Every bug here
reads VIOLATION, exit 1, and training that diverged says so in the report instead of stopping."""

import json

import pytest

from cli_helpers import dpaudit


@pytest.mark.parametrize("method, bug", [("dp-sgd", "no-clip"), ("dp-sgd", "noise-x0.5"), ("dp-zo", "no-clip")])
def test_a_planted_bug_reads_violation_with_audit_run_s_defaults(method, bug, tmp_path, monkeypatch):
    monkeypatch.setenv("DPAUDIT_ALLOW_BUGS", "1")
    out = dpaudit("audit", "run", "--white-box", "--method", method, "--eps", "4", "--plant-bug", bug,
                  "--out", tmp_path / "run", "--json", "--threads", "1")
    assert out.returncode == 1, (out.returncode, out.stderr[-500:])
    result = json.loads(out.stdout)
    assert result["violation"] and result["epsilon_lower_bound"] > 4
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert ("training diverged" in report) == ("training diverged" in result["context"])
