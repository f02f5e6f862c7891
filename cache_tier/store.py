"""The G4 store: KV blocks as files on a shared filesystem, keyed by kvgate's sequence hash.

Layout (docs/g4.md)::

    <root>/<model>-<digest16>/namespace.json         everything that changes a block's bytes
    <root>/<model>-<digest16>/ab/cd/abcd....kvb      one file per block (16 hex digits of the hash)

A block file is a fixed header, the block's token ids (little-endian u32) and the payload: the block's
KV for all layers as raw bytes in the namespace's dtype and shape. Writers write a temporary name in the
same directory and ``os.replace`` it, so readers never see a torn file and concurrent writers of the same
block (same bytes) are harmless. Readers read the whole file with one ``readinto`` into a reused buffer
and verify magic, version, the namespace digest (a block of another namespace copied here is refused,
whatever its shape), sizes, token ids and the payload's XXH3-64 checksum.

Every failure has a ``reason`` the connector counts by: a read raises :class:`BlockMissing`,
:class:`BlockTruncated`, :class:`BlockCorrupt`, :class:`BlockForeign` or :class:`BlockIOError`; a failed
write is an ``OSError`` that :func:`save_failure_reason` names (``disk_full``, ``unwritable``, ...).

Only torch, numpy, xxhash and the standard library are imported: this module runs inside vLLM's venv.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import xxhash

MAGIC = b"KVG4"
FORMAT_VERSION = 2  # 2: the header carries the namespace digest
SUFFIX = ".kvb"
# magic, version, flags, block_size, num_tokens, header_len, parent, payload_len, checksum, seq_hash,
# namespace digest
_HEADER = struct.Struct("<4sHHIIIQQQQQ")
HEADER_ALIGN = 64
_FLAG_HAS_PARENT = 1
_HEX = re.compile(r"^[0-9a-f]{16}$")
HASH_SCHEME = "kvgate-xxh3-1337-v1"


class G4Error(Exception):
    """A block could not be used; ``reason`` names why (the connector's failure counters use it)."""

    reason = "error"


class BlockMissing(G4Error):
    reason = "missing"


class BlockIOError(G4Error):
    """The file is there but could not be read (EIO, EACCES, a path component that is not a directory)."""

    reason = "io_error"


class BlockCorrupt(G4Error):
    """The file is not this block's: never to be served (callers remove it)."""

    reason = "corrupt"


class BlockTruncated(BlockCorrupt):
    reason = "truncated"


class BlockForeign(BlockCorrupt):
    """A block written under another namespace (another model, dtype, layout...) sits at this name."""

    reason = "foreign"


LOAD_FAILURE_REASONS = ("missing", "truncated", "corrupt", "foreign", "io_error", "error")
SAVE_FAILURE_REASONS = ("disk_full", "unwritable", "io_error", "error")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}


def save_failure_reason(exc: BaseException) -> str:
    """Why a block write failed, as counted by the connector (one of ``SAVE_FAILURE_REASONS``)."""
    if isinstance(exc, OSError):
        if exc.errno in _DISK_FULL:
            return "disk_full"
        if exc.errno in _UNWRITABLE:
            return "unwritable"
        return "io_error"
    return "error"


@dataclass(frozen=True)
class Namespace:
    """Everything that changes a block's bytes; blocks are shared only within one namespace."""

    model: str
    dtype: str
    block_size: int
    # Shape of one layer's slice of one block (e.g. [2, heads, block_size, head_dim]); one per layer.
    layer_shapes: tuple[tuple[int, ...], ...]
    kv_layout: str = "vllm-cpu"
    tp_rank: int = 0
    tp_size: int = 1
    hash_scheme: str = HASH_SCHEME
    format_version: int = FORMAT_VERSION

    @property
    def num_layers(self) -> int:
        return len(self.layer_shapes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    @property
    def layer_bytes(self) -> list[int]:
        item = torch.empty((), dtype=self.torch_dtype).element_size()
        return [int(np.prod(s)) * item for s in self.layer_shapes]

    @property
    def payload_bytes(self) -> int:
        return sum(self.layer_bytes)

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_shapes"] = [list(s) for s in self.layer_shapes]
        return d

    @property
    def digest(self) -> str:
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        return xxhash.xxh3_64_hexdigest(blob)

    @property
    def dirname(self) -> str:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model).strip("_")[:64] or "model"
        return f"{safe}-{self.digest}"


@dataclass
class StoreStats:
    """Counters of one store handle (one process); ``blocks``/``bytes`` are its view of the directory."""

    blocks: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    corruptions: int = 0
    writes: int = 0
    write_skips: int = 0
    evictions: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["read_bytes_per_s"] = self.read_bytes / self.read_seconds if self.read_seconds else 0.0
        d["write_bytes_per_s"] = self.write_bytes / self.write_seconds if self.write_seconds else 0.0
        return d


def hash_hex(h: int) -> str:
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"


@dataclass
class _Entry:
    size: int


class G4Store:
    """One namespace of the G4 directory: put/get blocks, LRU capacity GC, inventory scan, stats.

    Thread-safe: the connector's writer thread and its loader share one handle. The LRU order is an
    in-memory view rebuilt from file mtimes by :meth:`scan` (reads refresh mtime with ``os.utime`` when
    ``touch_on_read``), so several nodes sharing the directory converge on a common recency order.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        namespace: Namespace,
        *,
        capacity_bytes: int | None = None,
        low_watermark: float = 0.9,
        on_evict: Callable[[list[int]], None] | None = None,
        touch_on_read: bool = True,
        fsync: bool = False,
        scan: bool = True,
        read_bytes_per_s: float | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.ns = namespace
        self.dir = os.path.join(self.root, namespace.dirname)
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.on_evict = on_evict
        self.touch_on_read = touch_on_read
        self.fsync = fsync
        self.stats = StoreStats()
        self._lock = threading.RLock()
        self._lru: OrderedDict[int, _Entry] = OrderedDict()
        self._tls = threading.local()
        self._pace = _Pace(read_bytes_per_s) if read_bytes_per_s else None
        self._payload_len = namespace.payload_bytes
        self._tok_len = namespace.block_size * 4
        self._hdr_len = -(-(_HEADER.size + self._tok_len) // HEADER_ALIGN) * HEADER_ALIGN
        self.file_bytes = self._hdr_len + self._payload_len
        self._ns_id = int(namespace.digest, 16)
        # A G4 directory that cannot be written (read-only mount, full disk) still serves reads: the
        # failure is kept, and each save fails and is counted until the directory is writable again.
        self.init_error: OSError | None = None
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._write_namespace()
        except OSError as e:
            self.init_error = e
        if scan:
            self.rescan()

    # ---- paths -------------------------------------------------------------------------------------------
    def path(self, h: int) -> str:
        x = hash_hex(h)
        return os.path.join(self.dir, x[:2], x[2:4], x + SUFFIX)

    def _write_namespace(self) -> None:
        p = os.path.join(self.dir, "namespace.json")
        if os.path.exists(p):
            return
        tmp = f"{p}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.ns.to_json(), f, indent=1, sort_keys=True)
        os.replace(tmp, p)

    # ---- write -------------------------------------------------------------------------------------------
    def _header(
        self, h: int, token_ids: Sequence[int] | np.ndarray, parent: int | None, checksum: int
    ) -> bytes:
        toks = np.asarray(token_ids, dtype="<u4")
        if toks.shape != (self.ns.block_size,):
            raise ValueError(f"a block has {self.ns.block_size} token ids, got {toks.shape}")
        flags = _FLAG_HAS_PARENT if parent is not None else 0
        head = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            self.ns.block_size,
            len(toks),
            self._hdr_len,
            (parent or 0) & 0xFFFFFFFFFFFFFFFF,
            self._payload_len,
            checksum,
            h & 0xFFFFFFFFFFFFFFFF,
            self._ns_id,
        )
        return head + toks.tobytes() + b"\0" * (self._hdr_len - _HEADER.size - self._tok_len)

    @staticmethod
    def _as_bytes(payload: torch.Tensor | bytes | bytearray | memoryview) -> memoryview:
        if isinstance(payload, torch.Tensor):
            t = payload.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous().view(torch.uint8).reshape(-1)
            return memoryview(t.numpy())
        return memoryview(payload).cast("B")

    def put(
        self,
        h: int,
        token_ids: Sequence[int] | np.ndarray,
        parent: int | None,
        payload: torch.Tensor | bytes | bytearray | memoryview,
        *,
        overwrite: bool = False,
    ) -> bool:
        """Write one block atomically; returns False when it is already there (and ``overwrite`` is off)."""
        final = self.path(h)
        if not overwrite and os.path.exists(final):
            with self._lock:
                self.stats.write_skips += 1
                self._touch_lru(h, self.file_bytes)
            return False
        data = self._as_bytes(payload)
        if data.nbytes != self._payload_len:
            raise ValueError(f"payload is {data.nbytes} bytes, the namespace says {self._payload_len}")
        t0 = time.perf_counter()
        head = self._header(h, token_ids, parent, xxhash.xxh3_64_intdigest(data))
        d = os.path.dirname(final)
        if not os.path.isdir(d):
            # also when the namespace directory (or the whole G4 root) was removed under a running
            # server: recreate it with its namespace.json, which the gateway's inventory needs
            os.makedirs(d, exist_ok=True)
            self._write_namespace()
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            n = os.writev(fd, [head, data])
            if n != len(head) + data.nbytes:  # short write (rare, or a disk filling up): finish it
                rest = (head + bytes(data))[n:]
                while rest:
                    rest = rest[os.write(fd, rest) :]
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _unlink(tmp)
            raise
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.writes += 1
            self.stats.write_bytes += self.file_bytes
            self.stats.write_seconds += dt
            self._touch_lru(h, self.file_bytes)
        self.maybe_gc()
        return True

    # ---- read --------------------------------------------------------------------------------------------
    def _buffer(self) -> tuple[bytearray, memoryview]:
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = bytearray(self.file_bytes)
            self._tls.buf = buf
            self._tls.view = memoryview(buf)
        return buf, self._tls.view

    def contains(self, h: int) -> bool:
        return os.path.exists(self.path(h))

    def read(self, h: int, token_ids: Sequence[int] | np.ndarray | None = None) -> torch.Tensor:
        """The block's payload as a uint8 tensor over a per-thread buffer (valid until the next read).

        Raises :class:`BlockMissing` or :class:`BlockCorrupt` (also when ``token_ids`` differ)."""
        p = self.path(h)
        buf, view = self._buffer()
        t0 = time.perf_counter()
        try:
            with open(p, "rb", buffering=0) as f:
                # one read(2) may return less than asked (FUSE and network mounts, a signal): read to the
                # end, or a whole block would be taken for a truncated one and removed
                n = 0
                while n < len(buf) and (k := f.readinto(view[n:])):
                    n += k
                extra = f.read(1) if n == len(buf) else b""
        except FileNotFoundError:
            with self._lock:
                self.stats.misses += 1
                self._forget(h)
            raise BlockMissing(hash_hex(h)) from None
        except OSError as e:
            raise BlockIOError(f"{hash_hex(h)}: {e}") from e
        if self._pace is not None:
            self._pace.wait(n)
        try:
            self._verify(h, view, n, bool(extra), token_ids)
        except BlockCorrupt:
            with self._lock:
                self.stats.corruptions += 1
            raise
        dt = time.perf_counter() - t0
        if self.touch_on_read:
            try:
                os.utime(p)
            except OSError:
                pass
        with self._lock:
            self.stats.hits += 1
            self.stats.read_bytes += n
            self.stats.read_seconds += dt
            self._touch_lru(h, n)
        return torch.frombuffer(buf, dtype=torch.uint8, offset=self._hdr_len, count=self._payload_len)

    def read_block(self, h: int) -> tuple[np.ndarray, torch.Tensor]:
        """``(token ids, payload)`` of a verified block; the payload views the per-thread buffer."""
        payload = self.read(h)
        toks = np.frombuffer(self._tls.buf, dtype="<u4", count=self.ns.block_size, offset=_HEADER.size).copy()
        return toks, payload

    def _verify(
        self, h: int, view: memoryview, n: int, trailing: bool, token_ids: Sequence[int] | np.ndarray | None
    ) -> None:
        # the namespace is checked before the sizes: another model's block may have other sizes
        if n < _HEADER.size:
            raise BlockTruncated(f"{hash_hex(h)}: {n} bytes, shorter than a header")
        magic, ver, _flags, bs, ntok, hlen, _parent, plen, csum, sh, ns_id = _HEADER.unpack_from(view, 0)
        if magic != MAGIC or ver != FORMAT_VERSION:
            raise BlockCorrupt(f"{hash_hex(h)}: bad magic/version {magic!r}/{ver}")
        if ns_id != self._ns_id:
            raise BlockForeign(f"{hash_hex(h)}: written under namespace {ns_id:016x}, not {self.ns.digest}")
        if bs != self.ns.block_size or ntok != bs or hlen != self._hdr_len or plen != self._payload_len:
            raise BlockCorrupt(f"{hash_hex(h)}: header does not match the namespace")
        if n < hlen + plen:
            raise BlockTruncated(f"{hash_hex(h)}: truncated ({n} of {hlen + plen} bytes)")
        if trailing:
            raise BlockCorrupt(f"{hash_hex(h)}: longer than {hlen + plen} bytes")
        if sh != h & 0xFFFFFFFFFFFFFFFF:
            raise BlockCorrupt(f"{hash_hex(h)}: file holds block {sh:016x}")
        if xxhash.xxh3_64_intdigest(view[hlen : hlen + plen]) != csum:
            raise BlockCorrupt(f"{hash_hex(h)}: checksum mismatch")
        if token_ids is not None:
            want = np.asarray(token_ids, dtype="<u4")
            got = np.frombuffer(view, dtype="<u4", count=ntok, offset=_HEADER.size)
            if want.shape != got.shape or not np.array_equal(want, got):
                raise BlockCorrupt(f"{hash_hex(h)}: token ids differ")

    def header(self, h: int) -> dict:
        """Decoded header of one block file (for tools and tests)."""
        with open(self.path(h), "rb") as f:
            raw = f.read(self._hdr_len)
        magic, ver, flags, bs, ntok, _hlen, parent, plen, csum, sh, ns_id = _HEADER.unpack_from(raw, 0)
        toks = np.frombuffer(raw, dtype="<u4", count=ntok, offset=_HEADER.size).tolist()
        return {
            "magic": magic,
            "version": ver,
            "block_size": bs,
            "token_ids": toks,
            "parent": parent if flags & _FLAG_HAS_PARENT else None,
            "payload_len": plen,
            "checksum": csum,
            "hash": sh,
            "namespace": f"{ns_id:016x}",
        }

    def get_layers(self, h: int, token_ids=None) -> list[torch.Tensor]:
        """The block as one tensor per layer (views over the read buffer, in the namespace's dtype)."""
        raw = self.read(h, token_ids)
        out, off = [], 0
        for shape, nb in zip(self.ns.layer_shapes, self.ns.layer_bytes):
            out.append(raw[off : off + nb].view(self.ns.torch_dtype).view(shape))
            off += nb
        return out

    def remove(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            n += _unlink(self.path(h))
            with self._lock:
                self._forget(h)
        return n

    def _forget(self, h: int) -> None:
        e = self._lru.pop(h, None)
        if e is not None:
            self.stats.blocks -= 1
            self.stats.bytes -= e.size

    # ---- LRU + GC ----------------------------------------------------------------------------------------
    # Hand-written, not cachetools: eviction runs in batches down to a low watermark and unlinks the files
    # outside the lock, and rescan() rebuilds the order from file times; cachetools evicts one per insert.
    def _touch_lru(self, h: int, size: int) -> None:
        e = self._lru.get(h)
        if e is None:
            self._lru[h] = _Entry(size)
            self.stats.blocks += 1
            self.stats.bytes += size
        else:
            self._lru.move_to_end(h)

    def maybe_gc(self) -> list[int]:
        if self.capacity_bytes is None or self.stats.bytes <= self.capacity_bytes:
            return []
        return self.gc()

    def gc(self, target_bytes: int | None = None) -> list[int]:
        """Evict least recently used blocks until the store is under ``target_bytes`` (default: the low
        watermark of the capacity); returns the evicted hashes and reports them to ``on_evict``."""
        if target_bytes is None:
            if self.capacity_bytes is None:
                return []
            target_bytes = int(self.capacity_bytes * self.low_watermark)
        evicted: list[int] = []
        with self._lock:
            while self._lru and self.stats.bytes > target_bytes:
                h, e = self._lru.popitem(last=False)
                self.stats.blocks -= 1
                self.stats.bytes -= e.size
                evicted.append(h)
            self.stats.evictions += len(evicted)
        for h in evicted:
            _unlink(self.path(h))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return evicted

    # ---- inventory ---------------------------------------------------------------------------------------
    def scan(self) -> Iterator[tuple[int, int, float]]:
        """Yield ``(hash, size, mtime)`` of every block file in the namespace (stale temp files skipped)."""
        for d1 in _listdir(self.dir):
            if len(d1) != 2:
                continue
            p1 = os.path.join(self.dir, d1)
            for d2 in _listdir(p1):
                p2 = os.path.join(p1, d2)
                try:
                    it = os.scandir(p2)
                except (NotADirectoryError, FileNotFoundError):
                    continue
                with it:
                    for ent in it:
                        name = ent.name
                        if not name.endswith(SUFFIX) or not _HEX.match(name[: -len(SUFFIX)]):
                            continue
                        try:
                            st = ent.stat()
                        except FileNotFoundError:
                            continue
                        yield int(name[:16], 16), st.st_size, st.st_mtime

    def hashes(self) -> Iterator[int]:
        """Every block hash in the store (the index rebuild after a restart uses this)."""
        for h, _, _ in self.scan():
            yield h

    def rescan(self) -> int:
        """Rebuild the LRU view from the directory (oldest mtime first); returns the block count."""
        items = sorted(self.scan(), key=lambda t: t[2])
        with self._lock:
            self._lru = OrderedDict((h, _Entry(size)) for h, size, _ in items)
            self.stats.blocks = len(self._lru)
            self.stats.bytes = sum(e.size for e in self._lru.values())
        return self.stats.blocks

    def snapshot(self) -> dict:
        with self._lock:
            d = self.stats.as_dict()
        d["capacity_bytes"] = self.capacity_bytes
        d["namespace"] = self.ns.dirname
        return d


class _Pace:
    """Caps one handle's read bandwidth, all threads together: each read takes the next slot of
    ``bytes / rate`` seconds and sleeps until its slot ends. It emulates a slow or contended shared
    filesystem (the ``read_bytes_per_s`` option) in benchmarks on a machine whose local disk and page
    cache are far faster than a shared G4 mount."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = float(bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0

    def wait(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            end = max(now, self._free_at) + nbytes / self.rate
            self._free_at = end
        time.sleep(max(0.0, end - now))


def _listdir(p: str) -> list[str]:
    try:
        return os.listdir(p)
    except (NotADirectoryError, FileNotFoundError):
        return []


def _unlink(p: str) -> int:
    """1 if ``p`` was removed; 0 if it was not there or cannot be removed (a read-only G4 directory:
    a bad block left there is refused again by the next read, never served)."""
    try:
        os.unlink(p)
        return 1
    except OSError:
        return 0


def open_namespaces(root: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """Every namespace under a G4 root: ``(directory, namespace.json contents)``."""
    for name in _listdir(os.fspath(root)):
        p = os.path.join(os.fspath(root), name, "namespace.json")
        try:
            with open(p) as f:
                yield os.path.join(os.fspath(root), name), json.load(f)
        except (OSError, ValueError):
            continue


def store_for_dir(ns_dir: str, **kw) -> G4Store:
    """Open an existing namespace directory (e.g. from the gateway's inventory hook)."""
    with open(os.path.join(ns_dir, "namespace.json")) as f:
        d = json.load(f)
    d["layer_shapes"] = tuple(tuple(s) for s in d["layer_shapes"])
    ns = Namespace(**d)
    return G4Store(os.path.dirname(ns_dir), ns, **kw)


class PresenceCache:
    """Which blocks were recently seen on G4, so the scheduler does not ``stat`` every block of every
    prompt on a slow shared filesystem. Bounded (LRU) with a time-to-live: a block evicted by another node
    in the meantime is caught by the load (reported and recomputed), never served wrong.

    Hand-written rather than cachetools' ``TTLCache``: it is asked once per block of every waiting prompt
    in vLLM's scheduler loop, where ``TTLCache`` measured 3.3x slower (``python -m bench.bench_caches``,
    docs/BENCHMARKS.md "Caches")."""

    def __init__(self, store: G4Store, ttl_s: float = 30.0, max_entries: int = 200_000) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._seen: OrderedDict[int, float] = OrderedDict()
        self.stats_calls = 0

    def add(self, h: int) -> None:
        self._seen[h] = time.monotonic() + self.ttl_s
        self._seen.move_to_end(h)
        if len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)

    def discard(self, h: int) -> None:
        self._seen.pop(h, None)

    def contains(self, h: int) -> bool:
        exp = self._seen.get(h)
        if exp is not None and exp > time.monotonic():
            return True
        self.stats_calls += 1
        if self.store.contains(h):
            self.add(h)
            return True
        self._seen.pop(h, None)
        return False
