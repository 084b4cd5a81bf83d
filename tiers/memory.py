"""Host memory helpers shared by arena-backed tiers and the shared-memory data plane."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+

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

    Returns False when the kernel (before 5.14) or the platform cannot do it; raises OSError when
    the pages cannot be had (ENOMEM, or EFAULT for pages that would SIGBUS). The region must stay
    open meanwhile: the call holds a buffer export on it, so a concurrent ``close`` fails with
    BufferError instead of unmapping under it.
    """
    if _madvise is None:
        return False
    length = len(region) - start if length is None else length
    if not (0 <= start and 0 <= length and start + length <= len(region)):
        raise ValueError(f"[{start}, {start + length}) is outside the {len(region)}-byte mapping")
    if length == 0:
        return True
    anchor = ctypes.c_char.from_buffer(region)  # the mapping's address, and an export that pins it
    try:
        if _madvise(ctypes.addressof(anchor) + start, length, _MADV_POPULATE_WRITE) == 0:
            return True
        code = ctypes.get_errno()
    finally:
        del anchor
    if code == errno.EINVAL:
        return False
    raise OSError(code, f"MADV_POPULATE_WRITE: {errno.errorcode.get(code, code)}")


def prefault(region: mmap.mmap, step: int = 32 * 2**20, background: bool = True) -> threading.Thread | None:
    """Fault in a mapping's pages ahead of use, without changing their contents.

    A first write to a fresh page costs a page fault and a zeroing; on virtual machines that can
    be ~10x slower than the copy itself, so arenas are faulted in up front (in a background thread,
    safe alongside writers: MADV_POPULATE_WRITE never modifies data; see :func:`populate`). A
    kernel without it is fine: pages are then faulted in on first use.
    """

    def run() -> None:
        size = len(region)
        try:
            for start in range(0, size, step):
                if not populate(region, start, min(step, size - start)):
                    log.debug("prefault: the kernel has no MADV_POPULATE_WRITE; pages fault in on first use")
                    return
        except (OSError, ValueError, BufferError) as exc:  # no memory, or the mapping was closed meanwhile
            log.debug("prefault stopped: %s", exc)

    if not background:
        run()
        return None
    thread = threading.Thread(target=run, name="kvstore-prefault", daemon=True)
    thread.start()
    return thread
