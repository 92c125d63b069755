"""Balls-in-bins (random allocation: each example is put in one of the epoch's batches uniformly at random;
Chua et al. 2025, Feldman & Shenfeld 2025): named so that it can be refused with the reason."""

from dpaudit.accounting.result import ZERO_OUT_WORDS, NeighboringRelation
from dpaudit.accounting.samplers import Scheme

SCHEME = Scheme("balls-in-bins", NeighboringRelation.REPLACE_SPECIAL, True,
                "balls-in-bins: each example in one random batch of each epoch (B = {B} on average, N = {N}), "
                "T = {T} steps", ZERO_OUT_WORDS, epochs=True, looks_like=("balls-in-bins",), rank=3,
                refused="balls-in-bins (random allocation) is not accounted: the published methods (Chua et al. 2025; "
                        "Feldman & Shenfeld 2025) give a Monte-Carlo estimate, not a bound that holds, or an upper "
                        "bound whose computation does not fit the time and memory budgets here; account it as shuffle "
                        "(valid: each example meets at most one batch an epoch) or switch to Poisson sampling")
