"""A model folder that adds new tokens to a base model without copying its weights.

An audit run extends the base model with one new token per canary, each with a zero output row (and, tied, a zero
input row), or every one at one shared start row (canaries behind one shared prefix: canaries/hf.extend_model): the
extended model is the base's weights plus those rows, a function of the base's files, the token list and the start
row alone. Written in full it was a second copy of the model (2.4 GB of a 0.5 B model's 4.8 GB written). So the
folder holds what readers of a model folder need without the weights (config.json with the extended vocabulary,
the extended tokenizer) and ``MARKER``: the base's folder, a stamp of its files, the tokens in order and the start
row (absent: zero; written as exact floats). Loading it (models/loading.load_causal_lm) loads the base and adds the
tokens again, which gives the same weights to the bit (``add_new_tokens`` only appends rows, zero or that row). A
base whose files changed or went away is refused in one line: it would not be the model the run trained from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dpaudit.core.errors import DPAuditError
from dpaudit.core.atomic import atomic_folder, atomic_write_json, follow_umask
from dpaudit.core.lock import mark
from dpaudit.core.safe_json import load_json_file
from dpaudit.models.hf import resolve_model_path

MARKER = "dpaudit_added_tokens.json"
FORMAT = 2                    # 2: the start row ("row", absent for zero rows); 1: zero rows, still read
MAX_MARKER_BYTES = 64 << 20   # a token list of a few hundred thousand canaries


@dataclass(frozen=True)
class AddedTokens:
    """What an extension folder adds, read from its ``MARKER``: the base folder and the tokens, in order."""
    base: Path
    tokens: list[str]
    row: list[float] | None = None   # where every new output row starts (None: zero)


def add_new_tokens(model, tokenizer, tokens: list[str], row=None) -> list[int]:
    """Add ``tokens`` (one new token each) to the tokenizer and the model; returns their ids. New output rows start
    at zero (logit 0), or each at ``row`` (a vector of the hidden size), the same for members and non-members; ties
    are kept (tied: the new input rows are the same)."""
    import torch

    old = model.get_input_embeddings().weight.shape[0]
    ids = add_tokens(tokenizer, tokens)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    out = model.get_output_embeddings()
    new = slice(old, out.weight.shape[0])
    with torch.no_grad():
        # Zero output rows: every new token starts with logit 0, the same for members and non-members.
        # With tied weights this also zeroes the new input rows (the tie is kept, not broken).
        out.weight[new].zero_()
        if row is not None:
            start = torch.as_tensor(row, dtype=torch.float32).flatten()
            if start.numel() != out.weight.shape[1] or not bool(torch.isfinite(start).all()):
                raise DPAuditError(f"the new tokens' start row has {start.numel()} numbers (finite?); the model's "
                                   f"rows have {out.weight.shape[1]}")
            out.weight[new] = start.to(out.weight.dtype)
        if getattr(out, "bias", None) is not None:
            out.bias[new].zero_()
    return ids


def start_row(model, first: int) -> list[float] | None:
    """The row every new token from id ``first`` on starts at, as exact floats (None: zero rows); refused when the
    new rows differ, which an extension folder could not rebuild."""
    rows = model.get_output_embeddings().weight.detach()[first:]
    if not len(rows) or not bool(rows.any()):
        return None
    if not bool((rows == rows[0]).all()):
        raise DPAuditError("the new tokens' rows differ; an extension folder holds one start row for all of them")
    return rows[0].float().tolist()


def add_tokens(tokenizer, tokens: list[str]) -> list[int]:
    """Add each of ``tokens`` the tokenizer lacks as one new token, in order; returns the ids of all of them."""
    tokenizer.add_tokens([s for s in tokens if s not in tokenizer.get_vocab()])
    return tokenizer.convert_tokens_to_ids(tokens)


def files_stamp(folder: Path) -> list[list]:
    """The files of ``folder`` as [name, size, modification time in ns]: a changed file is a new model."""
    files = sorted(f for f in Path(folder).iterdir() if f.is_file())
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def save_extension(path: Path, base: Path, model, tokenizer, tokens: list[str]) -> Path:
    """Write ``path``: ``model`` (the base at ``base`` with ``tokens`` added by ``add_new_tokens``) as an extension
    folder: its config and tokenizer, and the marker (with the new rows' start row), but no weights. Written whole
    or not at all."""

    folder = resolve_model_path(base).resolve()
    if (folder / MARKER).is_file():
        raise DPAuditError(f"{base} is itself an extension folder; extend the model it was made from")
    path = Path(path)
    with atomic_folder(path) as tmp:
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # the base by a relative path when it sits beside the folder (audit run's base_model/), so the whole
        # output folder may move; else by its absolute path
        where = (os.path.relpath(folder, path.resolve().parent / path.name)
                 if path.resolve().parent in folder.parents else str(folder))
        row = start_row(model, model.get_output_embeddings().weight.shape[0] - len(tokens))
        atomic_write_json(tmp / MARKER, {"format": FORMAT, "base": where, "base_files": files_stamp(folder),
                                         "tokens": list(tokens), **({"row": row} if row is not None else {})})
        mark(tmp)
        follow_umask(tmp)
    return path


def added_tokens(folder: Path) -> AddedTokens | None:
    """What the extension folder ``folder`` adds to which base (None: not an extension folder). Refused: a marker
    dpaudit did not write, a base that is gone, or whose files changed since the folder was written."""

    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    data = load_json_file(marker, "added-tokens marker", MAX_MARKER_BYTES)
    row = data.get("row") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") not in (1, FORMAT) or not isinstance(data.get("base"), str) \
            or not isinstance(data.get("tokens"), list) or not all(isinstance(t, str) for t in data["tokens"]) \
            or (row is not None and not (isinstance(row, list) and all(isinstance(v, (int, float)) for v in row))):
        raise DPAuditError(f"{marker} is not an added-tokens marker this dpaudit wrote")
    base = (Path(folder) / data["base"]).resolve()   # an absolute "base" stays itself
    if not base.is_dir() or (base / MARKER).is_file():
        raise DPAuditError(f"{folder} adds {len(data['tokens'])} tokens to the model at {base}, which is gone; "
                           "the extended model cannot be rebuilt without it (run the audit again)")
    if files_stamp(base) != data.get("base_files"):
        raise DPAuditError(f"{folder} adds {len(data['tokens'])} tokens to the model at {base}, whose files changed "
                           "since (names, sizes or times); it would not be the model the run started from (run the "
                           "audit again)")
    return AddedTokens(base=base, tokens=data["tokens"], row=row)
