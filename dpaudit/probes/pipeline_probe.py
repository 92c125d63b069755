"""A probe whose canaries travel the user's data path: new-token examples read back from the model's own rows.

``WhiteBoxProbe`` plants its gradient canaries at the optimizer, so nothing upstream of the optimizer reaches
them: a batch reused for several steps, an un-noised side step, a loader that is not the sampler the accountant
was told, all leave its canaries untouched. ``PipelineProbe`` plants examples in the user's data instead:

- canary i is the text ``<new token i><new token i>``; the m new tokens are added to the tokenizer and the model
  (rows at zero, so all start alike with logit 0). Each is a member with probability 1/2 (secret membership: OS
  entropy, or ``secret_seed`` for tests and benchmarks), and ``insert(texts)`` puts the members, once each, at
  secret positions of the user's training texts;
- canary i's input row receives a gradient only from canary i's own example (no other text holds its token)
  and from the noise; with tied embeddings every example also pushes all new rows alike through the softmax,
  which is nearly the same for every canary and cancels out of the per-step standardisation (whitebox.py);
- after each optimizer step ``observe(step)`` reads the m rows and records how far each moved along its own
  descent direction, -<row_t - row_(t-1), u_i>, u_i the unit gradient of canary i's loss with respect to its row.
  The directions are one batched forward and backward of the m short canary texts, refreshed as often as
  ``budget`` (5 %) of the training's wall time allows, with the model's hooks set aside (Opacus' must not see
  it), in eval mode (no dropout: the user's RNG is not touched), into no parameter's ``.grad``.

The scores are functions of the released models alone (every canary treated alike, blind to membership), so the
one-run bounds apply to them as to any output of the training: whatever the pipeline did to the canaries' texts
(reuse, side updates, no clipping, no noise) shows in how their rows moved. What it cannot see: anything that
does not reach the canaries' examples (a bug in the accountant's arithmetic alone is the claim's, not the run's),
and a pipeline that never trains the input embeddings (frozen, or LoRA without new-token rows) moves no row:
``observe`` refuses it when no row has moved in 10 steps.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict

import numpy as np

from dpaudit.audit.whitebox import CANARY_BATCHES as BATCHES
from dpaudit.audit.whitebox_canaries import TRANSCRIPT
from dpaudit.core.errors import DPAuditError
from dpaudit.core.validate import check_canaries, check_number
from dpaudit.probes import probe_folder
from dpaudit.probes.probe import WhiteBoxProbe, refuse_links
from dpaudit.probes.transcript import Transcript
from dpaudit.models.extension import add_new_tokens
from dpaudit.probes.health import for_tensors

BUDGET = 0.05  # the share of the training's wall time the canaries' directions may take (refreshed that often)
CHUNK = 64  # canary sequences a backward pass
STILL = 10  # steps without any canary row moving: refused (the rows are not trained, so nothing can be read)
INSERT_DOMAIN = 0x70697073  # "pips": where the members go in the user's texts, apart from membership's stream


class PipelineProbe(WhiteBoxProbe):
    """``PipelineProbe(model, tokenizer, m=500, out=...)`` before the optimizer (and before ``make_private``):
    it adds m tokens and resizes the model's embeddings. Then ``texts = probe.insert(texts)``, the user's loop
    unchanged, ``probe.observe(step, batch=input_ids)`` after each optimizer step (``batch`` optional), and
    ``probe.audit(claimed_eps=, delta=, accountant=)``."""

    def __init__(self, model, tokenizer, *, m: int = 500, out, seed: int = 0,
                 budget: float = BUDGET, secret_seed: int | None = None):
        m = check_canaries(m, least=4)
        check_number("budget (the probe's share of the wall time)", budget, above=0, at_most=1)
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise DPAuditError("a PipelineProbe reads the canaries' rows from one process's model: the weights here "
                               "are sharded (FSDP); use WhiteBoxProbe, or probe an unsharded run")

        # no clip, rate or gradient release (no per-tensor noise check); the update's health check: the model's
        # trainable tensors as they are now (freeze first) must each move
        self._declare(kind="pipeline", clip=None, rate=None, out=out, params=[], secret_seed=secret_seed,
                      source="PipelineProbe: new-token canaries in the user's data, rows read from the model",
                      health=for_tensors([p for p in model.parameters() if p.requires_grad], model, bracketed=False))
        self.model, self.tokenizer = model, tokenizer
        self._inserted = False
        self._counted_from = None   # 0 or 1: how the caller counts steps (fixed by its first observe)
        refuse_links(self.out)
        probe_folder.start(self, int(m), 1.0, seed)
        self.ids = self._add_tokens()
        self._batches, self.sample_rate, self._moved = None, None, False
        self._texts = self._canary_ids()
        self.budget, self.probe_seconds, self.refreshed, self._first = float(budget), 0.0, 0, None
        self._previous = self._rows()
        self._direction = self._descent()
        self.transcript = Transcript(self.out / TRANSCRIPT, self.width)

    # -- setting up ----------------------------------------------------------------------------------------
    def _add_tokens(self) -> list[int]:
        import torch

        tokens = [f"<dpaudit-{self.run_id[:8]}-{i}>" for i in range(self.m)]
        ids = add_new_tokens(self.model, self.tokenizer, tokens)
        if len(set(ids)) != self.m or min(ids) < self.tokenizer.vocab_size:
            raise DPAuditError("the tokenizer did not take the canary tokens as new tokens")
        with torch.no_grad():  # untied models: the new input rows start at zero too, all alike
            self._embedding().weight[torch.as_tensor(ids)] = 0
        self.canaries.coordinates = [int(i) for i in ids]
        self.canaries.save(self.out)
        return [int(i) for i in ids]

    def _embedding(self):
        return self.model.get_input_embeddings()

    def _canary_ids(self) -> tuple[list[list[int]], list[list[int]]]:
        """(token ids of each canary's text as the tokenizer makes them, positions of its own token there)."""
        ids = [list(self.tokenizer(self.text(i))["input_ids"]) for i in range(self.m)]
        where = [[k for k, t in enumerate(row) if t == self.ids[i]] for i, row in enumerate(ids)]
        if not all(where) or len({len(row) for row in ids}) != 1:
            raise DPAuditError("the tokenizer split the canary tokens, or gave their texts different lengths; "
                               "they cannot be probed this way")
        return ids, where

    def text(self, i: int) -> str:
        """Canary i's example: its new token twice. Short, so the token as a target (its output row: the input
        row itself when tied) carries a whole example's loss, and the example's clipped gradient lies mostly in
        the canary's own row (about 0.5 to 0.96 of its norm on the embedded model, against 0.05 to 0.2 for the
        token before a 25-token phrase)."""
        return f"<dpaudit-{self.run_id[:8]}-{i}>" * 2

    def insert(self, texts: list[str]) -> list[str]:
        """The user's texts with each member canary once, at secret positions (a new list; call it once)."""
        if self._inserted:
            raise DPAuditError("insert() was called before: the members are in the data once")
        texts = list(texts)
        members = self.canaries.member_ids
        rng = np.random.default_rng(np.random.SeedSequence(
            self.secret_seed if self.secret_seed is not None else int.from_bytes(os.urandom(8), "little"),
            spawn_key=(INSERT_DOMAIN,)))
        for i in rng.permutation(members):
            texts.insert(int(rng.integers(0, len(texts) + 1)), self.text(int(i)))
        self._inserted = True
        return texts

    # -- reading the rows ----------------------------------------------------------------------------------
    def _rows(self) -> np.ndarray:
        import torch

        with torch.no_grad():
            weight = self._embedding().weight
            return weight[torch.as_tensor(self.ids, device=weight.device)].detach().float().cpu().numpy().astype(float)

    def _descent(self) -> np.ndarray:
        """Each canary's unit descent direction at its own current row: the gradient, at the current model, of its
        example's loss with respect to its token's input row (canary i's loss depends on row i alone, so one
        batched backward of the sum gives all m), chunked to bound memory. The model's hooks are set aside and
        it runs in eval mode; nothing goes into any parameter's ``.grad``."""
        import torch

        began = time.perf_counter()
        model, (ids, where) = self.model, self._texts
        weight = self._embedding().weight
        modes = [(mod, mod.training) for mod in model.modules()]
        hooks = _set_hooks_aside(model)
        out = np.zeros_like(self._previous)
        try:
            model.eval()
            with torch.enable_grad():
                for lo in range(0, self.m, CHUNK):
                    hi = min(self.m, lo + CHUNK)
                    x = torch.as_tensor(ids[lo:hi], device=weight.device)
                    mask = torch.zeros(x.shape, dtype=torch.bool, device=weight.device)
                    for r, w in enumerate(where[lo:hi]):
                        mask[r, w] = True
                    rows = torch.as_tensor(self._previous[lo:hi], dtype=weight.dtype, device=weight.device)
                    rows.requires_grad_(True)
                    embeds = torch.where(mask[..., None], rows[:, None, :].expand(-1, x.shape[1], -1),
                                         self._embedding()(x).detach())
                    logits = model(inputs_embeds=embeds).logits[:, :-1].float()
                    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="sum")
                    (g,) = torch.autograd.grad(loss, [rows])
                    out[lo:hi] = g.detach().float().cpu().numpy()
        finally:
            _restore_hooks(hooks)
            for mod, training in modes:
                mod.training = training
        norm = np.linalg.norm(out, axis=1, keepdims=True)
        self.probe_seconds += time.perf_counter() - began
        self.refreshed += 1
        return np.divide(out, norm, out=np.zeros_like(out), where=(norm > 0) & np.isfinite(norm))

    def observe(self, step: int | None = None, batch=None) -> None:
        """After an optimizer step: how far each canary's row moved along its descent direction. ``step``: the step
        just taken, counted from 0 (a loop's index) or from 1 (the Trainer's ``global_step`` after its first step):
        the first call fixes which; None: the next one. ``batch`` (optional, every step or none): the token ids the
        step trained on (a tensor or array of any shape); the probe notes which canaries were in it, and ``audit``
        tests that the members were Poisson-sampled at the accounted rate (a batch reused for several steps,
        fixed-size or shuffled batches, a rate other than the accountant's all show there)."""
        if step is None:
            step = self.step + (self._counted_from or 0)
        if self._counted_from is None:
            self._counted_from = 1 if (self.step == 0 and step == 1) else 0
        if step - self._counted_from != self.step:
            raise DPAuditError(f"the probe expected step {self.step + self._counted_from}, got {step}: observe each "
                               "step once, in order")
        step -= self._counted_from
        if step and (batch is None) != (self._batches is None):
            raise DPAuditError("give observe() the step's batch at every step or at none")
        self._maybe_look()  # a watched probe (probe.watch): the `step` releases recorded so far, outside the budget
        began = time.perf_counter()
        if batch is not None:
            self._note_batch(batch)
        rows = self._rows()
        moved = -np.einsum("ij,ij->i", rows - self._previous, self._direction)
        self._moved = self._moved or bool(np.any(rows != self._previous))
        if step + 1 >= STILL and not self._moved:  # a DP step moves every row (noise); a plain one, the batch's
            raise DPAuditError(f"no canary row moved in {step + 1} steps: the input embeddings are not trained "
                               "(frozen, or LoRA without new-token rows), or observe() is called before the optimizer "
                               "steps; a PipelineProbe reads the canaries from those rows")
        if self.health.due(step + 1):
            self.health.look(step + 1)
            self.save_health()
        self._begun = step
        self._store(step, moved)
        self._previous = rows
        now = time.perf_counter()
        self.probe_seconds += now - began
        self._first = self._first if self._first is not None else now
        if self.probe_seconds <= self.budget * (now - self._first):  # the directions, as often as the budget allows
            self._direction = self._descent()
        # a watched probe's planned last look, outside the budget as the other looks are; observe comes after the
        # optimizer step, so an accountant has counted it
        self.final_look(counted=True)

    def _note_batch(self, batch) -> None:
        import torch

        ids = batch.detach().cpu().numpy() if isinstance(batch, torch.Tensor) else np.asarray(batch)
        present = np.flatnonzero(np.isin(self.ids, ids.reshape(-1)))
        if self._batches is None:  # written 0600: which canaries appear is their membership
            self._batches = os.fdopen(os.open(self.out / BATCHES, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")
        self._batches.write(json.dumps([int(i) for i in present]) + "\n")
        self._batches.flush()

    def _sampler_rate(self, accountant) -> float | None:
        """When ``observe`` was given the batches: the rate the run is accounted with (the ``sample_rate`` given to
        ``audit``, else the Opacus accountant's last), at which ``audit_run_folder`` tests the member canaries'
        inclusions (half of alpha to it, half to the eps bounds)."""
        if self._batches is None:
            return None
        self._batches.flush()
        history = getattr(accountant, "history", None)
        rate = self.sample_rate
        if rate is None and isinstance(history, list) and history:
            rate = float(history[-1][1])
        if rate is None:
            raise DPAuditError("the probe saw the batches: give audit() the sample rate the run is accounted with "
                               "(sample_rate=, or accountant=)")
        return rate

    def watch(self, *, delta: float, claimed_eps: float | None = None, accountant=None,
              sample_rate: float | None = None, **kwargs) -> "PipelineProbe":
        """As ``WhiteBoxProbe.watch``; ``sample_rate``: as in ``audit``, for every look (the looks then test the
        canaries' inclusions and, where they pass, read the run's own family as the end-of-run audit does)."""
        self._keep_rate(sample_rate)
        return super().watch(delta=delta, claimed_eps=claimed_eps, accountant=accountant, **kwargs)

    def audit(self, claimed_eps: float | None = None, delta: float | None = None, *, sample_rate: float | None = None,
              accountant=None, alpha: float = 0.05, report=True):
        """As ``WhiteBoxProbe.audit``; ``sample_rate``: the rate the run is accounted with, for the sampler audit
        of the canaries' inclusions (needed only when ``observe`` was given the batches and no Opacus accountant;
        kept for later audits and looks). Where that audit passes and the steps are independent releases (a
        memoryless optimizer: plain SGD), the statistics are read through the run's own family (audit/whitebox.py
        ``_pipeline_family``), else through G_mu."""
        self._keep_rate(sample_rate)
        return super().audit(claimed_eps, delta, accountant=accountant, alpha=alpha, report=report)

    def _keep_rate(self, sample_rate) -> None:
        if sample_rate is not None:
            check_number("sample_rate", sample_rate, above=0, at_most=1)
            self.sample_rate = float(sample_rate)

    def close(self) -> None:
        super().close()
        if self._batches is not None and not self._batches.closed:
            self._batches.close()

    @property
    def width(self) -> int:
        return self.canaries.m

    def _context(self) -> dict:
        return {"canaries": f"{self.m} new-token examples in the user's data (members inserted once each); "
                            "every step of the pipeline acts on them, and their input rows are read each step"}


def _set_hooks_aside(model) -> list:
    """Every module's hooks, emptied for the probe's own forward and backward (Opacus' per-sample hooks would
    record it as a batch); returns what ``_restore_hooks`` puts back."""

    saved = []
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    for mod in model.modules():
        saved.append((mod, {n: getattr(mod, n) for n in names if hasattr(mod, n)}))
        for n in names:
            if hasattr(mod, n):
                setattr(mod, n, OrderedDict())
    return saved


def _restore_hooks(saved: list) -> None:
    for mod, hooks in saved:
        for n, h in hooks.items():
            setattr(mod, n, h)
