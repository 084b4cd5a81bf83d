"""Host memory helpers shared by arena-backed tiers and the shared-memory data plane."""

from __future__ import annotations

import logging
import mmap
import threading

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


def prefault(region: mmap.mmap, step: int = 32 * 2**20, background: bool = True) -> threading.Thread | None:
    """Fault in a mapping's pages ahead of use, without changing their contents.

    A first write to a fresh page costs a page fault and a zeroing; on virtual machines that can
    be ~10x slower than the copy itself, so arenas are faulted in up front (in a background thread,
    safe alongside writers: MADV_POPULATE_WRITE never modifies data). A kernel without it is fine:
    pages are then faulted in on first use.
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
