"""Rebuild a DP-ZO fine-tuned model from the base model and the run's (seed, scalar) log alone."""

from __future__ import annotations

from pathlib import Path

from dpaudit.core import run_folder
from dpaudit.core.errors import DPAuditError


def replay_run(run_dir: Path, base_model: Path | None = None):
    """(model, tokenizer) after re-applying every logged step to the base weights."""
    import torch

    from dpaudit.models.loading import load_causal_lm
    from dpaudit.training.streams import LEGACY, STREAM
    from dpaudit.training.trainable import merged, select_trainable, trainable_parameters
    from dpaudit.training.zo import replay

    run_dir = Path(run_dir)
    meta = run_folder.run_config(run_dir)
    cfg = meta["config"]
    if run_folder.release_of(meta) != "zo-log":
        raise DPAuditError("only DP-ZO runs can be replayed from their log (DP-SGD releases whole gradients)")
    seeds, scalars = run_folder.zo_log(run_dir)
    steps = [(int(a), float(b)) for a, b in zip(seeds, scalars)]
    base = Path(base_model or meta["base_model"])
    model, tokenizer = load_causal_lm(base, dtype=torch.bfloat16 if cfg["bf16"] else None)
    torch.manual_seed(cfg["seed"])
    model = select_trainable(model, cfg["trainable"], cfg["lora_rank"], meta.get("lora_new_token_rows", []))
    device = meta.get("direction_device", "cpu")  # the generator type that drew the directions
    if device == "cuda" and not torch.cuda.is_available():
        raise DPAuditError("this run drew its DP-ZO directions on a GPU (CUDA generator); replay it on a machine with one")
    model.to(device)
    # Runs made before the position-addressable stream drew z from one generator in sequence.
    stream = meta.get("direction_stream", LEGACY)
    if stream not in (LEGACY, STREAM):
        raise DPAuditError(f"this run drew its directions with stream {stream!r}, unknown to this dpaudit; upgrade it")
    replay(trainable_parameters(model), steps, cfg["lr"], cfg["direction"], stream)
    return merged(model).to("cpu"), tokenizer


def max_weight_difference(model, reference) -> float:
    """Largest |difference| between same-named parameters of two models (float32, on CPU)."""
    ref = dict(reference.named_parameters())
    return max(float((p.detach().float().cpu() - ref[n].detach().float().cpu()).abs().max())
               for n, p in model.named_parameters())
