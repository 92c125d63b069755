"""Give freed CPU memory back to the system between the phases of a training step.

glibc keeps freed buffers on its heap: after the first large buffer is freed its dynamic mmap threshold
rises (up to 32 MiB), so later activations and gradients come from the heap, and pages freed in its middle
stay resident. A step that allocates in phases (the forward pass, ghost clipping's norm pass, the clipped
backward) then holds more resident memory than it ever has alive: DP-SGD with ghost clipping peaked at
1.31-1.40x SGD's resident set while its live tensors were 1.08x (benchmarks/trainers.py, 17.1M model).
``malloc_trim(0)`` (glibc >= 2.8) returns every free page, in the middle of the heap too, so the next phase
faults fresh pages in rather than keeping the old ones resident.

By hand because torch's CPU allocator has no ``empty_cache`` and no library wraps glibc's. A no-op where
malloc_trim does not exist (macOS, musl) and off the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed(device_type: str) -> None:
    """Return the process heap's free pages to the system (CPU tensors only)."""
    trim = _malloc_trim() if device_type == "cpu" else None
    if trim is not None:
        trim(0)
