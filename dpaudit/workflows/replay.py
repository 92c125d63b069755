"""Rebuild a DP-ZO fine-tuned model from the base model and the run's (seed, scalar) log alone."""

from __future__ import annotations

from pathlib import Path

import torch

from dpaudit.core import run_folder, run_record
from dpaudit.core.errors import DPAuditError
from dpaudit.models.loading import load_causal_lm
from dpaudit.training.streams import COUNTER, STREAMS
from dpaudit.training.trainable import merged, select_trainable, trainable_parameters
from dpaudit.training.zo import replay


def replay_run(run_dir: Path, base_model: Path | None = None):
    """(model, tokenizer) after re-applying every logged step to the base weights."""

    run_dir = Path(run_dir)
    record = run_record.read(run_dir)
    cfg = record.settings
    if record.release != "zo-log":
        raise DPAuditError("only DP-ZO runs can be replayed from their log (DP-SGD releases whole gradients)")
    seeds, scalars = run_folder.zo_log(run_dir)
    steps = [(int(a), float(b)) for a, b in zip(seeds, scalars)]
    base = Path(base_model or record.base_model)
    model, tokenizer = load_causal_lm(base, dtype=torch.bfloat16 if cfg.bf16 else None)
    torch.manual_seed(cfg.seed)
    model = select_trainable(model, cfg.trainable, cfg.lora_rank, list(record.lora_new_token_rows))
    stream = record.direction_stream
    if stream not in STREAMS:
        raise DPAuditError(f"this run drew its directions with stream {stream!r}, unknown to this dpaudit; upgrade it")
    device = record.direction_device  # the generator type that drew the directions
    if device == "cuda" and not torch.cuda.is_available():
        if stream != COUNTER:  # counter-v1 is a function of the position alone: the same signs on any device
            raise DPAuditError("this run drew its DP-ZO directions on a GPU (CUDA generator); replay it on a machine with one")
        device = "cpu"
    model.to(device)
    replay(trainable_parameters(model), steps, cfg.lr, cfg.direction, stream)
    return merged(model).to("cpu"), tokenizer


ROUNDINGS_PER_STEP = 4   # training rounds each weight 3 times a step (+phi z, -2 phi z, +(phi - lr s) z), replay once
FLOAT32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-2


def default_tolerance(model, steps: int) -> float:
    """The largest |weight difference| an honest run's replay can show: float rounding, bounded by the run's own
    length and size. A weight moves by a rounding of at most u |w| (u = 2^-24 in float32) at each of
    ``ROUNDINGS_PER_STEP`` additions a step, so T steps differ by at most 4 T u max|w| (the worst case: the
    roundings need not cancel; a DP-ZO run of 200 steps replayed 1.17e-5 off, over the fixed 1e-5 it used to
    get). Never below 1e-5. bf16 keeps 1e-2 (its u is 2^-8: the worst case would be vacuous)."""

    params = list(model.parameters())
    if params and params[0].dtype != torch.float32:
        return BF16_TOLERANCE
    largest = max((float(p.detach().abs().max()) for p in params if p.numel()), default=0.0)
    return max(FLOAT32_TOLERANCE, ROUNDINGS_PER_STEP * steps * 2.0 ** -24 * largest)


def max_weight_difference(model, reference) -> float:
    """Largest |difference| between same-named parameters of two models (float32, on CPU)."""
    ref = dict(reference.named_parameters())
    return max(float((p.detach().float().cpu() - ref[n].detach().float().cpu()).abs().max())
               for n, p in model.named_parameters())
