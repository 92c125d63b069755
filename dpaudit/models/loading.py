"""Load a local Hugging Face causal-LM checkpoint safely: safetensors or weights_only pickles, local files only.
A GGUF file or a hub-cache folder is first resolved to a plain folder (models/hf.resolve_model_path)."""

from __future__ import annotations

from pathlib import Path

from dpaudit.core.errors import DPAuditError
from dpaudit.models.hf import load_tokenizer, refuse_remote_code, require_transformers, resolve_model_path
from dpaudit.models.extension import add_new_tokens, added_tokens


def load_causal_lm(path: str | Path, dtype=None):
    """(model, tokenizer) from a model folder, a hub-cache folder, a .gguf file or an extension folder (a base
    model's folder plus new tokens, models/extension.py)."""
    transformers = require_transformers()

    path = resolve_model_path(path)
    if not path.is_dir():
        raise DPAuditError(f"checkpoint directory not found: {path}")
    extension = added_tokens(path)
    if extension is not None:  # a base model plus rows for new tokens, zero or one start row (models/extension.py)
        model, tokenizer = load_causal_lm(extension.base, dtype)
        add_new_tokens(model, tokenizer, extension.tokens, extension.row)
        return model, tokenizer
    refuse_remote_code(path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise DPAuditError(f"no model weights (*.safetensors or *.bin) in {path}")
    # transformers loads .bin pickles with torch.load(weights_only=True); safetensors needs no pickle.
    kwargs = {"local_files_only": True, "trust_remote_code": False,
              "use_safetensors": any(path.glob("*.safetensors"))}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        tokenizer = load_tokenizer(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        import torch

        if dtype is None and next(model.parameters()).dtype == torch.float16:
            model = model.float()  # fp16 weights (a converted F16 GGUF): training takes no loss scaling, so fp32
    except DPAuditError:
        raise
    except Exception as exc:  # transformers raises many types for a bad checkpoint; report one line
        raise DPAuditError(f"cannot load a causal LM from {path}: {type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
    model.eval()
    return model, tokenizer
