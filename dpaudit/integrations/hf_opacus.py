"""DP-SGD inside the Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``) with Opacus, wired the way it must be:

    trainer = opacus_trainer(Trainer, model=model, args=args, train_dataset=data, data_collator=collator,
                             noise_multiplier=1.0, max_grad_norm=1.0, callbacks=[audit])

No maintained package does this beside the pinned torch (dp-transformers 1.0 needs torch <= 1.12.1 and
prv-accountant < 0.2), so it is written here, small, on Opacus' own parts and dpaudit's DP step (dp_step.py):
- Poisson sampling: the Trainer's data loader is replaced by Opacus' ``DPDataLoader`` over the same dataset and
  collator (sample rate p = per-device batch size / N); an empty batch is a noise-only step.
- Per-example losses: each example's mean token loss over its own labels (-100 ignored), averaged over the batch:
  the Trainer's default (a mean over all the batch's tokens) makes one example's gradient depend on the others'
  lengths, which no per-example clipping bounds.
- The optimizer is zeroed at the start of each ``training_step`` (Opacus refuses accumulated per-example
  gradients under Poisson sampling, and the Trainer only calls ``model.zero_grad()``); gradient accumulation is
  refused; the Trainer's own gradient-norm clipping is turned off (the DP optimizer clips per example).
- ``grad_sample_mode="ghost"`` (default): ghost clipping (training/ghost.py; tied embeddings supported, which
  Opacus' own ghost mode rejects), or ``"hooks"``: Opacus' per-example gradients (materialised). Position ids
  are passed per example (GPT-2's position embedding otherwise sees one row for the whole batch in hooks mode).
- The noise is drawn from a secret key (fresh OS entropy) per step; the accountant (Opacus' PRV, or RDP) is
  attached to the optimizer as PrivacyEngine attaches it, so ``DPAuditCallback`` reads eps for the steps taken.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
import json
import warnings

import torch
import torch.nn.functional as F
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader, Dataset

from dpaudit.accounting.unit import unit_from
from dpaudit.core.errors import DPAuditError
from dpaudit.core.users import capped_indices, user_id, user_indices
from dpaudit.integrations.opacus_accountant import DpauditAccountant
from dpaudit.training.data import user_means
from dpaudit.core.atomic import atomic_write_json
from dpaudit.core.run_record import accountant_ledger_json, read_accountant_history
from dpaudit.training.bias_clipping import bias_only
from dpaudit.training.sgd import dp_optimizer_class, per_example_module
from dpaudit.training.streams import step_key

MODES = ("ghost", "hooks")
# The accountant's history across attempts, in the Trainer's output_dir: written ahead of each step's release, so a
# resumed run (trainer.train(resume_from_checkpoint=...)) counts every step every earlier attempt released, those
# after its checkpoint included, and the claim read from the accountant covers each of them.
LEDGER = "dpaudit_accountant.json"
USER_KEY = "dpaudit_user"   # a ULS row's user index, and the batch's tensor of them (UserRows, _with_users)


def opacus_trainer(trainer_class=None, *, noise_multiplier: float, max_grad_norm: float = 1.0,
                   grad_sample_mode: str = "ghost", accountant: str | None = None, noise_seed: int | None = None,
                   user_column: str | None = None, records_per_user: int | None = None, user_sampling: str = "els",
                   cap_seed: int = 0, **trainer_kwargs):
    """An instance of ``trainer_class`` (default ``transformers.Trainer``) that trains with DP-SGD. ``noise_seed``:
    reproducible noise, for tests and benchmarks only (default: fresh OS entropy, the only private choice).

    User-level DP (accounting/unit.py): ``user_column`` names the column of ``train_dataset`` that says whose each
    row is; each user's rows are capped at ``records_per_user`` = k (core/users.capped_indices: k of a user's rows
    chosen by ``cap_seed`` and the user's id alone), the column is dropped before the collator, and the run is
    ``user_sampling`` "els" (rows Poisson-sampled and clipped as usual, accounted per user by dpaudit's PLD of the
    Binomial(k, p) mixture) or "uls" (users Poisson-sampled at q = B / N with all their rows, each user's mean
    per-example gradient clipped as one: under ghost its norm from book-keeping, training/ghost.py). ``accountant``: prv
    (Opacus', the default for examples), rdp, or dpaudit-pld (the default, and the only one for ELS, at the user
    level)."""
    from transformers import Trainer

    if grad_sample_mode not in MODES:
        raise DPAuditError(f"grad_sample_mode must be ghost or hooks, got {grad_sample_mode!r}")
    if not (noise_multiplier >= 0 and max_grad_norm > 0):
        raise DPAuditError("noise_multiplier must be >= 0 and max_grad_norm > 0")
    unit = unit_from("user" if user_column else None, records_per_user, user_sampling if user_column else None)
    accountant = accountant or ("dpaudit-pld" if unit.user_level else "prv")
    if accountant not in ("prv", "rdp", "dpaudit-pld"):
        raise DPAuditError(f"accountant must be prv, rdp or dpaudit-pld, got {accountant!r}")
    if unit.algorithm == "ELS" and accountant != "dpaudit-pld":
        raise DPAuditError(f"ELS (rows sampled, a user's k rows in a step Binomial(k, p)) is accounted by dpaudit-pld, "
                           f"not Opacus' {accountant} (which counts one row)")
    if user_column is not None:
        trainer_kwargs["train_dataset"] = UserRows(trainer_kwargs.get("train_dataset"), user_column, unit.records,
                                                   cap_seed)
    base = trainer_class or Trainer
    cls = type(f"DP{base.__name__}", (OpacusTrainerMixin, base), {})
    args = trainer_kwargs.get("args")
    if args is not None and args.gradient_accumulation_steps != 1:
        raise DPAuditError("gradient accumulation is not supported with Poisson sampling here: raise the per-device "
                           "batch size instead")
    if args is not None:
        args.max_grad_norm = 0.0  # the DP optimizer clips each example; clipping the noisy sum again is not DP's
    trainer = cls(**trainer_kwargs)
    trainer.dp_settings = dict(noise_multiplier=float(noise_multiplier), max_grad_norm=float(max_grad_norm),
                               mode=grad_sample_mode, accountant=accountant, noise_seed=noise_seed, unit=unit)
    return trainer


class UserRows(Dataset):
    """A user-level training set: the rows of ``rows`` kept by the cap of k a user, without the user column (a
    collator pads tensors); ``owners`` is each kept row's user index. Under ULS each row carries its user's index in
    USER_KEY, which the collate wrapper turns into the batch's tensor under the same key."""

    def __init__(self, rows, column: str, k: int, seed: int) -> None:
        if rows is None or not hasattr(rows, "__len__"):
            raise DPAuditError("a user-level run needs a sized train_dataset with the user column")
        users = []
        for i in range(len(rows)):
            row = rows[i]
            if not isinstance(row, Mapping) or column not in row:
                raise DPAuditError(f"row {i} of the train_dataset has no user column {column!r} (every row of a "
                                   "user-level run needs its owner)")
            users.append(user_id(row[column], column, f"row {i}"))
        self.rows, self.column, self.with_owner = rows, column, False
        self.kept = capped_indices(users, k, seed)
        owners, self.users = user_indices([users[i] for i in self.kept])
        self.owners, self.read = torch.tensor(owners), len(users)

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, i: int):
        row = {k: v for k, v in self.rows[self.kept[i]].items() if k != self.column}
        if self.with_owner:
            row[USER_KEY] = int(self.owners[i])
        return row


class UserPoissonBatches:
    """ULS batches: each user joins a step with probability ``sample_rate`` = q, independently, with all its rows
    (training/batches.user_source, here as a DataLoader batch sampler; ``sample_rate`` is what the probe's rate check
    reads). ``len``: 1 / q steps an epoch, as Opacus' Poisson sampler counts them."""

    def __init__(self, owners: torch.Tensor, sample_rate: float, generator=None) -> None:
        self.sample_rate, self.generator = float(sample_rate), generator
        self.order = torch.argsort(owners, stable=True)
        counts = torch.bincount(owners)
        self.bounds = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        self.steps = max(1, int(1 / self.sample_rate))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        users = len(self.bounds) - 1
        for _ in range(self.steps):
            chosen = torch.nonzero(torch.rand(users, generator=self.generator) < self.sample_rate).flatten().tolist()
            yield [int(i) for u in chosen for i in self.order[self.bounds[u]:self.bounds[u + 1]]]


class OpacusTrainerMixin:
    """The Trainer's three seams that DP-SGD changes: its data loader, its optimizer and its training step."""

    dp_settings: dict = {}
    dp_optimizer = None
    per_example_module = None
    dpaudit_resuming = False
    released_before = 0   # steps every earlier attempt released (the ledger's count at this attempt's start)
    ledger_history: list = []  # those steps as (noise multiplier, sample rate, steps), Opacus' history format
    attempt_steps = 0     # steps this attempt has released (counted ahead of each release)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.dpaudit_resuming = resume_from_checkpoint not in (None, False)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _ledger_path(self) -> Path:
        return Path(self.args.output_dir) / LEDGER

    def _read_ledger(self) -> list | None:
        """The history of the attempts before this one, or None where the output folder holds no ledger."""

        return read_accountant_history(self._ledger_path())

    def _load_optimizer_and_scheduler(self, checkpoint):
        """A resume: the accountant starts from every step the earlier attempts released (the ledger), or, with no
        ledger (a checkpoint written before it), from the checkpoint's steps: a floor the report names."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.ledger_history:
            return

        try:
            with open(Path(checkpoint) / "trainer_state.json", encoding="utf-8") as fh:
                steps = int(json.load(fh)["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            raise DPAuditError(f"{checkpoint}: no readable trainer_state.json to count the steps already released") \
                from None
        self._start_history([(self.dp_settings["noise_multiplier"], self.sample_rate_accounted, steps)])

    def _start_history(self, history: list) -> None:
        self.ledger_history = list(history)
        self.released_before = sum(h[2] for h in history)
        self.accountant.history = [tuple(h) for h in history if h[2] > 0]

    def _write_ahead(self) -> None:
        """Before a step's release: the ledger counts it (with every earlier attempt's steps)."""

        self.attempt_steps += 1
        history = self.ledger_history + [(self.dp_settings["noise_multiplier"], self.sample_rate_accounted,
                                          self.attempt_steps)]
        atomic_write_json(self._ledger_path(), accountant_ledger_json(history))

    def get_train_dataloader(self):
        plain = super().get_train_dataloader()
        collate = _empty_safe(plain.collate_fn)
        if self.dp_settings["unit"].algorithm == "ULS":   # users sampled, each with all its rows
            rows = self.train_dataset
            rows.with_owner = True
            self.sample_rate = self.args.per_device_train_batch_size / len(rows)
            sampler = UserPoissonBatches(rows.owners, self.sample_rate, _secret_generator(self.dp_settings))
            return DataLoader(rows, batch_sampler=sampler, collate_fn=_with_users(collate))
        loader = DataLoader(plain.dataset, batch_size=self.args.per_device_train_batch_size, collate_fn=collate)
        dp = DPDataLoader.from_data_loader(loader, distributed=False)
        dp.collate_fn = collate  # Opacus' empty-batch collate returns a list; ours marks the batch empty
        self.sample_rate = 1 / len(loader)
        return dp

    def create_optimizer(self, *args, **kwargs):

        base = super().create_optimizer(*args, **kwargs)
        if self.dp_optimizer is not None:
            return self.optimizer
        settings = self.dp_settings
        ghost = settings["mode"] == "ghost"
        if ghost and settings["unit"].algorithm == "ULS" and bias_only(self.model):
            ghost = False   # DP-BiTFiT's bias route clips rows: a user's mean is formed from each row's gradient
            settings["mode"] = "hooks"
        self.per_example_module = per_example_module(self.model, ghost, settings["max_grad_norm"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus warns about secure_mode; the noise is drawn by dp_step
            rate = getattr(self, "sample_rate", None) or self.args.per_device_train_batch_size / len(self.train_dataset)
            # the noisy sum's divisor: the expected rows a step, or under ULS the expected users (q x users)
            units = (self.args.per_device_train_batch_size if settings["unit"].algorithm != "ULS"
                     else rate * self.train_dataset.users)
            self.dp_optimizer = dp_optimizer_class(ghost)(
                base, noise_multiplier=settings["noise_multiplier"], max_grad_norm=settings["max_grad_norm"],
                expected_batch_size=units)
            self.dp_optimizer.per_user = settings["unit"].algorithm == "ULS"

        opacus_kinds = {"prv": PRVAccountant, "rdp": RDPAccountant}
        self.accountant = (opacus_kinds[settings["accountant"]]() if settings["accountant"] in opacus_kinds
                           else DpauditAccountant(settings["unit"]))
        self.sample_rate_accounted = float(rate)
        self.dp_optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(sample_rate=rate))
        if self.dpaudit_resuming:
            prior = self._read_ledger()
            if prior is not None:
                self._start_history(prior)
        elif self._ledger_path().exists():  # a new run in this folder: its own count from 0
            self._ledger_path().unlink()
        seed = settings.get("noise_seed")
        self.noise_secret = int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.optimizer = self.dp_optimizer
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):

        model.train()
        self.dp_optimizer.zero_grad(set_to_none=True)  # Poisson: no per-example gradients carried over
        # a resumed attempt's noise also keyed by the steps released before it (as streams.attempt_seed): two attempts
        # from one checkpoint never draw the same noise for other batches, even under a fixed noise_seed
        self.dp_optimizer.noise_key = step_key(self.noise_secret, int(self.state.global_step),
                                               *([self.released_before] if self.released_before else []))
        self._write_ahead()
        params = [p for p in self.dp_optimizer.params]
        if inputs.get("dpaudit_empty") is not None:  # no example sampled: the step adds noise only
            for p in params:
                if self.dp_settings["mode"] == "ghost":
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            return torch.zeros((), device=self.args.device)
        users = inputs.pop(USER_KEY, None)
        inputs = self._prepare_inputs(inputs)
        losses = per_example_losses(self.per_example_module, inputs)
        if self.dp_settings["mode"] == "ghost":
            coef = self.per_example_module.norm_pass(losses.sum(), params).to(losses.dtype)
            if self.dp_optimizer.clips_per_user():   # ULS: c_u / n_u for each of user u's rows (ghost.user_coef)
                coef = self.per_example_module.user_coef(users.to(losses.device)).to(losses.dtype)
            self.per_example_module.clipped_backward(losses, coef)  # the clipped sum, straight into p.grad
        else:
            losses.mean().backward()  # Opacus' loss_reduction="mean"
            if self.dp_optimizer.clips_per_user():   # ULS: one row a user, the mean of its rows' gradients
                for p in params:
                    p.grad_sample = user_means(p.grad_sample, users.to(p.device))
        return losses.detach().mean()


def per_example_losses(model, inputs):
    """Each example's mean next-token loss over its own labels (-100 ignored), float32."""

    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    labels = inputs.get("labels", ids if mask is None else ids.masked_fill(mask == 0, -100))
    mask = torch.ones_like(ids) if mask is None else mask
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)  # per example: GPT-2's hooks need a row per example
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1].float()
    target = labels[:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(target.shape)
    return tok.sum(1) / (target != -100).sum(1).clamp(min=1)


def _with_users(collate):
    """The collate of a ULS loader: each row's user index (USER_KEY) taken out before ``collate`` and put back as the
    batch's tensor under USER_KEY."""
    def wrapped(rows):
        users = [row.pop(USER_KEY) for row in rows]
        batch = collate(rows)
        if rows:
            batch[USER_KEY] = torch.tensor(users)
        return batch

    return wrapped


def _secret_generator(settings: dict):
    """The ULS sampler's generator: from the noise seed where one is given (tests), else fresh OS entropy."""
    generator = torch.Generator()
    seed = settings.get("noise_seed")
    generator.manual_seed(int(seed) + 1 if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return generator


def _empty_safe(collate):
    def wrapped(rows):
        if not rows:
            return {"dpaudit_empty": torch.zeros(0)}
        return collate(rows)

    return wrapped
