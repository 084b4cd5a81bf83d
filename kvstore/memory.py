"""Host memory helpers shared by arena-backed tiers and the shared-memory data plane."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
#: Bytes per madvise call of :func:`populate`. The kernel holds the process's mmap lock for a
#: whole call; between calls, the other threads' mmap/munmap (malloc, obmalloc arenas, unmapping
#: a released arena) and their page faults get in. Measured (2 cores): another thread's
#: mmap+fault+munmap of 1 MiB ran 0.7 times per ms while one call populated a 112 MiB arena,
#: 2.1 with 32 MiB calls, 7.7 with 2 MiB calls (23.5 with nothing populating).
POPULATE_STEP = 2 * 2**20

try:  # a ctypes call drops the GIL for its duration; mmap.madvise (and, before 3.12, mmap.mmap) hold it
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):  # no libc to call: populate() reports it unsupported
    _madvise = None


def populate(region: mmap.mmap, start: int = 0, length: int | None = None) -> bool:
    """Allocate and map the pages of ``region[start : start + length]`` for writing, without
    changing their contents (MADV_POPULATE_WRITE), with the GIL released: the calling thread's
    page zeroing never stalls the other threads' Python.

    Pages go in :data:`POPULATE_STEP` at a time. Returns False when the kernel (before 5.14) or
    the platform cannot do it; raises OSError when the pages cannot be had (ENOMEM, or EFAULT for
    pages that would SIGBUS). The region must stay open meanwhile: the call holds a buffer export
    on it, so a concurrent ``close`` fails with BufferError instead of unmapping under it.
    """
    if _madvise is None:
        return False
    end = len(region) if length is None else start + length
    if not 0 <= start <= end <= len(region):
        raise ValueError(f"[{start}, {end}) is outside the {len(region)}-byte mapping")
    if start % mmap.PAGESIZE:
        raise ValueError(f"start {start} is not a multiple of the page size ({mmap.PAGESIZE})")
    anchor = ctypes.c_char.from_buffer(region)  # the mapping's address, and an export that pins it
    try:
        base = ctypes.addressof(anchor)
        for offset in range(start, end, POPULATE_STEP):
            if _madvise(base + offset, min(POPULATE_STEP, end - offset), _MADV_POPULATE_WRITE) != 0:
                code = ctypes.get_errno()
                if code == errno.EINVAL:
                    return False
                raise OSError(code, f"MADV_POPULATE_WRITE: {errno.errorcode.get(code, code)}")
    finally:
        del anchor
    return True


def prefault(region: mmap.mmap, step: int = 32 * 2**20, background: bool = True) -> threading.Thread | None:
    """Fault in a mapping's pages ahead of use, without changing their contents.

    A first write to a fresh page costs a page fault and a zeroing; on virtual machines that can
    be ~10x slower than the copy itself, so arenas are faulted in up front (in a background thread,
    safe alongside writers: MADV_POPULATE_WRITE never modifies data). A kernel without it is fine:
    pages are then faulted in on first use.

    ``mmap.madvise`` holds the GIL for each ``step``, so in practice the CPU tier's prefault at
    start-up ends before the daemon says it is ready (tests that bound the daemon's RSS rely on
    it; with :func:`populate` it ran on for seconds into them). An arena made while clients are
    served uses :func:`populate` instead.
    """

    def run() -> None:
        size = len(region)
        try:
            for start in range(0, size, step):
                region.madvise(_MADV_POPULATE_WRITE, start, min(step, size - start))
        except (OSError, ValueError) as exc:  # old kernel, or the mapping was closed meanwhile
            log.debug("prefault stopped: %s", exc)

    if not background:
        run()
        return None
    thread = threading.Thread(target=run, name="kvstore-prefault", daemon=True)
    thread.start()
    return thread
