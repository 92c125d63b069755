"""Loading Hugging Face files safely: the optional dependency, checkpoints that would run their own code
(refused), and tokenizers (local files only, trust_remote_code=False)."""

from __future__ import annotations

from pathlib import Path

from dpaudit.core.errors import DPAuditError
from dpaudit.models.dependency import require_transformers  # noqa: F401 - importable from here as before
from dpaudit.core import limits as budget
from dpaudit.core.limits import human_bytes
from dpaudit.core.safe_json import load_json_file
from dpaudit.models.gguf import as_hf_folder, gguf_file_in


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json")
# Real configs are a few KB and tokenizer configs (chat templates, added tokens) a few MB at most; a larger
# one is refused unread rather than skipped, so nothing gets past the auto_map check by size.
MAX_CONFIG_BYTES = 16 << 20
MAX_LAYERS = 4096  # the deepest released LMs have a few hundred


def refuse_remote_code(folder: Path) -> None:
    """A checkpoint that names its own code (``auto_map``) is refused before transformers reads it: loading
    it would mean running files that came with the checkpoint. (Loads also pass trust_remote_code=False.)
    A config too large or too nested to read is refused too, and a model config is checked for size
    (``check_model_size``) before anything is built from it."""

    for name in REMOTE_CODE_FILES:
        f = Path(folder) / name
        if not f.is_file():
            continue
        data = load_json_file(f, "checkpoint config", max_bytes=MAX_CONFIG_BYTES)
        if isinstance(data, dict) and "auto_map" in data:
            raise DPAuditError(f"{f} asks to run code shipped with the checkpoint (auto_map); dpaudit never runs "
                               "checkpoint code")
        if name == "config.json":
            check_model_size(f, data)


def _size(config: dict, *names: str, default: float = 0.0) -> float:
    for name in names:
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not (value >= 0 and value < 1e15):
                raise DPAuditError(f"the model config's {name} is not a plausible size")
            return float(value)
    return default


def parameter_estimate(config: dict) -> float:
    """Parameters a config describes, from its sizes alone (no model is built): embeddings (input and
    output) plus, per layer, attention (4 h^2) and a gated MLP (3 h x intermediate). Errs high."""
    parts = [config, *(v for v in config.values() if isinstance(v, dict))]  # multimodal configs nest theirs
    total = 0.0
    for c in parts:
        h = _size(c, "hidden_size", "n_embd", "d_model", "dim")
        layers = _size(c, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
        vocab = _size(c, "vocab_size")
        inner = _size(c, "intermediate_size", "n_inner", "ffn_dim", "d_ff", default=4 * h)
        experts = max(1.0, _size(c, "num_local_experts", "num_experts", "n_routed_experts"))
        total += 2 * vocab * h + layers * (4 * h * h + 3 * h * inner * experts)
    return total


def check_model_size(path: Path, config: dict, max_bytes: float | None = None) -> None:
    """Refuse a config whose model would not fit: its weights at 2 bytes a parameter (bf16, the least any
    load here uses) against ``max_bytes`` (default: the memory available to this process), and a layer
    count no model has. Checked before transformers builds anything, so a config naming 1e8 layers is
    refused in milliseconds instead of filling the memory or building modules for hours."""

    if not isinstance(config, dict):
        raise DPAuditError(f"{path} is not a model config (a JSON object)")
    layers = max(_size(c, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
                 for c in (config, *(v for v in config.values() if isinstance(v, dict))))
    if layers > MAX_LAYERS:
        raise DPAuditError(f"{path} names {layers:.3g} layers; no model has more than {MAX_LAYERS}")
    need = 2 * parameter_estimate(config)
    limit = max_bytes or (budget.current().max_memory if budget.current().explicit else None) \
        or budget.available_bytes() or float("inf")
    if need > limit:
        raise DPAuditError(f"{path} describes a model of about {need / 2:.3g} parameters ({human_bytes(need)} even "
                           f"in bf16), more than the {human_bytes(limit)} this command may use")


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


def vocab_rows(path: str | Path) -> int:
    """The token rows of the model in ``path``, from its config alone (its text model's, for a multimodal one)."""
    return _from_config(path, lambda config: int(config.get_text_config().vocab_size))


def meta_model(path: str | Path):
    """The model built from its config on the meta device: names and shapes, no weights read."""
    import torch

    def build(config):
        with torch.device("meta"):
            return require_transformers().AutoModelForCausalLM.from_config(config, trust_remote_code=False)

    return _from_config(path, build)


def _from_config(path: str | Path, use):
    """``use(config)`` of the model config in ``path`` (no remote code); any failure is one line naming the file."""
    transformers = require_transformers()
    path = Path(path)
    refuse_remote_code(path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        return use(config)
    except Exception as exc:  # a bad config: one line naming the file, never its content
        raise DPAuditError(f"cannot read the model config in {path}: {type(exc).__name__}") from None
