"""Loading Hugging Face files safely: the optional dependency, checkpoints that would run their own code
(refused), and tokenizers (local files only, trust_remote_code=False)."""

from __future__ import annotations

from pathlib import Path

from dpaudit.errors import DPAuditError


def require_transformers():
    try:
        import transformers
    except ImportError:  # the base install is accounting-only
        raise DPAuditError("this command needs the training extras: pip install 'dpaudit[train]'") from None
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # deprecation chatter
    transformers.logging.set_verbosity_error()  # library chatter would bury our one-line messages
    transformers.utils.logging.disable_progress_bar()
    return transformers


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json")


def refuse_remote_code(folder: Path) -> None:
    """A checkpoint that names its own code (``auto_map``) is refused before transformers reads it: loading
    it would mean running files that came with the checkpoint. (Loads also pass trust_remote_code=False.)"""
    import json

    for name in REMOTE_CODE_FILES:
        f = Path(folder) / name
        try:
            if not f.is_file() or f.stat().st_size > 16 << 20:
                continue
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "auto_map" in data:
            raise DPAuditError(f"{f} asks to run code shipped with the checkpoint (auto_map); dpaudit never runs "
                               "checkpoint code")


def load_tokenizer(path: str | Path):
    transformers = require_transformers()
    path = Path(path)
    if not path.exists():
        raise DPAuditError(f"tokenizer/model directory not found: {path}")
    if path.is_dir() or path.suffix.lower() == ".gguf":
        path = resolve_model_path(path)
    refuse_remote_code(path if path.is_dir() else path.parent)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DPAuditError(f"cannot load a tokenizer from {path}: {str(exc).splitlines()[0]}") from None


def resolve_model_path(path: str | Path) -> Path:
    """The Hugging Face folder a user's path stands for: the folder itself; the snapshot inside a
    hub-cache folder (``models--org--name/`` with ``refs/main`` and ``snapshots/<revision>/``); or, for
    a GGUF file (or a folder holding one and no config.json), its converted folder (models/gguf.py)."""
    from dpaudit.models.gguf import as_hf_folder, gguf_file_in

    path = Path(path)
    if not path.exists():
        raise DPAuditError(f"model not found: {path}")
    source = gguf_file_in(path)
    if source is not None:
        return as_hf_folder(source)
    snapshots = path / "snapshots"
    if not path.is_dir() or not snapshots.is_dir() or (path / "config.json").is_file():
        return path
    ref = path / "refs" / "main"
    if ref.is_file():
        revision = ref.read_text(encoding="utf-8", errors="replace").strip()[:200]
        if revision not in ("", ".", "..") and Path(revision).name == revision and (snapshots / revision).is_dir():
            return snapshots / revision
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) == 1:
        return found[0]
    raise DPAuditError(f"{path} is a hub-cache folder with {len(found)} snapshots and no refs/main; "
                       "pass the snapshot folder itself")


def meta_model(path: str | Path):
    """The model built from its config on the meta device: names and shapes, no weights read."""
    import torch

    transformers = require_transformers()
    path = Path(path)
    refuse_remote_code(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # a bad config: one line naming the file, never its content
        raise DPAuditError(f"cannot read the model config in {path}: {type(exc).__name__}") from None
    return model
