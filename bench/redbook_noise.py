"""A bounded, self-stopping noisy neighbour on a filesystem: processes writing and reading junk files
(``kvgate bench redbook``'s third benchmark, after the Redbook's clients pushing junk traffic at the
shared storage while the workload runs).

Writers overwrite their own few files in turn (``file_mib`` each, ``fsync`` after each file), so the
space used never exceeds ``cap_mib``; readers read theirs back after evicting them from the page cache
(``POSIX_FADV_DONTNEED``), so every read reaches the disk. Every process stops at its deadline even if
nobody stops it, and runs at a lower CPU priority (``nice``): it is meant to contend for the storage, not
for the two cores the vLLM servers compute on. Bytes moved are counted, so the bandwidth it generated is
reported beside the results.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time

CHUNK = 4 << 20


def _junk(size: int) -> bytes:
    return (os.urandom(CHUNK) * (size // CHUNK + 1))[:size]


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        for off in range(0, len(data), CHUNK):
            os.write(fd, view[off : off + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def _writer(d: str, files: int, file_bytes: int, deadline: float, stop, counter, nice: int) -> None:
    os.nice(nice)
    data = _junk(file_bytes)
    i = 0
    while not stop.is_set() and time.time() < deadline:
        _write_file(os.path.join(d, f"w{i % files}.junk"), data)
        with counter.get_lock():
            counter.value += file_bytes
        i += 1


def _reader(d: str, files: int, file_bytes: int, deadline: float, stop, counter, nice: int) -> None:
    os.nice(nice)
    paths = [os.path.join(d, f"r{i}.junk") for i in range(files)]
    data = _junk(file_bytes)
    for p in paths:
        _write_file(p, data)
    del data
    buf = bytearray(CHUNK)
    i = 0
    while not stop.is_set() and time.time() < deadline:
        fd = os.open(paths[i % files], os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n = 0
            while not stop.is_set():
                k = os.readv(fd, [buf])
                if not k:
                    break
                n += k
        finally:
            os.close(fd)
        with counter.get_lock():
            counter.value += n
        i += 1


class NoisyNeighbour:
    """``with NoisyNeighbour(dir_on_the_fs, ...) as nn: ...`` then ``nn.result()``: MB/s written and read
    while it ran. Its files live in a temp directory under ``root`` and are deleted when it stops."""

    def __init__(self, root: str, writers: int = 2, readers: int = 2, file_mib: int = 64,
                 cap_mib: int = 1024, max_s: float = 900.0, nice: int = 10) -> None:
        self.root, self.writers, self.readers, self.max_s, self.nice = root, writers, readers, max_s, nice
        self.file_bytes = file_mib << 20
        per_proc = max(1, cap_mib // file_mib // max(1, writers + readers))
        self.files = per_proc
        self.cap_bytes = per_proc * (writers + readers) * self.file_bytes
        self.ctx = mp.get_context("spawn")
        self.procs: list = []

    def __enter__(self) -> "NoisyNeighbour":
        self.dir = tempfile.mkdtemp(prefix="kvgate-noise-", dir=self.root)
        self.stop_event = self.ctx.Event()
        self.written = self.ctx.Value("q", 0)
        self.read = self.ctx.Value("q", 0)
        deadline = time.time() + self.max_s
        for kind, n, fn, counter in (("w", self.writers, _writer, self.written),
                                     ("r", self.readers, _reader, self.read)):
            for i in range(n):
                d = os.path.join(self.dir, f"{kind}{i}")
                os.makedirs(d)
                p = self.ctx.Process(target=fn, daemon=True,
                                     args=(d, self.files, self.file_bytes, deadline, self.stop_event, counter,
                                           self.nice))
                p.start()
                self.procs.append(p)
        self.t0 = time.monotonic()
        self.base = (0, 0)
        return self

    def mark(self) -> None:
        """Count from now on (e.g. once the readers have written their files)."""
        self.t0, self.base = time.monotonic(), (self.written.value, self.read.value)

    def __exit__(self, *exc) -> None:
        self.elapsed = time.monotonic() - self.t0
        self.totals = (self.written.value - self.base[0], self.read.value - self.base[1])
        self.stop_event.set()
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def result(self) -> dict:
        w, r = self.totals
        return {
            "writers": self.writers,
            "readers": self.readers,
            "cap_MiB": self.cap_bytes >> 20,
            "seconds": self.elapsed,
            "write_MBps": w / self.elapsed / 1e6,
            "read_MBps": r / self.elapsed / 1e6,
            "total_MBps": (w + r) / self.elapsed / 1e6,
        }
