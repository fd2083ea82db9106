"""How much of a file the OS page cache holds: a warm file reads at memory speed, a cold one at the disk's.

The restore planner weighs each segment's bytes by this (reading a chat just written, or opened a minute ago,
costs little; after a reboot every byte comes from the disk). mincore(2) on a private read mapping of the file
answers per page without reading anything. Where the call is missing (not Linux or macOS), files count as cold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

_PAGE = mmap.PAGESIZE
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore sets bit 0 of a page's byte when it is resident
SAMPLES, WINDOW_PAGES = 8, 32
_libc = None


def _mincore():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
            _libc.mincore.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    return _libc.mincore if _libc else None


def resident_fraction(path: Path, samples: int = SAMPLES, window: int = WINDOW_PAGES) -> float:
    """The share (0..1) of the file's pages in the page cache; 0.0 when it cannot be told (or the file is gone:
    the restore finds that out for itself). A large file is judged by `samples` evenly spaced windows of `window`
    pages: the kernel looks each page up (~16 ns), and a 32k chat's ~200 files, looked at whole, took the restore
    30-50 ms before anything else could start."""
    mincore = _mincore()
    if mincore is None:
        return 0.0
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 1.0
            # A private (copy-on-write) mapping is writable to ctypes, so its address can be taken; nothing is
            # written, so no page is copied and residency is the file's own.
            with mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
                pages = (size + _PAGE - 1) // _PAGE
                # The temporary ctypes view is dropped at once (an exported buffer would keep the mapping open).
                addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
                return _resident_pages(mincore, addr, pages, size, samples, window)
    except (OSError, ValueError, BufferError):
        return 0.0


def _resident_pages(mincore, addr: int, pages: int, size: int, samples: int, window: int) -> float:
    if pages <= samples * window:
        spans = [(0, pages)]
    else:
        step = (pages - window) / (samples - 1)
        spans = [(round(i * step), window) for i in range(samples)]
    vec = (ctypes.c_ubyte * max(n for _, n in spans))()
    resident = looked = 0
    for first, n in spans:
        length = min(n * _PAGE, size - first * _PAGE)
        if mincore(ctypes.c_void_p(addr + first * _PAGE), ctypes.c_size_t(length), vec) != 0:
            return 0.0
        resident += bytes(vec)[:n].translate(_LOW_BIT).count(1)
        looked += n
    return resident / looked


def evict(paths: list[Path]) -> bool:
    """Push files out of the page cache (flushed first), so the next read comes from the disk: a cold read.
    posix_fadvise needs no root and leaves the rest of the cache alone. False where the OS has no such call."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def disk_bytes_read() -> int | None:
    """Bytes this process (all its threads) has had read from storage so far, the kernel's own count: what reached
    the disk, whole pages and the kernel's read-ahead included, not what was asked for; page-cache hits count
    nothing. None where the OS keeps no such count (/proc/self/io: Linux with task I/O accounting)."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
