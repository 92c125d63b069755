"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from dpaudit.core.errors import DPAuditError
from dpaudit.core.lock import LOCK, MARKER, assert_unlocked, is_marked, mark


def check_replaceable(path: Path) -> None:
    """Only a regular file is ever replaced: never a device, FIFO, socket, folder or symbolic link."""
    path = Path(path)
    if path.is_symlink():
        raise DPAuditError(f"{path} is a symbolic link; refusing to replace it (write to a plain path)")
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise DPAuditError(f"{path} is {kind}; refusing to replace it")


def guard_new_file(path: Path, force: bool) -> None:
    """Refuse to replace a file the user already has, unless told to; never replace anything but a file."""
    path = Path(path)
    check_replaceable(path)
    if path.exists() and not force:
        raise DPAuditError(f"{path} exists; pass --force to replace it")


def guard_new_folder(path: Path, force: bool) -> None:
    """Refuse to write into a non-empty folder the user already has, unless told to; --force only ever
    reuses a folder dpaudit made (it holds the marker), never one of the user's."""

    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise DPAuditError(f"{path} is not a plain folder")
    if path.exists() and any(p.name not in (MARKER, LOCK) for p in path.iterdir()):
        if not force:
            raise DPAuditError(f"{path} is not empty; pass --force to write into it")
        if not is_marked(path):
            raise DPAuditError(f"{path} is not empty and was not made by dpaudit; --force only replaces dpaudit's "
                               "own folders (use a new folder)")
        assert_unlocked(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, write: Callable[[Path], None], private: bool = False) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.
    The file gets the user's usual mode (the umask's), or 0600 when ``private`` (it holds audit secrets:
    canary membership, white-box canaries)."""
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600 if private else 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def atomic_write_text(path: Path, text: str, private: bool = False) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), private)


def atomic_write_json(path: Path, data: object, private: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n", private)


RENAME_EXCHANGE = 2
AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE, which Python's os does not offer);
    False where the system or file system cannot, so the caller falls back to two renames."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_folder(new: Path, path: Path) -> Path:
    """Put the complete folder ``new`` at ``path``, keeping the old ``path`` in place until then and
    restoring it on any failure; returns where the old copy now is (for the caller to remove), or
    ``new`` itself when there was none (nothing to remove). Never replaces a folder a live run holds."""

    new, path = Path(new), Path(path)
    if not (path.exists() or path.is_symlink()):
        os.replace(new, path)
        return new
    if path.is_symlink() or not path.is_dir():
        raise DPAuditError(f"{path} is not a plain folder; refusing to replace it")
    assert_unlocked(path)
    if _exchange(new, path):
        return new  # now holds the old folder
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent)) / "x"
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old, path)  # the old folder back where it was
        old.parent.rmdir()
        raise
    return old.parent


@contextmanager
def atomic_folder(path: Path):
    """Build a folder beside ``path`` and swap it into place at the end: a failure (disk full, a kill)
    leaves no half-written folder, only the old one (if any), in place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the user's usual mode
    try:
        yield tmp
        old = replace_folder(tmp, path)
        if old != tmp:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def refuse_overlap(output: Path, inputs: dict[str, Path | None], folder_output: bool = False) -> None:
    """An output must not be an input, nor lie inside one (it would write over what it reads); a folder
    output must not hold an input either (replacing the folder would delete it)."""
    out = Path(output).resolve()
    for name, given in inputs.items():
        if given is None:
            continue
        inp = Path(given).resolve()
        if out == inp or inp in out.parents or (folder_output and out in inp.parents):
            how = "is" if out == inp else "is inside" if inp in out.parents else "holds"
            raise DPAuditError(f"the output {output} {how} the {name} {given}; write to another path")


def follow_umask(folder: Path) -> None:
    """Give the files a library wrote into ``folder`` the user's usual mode (transformers writes its
    safetensors through mkstemp, 0600, while everything else follows the umask)."""
    mode = 0o666 & ~_umask()
    for f in Path(folder).iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, mode)


def save_model_folder(path: Path, model, tokenizer, extra_json: dict | None = None, state_dict=None) -> Path:
    """A Hugging Face model folder (safetensors, plus ``extra_json`` files), written whole or not at all,
    marked as dpaudit's. ``state_dict``: the weights to write instead of the model's own."""

    with atomic_folder(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for name, data in (extra_json or {}).items():
            atomic_write_json(tmp / name, data)
        mark(tmp)
        follow_umask(tmp)
    return Path(path)
