"""GGUF checkpoints (llama.cpp's format, often quantised) as plain Hugging Face folders.

transformers reads a GGUF file (``gguf_file=``) and dequantises it, but the model it returns is marked
as quantised and cannot be saved, and the read is slow (minutes for a 135M Q4_1 file). So a GGUF is
converted once: read by transformers, its weights copied into a model built from the same config,
and saved with the tokenizer as ``<file>.hf/`` beside it (or under ``$DPAUDIT_CACHE``/~/.cache/dpaudit
when that folder cannot be written). Later commands reuse the folder while the file's size, modification
time and the SHA-256 of its header and tensor table are those recorded in it.

Before any library reads the file, ``scan_header`` walks its header and tensor table itself with caps
(gguf's reader makes a Python object per array element: a 45 MB file holding a 5M-string array took
4.9 GB), so a hostile file is refused in a second with one line. The GGUF layout (v2/v3): magic, version
u32, tensor count u64, metadata count u64; each metadata entry a string key, a u32 type and its value
(strings: u64 length + bytes; arrays: u32 item type, u64 count, items); then per tensor a string name,
u32 dimension count, u64 dimensions, u32 type, u64 offset.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
import time
from pathlib import Path
import shutil

from dpaudit.core import limits
from dpaudit.core.errors import DPAuditError
from dpaudit.core.limits import human_bytes
from dpaudit.core.atomic import atomic_folder, save_model_folder
from dpaudit.core.lock import is_marked
from dpaudit.models.dependency import require_transformers

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


# Caps on what a GGUF header may hold. Real files: a few dozen metadata entries, vocabularies up to ~262k
# tokens (token, score and type arrays, merges), chat templates of tens of KB, a few thousand tensors.
MAX_ENTRIES = 1 << 16
MAX_TENSORS = 1 << 17
MAX_ARRAY = 1 << 20
MAX_ELEMENTS = 1 << 22            # all arrays together
MAX_STRING = 16 << 20
MAX_DIMS = 8
BYTES_PER_ELEMENT_READ = 1024      # what gguf's reader holds per array element (measured: 4.9 GB / 5M)
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # numeric types' sizes
STRING, ARRAY = 8, 9


class _Header:
    """A bounds-checked cursor over the mapped file."""

    def __init__(self, buf, size: int, order: str):
        self.buf, self.size, self.pos, self.order, self.elements = buf, size, 0, order, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise ValueError("truncated")
        at, self.pos = self.pos, self.pos + n
        return at

    def u(self, width: int) -> int:
        return struct.unpack_from(self.order + {4: "I", 8: "Q"}[width], self.buf, self.take(width))[0]

    def string(self) -> None:
        n = self.u(8)
        if n > MAX_STRING:
            raise ValueError(f"a string of {n} bytes")
        self.take(n)

    def value(self, kind: int, depth: int = 0) -> None:
        if kind in _FIXED:
            self.take(_FIXED[kind])
        elif kind == STRING:
            self.string()
        elif kind == ARRAY:
            item, count = self.u(4), self.u(8)
            self.elements += count
            if depth > 1 or count > MAX_ARRAY or self.elements > MAX_ELEMENTS:
                raise ValueError(f"an array of {count} elements" if count > MAX_ARRAY else "too many array elements"
                                 if depth <= 1 else "arrays nested too deeply")
            if item in _FIXED:
                self.take(_FIXED[item] * count)
            else:
                for _ in range(count):
                    self.value(item, depth + 1)
        else:
            raise ValueError(f"unknown value type {kind}")


def scan_header(source: Path) -> str:
    """Check the header and tensor table of the GGUF file ``source`` against the caps above and the memory
    available, and return their SHA-256 (the conversion's cache key). One line, exit 2, when refused."""

    try:
        with open(source, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            size = len(buf)
            if size < 24 or buf[:4] != b"GGUF":
                raise ValueError("no GGUF magic")
            order = "<" if struct.unpack_from("<I", buf, 4)[0] < 1 << 16 else ">"
            h = _Header(buf, size, order)
            h.take(4)
            version = h.u(4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version}")
            tensors, entries = h.u(8), h.u(8)
            if tensors > MAX_TENSORS or entries > MAX_ENTRIES:
                raise ValueError(f"{tensors} tensors and {entries} metadata entries")
            for _ in range(entries):
                h.string()
                h.value(h.u(4))
            for _ in range(tensors):
                h.string()
                dims = h.u(4)
                if dims > MAX_DIMS:
                    raise ValueError(f"a tensor of {dims} dimensions")
                h.take(8 * dims + 4 + 8)
            digest = hashlib.sha256(buf[:h.pos]).hexdigest()
    except (OSError, ValueError) as exc:
        raise DPAuditError(f"{source} is not a GGUF file dpaudit reads: {exc}") from None
    need = BYTES_PER_ELEMENT_READ * h.elements
    available = limits.available_bytes()
    if available is not None and need > available / 2:
        raise DPAuditError(f"{source}'s metadata holds {h.elements} array elements, which the GGUF reader would "
                           f"need about {human_bytes(need)} for; more than half the {human_bytes(available)} free")
    return digest


def _stamp(source: Path, digest: str) -> dict:
    st = source.stat()
    return {"source": source.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": digest}


def cache_folder(source: Path) -> Path:
    beside = source.with_name(source.name + ".hf")
    if os.access(source.parent, os.W_OK):
        return beside
    root = Path(os.environ.get("DPAUDIT_CACHE") or Path.home() / ".cache" / "dpaudit")

    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:16]
    return root / "gguf" / f"{source.stem}-{key}.hf"


def _current(folder: Path, source: Path, digest: str) -> bool:
    try:
        return json.loads((folder / STAMP).read_text(encoding="utf-8")) == _stamp(source, digest)
    except (OSError, ValueError, RecursionError):
        return False


def as_hf_folder(source: Path) -> Path:
    """The plain Hugging Face folder for the GGUF file ``source`` (converted on first use)."""

    source = Path(source)
    folder = cache_folder(source)
    digest = scan_header(source)  # refuses a hostile header before any library reads it
    if folder.is_dir() and _current(folder, source, digest):
        return folder
    if folder.exists() and not is_marked(folder):
        raise DPAuditError(f"{folder} exists and was not made by dpaudit; move it to convert {source} there")
    return _convert(source, folder, digest)


def convert_to(source: Path, folder: Path) -> Path:
    """Convert the GGUF file ``source`` into ``folder`` (``dpaudit model convert``); a conversion already beside
    the file (``<file>.hf``, current) is copied instead of redone."""

    source = Path(source)
    digest = scan_header(source)
    done = cache_folder(source)
    if done.is_dir() and _current(done, source, digest):
        with atomic_folder(Path(folder)) as tmp:
            for item in done.iterdir():
                if item.is_file():
                    shutil.copy2(item, tmp / item.name)
        return Path(folder)
    return _convert(source, Path(folder), digest)


def stored_precision(source: Path):
    """(torch dtype, why) the converted weights are written in: the GGUF's own where transformers loads it (F16,
    BF16, F32 matrices), else float32: a quantized block (Q8_0, Q4_K, ...) dequantizes to products of an integer and
    a 16-bit scale that 16 bits would round, and transformers cannot load the blocks themselves."""
    import gguf
    import torch

    own = {gguf.GGMLQuantizationType.F16: torch.float16, gguf.GGMLQuantizationType.BF16: torch.bfloat16,
           gguf.GGMLQuantizationType.F32: torch.float32}
    kinds = {t.tensor_type for t in gguf.GGUFReader(str(source)).tensors if len(t.shape) >= 2}
    if len(kinds) == 1 and next(iter(kinds)) in own:
        return own[next(iter(kinds))], "the GGUF's own precision"
    if kinds and kinds <= set(own):
        return torch.float32, "the GGUF mixes 16- and 32-bit matrices: float32 holds each exactly"
    quantized = sorted(gguf.GGMLQuantizationType(k).name for k in kinds if k not in own)
    return torch.float32, (f"its {', '.join(quantized)} blocks dequantize to values 16 bits would round, and "
                           "transformers cannot load the blocks themselves")


def _convert(source: Path, folder: Path, digest: str) -> Path:
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
    dtype, why = stored_precision(source)
    print(f"weights written in {str(dtype).replace('torch.', '')}: {why}", file=sys.stderr, flush=True)
    kwargs = {"gguf_file": source.name, "local_files_only": True, "trust_remote_code": False}
    try:
        import torch

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=dtype, **kwargs)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):  # no second copy of the weights: the plain model takes the loaded tensors
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=dtype)
        model.load_state_dict(loaded.state_dict(), strict=True, assign=True)  # a plain (saveable) model
        del loaded
        model.tie_weights()
    except DPAuditError:
        raise
    except Exception as exc:  # transformers raises many types for an unreadable file; one line naming it
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DPAuditError(f"cannot read the GGUF file {source}: {type(exc).__name__}: {first[:200]}") from None
    save_model_folder(folder, model, tokenizer, {STAMP: _stamp(source, digest)})
    print(f"converted {source} in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
    return folder
