"""Run folders: a marker that says dpaudit made the folder (so --force only ever clears its own), and an
advisory lock so two runs never write one folder at once.

The lock is flock(2) on <folder>/.dpaudit.core.lock: the kernel drops it when its process dies, so a lock is
never stale; the file says who holds it (pid and host) for the message a second writer gets.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from contextlib import ExitStack, contextmanager
from pathlib import Path

from dpaudit.core.errors import DPAuditError

MARKER = ".dpaudit-folder"
LOCK = ".dpaudit.core.lock"


def mark(folder: Path) -> None:
    (Path(folder) / MARKER).write_text("made by dpaudit: --force may replace what dpaudit wrote here\n")


def is_marked(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


@contextmanager
def folder_lock(folder: Path):
    """Hold the folder's lock for the block; a second holder is refused at once with one line."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise DPAuditError(f"{folder} is in use by another dpaudit run ({holder}); wait for it or use another "
                           "folder") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def _holding_every_lock(tree: Path):
    """Take every dpaudit lock found in ``tree`` (symbolic links not followed) for the block; a lock held
    by another process (a live run) refuses at once, naming its folder."""
    with ExitStack() as stack:
        for root, dirs, files in os.walk(tree):
            if LOCK not in files:
                continue
            try:
                fd = os.open(Path(root) / LOCK, os.O_RDWR | os.O_NOFOLLOW)
            except OSError:
                continue
            stack.callback(os.close, fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                raise DPAuditError(f"{root} is in use by a running dpaudit process ({holder}); refusing to remove "
                                   "or replace it (wait for it, or use another folder)") from None
        yield


def assert_unlocked(tree: Path) -> None:
    """Refuse when any folder in ``tree`` is held by a running dpaudit process."""
    with _holding_every_lock(Path(tree)):
        pass


def remove_folder(folder: Path) -> None:
    """Remove a folder dpaudit wrote, never one (or one holding one) that a running dpaudit process holds:
    the locks inside are taken, and held while it is removed."""
    folder = Path(folder)
    if folder.is_symlink():
        folder.unlink()
        return
    if not folder.exists():
        return
    with _holding_every_lock(folder):
        shutil.rmtree(folder)
