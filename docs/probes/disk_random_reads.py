"""How many small random reads a second this machine's disk gives when they are not in the page cache: the bound
under a cold lazy resume's first token (issue 44), which reads ~1,000 unit frames of ~4.4 KB a layer, one layer
after another. A file of random bytes is written, pushed out of the page cache (storage.pagecache.evict), then read
at 20,000 random places, 4,400 bytes each, in four ways, the file evicted again before each:

- preads on 1, 8 and 32 threads (each thread its share, one after another), as a lazy resume's reader threads
  read what the page cache does not hold;
- the file memory-mapped, every range asked for ahead (`madvise(MADV_WILLNEED)`), then the bytes copied out of the
  map (a variant of the reader tried and dropped, 2026-11-28; the copies hold the GIL, so the 32 threads copy one
  at a time: in effect one copying thread behind the read-ahead).

    python docs/probes/disk_random_reads.py [--dir /tmp] [--mib 2048] [--reads 20000]

Prints reads a second and MB/s for each.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from kvchat.storage.pagecache import evict

SIZE = 4400  # a unit frame's compressed bytes at the 8B shape (~145 MB / 33,452 frames)


def preads(path: Path, places: list[int], threads: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        shares = np.array_split(np.asarray(places), threads)

        def read(share) -> None:
            for at in share.tolist():
                os.pread(fd, SIZE, at)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, shares))
    finally:
        os.close(fd)


def mapped(path: Path, places: list[int], threads: int) -> None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        m.madvise(mmap.MADV_RANDOM)
        for at in places:
            begin = at // mmap.PAGESIZE * mmap.PAGESIZE
            m.madvise(mmap.MADV_WILLNEED, begin, at + SIZE - begin)
        shares = np.array_split(np.asarray(places), threads)

        def read(share) -> None:
            for at in share.tolist():
                m[at : at + SIZE]

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, shares))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--mib", type=int, default=2048, help="the file's size, a multiple of 16")
    parser.add_argument("--reads", type=int, default=20000)
    args = parser.parse_args()
    if args.mib % 16 or args.mib < 16:
        parser.error("--mib must be a multiple of 16")
    path = args.dir / "disk-random-reads.bin"
    block = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(args.mib // 16):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    places = np.random.default_rng(1).integers(0, args.mib * (1 << 20) - SIZE, args.reads).tolist()
    try:
        for name, how, threads in [("pread", preads, 1), ("pread", preads, 8), ("pread", preads, 32),
                                   ("mmap + WILLNEED", mapped, 32)]:
            if not evict([path]):
                print("the page cache could not be dropped: these reads are not cold")
            t0 = time.perf_counter()
            how(path, places, threads)
            took = time.perf_counter() - t0
            print(f"{name}, {threads} threads: {args.reads / took:,.0f} reads/s, "
                  f"{args.reads * SIZE / took / 1e6:,.0f} MB/s ({took:.2f} s)")
    finally:
        path.unlink()


if __name__ == "__main__":
    main()
