"""A health check of the DP update: did the tensors the run trains move as a DP step can move them?

Opacus users lose whole runs to updates that "looked normal" (Opacus issue #820: LoRA adapters that never
trained; #827 asks for a weight-delta check). Every ``every`` DP steps this module compares per-tensor
fingerprints (a float64 sum, a sum of squares and up to ``SAMPLES`` strided values, taken on the tensors' device
and copied to the host once for all tensors) and says, once per tensor and finding, in one line:

- ``never-moved``: a tensor the run trains is exactly where it started after ``every`` or more steps (frozen
  adapters, a tensor the optimizer does not hold, a parameter group whose rate is 0). A warning: nothing leaks
  from a tensor that does not move, and nothing trains it either.
- ``moved-outside``: a tensor changed between the end of one DP step and the start of the next, or a trainable
  tensor the DP optimizer does not hold moved (an optimizer built before ``make_private`` and stepped itself, a
  second optimizer, a manual update). Such updates see no clipping and no noise: the probe's verdict is then
  VIOLATION (analysis.py, ``unprotected``).
- ``stepped-outside``: the optimizer under the DP optimizer stepped outside the DP optimizer's step (it was
  built before ``make_private`` and is stepped itself).
- ``no-gradient``: a tensor whose clipped gradient sum before the noise was exactly zero at two checks in a row:
  the loss does not reach it (a detached adapter), so its updates are the noise alone.
- ``too-large``: in a checked step a tensor moved more than ``TOO_LARGE`` times what the optimizer can move it
  from the released gradient: SGD moves a coordinate by lr (|momentum buffer| + wd |theta|), the Adam family by
  at most lr (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2)) + lr wd |theta| (Cauchy-Schwarz on the moment sums; 7.3 lr
  at the default betas). Other optimizers: not checked, and the report says so.

A fingerprint that equals an earlier one is read as "did not move": a DP step's noise moves every coordinate,
so the sums and the sampled values all staying put by chance does not happen in practice.
"""

from __future__ import annotations

import math

import numpy as np

from dpaudit.core.run_record import HealthRecord
from dpaudit.core.run_folder import OUTSIDE_DP

SAMPLES = 64         # strided values a tensor's fingerprint keeps (besides its sum and sum of squares)
EVERY = 50           # DP steps between checks, once the doublings (0, 1, 2, 4, ...) reach it
TOO_LARGE = 10.0     # a checked update this many times the optimizer's bound is "too large"
STILL_AFTER = 4      # DP steps after which a tensor the DP step releases must have moved (its noise moves it)
# What a group of tensors with one finding is said as (one printed line a cause, not one a tensor)
SUMMARY = {
    "never-moved": "have not moved in {step} DP steps: frozen, not stepped by the optimizer, or their group's "
                   "learning rate is 0",
    "moved-outside": "moved outside the DP step: updated without clipping or noise",
    "no-gradient": "get no gradient from the loss (clipped sums 0 at two checks): detached from the forward, so "
                   "their updates are noise alone",
    "too-large": "moved more in one DP step than the optimizer can move them from the release: something else "
                 "updates them",
}


def fingerprints(tensors):
    """A (len(tensors), 2 + SAMPLES) float64 host array: each tensor's sum, sum of squares and strided values
    (NaN-padded), computed where the tensors are and copied once."""
    import torch

    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        stride = max(1, flat.numel() // SAMPLES)
        picked = flat[::stride][:SAMPLES].double()
        pad = torch.full((SAMPLES - picked.numel(),), float("nan"), dtype=torch.float64, device=flat.device)
        total = torch.sum(flat, dtype=torch.float64).view(1)  # no float64 copy of the tensor
        square = torch.linalg.vector_norm(flat, 2, dtype=torch.float64).square().view(1)
        rows.append(torch.cat([total, square, picked, pad]))
    if not rows:
        return np.zeros((0, 2 + SAMPLES))
    return torch.stack([r.to(rows[0].device) for r in rows]).cpu().numpy()


def _same(a, b):
    """Per row: whether two fingerprints are equal (NaN padding equal to itself)."""

    return np.all((a == b) | (np.isnan(a) & np.isnan(b)), axis=1)


def update_bound(optimizer, param, released=None) -> float | None:
    """The largest change one step of ``optimizer`` (torch's own SGD or Adam family) can make to a coordinate of
    ``param``, from its group's settings and state after the step; None for another optimizer."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None:
        return None
    lr, wd = float(group.get("lr", 0.0)), float(group.get("weight_decay", 0.0) or 0.0)
    size = float(param.detach().abs().max()) if param.numel() else 0.0
    betas = group.get("betas")
    if betas is not None and "momentum" not in group:
        b1, b2 = float(betas[0]), float(betas[1])
        if not (0 <= b1 < 1 and 0 < b2 < 1 and b1 * b1 < b2):
            return None
        return lr * (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2)) + lr * wd * size
    if type(optimizer).__name__ != "SGD":
        return None
    buffer = optimizer.state.get(param, {}).get("momentum_buffer")
    step = buffer if buffer is not None else released
    if step is None:
        return None
    biggest = float(step.detach().abs().max()) if step.numel() else 0.0
    if buffer is None:  # no momentum: lr (g + wd theta)
        return lr * (biggest + wd * size)
    if group.get("nesterov"):  # lr (g + wd theta + momentum x buffer)
        grad = float(released.detach().abs().max()) if released is not None and released.numel() else biggest
        return lr * (grad + wd * size + float(group.get("momentum", 0.0)) * biggest)
    return lr * biggest  # the buffer holds g + wd theta already


def unprotected(health: "UpdateHealth | None", declared: list[str]) -> list[str]:
    """The trainable tensors updated outside DP: those the DP optimizer does not hold (``declared``), less those the
    health check has seen never move (nothing leaks from a tensor left where it started), plus any the check saw
    move outside the DP step. Before the first checked step: every tensor the optimizer does not hold."""
    if health is None or health.steps == 0:
        return list(declared)
    still = set(health.untouched_others)
    return [n for n in declared if n not in still] + [n for n in health.outside if n not in declared]


def for_tensors(params, model=None, *, bracketed: bool = True) -> "UpdateHealth":
    """The check on ``params`` (the tensors the DP step releases), named as ``model`` names them, and on the
    model's other trainable tensors (they must not move). ``bracketed``: the caller reports each DP step's start
    and end (an attached Opacus probe); else it only looks (a plain loop, a pipeline probe)."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    held = {id(p) for p in params}
    others = [] if model is None else [(n, p) for n, p in model.named_parameters()
                                       if p.requires_grad and id(p) not in held]
    health = UpdateHealth([(names.get(id(p), f"parameter {k}"), p) for k, p in enumerate(params)], others)
    health.bracketed = bracketed
    return health


class UpdateHealth:
    """The checks above on ``dp_named`` (name, tensor) pairs, the tensors the DP step releases, and on
    ``other_named``, the model's other trainable tensors (they must not move at all). ``bracketed`` (set by
    ``for_tensors``): the caller reports each DP step's start and end (``before``, ``after``); else only ``look``."""

    def __init__(self, dp_named, other_named=(), *, every: int = EVERY, say=print):
        self.names = [n for n, _ in dp_named] + [n for n, _ in other_named]
        self.tensors = [t for _, t in dp_named] + [t for _, t in other_named]
        self.dp = len(dp_named)
        self.every, self.say = int(every), say
        self.first = fingerprints(self.tensors)
        self.moved = [False] * len(self.tensors)
        self.steps = 0
        self.findings: dict[tuple[str, str], str] = {}
        self._after = None      # fingerprint at the end of the last checked DP step
        self._before = None     # at the start of the current checked step
        self._zero_sum = [0] * self.dp
        self.unchecked: str | None = None  # why the update size is not checked (another optimizer)
        self.bracketed = True  # the caller calls before/after around each DP step (else only look)
        self._new: list = []   # findings not printed yet (kind, tensor, line, cause)

    # -- findings ----------------------------------------------------------------------------------------
    def _find(self, kind: str, name: str, line: str, cause: str | None = None) -> None:
        """A finding, kept per tensor (the report, health.json); printed grouped by kind and cause (``_say``)."""
        if (kind, name) not in self.findings:
            self.findings[(kind, name)] = line
            self._new.append((kind, name, line, cause))

    def _say(self, step: int | None = None) -> None:
        """Print the findings since the last print: one line a (kind, cause), naming up to three tensors."""
        groups: dict = {}
        for kind, name, line, cause in self._new:
            groups.setdefault((kind, cause), []).append((name, line))
        self._new = []
        for (kind, cause), found in groups.items():
            if len(found) == 1 and cause is None:
                self.say(f"dpaudit: health: {found[0][1]}")
                continue
            names = ", ".join(n for n, _ in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
            words = cause or SUMMARY.get(kind, kind).format(step=self.steps if step is None else step)
            self.say(f"dpaudit: health: {len(found)} tensor{'s' if len(found) > 1 else ''} ({names}) {words}")

    def due(self, step: int) -> bool:
        """Whether DP step ``step`` (0-based) is checked: 0, 1, 2, 4, 8, ... (so a short run is checked too), then
        every ``every``-th."""
        return step % self.every == 0 or (step < self.every and step & (step - 1) == 0)

    @property
    def outside(self) -> list[str]:
        """Tensors updated outside the DP step (their updates saw no clipping or noise)."""
        moved = [n for k, n in self.findings if k == OUTSIDE_DP[0]]
        if any(k == OUTSIDE_DP[1] for k, _ in self.findings):  # every tensor it holds moved so
            return self.names[:self.dp] + [n for n in moved if n not in self.names[:self.dp]]
        return moved

    @property
    def untouched_others(self) -> list[str]:
        """Trainable tensors the DP optimizer does not hold that have not moved (so far): nothing leaks from them."""
        return [n for k, n in enumerate(self.names) if k >= self.dp and not self.moved[k]]

    def lines(self) -> dict:
        """The report's lines: each finding, or that the checks found nothing."""
        if not self.findings:
            said = (f"no finding in {self.steps} DP steps (checked at steps 0, 1, 2, 4, ... then every {self.every}, "
                    "and at the audit)")
            return {"health of the update": said + (f"; update size not checked: {self.unchecked}"
                                                    if self.unchecked else "")}
        out = {f"health: {k} {n}": line for (k, n), line in self.findings.items()}
        if self.unchecked:
            out["health: update size"] = f"not checked: {self.unchecked}"
        return out

    def to_dict(self) -> dict:
        return HealthRecord(self.steps, self.every, tuple((k, n, line) for (k, n), line in self.findings.items()),
                            self.unchecked).to_json()

    # -- the checks --------------------------------------------------------------------------------------
    def look(self, step: int) -> None:
        """A check without the step's bracket (a plain loop, a callback): moves since the start only."""
        self.steps = max(self.steps, step)
        self._moves(fingerprints(self.tensors), step)
        self._say(step)

    def _moves(self, now, step: int) -> None:
        still = _same(now, self.first)
        for k, name in enumerate(self.names):
            if not still[k]:
                if k >= self.dp and not self.moved[k]:
                    self._find("moved-outside", name, f"{name} is trainable, is not held by the DP optimizer, and "
                               "moved: it is updated without clipping or noise")
                self.moved[k] = True
            elif k < self.dp and step >= STILL_AFTER and not self.moved[k]:
                rounding = _rounded_away(self.tensors[k])
                self._find("never-moved", name, f"{name} has not moved in {step} DP steps: "
                           + (rounding or "it is frozen, not stepped by the optimizer, or its group's learning rate "
                                          "is 0"), cause=rounding)
            elif step >= STILL_AFTER and not self.moved[k]:
                self._find("never-moved", name, f"{name} is trainable but the DP optimizer does not hold it, and it "
                           f"has not moved in {step} DP steps: it is not trained (was the optimizer built before it "
                           "was added, as LoRA adapters added after the optimizer?)")

    def before(self, step: int) -> None:
        """The start of DP step ``step``: on a checked step, whether anything moved since the last DP step ended."""
        if not self.due(step) and self._after is None:
            return
        now = fingerprints(self.tensors)
        if self._after is not None:
            changed = ~_same(now, self._after)
            for k in range(self.dp):
                if changed[k]:
                    self._find("moved-outside", self.names[k], f"{self.names[k]} changed between DP steps {step - 1} "
                               f"and {step}: an update outside the DP step (a second optimizer, one built before "
                               "make_private, or a manual change) sees no clipping or noise")
            self._after = None
            self._say(step)
        self._before = now if self.due(step) else None

    def after(self, step: int, optimizer=None, released=None) -> None:
        """The end of DP step ``step`` (the optimizer stepped): on a checked step, the moves and the update size;
        the step before a checked one keeps its fingerprint for ``before``."""
        self.steps = step + 1
        if self._before is not None:
            now = fingerprints(self.tensors)
            self._moves(now, step + 1)
            if optimizer is not None:
                self._size(now, optimizer, released)
            self._before = None
            self._say(step + 1)
        if self.due(step + 1) and step + 1 > 0:
            self._after = fingerprints(self.tensors)

    def _size(self, now, optimizer, released) -> None:
        for k in range(self.dp):
            moved = np.nanmax(np.abs(now[k, 2:] - self._before[k, 2:])) if not np.all(np.isnan(now[k, 2:])) else 0.0
            bound = update_bound(optimizer, self.tensors[k], None if released is None else released[k])
            if bound is None:
                self.unchecked = f"{type(optimizer).__name__} (checked: torch's SGD and Adam family)"
                return
            if moved > TOO_LARGE * bound and moved > 0:
                self._find("too-large", self.names[k], f"{self.names[k]} moved {moved:.3g} in one DP step, "
                           f"{moved / bound:.0f}x the most {type(optimizer).__name__} can move it from the release "
                           f"({bound:.3g}): something else updates it")

    def gradient_sums(self, step: int, sums) -> None:
        """The clipped sums before the noise (None for a tensor that has none) at DP step ``step``, read on checked
        steps: zero at two checks in a row is ``no-gradient``."""
        if not self.due(step):
            return
        import torch

        zero = [s is None or not bool(torch.count_nonzero(s)) for s in sums[:self.dp]]
        for k, z in enumerate(zero):
            self._zero_sum[k] = self._zero_sum[k] + 1 if z else 0
            if self._zero_sum[k] >= 2:
                cause = self._lora_partner(k)
                self._find("no-gradient", self.names[k], f"{self.names[k]} gets no gradient from the loss (its clipped "
                           "sum was 0 at two checks): " + (cause or "it is detached from the forward") +
                           ", and its updates are noise alone", cause=cause)
        self._say(step)

    def _lora_partner(self, k: int) -> str | None:
        """Why a LoRA ``lora_A`` gets no gradient, where that is the reason: its ``lora_B`` (zero at the start) is
        not trained, so it stays zero and no gradient passes through it to lora_A."""
        name = self.names[k]
        if "lora_A" not in name:
            return None
        partner = name.replace("lora_A", "lora_B")
        trained = partner in self.names
        if trained:
            return None
        return ("its LoRA partner lora_B is not trained (frozen, or not in the DP optimizer) and is zero, so no "
                "gradient reaches lora_A: train the lora_B adapters too")

    def stepped_outside(self, optimizer) -> None:
        """The optimizer under the DP optimizer stepped outside the DP step."""
        self._find("stepped-outside", type(optimizer).__name__,
                   f"the {type(optimizer).__name__} under the DP optimizer stepped by itself: it was built before "
                   "make_private and is stepped directly, so its updates see no clipping or noise")
        self._say()


def _rounded_away(tensor) -> str | None:
    """Why a tensor in half precision (bf16, fp16) stays put though it is stepped, where that is likely: an update
    below half the spacing of its values rounds back to the same number (bf16 keeps 8 bits: a value near 0.5 moves
    only by 0.002 or more), so small learning rates leave it where it is."""
    import torch

    if tensor.dtype not in (torch.bfloat16, torch.float16):
        return None
    return (f"it is stored in {str(tensor.dtype).replace('torch.', '')}, whose rounding swallows updates smaller than "
            "half the spacing of its values (likely at a small learning rate): keep fp32 master weights, or raise "
            "the learning rate")
