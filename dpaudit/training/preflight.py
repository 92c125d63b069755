"""Refusals made before any folder is created or weight read, from the model's config alone (a meta model):
a trainable subset the model lacks, a layer DP-SGD cannot clip per example, and a step estimated not to fit
the memory given (training/memory.py).

A run is checked once: ``check_model`` builds the meta model and makes the refusals that need only its structure,
and returns a ``StepCheck`` that answers the later questions (the step's estimate at a batch, the micro batch that
fits a budget, the model grown by the canaries' rows, the texts' longest length) without building it again.
``train(step=...)`` takes the caller's, so ``audit run`` checks its model once, before its folder exists."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
import math
import os
from pathlib import Path
import sys
from typing import Any

import torch

from dpaudit.core.errors import DPAuditError
from dpaudit.training.methods import METHODS
from dpaudit.core.limits import human_bytes
from dpaudit.core.safe_json import load_json_file
from dpaudit.models import hf as hf_models  # meta_model through the module: tests stand in for it there
from dpaudit.models.hf import MAX_CONFIG_BYTES, check_model_size, load_tokenizer, resolve_model_path
from dpaudit.training import memory
from dpaudit.training.bias_clipping import bias_only
from dpaudit.training.per_example import check_layers


@dataclass(frozen=True)
class StepCheck:
    """A model's step as pre-flight saw it, its structural refusals made. ``model``: built on the meta device
    (names and shapes, no weights); ``tokens``: the longest training text in tokens, None until the texts are
    known (a step is then estimated at ``max_length``, the side to err on)."""
    folder: Path
    model: Any
    tokens: int | None = None

    def with_texts(self, texts: list[str], max_length: int, folder: Path | None = None) -> "StepCheck":
        """The same model with the texts' longest length, tokenised by ``folder``'s tokenizer (default its own)."""
        return replace(self, tokens=longest_tokens(folder or self.folder, texts, max_length))

    def grown(self, folder: Path) -> "StepCheck":
        """The model as extended in ``folder`` (the canaries' token rows added; its config read, no model built),
        a copy: this check still describes the model it was made of."""
        rows = hf_models.vocab_rows(folder)
        model = copy.deepcopy(self.model)  # meta tensors: shapes only, nothing allocated
        if model.get_input_embeddings().weight.shape[0] != rows:
            model.resize_token_embeddings(rows, mean_resizing=False)
        return replace(self, folder=Path(folder), model=model)

    def settings(self, cfg) -> tuple[dict, int, int]:
        """(memory.peak_bytes' settings but the example count, tokens per example, shards) of a step of ``cfg``."""
        model = self.model
        total = sum(p.numel() for p in model.parameters())
        shards = int(os.environ.get("WORLD_SIZE", "1")) if cfg.shard else 1
        tokens = min(cfg.max_length, self.tokens) if self.tokens is not None else cfg.max_length
        bias_route = cfg.trainable == "bias" and shards == 1 and bias_only(model, lambda name: name.endswith(".bias"))
        return dict(shape=memory.ModelShape.of(model.config, total), trainable=_trainable_count(model, cfg, total),
                    method=cfg.method, tokens=tokens, bf16=cfg.bf16, optimizer=cfg.optimizer,
                    per_sample_grads=cfg.per_sample_grads, private=cfg.private, shards=shards,
                    norm_pass=not bias_route), tokens, shards

    def estimate(self, cfg, examples: int, warn: bool = True) -> int:
        """The estimated peak bytes of a step of ``cfg`` over ``examples`` (a batch of them, micro-batched as
        ``cfg`` says); refused over ``cfg.max_memory``. ``warn``: say when it is above the free memory (once per
        run: ``train`` says it, callers checking early don't)."""

        settings, tokens, shards = self.settings(cfg)
        # ULS samples users of up to k records whole, and a micro batch never splits one (data.split_users)
        whole = cfg.privacy_unit.records if cfg.uls else 1
        share = math.ceil(memory.largest_batch(cfg.batch_size or examples, whole) / shards)  # this rank's
        at_once = min(max(cfg.micro_batch, whole), share) if cfg.micro_batch else share
        estimate = memory.process_peak_bytes(examples=at_once, **settings)
        if cfg.max_memory and estimate > cfg.max_memory:
            fits = memory.examples_that_fit(cfg.max_memory, **settings)
            hint = (f"--micro-batch {fits} fits (same batches, noise and accounting)" if fits else
                    "not even one example fits: try --trainable lora, --bf16 or --method dp-zo")
            raise DPAuditError(f"a step of {cfg.method} on {at_once} examples x {tokens} tokens needs about "
                               f"{human_bytes(estimate)}, over --max-memory {human_bytes(cfg.max_memory)}; {hint}")
        available = memory.available_bytes() if warn else None
        if not cfg.max_memory and available is not None and estimate > available:
            fits = memory.examples_that_fit(available, **settings)
            print(f"warning: a step of {cfg.method} on {at_once} examples x {tokens} tokens needs about "
                  f"{human_bytes(estimate)}, more than the {human_bytes(available)} available; "
                  + (f"--micro-batch {fits} would fit" if fits else "not even one example would fit"),
                  file=sys.stderr, flush=True)
        return estimate

    def micro_batch_that_fits(self, cfg, examples: int, share: float = 0.7) -> int:
        """For a run whose own recipe sets the batch (``audit run``'s full batches on a pretrained model): 0 (the
        whole batch at once) when a step is estimated within the budget (``cfg.max_memory`` when given, else
        ``share`` of the available memory), else the most examples a forward/backward may take to stay within it
        (at least 1; the same batches, noise and accounting)."""

        available = memory.available_bytes()
        budget = cfg.max_memory or (int(share * available) if available is not None else None)
        if budget is None:
            return cfg.micro_batch
        settings, _, shards = self.settings(cfg)
        at_once = math.ceil(memory.largest_batch(cfg.batch_size or examples) / shards)
        if memory.process_peak_bytes(examples=at_once, **settings) <= budget:
            return 0
        return max(1, memory.examples_that_fit(budget, **settings))


def check_model(model_dir: Path, cfg) -> StepCheck | None:
    """The refusals that need only the model's config: a model over ``cfg.max_memory`` by its weights alone, a
    layer DP-SGD cannot clip per example, ``--trainable bias`` on a model without biases. None when the folder
    has no config to read (the run itself then says what is missing)."""

    folder = resolve_model_path(model_dir)
    if not (folder / "config.json").is_file():
        return None
    if cfg.max_memory:  # the weights alone must fit the budget given (meta_model checks the free memory)
        check_model_size(folder / "config.json", load_json_file(folder / "config.json", "model config",
                                                                MAX_CONFIG_BYTES), cfg.max_memory)
    model = hf_models.meta_model(folder)
    if METHODS[cfg.method].per_example_gradients and cfg.private and cfg.trainable == "full":
        check_layers(model)  # a layer DP-SGD cannot clip per example: refused before any canary or weight work
    if cfg.trainable == "bias" and not any(name.endswith(".bias") for name, _ in model.named_parameters()):
        raise DPAuditError(f"the model in {model_dir} has no bias terms (Llama-family models have none), so "
                           "--trainable bias (DP-BiTFiT) has nothing to train; use --trainable lora or full")
    return StepCheck(folder, model)


def preflight(model_dir: Path, cfg, examples: int, warn: bool = True,
              texts: list[str] | None = None, step: StepCheck | None = None) -> int | None:
    """Refusals that need only the model's config, made before any folder is created or weight read
    (``check_model``), and (``cfg.max_memory``) a step estimated not to fit. Returns the estimated peak bytes of
    a step (None when the folder has no config to read). Given ``texts``, a step is estimated at their longest
    tokenised length (a batch is cut to its longest example, so short texts never fill ``max_length``); without,
    at ``max_length``. ``step``: the caller's check of this model (not made again; its texts' length is kept)."""

    step = step or check_model(model_dir, cfg)
    if step is None:
        return None
    if texts is not None and step.tokens is None:
        step = step.with_texts(texts, cfg.max_length)
    return step.estimate(cfg, examples, warn)


def longest_tokens(folder: Path, texts: list[str], max_length: int) -> int:
    """The longest of ``texts`` in tokens, at most ``max_length`` (the widest batch a run can draw)."""

    try:
        tokenizer = load_tokenizer(folder)
        lengths = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    except Exception:  # noqa: BLE001 - an estimate only: the run itself reports a tokenizer it cannot use
        return max_length
    return max(1, min(max_length, max((len(ids) for ids in lengths), default=1)))


def _trainable_count(model, cfg, total: int) -> int:
    """How many weights the run trains: all, the biases (DP-BiTFiT), or LoRA's on every linear layer."""

    if cfg.trainable == "full":
        return total
    if cfg.trainable == "bias":
        return sum(p.numel() for name, p in model.named_parameters() if name.endswith(".bias"))
    if cfg.trainable in ("embeddings", "new-tokens"):  # new-tokens: a part of these rows (an estimate from above)
        rows = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
                if m is not None}
        return sum(rows.values())
    return sum(cfg.lora_rank * (m.in_features + m.out_features) for m in model.modules()  # LoRA: every linear layer
               if isinstance(m, torch.nn.Linear))
