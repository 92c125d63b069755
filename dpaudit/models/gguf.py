"""GGUF checkpoints (llama.cpp's format, often quantised) as plain Hugging Face folders.

transformers reads a GGUF file (``gguf_file=``) and dequantises it, but the model it returns is marked
as quantised and cannot be saved, and the read is slow (minutes for a 135M Q4_1 file). So a GGUF is
converted once: read by transformers, its weights copied into a model built from the same config,
and saved with the tokenizer as ``<file>.hf/`` beside it (or under ``$DPAUDIT_CACHE``/~/.cache/dpaudit
when that folder cannot be written). Later commands reuse the folder while the file's size and
modification time are those recorded in it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dpaudit.errors import DPAuditError

STAMP = "dpaudit_gguf.json"


def gguf_file_in(path: Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the only *.gguf in a folder without config.json."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise DPAuditError(f"{path} holds {len(found)} GGUF files; pass the one to use")
    return None


def _stamp(source: Path) -> dict:
    st = source.stat()
    return {"source": source.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def cache_folder(source: Path) -> Path:
    beside = source.with_name(source.name + ".hf")
    if os.access(source.parent, os.W_OK):
        return beside
    root = Path(os.environ.get("DPAUDIT_CACHE") or Path.home() / ".cache" / "dpaudit")
    import hashlib

    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
    return root / "gguf" / f"{source.stem}-{key}.hf"


def _current(folder: Path, source: Path) -> bool:
    try:
        return json.loads((folder / STAMP).read_text(encoding="utf-8")) == _stamp(source)
    except (OSError, ValueError):
        return False


def as_hf_folder(source: Path) -> Path:
    """The plain Hugging Face folder for the GGUF file ``source`` (converted on first use)."""
    from dpaudit.atomic import save_model_folder
    from dpaudit.lock import is_marked
    from dpaudit.models.hf import require_transformers

    source = Path(source)
    folder = cache_folder(source)
    if folder.is_dir() and _current(folder, source):
        return folder
    if folder.exists() and not is_marked(folder):
        raise DPAuditError(f"{folder} exists and was not made by dpaudit; move it to convert {source} there")
    transformers = require_transformers()
    try:
        import gguf
    except ImportError:
        raise DPAuditError(f"{source} is a GGUF file; reading it needs the gguf package: "
                           "pip install 'dpaudit[train]'") from None
    try:  # header and tensor table only (memory-mapped): a broken file is refused before any work
        gguf.GGUFReader(str(source))
    except Exception as exc:
        raise DPAuditError(f"{source} is not a readable GGUF file: {type(exc).__name__}") from None
    print(f"converting {source} to a plain Hugging Face folder {folder} (once; later commands reuse it)",
          file=sys.stderr, flush=True)
    began = time.perf_counter()
    kwargs = {"gguf_file": source.name, "local_files_only": True, "trust_remote_code": False}
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(source.parent), **kwargs)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        model.load_state_dict(loaded.state_dict(), strict=True)  # a plain (saveable) copy of the weights
        model.tie_weights()
    except DPAuditError:
        raise
    except Exception as exc:  # transformers raises many types for an unreadable file; one line naming it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DPAuditError(f"cannot read the GGUF file {source}: {type(exc).__name__}: {first[:200]}") from None
    save_model_folder(folder, model, tokenizer, {STAMP: _stamp(source)})
    print(f"converted {source} in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    return folder
