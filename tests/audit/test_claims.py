"""A canary inserted k times is a group of k examples: its audit is held to group privacy (k eps, k e^((k-1) eps)
delta), never to the one-example claim, which a correct run would fail."""

import math

import numpy as np
import pytest

from dpaudit.audit.analysis import analyse
from dpaudit.audit.claims import group_claim
from dpaudit.audit.gdp import mu_from_epsilon


def test_group_claim_is_the_textbook_one_and_unchanged_for_one_copy():
    assert group_claim(1.0, 1e-5, 1) == (1.0, 1e-5, None)
    eps, delta, words = group_claim(1.0, 1e-5, 3)
    assert eps == 3.0 and delta == pytest.approx(3 * math.exp(2) * 1e-5) and "inserted 3 times" in words
    assert group_claim(None, 1e-5, 4)[0] is None


def test_a_correct_run_with_repeated_canaries_passes_its_group_claim_and_would_fail_the_plain_one():
    """Scores of a mu-GDP release of each copy: k copies shift a member by k mu (group privacy of GDP). Held to the
    group claim, the verdict is consistent in (far) more than 1 - alpha of the runs; held to the one-example
    claim, the same correct runs read VIOLATION."""
    eps, delta, k, m = 1.0, 1e-5, 4, 1000
    mu = mu_from_epsilon(eps, delta)
    rng = np.random.default_rng(0)
    wrong = group_violations = 0
    for _ in range(10):
        members = rng.random(m) < 0.5
        scores = rng.normal(0.0, 1.0, m) + k * mu * members
        held, group_delta, _ = group_claim(eps, delta, k)
        group_violations += analyse(scores, members, claimed_epsilon=held, delta=group_delta).violation
        wrong += analyse(scores, members, claimed_epsilon=eps, delta=delta).violation
    assert group_violations == 0 and wrong >= 8
