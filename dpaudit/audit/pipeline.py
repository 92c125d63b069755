"""`dpaudit audit run`: canaries -> insert -> extend the model -> train privately -> score -> report.

Everything lands in one output folder: base_model/ (the embedded default, when no model is given),
canaries.json, train_data.jsonl, extended_model/, run/ (ledger, logs, checkpoint, model) and report/.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from dpaudit.atomic import atomic_write_json, atomic_write_text
from dpaudit.audit.analysis import AuditResult, analyse
from dpaudit.audit.report import prepare_folder, write_report
from dpaudit.training.runner import TrainConfig, TrainResult, train


@dataclass
class AuditRunSettings:
    canaries: int = 500
    repeats: int = 1
    examples: int = 1000          # synthetic examples when no dataset is given
    seed: int = 0
    prefix_length: int = 8
    alpha: float = 0.05


def embedded_default(folder: Path, seed: int = 0) -> Path:
    """Build the embedded default model once into ``folder`` (reused when already there)."""
    from dpaudit.models.embedded import build_embedded_default

    if (folder / "dpaudit_model.json").is_file():
        return folder
    return build_embedded_default(folder, seed=seed)


def run_audit(out: Path, cfg: TrainConfig, settings: AuditRunSettings, *, model: Path | None = None,
              data: Path | None = None, data_format: str | None = None, field: str = "text",
              force: bool = False, show_progress: bool = True) -> tuple[AuditResult, TrainResult, dict]:
    from dpaudit.audit.scoring import score_checkpoint
    from dpaudit.canaries.generate import make_canaries
    from dpaudit.canaries.hf import extend_model
    from dpaudit.canaries.insert import detect_format, insert_canaries, read_texts
    from dpaudit.models.corpus import sentences
    from dpaudit.models.loading import load_causal_lm

    out = prepare_folder(out, force)  # a non-empty folder only with --force: then our sub-folders are redone
    base = model if model is not None else embedded_default(out / "base_model", settings.seed)
    lm, tok = load_causal_lm(base)
    manifest = make_canaries(tok, settings.canaries, seed=settings.seed, prefix_length=settings.prefix_length,
                             name_or_path=str(base))
    manifest.save(out / "canaries.json")
    if data is None:
        data = out / "public_data.jsonl"
        atomic_write_text(data, "".join(json.dumps({"text": s}) + "\n"
                                        for s in sentences(settings.examples, seed=settings.seed + 1)))
        data_format, field = "jsonl", "text"
    fmt = detect_format(Path(data), data_format)
    train_file = out / f"train_data.{fmt}"
    insert_canaries(manifest, data, train_file, fmt=fmt, field=field, repeats=settings.repeats,
                    seed=settings.seed, force=True)
    extend_model(lm, tok, manifest)
    lm.save_pretrained(out / "extended_model", safe_serialization=True)
    tok.save_pretrained(out / "extended_model")
    del lm
    shutil.rmtree(out / "run", ignore_errors=True)
    result = train(out / "extended_model", read_texts(train_file, fmt, field), out / "run", cfg,
                   show_progress=show_progress)
    trained, trained_tok = load_causal_lm(result.model_dir)
    scores, members = score_checkpoint(trained, trained_tok, manifest, str(result.model_dir),
                                       show_progress=show_progress)
    claimed = result.epsilon if math.isfinite(result.epsilon) else None
    audit = analyse(scores, members, claimed_epsilon=claimed, delta=cfg.delta, alpha=settings.alpha)
    context = {
        "method": cfg.method + ("" if result.private else " (non-private baseline)"),
        "claimed eps": f"{result.epsilon:.4g}" if claimed is not None else "inf (no DP)",
        "delta": cfg.delta, "sigma": result.sigma, "mechanism": cfg.mechanism if result.private else None,
        "accountant": result.accountant, "relation": result.relation,
        "sampling rate p": round(result.sampling_rate, 6), "steps": result.steps, "examples": result.examples,
        "trainable": cfg.trainable, "model": str(base),
        "noise": "DISABLED (unsafe test setting)" if cfg.unsafe_disable_noise else "on" if result.private else "off",
    }
    shutil.rmtree(out / "report", ignore_errors=True)
    files = write_report(out / "report", audit, scores, members, context)
    summary = {**audit.to_dict(), "context": context, "training": result.to_dict(),
               "report_files": {k: str(v) for k, v in files.items()}}
    atomic_write_json(out / "summary.json", summary)
    return audit, result, summary
