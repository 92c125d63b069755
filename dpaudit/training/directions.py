"""DP-ZO's search directions z, by name (no torch here: the CLI and the config read them at start-up).

All three are on the sqrt(d)-sphere in expectation or exactly, with E[z z^T] = I, so the two-point
estimate (z^T g) z is unbiased for the gradient g in each case; privacy does not depend on z at all (z
is public, drawn from the step's public seed; only the clipped, noised scalar touches the data).
- "rademacher" (the default): +-1 entries, SPSA's classic perturbation (Spall 1992). Exactly on the
  sphere, so its estimate varies less than the Gaussian's: E||(z^T g) z||^2 = d ||g||^2 (as for the
  sphere), against (d + 2) ||g||^2, since E[z_i^4] = 1 against 3. Drawn 32 signs to a generator word,
  a pass over the weights costs a third of a Gaussian one on CPU (docs/trainers.md).
- "gaussian": N(0, I), as in MeZO and the DP-ZO paper (Tang et al. 2024); the default before
  2026-11-25 (every run records its direction, so replay and resume take the one it was trained with).
- "sphere": Gaussian scaled onto the sqrt(d)-sphere (uniform there), as in DPZero; one extra pass.
"""

# Each direction's stream kind (training/streams.py): what its passes draw from the step's seed.
STREAM_KIND = {"rademacher": "signs", "gaussian": "normal", "sphere": "normal"}
DIRECTIONS = tuple(STREAM_KIND)
DEFAULT_DIRECTION = "rademacher"
