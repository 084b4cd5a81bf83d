"""Disk tier: one file per block under a directory on local disk.

Layout: ``ROOT/ab/abcdef....kvb`` (the key in hex, fanned out by its first byte). A file holds the
whole block, header then payload, so the index is rebuilt on restart by reading headers alone.

Writes are atomic: the block goes to ``ROOT/ab/.abcdef....tmp.PID``, is flushed (and fsynced when
``fsync`` is on), then renamed over the final name. A crash leaves either the old block, the new
block, or a temp file that the next start deletes; never a torn ``.kvb``.

Reads verify the payload checksum every time; a block that fails is reported as corrupt (the store
deletes it and counts a miss). A read is ``pread`` calls of a few hundred KB straight into the
caller's buffer, each chunk hashed while it is still in the CPU cache (hashing the whole payload
after copying it would read it back from memory); the header on disk is compared byte for byte
with the one packed when the block was indexed, instead of being parsed again. ``o_direct`` reads
bypass the page cache (through an aligned bounce buffer), for hosts where cached KV must not crowd the engine's memory and for honest cold-read
benchmarks.

With ``at_rest`` (``disk_encrypt``) every file is a sealed block (tiers/at_rest.py: AEGIS-256X4 under a
key derived from the server secret): the header and payload on disk are ciphertext. A write seals
the payload a chunk at a time into a small buffer and writes it, each chunk hashed, then, if the
payload is its header's checksum's, the head at the file's start; a read opens the head (the
header inside is compared with the indexed one), then preads each chunk into its thread's bounce
buffer and opens it into the caller's, the tag checked at the end, which stands for the checksum
(the payload is the one sealed: no hash on reads); ``o_direct`` reads the whole file into its
bounce buffer and opens it from there. A file
that does not open (another key, a flipped byte, another block's) is a corrupt block, like one
whose checksum fails. A folder's files are either all sealed or all plain: those of the other
kind, and sealed ones of an earlier format, are dropped at start (counted as corrupt), so turning
encryption on leaves no plain block.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Iterator

import xxhash

from kvstore.block import MAGIC as PLAIN_MAGIC
from kvstore.block import MAX_HEADER_BYTES, BlockHeader, CorruptBlockError, payload_checksum
from tiers import at_rest
from tiers.at_rest import AtRestKey
from tiers.base import HeaderIndex, Tier, TierError, TierFullError, TierUnavailableError

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
_DIRECT_ALIGN = 4096
#: The only names the daemon reads or deletes in its folder: ab/<32 hex>.kvb and ab/.<32 hex>.tmp.PID.TID
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX))
_TEMP_NAME = re.compile(r"\.[0-9a-f]{32}\.tmp\.\d+\.\d+")
#: Read errors that say the daemon lacks a resource now, not that the block is bad: such a read is
#: a miss, and the block stays (another client exhausting the daemon's fds must not delete it).
_TRANSIENT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR}
#: Bytes per pread: small enough that a chunk is still in L2 when it is hashed, large enough that
#: syscalls stay cheap (measured here: 128-256 KB beat both 64 KB and 1 MB).
READ_CHUNK = 256 * 1024
#: Bytes a sealed read preads and opens at once (into each reader thread's own bounce buffer,
#: kept): the chunk stays in this host's 1 MiB of L2 per core while the cipher reads it back.
SEALED_CHUNK = 1 << 20
_bounces = threading.local()  # .buffer: this thread's bounce buffer for sealed reads
#: The least capacity the tier starts with after shrinking to the free space (DaemonConfig's minimum).
MIN_CAPACITY = 2**20


class DiskTier(HeaderIndex, Tier):
    blocking_io = True

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, name: str = "disk",
                 fsync: bool = True, o_direct: bool = False, at_rest: AtRestKey | None = None) -> None:
        """``at_rest``: seal every block under this key (tiers/at_rest.py); None: plain files."""
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity_bytes}")
        if o_direct and not hasattr(os, "O_DIRECT"):
            raise ValueError("o_direct=True needs a platform with O_DIRECT (Linux)")
        self.name = name
        self.root = Path(root).expanduser()
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.durable = fsync
        self.o_direct = o_direct
        self.at_rest = at_rest
        self._lock = threading.Lock()  # guards _blocks/_used against reader threads
        self._blocks: dict[bytes, BlockHeader] = {}
        #: The packed header of each indexed block, as it must read back from disk.
        self._packed: dict[bytes, bytes] = {}
        self._used = 0
        #: Files found unreadable or corrupt while rebuilding the index (deleted).
        self.corrupt_on_start = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Block file names are stored keys: others may not list them (the owner's bits are kept,
            # so a read-only folder stays read-only and fails below, at the lock).
            os.chmod(self.root, self.root.stat().st_mode & 0o700)
        except OSError as exc:
            raise TierError(f"{name}: cannot create the folder {self.root}: {exc.strerror}") from exc
        # One daemon per folder, locked before the rebuild deletes any temp file (another daemon's).
        from kvstore.instance_lock import InstanceLock, LockError

        try:
            self._instance = InstanceLock(self.root / ".lock", f"{name} folder {self.root}")
        except LockError as exc:
            raise TierError(str(exc)) from None
        except OSError as exc:
            raise TierError(f"{name}: {self.root} is not writable: {exc}") from exc
        self._rebuild_index()
        self._fit_capacity_to_free_space()

    def _fit_capacity_to_free_space(self) -> None:
        """Shrink the capacity to what the filesystem can hold: the blocks already here plus its
        free space, warning once.

        A choice, not an error: a smaller cache still works, whereas a capacity the device cannot
        hold turns every write past the free space into a failed write and then an eviction
        (ENOSPC, ``Evictor.store_in``). ``Stats`` reports the shrunk capacity. Space freed later
        is taken back only at a restart; space others take later still ends in ENOSPC evictions.
        """
        fs = os.statvfs(self.root)
        free = fs.f_bavail * fs.f_frsize
        room = self._used + free
        if room >= self.capacity_bytes:
            return
        if room < MIN_CAPACITY:
            raise TierError(f"{self.name}: only {_size(free)} free on {self.root}; the tier needs at least "
                            f"{_size(MIN_CAPACITY)}: free some space or choose another disk_path")
        besides = f" (besides {_size(self._used)} of blocks already there)" if self._used else ""
        log.warning("%s tier capacity shrunk from %s to %s: only %s free on %s%s", self.name,
                    _size(self.capacity_bytes), _size(room), _size(free), self.root, besides)
        self.capacity_bytes = room

    # -- index -------------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        return block_path(self.root, key)

    def close(self) -> None:
        """Release the folder's lock (another daemon may then open it)."""
        self._instance.release()

    def _block_files(self) -> Iterator[Path]:
        """Files named exactly like a block or its temp file, in the two-hex-digit subfolders; no
        symlink is followed (a linked folder or file is another's, never read or deleted)."""
        for sub in os.scandir(self.root):
            if not (_SUBDIR.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                continue
            for entry in os.scandir(sub.path):
                if (_BLOCK_NAME.fullmatch(entry.name) or _TEMP_NAME.fullmatch(entry.name)) \
                        and entry.is_file(follow_symlinks=False) and entry.name.lstrip(".").startswith(sub.name):
                    yield Path(entry.path)

    def _rebuild_index(self) -> None:
        other_kind = 0  # sealed files with encryption off, or plain ones with it on
        old_format = 0  # sealed by an earlier format (tiers/at_rest.py), with encryption on
        for path in self._block_files():
            if _TEMP_NAME.fullmatch(path.name):
                path.unlink(missing_ok=True)  # an interrupted write of ours (the folder is locked)
                continue
            try:
                with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
                    head = f.read(at_rest.OVERHEAD + MAX_HEADER_BYTES)
                    size = os.fstat(f.fileno()).st_size
                found = at_rest.format_of(head)
                if found != ("sealed" if self.at_rest else "plain") and head[:4] in (PLAIN_MAGIC, at_rest.MAGIC):
                    if found == "sealed-old" and self.at_rest:
                        old_format += 1
                    else:
                        other_kind += 1
                    self.corrupt_on_start += 1
                    path.unlink(missing_ok=True)
                    continue
                header, packed = self._open_head(head)
                if self._stored_len(header) != size or path.name != header.key.hex() + SUFFIX:
                    raise CorruptBlockError(f"file size {size} or name does not match its header")
            except (OSError, CorruptBlockError) as exc:
                log.warning("%s: dropping unreadable block file %s: %s", self.name, path, exc)
                self.corrupt_on_start += 1
                path.unlink(missing_ok=True)
                continue
            self._blocks[header.key] = header
            self._packed[header.key] = packed
            self._used += header.block_len
        if other_kind:
            log.warning("%s: dropped %d block files written with encryption %s (disk_encrypt is %s now)", self.name,
                        other_kind, "off" if self.at_rest else "on", "on" if self.at_rest else "off")
        if old_format:
            log.warning("%s: dropped %d block files sealed by an earlier kvstore's format (format %d is read now)",
                        self.name, old_format, at_rest.VERSION)

    def _open_head(self, head: bytes) -> tuple[BlockHeader, bytes]:
        """The header a file starts with, and its bytes as packed; CorruptBlockError."""
        if self.at_rest is None:
            header = BlockHeader.unpack(head)
            return header, bytes(head[: header.header_len])
        opened = self.at_rest.open_head(head)
        return opened.header, opened.packed

    def _stored_len(self, header: BlockHeader) -> int:
        """Bytes of ``header``'s block file: the block, sealed or not."""
        return header.block_len if self.at_rest is None else self.at_rest.stored_len(header)

    # -- Tier --------------------------------------------------------------------------------

    def put(self, header: BlockHeader, payload: memoryview) -> None:
        if len(payload) != header.payload_len:
            raise ValueError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
        previous = self._blocks.get(header.key)
        growth = header.block_len - (previous.block_len if previous else 0)
        if self._used + growth > self.capacity_bytes:
            raise TierFullError(f"{self.name}: {header.block_len} bytes do not fit")
        path = self._path(header.key)
        tmp = path.with_name(f".{path.stem}.tmp.{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True, mode=0o700)
            packed = header.pack()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                if self.at_rest is None:
                    _write_all(fd, packed)
                    _write_all(fd, payload)
                else:
                    _write_sealed(fd, self.at_rest.sealer(len(packed)), packed, payload, header.checksum)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(path.parent)  # the rename itself must survive a power cut
        except CorruptBlockError:  # a sealed payload that is not its header's: nothing written
            tmp.unlink(missing_ok=True)
            raise
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == 28:  # ENOSPC: the device is fuller than our capacity says
                raise TierFullError(f"{self.name}: device full while writing {path.name}") from exc
            raise TierError(f"{self.name}: writing {path}: {exc}") from exc
        with self._lock:
            # Readers take no lock and look up the header, then the packed bytes: publish the
            # packed bytes first, so a reader that sees the new header sees its bytes too.
            self._packed[header.key] = packed
            self._blocks[header.key] = header
            self._used += growth

    def read_payload_into(self, key: bytes, dest: memoryview) -> BlockHeader:
        header = self._blocks[key]
        packed = self._packed[key]
        if len(dest) < header.payload_len:
            raise ValueError(f"destination of {len(dest)} bytes is smaller than the {header.payload_len}-byte payload")
        path = self._path(key)
        try:
            if self.o_direct:
                on_disk, checksum = self._read_direct(path, header, dest)
            else:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if self.at_rest is None:
                        on_disk, checksum = _read_hashed(fd, len(packed), dest[: header.payload_len])
                    else:
                        on_disk, checksum = _read_sealed(fd, self.at_rest, header, dest[: header.payload_len])
                finally:
                    os.close(fd)
        except FileNotFoundError:
            raise KeyError(key) from None
        except OSError as exc:
            if exc.errno in _TRANSIENT_ERRNOS:  # the daemon is short of fds or memory: the block is fine
                raise TierUnavailableError(f"{self.name}: reading {path.name}: {exc}") from exc
            raise CorruptBlockError(f"{self.name}: reading {path.name}: {exc}") from exc
        except CorruptBlockError as exc:
            raise CorruptBlockError(f"{self.name}: {path.name}: {exc}") from None
        if on_disk != packed:
            raise CorruptBlockError(f"{self.name}: header of {path.name} changed on disk")
        if checksum != header.checksum:
            raise CorruptBlockError(f"{self.name}: {path.name}: payload checksum mismatch")
        return header

    def _read_direct(self, path: Path, header: BlockHeader, dest: memoryview) -> tuple[bytes, int]:
        """Read through O_DIRECT into an aligned bounce buffer, then copy the payload out (or,
        sealed, open it out).

        Returns the header bytes found on disk and the payload's checksum.
        """
        total = self._stored_len(header)
        padded = (total + _DIRECT_ALIGN - 1) // _DIRECT_ALIGN * _DIRECT_ALIGN
        bounce = mmap.mmap(-1, padded)  # anonymous mappings are page-aligned
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                got = 0
                view = memoryview(bounce)
                while got < total:
                    n = os.preadv(fd, [view[got:]], got)
                    if n == 0:
                        raise CorruptBlockError(f"{self.name}: {path.name} is truncated")
                    got += n
                view.release()
            finally:
                os.close(fd)
            if self.at_rest is not None:
                with memoryview(bounce) as view:
                    opened = self.at_rest.open_head(view[: at_rest.OVERHEAD + header.header_len])
                    checksum = _open_sealed(opened, header, view[at_rest.OVERHEAD + header.header_len : total],
                                            dest[: header.payload_len])
                return opened.packed, checksum
            on_disk = bounce[: header.header_len]
            dest[: header.payload_len] = bounce[header.header_len : total]
            return on_disk, payload_checksum(dest[: header.payload_len])
        finally:
            try:
                bounce.close()
            except BufferError:  # views of it live on in a raised error's frames: unmapped when it goes
                pass

    def delete(self, key: bytes) -> int:
        with self._lock:
            header = self._blocks.pop(key, None)
            if header is None:
                return 0
            self._packed.pop(key, None)
            self._used -= header.block_len
        self._path(key).unlink(missing_ok=True)
        return header.block_len

    def check_integrity(self) -> None:
        on_disk: dict[bytes, int] = {}
        for path in self._block_files():
            if _BLOCK_NAME.fullmatch(path.name):
                on_disk[bytes.fromhex(path.stem)] = path.stat().st_size
        indexed = {key: self._stored_len(header) for key, header in self._blocks.items()}
        if on_disk != indexed:
            missing = set(indexed) - set(on_disk)
            extra = set(on_disk) - set(indexed)
            raise RuntimeError(f"{self.name}: index and files differ: {len(missing)} indexed blocks "
                               f"missing on disk, {len(extra)} files not indexed, or sizes differ")
        blocks = sum(header.block_len for header in self._blocks.values())
        if blocks != self._used:
            raise RuntimeError(f"{self.name}: used bytes {self._used} != sum of blocks {blocks}")


def block_path(root: Path, key: bytes) -> Path:
    """Where the disk tier rooted at ``root`` keeps ``key``'s block: ``ab/<32 hex>.kvb``."""
    hexkey = key.hex()
    return root / hexkey[:2] / (hexkey + SUFFIX)


def _size(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_hashed(fd: int, header_len: int, dest: memoryview) -> tuple[bytes, int]:
    """Read ``header_len`` header bytes and then ``len(dest)`` payload bytes from ``fd``.

    The payload goes straight into ``dest`` in ``READ_CHUNK`` preads, each hashed (xxh3-64, the
    block's payload checksum) right after it lands, while it is still cached. Returns the header
    bytes and the payload checksum. Raises CorruptBlockError if the file ends early or runs on
    past the payload (its size then contradicts the header)::

        file:   | header (header_len) | payload (len(dest))                     | EOF
        preads: |<- 1st: header + chunk 0 ->|<- chunk 1 ->| ... |<- last chunk + 1 spare byte ->
    """
    head = bytearray(header_len)
    spare = bytearray(1)  # filled only if the file is longer than header + payload
    hasher = xxhash.xxh3_64()  # streaming form of kvstore.block.payload_checksum
    size = len(dest)
    end = min(READ_CHUNK, size)
    buffers = [head, dest[:end]] if end < size else [head, dest, spare]
    n = os.preadv(fd, buffers, 0)
    if n < header_len:
        raise CorruptBlockError("file is shorter than its header (truncated)")
    pos = 0  # payload bytes read so far
    n -= header_len
    while True:
        if n > size - pos:
            raise CorruptBlockError("file is longer than its header says")
        if n:
            hasher.update(dest[pos : pos + n])
            pos += n
        if pos == size:
            return bytes(head), hasher.intdigest()
        if n == 0:
            raise CorruptBlockError("file is shorter than its header says (truncated)")
        end = min(pos + READ_CHUNK, size)
        buffers = [dest[pos:end]] if end < size else [dest[pos:end], spare]
        n = os.preadv(fd, buffers, header_len + pos)


def _write_sealed(fd: int, sealer: at_rest.BlockSealer, packed: bytes, payload: memoryview, checksum: int) -> None:
    """Write the sealed block of ``packed`` and ``payload`` to ``fd``: each ``READ_CHUNK`` of the
    payload sealed into one small buffer and written at its place, then the head at the start.
    Each chunk is hashed as it is sealed, and the head is written only if the payload sealed is the
    one ``checksum`` (the header's) names (else CorruptBlockError): a reader then trusts the
    payload's AEAD tag for it and hashes nothing (:func:`_read_sealed`).

        file:  | head (sealer.seal_head, written last) | sealed chunk 0 | sealed chunk 1 | ... |
    """
    source = memoryview(payload).cast("B")
    out = memoryview(bytearray(min(READ_CHUNK, len(source))))
    at = at_rest.OVERHEAD + len(packed)
    hasher = xxhash.xxh3_64()  # streaming form of kvstore.block.payload_checksum
    for start in range(0, len(source), READ_CHUNK):
        chunk = source[start : start + READ_CHUNK]
        sealed = out[: len(chunk)]
        sealer.seal_into(chunk, sealed)
        hasher.update(chunk)  # while in cache
        _pwrite_all(fd, sealed, at + start)
    if hasher.intdigest() != checksum:
        raise CorruptBlockError("payload does not match its header's checksum; not written")
    _pwrite_all(fd, sealer.seal_head(packed), 0)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _read_sealed(fd: int, key: AtRestKey, header: BlockHeader, dest: memoryview) -> tuple[bytes, int]:
    """:func:`_read_hashed` for a sealed file of the block ``header`` indexed: the head opened (its
    header returned as packed, not parsed: the caller compares it with the indexed one), then the
    payload in ``SEALED_CHUNK`` preads into this thread's bounce buffer, each opened into ``dest``;
    the payload's tag checked once all is read. CorruptBlockError when the file does not open,
    ends early or runs on.

    The checksum returned is the indexed header's, not a hash of ``dest``: once the caller found the
    sealed header to be that one, the tag proves the payload is the one sealed, and the sealer
    checked that one against this checksum (:func:`_write_sealed`), so a hash here would prove
    nothing more (it cost a fifth of a sealed read: docs/benchmarks.md, issue 56).

        file:   | head (OVERHEAD + header_len) | sealed payload (len(dest))      | EOF
        preads: |<- head ->|<- chunk 0 ->|<- chunk 1 ->| ... |<- last chunk + 1 spare byte ->
    """
    head_len = at_rest.OVERHEAD + header.header_len
    head = os.pread(fd, head_len, 0)
    if len(head) < head_len:
        raise CorruptBlockError("file is shorter than its header (truncated)")
    opened = key.open_head(head)
    size, pos = len(dest), 0
    bounce = _bounce()
    spare = bytearray(1)  # filled only if the file is longer than head + payload
    while True:
        want = min(SEALED_CHUNK, size - pos)
        buffers = [bounce[:want]] if pos + want < size else [bounce[:want], spare]
        n = os.preadv(fd, buffers, head_len + pos)
        if n > size - pos:
            raise CorruptBlockError("file is longer than its header says")
        if n:
            opened.payload.open_into(bounce[:n], dest[pos : pos + n])
            pos += n
        if pos == size:
            opened.payload.finish()
            return opened.packed, header.checksum
        if n == 0:
            raise CorruptBlockError("file is shorter than its header says (truncated)")


def _bounce() -> memoryview:
    """This thread's ``SEALED_CHUNK`` bounce buffer (made once: a read zeroes no fresh buffer)."""
    buffer = getattr(_bounces, "buffer", None)
    if buffer is None:
        buffer = _bounces.buffer = memoryview(bytearray(SEALED_CHUNK))
    return buffer


def _open_sealed(opened: at_rest.OpenedHead, header: BlockHeader, sealed: memoryview, dest: memoryview) -> int:
    """Open the sealed payload in ``sealed`` into ``dest`` (as long), a ``SEALED_CHUNK`` at a
    time; the tag checked. Returns the indexed ``header``'s checksum (why: :func:`_read_sealed`)."""
    if len(sealed) != len(dest):
        raise CorruptBlockError(f"sealed payload of {len(sealed)} bytes, header says {len(dest)}")
    for start in range(0, len(dest), SEALED_CHUNK):
        opened.payload.open_into(sealed[start : start + SEALED_CHUNK], dest[start : start + SEALED_CHUNK])
    opened.payload.finish()
    return header.checksum
