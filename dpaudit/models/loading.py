"""Load a local Hugging Face causal-LM checkpoint safely: safetensors or weights_only pickles, local files only."""

from __future__ import annotations

from pathlib import Path

from dpaudit.models.hf import load_tokenizer, refuse_remote_code, require_transformers
from dpaudit.errors import DPAuditError


def load_causal_lm(path: str | Path, gguf_file: str | None = None, dtype=None):
    """(model, tokenizer) from a directory, or from a .gguf file (transformers' gguf loader)."""
    transformers = require_transformers()
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        path, gguf_file = path.parent, path.name
    if not path.is_dir():
        raise DPAuditError(f"checkpoint directory not found: {path}")
    refuse_remote_code(path)
    kwargs = {"local_files_only": True, "trust_remote_code": False}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    else:
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise DPAuditError(f"no model weights (*.safetensors or *.bin) in {path}")
        # transformers loads .bin pickles with torch.load(weights_only=True); safetensors needs no pickle.
        kwargs["use_safetensors"] = any(path.glob("*.safetensors"))
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        tokenizer = (transformers.AutoTokenizer.from_pretrained(str(path), **kwargs) if gguf_file
                     else load_tokenizer(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except DPAuditError:
        raise
    except Exception as exc:  # transformers raises many types for a bad checkpoint; report one line
        raise DPAuditError(f"cannot load a causal LM from {path}: {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
    model.eval()
    return model, tokenizer
