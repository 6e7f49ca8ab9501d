"""Keep freed memory for reuse instead of handing it back to the system (glibc only).

A decode step makes many short-lived tensors of a vocabulary's size (logits, probabilities, a
sampler's cumulative sum: 0.6 MB a row at 152k tokens). glibc serves each allocation above its
mmap threshold (128 KB to start) with a fresh mapping and unmaps it on free, so every such tensor
pays page faults on first touch: measured here, drawing one token from a 152k distribution took
1.8 ms and a softmax over 6 rows 4.5 ms, against 0.3 and 1.0 ms once freed memory is kept and
reused. :func:`keep_freed_memory` raises the mmap and trim thresholds (``mallopt``) so that such
tensors come from, and return to, the heap. The cost: memory freed by the process is kept for reuse
rather than returned at once (its peak of transient tensors, small beside the model weights).

Nothing happens on import: a library should not change a process's allocator. The command line,
the benchmark and the server call :func:`keep_freed_memory` at start; a program using the Python
API opts in with the same one call. ``SPECDEC_MALLOC=system`` leaves the allocator alone even
then; elsewhere than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_MMAP_THRESHOLD = 32 << 20  # glibc's largest mmap threshold on 64-bit systems
KEEP_TRIM_THRESHOLD = 1 << 30
SYSTEM_THRESHOLD = 128 << 10  # glibc's defaults for both


def _mallopt():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt, Windows)
        return None


def keep_freed_memory(keep: bool = True) -> bool:
    """Keep (or with ``keep=False``, hand back as glibc does by default) freed memory. Returns
    whether the allocator took the setting; False where it cannot (not glibc) or where
    ``SPECDEC_MALLOC=system`` asks to leave it alone."""
    if os.environ.get("SPECDEC_MALLOC", "").strip().lower() == "system":
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    mmap, trim = (KEEP_MMAP_THRESHOLD, KEEP_TRIM_THRESHOLD) if keep else (SYSTEM_THRESHOLD, SYSTEM_THRESHOLD)
    return bool(mallopt(M_MMAP_THRESHOLD, mmap)) and bool(mallopt(M_TRIM_THRESHOLD, trim))
