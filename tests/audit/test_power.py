"""What m canaries can refute, before training (dpaudit/audit/power.py), checked against the audit itself."""

import numpy as np
import pytest

from dpaudit.audit.analysis import analyse
from dpaudit.audit.power import most_certifiable, power_note, smallest_m


@pytest.mark.parametrize("claim", [1.0, 4.0])
def test_the_smallest_m_is_the_first_whose_perfect_audit_refutes_the_claim(claim):
    m = smallest_m(claim, 1e-5, 0.05)
    assert most_certifiable(m - 1, 1e-5, 0.05) <= claim < most_certifiable(m, 1e-5, 0.05)
    members = np.arange(m) % 2 == 0
    ordered = members + np.linspace(0.5, 0.0, m)  # every member above every non-member, no two scores tied
    perfect = analyse(ordered, members, claimed_epsilon=claim, delta=1e-5)  # every guess right
    assert perfect.violation  # the audit does reach it
    fewer = analyse(ordered[:-1], members[:-1], claimed_epsilon=claim, delta=1e-5)
    assert not fewer.violation  # and one canary fewer cannot, even with every guess right


def test_the_note_speaks_only_when_the_audit_cannot_refute():
    assert power_note(1000, 4.0, 1e-5, 0.05) is None and power_note(1000, None, 1e-5, 0.05) is None
    line = power_note(21, 8.0, 1e-5, 0.05)
    assert line.startswith("m = 21 canaries can certify at most eps") and f"is {smallest_m(8.0, 1e-5, 0.05)}" in line
    ceilings = [most_certifiable(m, 1e-5, 0.05) for m in (10, 100, 1000, 10_000)]
    assert ceilings == sorted(ceilings)
