"""Correlated noise: matrix-factorisation mechanisms (DP-FTRL, banded MF, BLT).

- ``toeplitz``: the Toeplitz strategies' numerics (inverse, error, min-separation sensitivity, the optimal banded
  strategy);
- ``strategy``: the ``Strategy`` an event carries (``--noise``), its participation, sensitivity and error;
- ``bandmf``: the ``bandmf`` accountant (cyclic Poisson amplification, Choquette-Choo et al. 2023);
- ``single``: the ``matrix`` accountant (one Gaussian release at the sensitivity, no amplification).
"""
