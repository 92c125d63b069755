"""Peak memory of a training step, estimated from the model's config before any weight is loaded.

A count of what a step keeps alive, not a measurement: weights, gradients and optimizer state of the
trainable parameters, plus the activations autograd saves for a Llama-style block (about 10 hidden-
and 4 intermediate-sized vectors, and the attention scores, per token and layer) and the logits (three
vocabulary-sized float32 copies per token: the logits, their float32 cast and their gradient), which
the backward pass frees as the gradients form (so only half of the smaller of the two is counted on
top of the larger). DP-SGD with ghost clipping adds the output gradients alive during its norm pass
(~15 %); with materialised per-example gradients, one copy of the trainable parameters per example;
DP-ZO keeps no activations beyond one forward; every process adds ~160 MB of its own. Checked
against the live peaks benchmarks/trainers.py measured (tests/training/test_memory.py holds them): 0-45 %
above (the side to err on), never more than 5 % below.

Sharded over W ranks (``shards``, shard.py): a rank keeps 1/W of the weights (float32 master copies
under bf16), gradients and optimizer state, plus two gathered units in the computing precision (the
one running and the one prefetched, each also in its all-gather buffer; DP-ZO, forward only: one; a
unit is a block, or the embeddings with the rest) and, in the backward pass, one unit's unsharded
gradient and its reduce-scatter buffer. ``examples`` is then the rank's share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dpaudit.core.limits import available_bytes  # noqa: F401 - callers read it here too
from dpaudit.training.methods import method as method_record

OVERHEAD = 160 * 2**20  # torch's own allocations, the tokenizer and the data (as core/limits.py)
# What a process holds before any model: Python with torch, transformers and dpaudit imported (253 MB
# resident measured on CPU torch 2.13, 2026-11-25). ``process_peak_bytes`` adds it, so the figure compares
# with the process's peak RSS and with --max-memory (the embedded model: 0.46x its RSS without it).
IMPORTS = 250 * 2**20


@dataclass(frozen=True)
class ModelShape:
    parameters: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int

    @classmethod
    def of(cls, config, parameters: int) -> "ModelShape":
        hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
        return cls(parameters=parameters, hidden=hidden,
                   intermediate=int(getattr(config, "intermediate_size", 0) or 4 * hidden),
                   layers=int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 0),
                   heads=int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0) or 1),
                   vocab=int(getattr(config, "vocab_size", 0) or 0))


def peak_bytes(shape: ModelShape, *, trainable: int, method: str, examples: int, tokens: int, bf16: bool = False,
               optimizer: str = "adamw", per_sample_grads: str = "ghost", private: bool = True,
               shards: int = 1, norm_pass: bool = True) -> int:
    """Estimated peak bytes of one step over ``examples`` sequences of ``tokens`` tokens at once (per
    rank, when the model is sharded over ``shards`` ranks). ``norm_pass`` False: DP-BiTFiT's own route
    (training/bias_clipping.py), which keeps what BiTFiT keeps plus each example's bias gradients."""

    forward_only = method_record(method).zeroth_order  # no backward: activations, gradients, moments absent
    width = 2 if bf16 else 4
    state = 4 if shards > 1 else width  # sharded bf16 keeps float32 master shards
    unit = max(shape.vocab * shape.hidden, (shape.parameters - shape.vocab * shape.hidden) // max(1, shape.layers))
    # Two units gathered, each also in its all-gather buffer (DP-ZO, forward only: one and its buffer).
    gathered = (2 if forward_only else 4) * unit * width if shards > 1 else 0
    weights = shape.parameters * state // shards + gathered
    n = examples * tokens
    logits = 3 * n * shape.vocab * 4
    if forward_only:
        return int(OVERHEAD + weights + logits + n * (8 * shape.hidden + 4 * shape.intermediate) * width)
    moments = trainable * state * (2 if optimizer == "adamw" else 0) // shards
    grads = trainable * state // shards + (2 * unit * 4 if shards > 1 else 0)  # + reduce-scatter buffer
    per_token_layer = 10 * shape.hidden + 4 * shape.intermediate + shape.heads * tokens
    activations = n * shape.layers * per_token_layer * width + logits
    extra = examples * trainable * width if private and per_sample_grads == "materialise" else 0
    if private and per_sample_grads != "materialise" and norm_pass:
        activations *= 1.15  # output gradients alive during the norm pass (noise is added in place)
    elif private and per_sample_grads != "materialise":
        extra = examples * trainable * 4  # the bias route: each example's bias gradients, float32
    # Activations are freed as gradients form during the backward pass: the two overlap only in part.
    return int(OVERHEAD + weights + moments + max(activations, grads) + min(activations, grads) / 2 + extra)


def process_peak_bytes(**kwargs) -> int:
    """The peak resident memory of the process running the step: ``peak_bytes`` plus the imports."""
    return IMPORTS + peak_bytes(**kwargs)


def examples_that_fit(budget: int, **kwargs) -> int:
    """The most examples per forward/backward whose process peak is within ``budget`` (0 if even one is not)."""
    low, high = 0, 1
    while high < 1 << 20 and process_peak_bytes(examples=high, **kwargs) <= budget:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if process_peak_bytes(examples=mid, **kwargs) <= budget else (low, mid)
    return low


def largest_batch(expected: int, records: int = 1) -> int:
    """A Poisson batch of expected size B exceeds B + 4 sqrt(B) + 4 with probability below ~1e-4. ``records``: units
    of up to that many records each sampled whole (ULS users of at most k): the records' variance is then at most
    k B (q sum s_u^2 <= k q sum s_u), so B + 4 sqrt(k B) + 4 k."""
    return int(expected + 4 * math.sqrt(records * expected) + 4 * records)


