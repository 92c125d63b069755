"""Shuffled epochs: a fresh permutation each epoch, cut into N // B batches of B.

Neighbours replace one example by a null one whose clipped contribution is 0 (zero-out; dp-accounting's
REPLACE_SPECIAL), the relation under which Chua et al. (ICML 2024) compare shuffling with Poisson sampling. The
bound is accounting/shuffle.py's.
"""

from dpaudit.accounting.result import ZERO_OUT_WORDS, NeighboringRelation
from dpaudit.accounting.samplers import Scheme

SCHEME = Scheme("shuffle", NeighboringRelation.REPLACE_SPECIAL, True,
                "shuffled epochs: a fresh permutation of N = {N} each epoch, cut into batches of B = {B}, T = {T} steps",
                ZERO_OUT_WORDS, accountants=("shuffle",), epochs=True, looks_like=("shuffled epochs", "a cyclic pass", "a fixed order"), rank=2)
