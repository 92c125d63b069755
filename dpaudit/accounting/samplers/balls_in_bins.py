"""Balls-in-bins (random allocation, k = 1): each epoch of t = N // B steps puts each example in one of the t
steps uniformly at random, independently of the other examples (batches hold N / t examples on average, not
exactly B). Chua et al. (2024) name it balls-and-bins; Feldman & Shenfeld (ICML 2026) account it.

Neighbours add or remove one example (batch sizes are not fixed, so nothing else moves). The accountant is
accounting/allocation.py (Gaussian: an upper bound with a lower bound beside it); every noise also has the shuffle
bound (each example in exactly one batch an epoch: E full-batch releases, valid, no amplification).
"""

from dpaudit.accounting.result import NeighboringRelation
from dpaudit.accounting.samplers import Scheme

SCHEME = Scheme("balls-in-bins", NeighboringRelation.ADD_OR_REMOVE_ONE, True,
                "balls-in-bins: each example in one uniformly random step of each epoch of N // B = "
                "{t} steps (B = {B} on average, N = {N}), T = {T} steps", accountants=("allocation", "shuffle"),
                epochs=True, whole_epochs=True, looks_like=("balls-in-bins",), rank=3)
