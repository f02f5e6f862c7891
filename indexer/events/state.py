"""Per-worker event state: vLLM's engine block hashes mapped onto kvgate's sequence hashes.

vLLM's hashes are opaque handles (their algorithm, PYTHONHASHSEED and LoRA paths vary); ``BlockStored``
carries each block's token ids and its parent's handle, so the state recomputes kvgate's chained hash
(``indexer.hashing``) and remembers ``(group, engine hash) -> kvgate hash``, which ``BlockRemoved`` needs.

Reference counting (vllm-interface.md 1.5): vLLM may cache the same content in two physical blocks and
announce it twice; evicting one copy sends one ``BlockRemoved``. So every (group, engine hash, tier) has a
count, and the index entry (worker, tier, kvgate hash) goes only when no handle holds it any more.

Seed rule (matches vLLM's extra keys): the LoRA name salts every block; the ``cache_salt`` -- the plain
string in ``extra_keys`` of *absolute* block 0 (parent None, first hash) that is not the LoRA name --
salts block 0 only, and the chain carries it on. Multimodal identifiers are not part of kvgate's key.

``apply(events)`` returns index operations coalesced per event batch (the last operation on a
(tier, hash) wins), so one batch costs one write per tier.

STORAGE blocks (G4) carry a *scope*: vLLM's offloading connector says where its secondary tier's storage
is relative to the publishing instance (``locality``, vllm/v1/kv_offload/base.py ``Locality``): ``REMOTE``
(a shared filesystem other instances mount too) and no locality (kvgate's connector, whose store is
shared) give scope ``None`` -- the tier the worker mounts, credited to every worker of the model that
mounts it; ``LOCAL`` gives scope ``"LOCAL"`` -- credited to the publishing worker only. Which index entry
a scope becomes is the ingestor's business (it knows the worker's tier). Another locality is counted
(``bad_locality``) and the event dropped. vLLM's engine hashes of STORAGE blocks resolve to kvgate's
through the handles the worker's GPU events left (its offload events carry no extra keys, so a known
handle is preferred to recomputing: it keeps the cache_salt), else through the parent and token ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cachetools import LRUCache

from indexer import hashing
from indexer.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from indexer.index.base import Tier

G4 = "G4"
# BlockRemoved(medium="STORAGE") with this ownership comes from kvgate's connector when the G4 store's GC
# evicts blocks; its block_hashes are kvgate sequence hashes already (docs/g4.md).
G4_OWNERSHIP = "kvgate-g4"
ACCEPTED_KINDS = frozenset({None, "full_attention", "mla_attention"})
LOCAL = "LOCAL"  # scope of a STORAGE block on the publishing worker's own storage
# vLLM's locality (any case) -> scope: None = the shared tier the worker mounts, LOCAL = its own.
_LOCALITIES = {None: None, "REMOTE": None, "LOCAL": LOCAL}
_BAD = object()
_UNTRACKED = object()  # scope of a STORAGE handle whose tier sends no removals (no locality)
STORAGE_HANDLES = 100_000  # STORAGE handles a source remembers (the default of WorkerState's bound)


def storage_scope(locality):
    """None (shared: REMOTE or no locality), ``LOCAL``, or ``_BAD`` for a locality vLLM does not define."""
    if locality is None:
        return None
    if isinstance(locality, str):
        scope = _LOCALITIES.get(locality.upper(), _BAD)
        return scope
    return _BAD


_SHARED_PREFIX, _LOCAL_PREFIX = "#g4:", "#g4-local:"


def shared_g4_member(tier: str) -> str:
    """The index entry (a pseudo-worker, tier GPU) of the blocks on the shared G4 tier ``tier`` other
    than the model-wide one: a lookup gives its leading run with the workers' in the same round trip."""
    return _SHARED_PREFIX + tier


def local_g4_member(worker: str) -> str:
    """The index entry (a pseudo-worker, tier GPU) of the blocks on ``worker``'s own (LOCAL) storage."""
    return _LOCAL_PREFIX + worker


def entries_per_tier(model_stats: dict) -> dict[str, int]:
    """A model's index entries per tier (from ``BlockIndex.stats``) with the G4 pseudo-workers' entries
    counted as ``G4_TIER`` (named shared tiers) and ``G4_LOCAL`` instead of GPU."""
    out = dict(model_stats.get("entries_per_tier") or {})
    for name, tiers in (model_stats.get("workers") or {}).items():
        kind = ("G4_LOCAL" if name.startswith(_LOCAL_PREFIX)
                else "G4_TIER" if name.startswith(_SHARED_PREFIX) else None)
        if kind is not None:
            n = sum(int(v) for v in tiers.values())
            out["GPU"] = out.get("GPU", 0) - n
            out[kind] = out.get(kind, 0) + n
    return out


class _StorageLRU(LRUCache):
    """The STORAGE handles, least recently used first out; what it evicts is kept in ``evicted`` so its
    index entry goes too: a later BlockRemoved for it would find nothing, and the entry would stay for
    good (losing a hit is safe, a phantom is not)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize=maxsize)
        self.evicted: list = []

    def popitem(self):
        key, value = super().popitem()
        self.evicted.append(value)
        return key, value


@dataclass(slots=True)
class Ops:
    """Index writes for one batch, in order: ``("store"|"remove", Tier, hashes)``, ``("g4"|"g4_remove",
    scope, hashes)`` (scope None: the shared tier, ``LOCAL``: the worker's own storage), ``("clear", None,
    None)`` (drop the worker's local tiers)."""

    items: list[tuple[str, Tier | None, list[int] | None]] = field(default_factory=list)


_MASK64 = (1 << 64) - 1
_COUNT_SHIFT = (64, 96)  # a handle's count of copies on GPU, on CPU: 32 bits each above its kvgate hash
_COUNT_MASK = (1 << 32) - 1


def _pack(rh: int, gpu: int, cpu: int) -> int:
    """A handle as one int: its kvgate hash and its counts of copies on GPU and on CPU."""
    return rh | gpu << _COUNT_SHIFT[0] | cpu << _COUNT_SHIFT[1]


def _unpack(h: int) -> tuple[int, int, int]:
    """(kvgate hash, count on GPU, count on CPU) of a packed handle."""
    return h & _MASK64, (h >> _COUNT_SHIFT[0]) & _COUNT_MASK, h >> _COUNT_SHIFT[1]


_TIERS = (Tier.GPU, Tier.CPU)  # tier codes 0 and 1 (ints: cheaper dict keys than the enum)
# vLLM's ``medium`` of a BlockStored/BlockRemoved -> tier code (an index into _TIERS), or G4 for STORAGE.
# The one place this mapping is written; a medium not here (any case) is not indexed.
_MEDIUMS = {None: 0, "GPU": 0, "CPU": 1, "CPU_TIER": 1, "STORAGE": G4}


def medium_code(medium: str | None) -> int | str | None:
    """0 (GPU, also for a missing medium), 1 (CPU), ``G4`` (STORAGE), None for a medium kvgate does not index."""
    code = _MEDIUMS.get(medium)
    if code is None and isinstance(medium, str):
        code = _MEDIUMS.get(medium.upper())
    return code


def cache_salt_of(extra_keys: list | None, lora_name: str | None) -> str | None:
    """The cache_salt in block 0's extra keys: a plain string that is not the LoRA name."""
    if not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    salt = None
    lora_seen = False
    for k in first:
        if isinstance(k, str):
            if lora_name and not lora_seen and k == lora_name:
                lora_seen = True
                continue
            salt = k
    return salt


# A presence change within a batch: (present before) << 1 | (present now), a small int (no allocation: a
# tuple per new block was what set off the cyclic GC most in a 16-worker replay, py-spy).
_GONE, _NEW = 0b10, 0b01


def _touch(changes: dict[int, int], rh: int, on: bool) -> None:
    """Record a presence change; the first touch also tells the presence before the batch."""
    prev = changes.get(rh)
    changes[rh] = ((not on) if prev is None else prev >> 1) << 1 | on


def _key(group: int, eh: int):
    """Handle key: the engine hash alone for group 0 (the common case, no tuple), else (group, hash)."""
    return eh if group == 0 else (group, eh)


class WorkerState:
    """State of one event source (one worker, one data-parallel rank).

    ``_handles``: handle key -> kvgate hash | count on GPU << 64 | count on CPU << 96, one int (:func:`_unpack`).
    Why not a list per handle: a 16-worker simulator replay holds about a million handles, and a million
    lists the cyclic GC walks at every full collection while the handles churn; ints it never looks at
    (a micro-benchmark of that churn: 2.3x faster);
    ``_held[code]``: kvgate hash -> number of handles holding it on that tier (an index entry exists
    while it is > 0).
    """

    def __init__(self, block_size: int | None = None, storage_handles: int | None = None) -> None:
        self.block_size = block_size
        self._handles: dict = {}
        self._held: tuple[dict[int, int], dict[int, int]] = ({}, {})
        storage_handles = STORAGE_HANDLES if storage_handles is None else storage_handles
        # STORAGE blocks: handle key -> [kvgate hash, announcements, scope]. vLLM's fs tier never removes;
        # other offload tiers do (refcounted: a chunk re-announces shared hashes). Later events chain from
        # them. Bounded: an evicted handle's entry is removed (_StorageLRU).
        self._storage: _StorageLRU = _StorageLRU(storage_handles)
        # Handles whose last GPU/CPU copy went (handle key -> kvgate hash), bounded: an offload tier may
        # finish storing a block after the engine evicted it (fs behind the CPU tier), and its event's
        # parent is then only known from here.
        self._gone: LRUCache = LRUCache(maxsize=storage_handles)
        self.counters = {"unknown_parent": 0, "size_mismatch": 0, "unmapped": 0, "skipped": 0,
                         "malformed": 0, "bad_locality": 0, "storage_evicted": 0}
        self._changed: set = set()  # handle keys changed since take_changes (the index keeps the map too)

    def __len__(self) -> int:
        return len(self._handles)

    def held(self, tier: Tier) -> list[int]:
        """kvgate hashes the worker holds on ``tier`` (what the index should hold for it)."""
        return list(self._held[_TIERS.index(Tier(tier))])

    def reset(self) -> None:
        """Forget everything but the G4 handles (the worker restarted or the index was cleared)."""
        self._handles.clear()
        self._gone.clear()
        for held in self._held:
            held.clear()
        self._changed.clear()

    # -- the handle map as the index keeps it: (group, engine hash) -> (kvgate hash, GPU count, CPU count) --
    @staticmethod
    def _norm(key) -> tuple[int, int]:
        return key if isinstance(key, tuple) else (0, key)

    def take_changes(self) -> tuple[dict, list]:
        """(upserts, deletes) of the handle map since the last call."""
        ups, dels = {}, []
        for key in self._changed:
            h = self._handles.get(key)
            if h is None:
                dels.append(self._norm(key))
            else:
                ups[self._norm(key)] = _unpack(h)
        self._changed.clear()
        return ups, dels

    def export(self) -> dict:
        """The whole handle map (what a new writer pushes)."""
        self._changed.clear()
        return {self._norm(k): _unpack(h) for k, h in self._handles.items()}

    def adopt(self, handles: dict) -> None:
        """Take over a handle map saved by another gateway (replaces the local tiers' state)."""
        self.reset()
        for (g, eh), (rh, gpu, cpu) in handles.items():
            if gpu <= 0 and cpu <= 0:
                continue
            self._handles[_key(g, eh)] = _pack(rh, max(0, gpu), max(0, cpu))
            for code, c in ((0, gpu), (1, cpu)):
                if c > 0:
                    self._held[code][rh] = self._held[code].get(rh, 0) + 1

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _rh(self, key) -> int | None:
        h = self._handles.get(key)
        if h is not None:
            return h & _MASK64
        st = self._storage.get(key)
        return self._gone.get(key) if st is None else st[0]

    def _remember_storage(self, key, rh: int, scope) -> None:
        st = self._storage.get(key)
        if st is None or st[0] != rh:
            self._storage[key] = [rh, 1, scope]
        else:
            st[1] += 1

    def _forget_storage(self, key) -> int | None:
        """One removal announcement of a STORAGE handle: its kvgate hash once no announcement holds it."""
        st = self._storage.get(key)
        if st is None:
            return None
        st[1] -= 1
        if st[1] > 0:
            return None
        del self._storage[key]
        return st[0]

    def _incr_all(self, keys, rhs, code: int, pending: dict[int, int]) -> None:
        """One more copy on tier ``code`` of each handle (a handle already mapped keeps its kvgate hash), in
        one loop per stored event. Why: at ~700 blocks per request (a 16-worker simulator replay) a call per
        block was most of the event loop's ingestion time (cProfile: 2.0 of 4.3 us per stored block)."""
        handles = self._handles
        get = handles.get
        held = self._held[code]
        shift = _COUNT_SHIFT[code]
        one = 1 << shift
        self._changed.update(keys)
        for key, rh in zip(keys, rhs):
            h = get(key)
            h = (rh if h is None else h) + one
            handles[key] = h
            if (h >> shift) & _COUNT_MASK == 1:
                rh = h & _MASK64
                n = held.get(rh, 0) + 1
                held[rh] = n
                if n == 1:  # _touch(pending, rh, True)
                    prev = pending.get(rh)
                    pending[rh] = _NEW if prev is None else (prev & 0b10) | 1

    def _decr(self, key, code: int, pending: dict[int, int]) -> None:
        h = self._handles.get(key)
        shift = _COUNT_SHIFT[code]
        if h is None or not (h >> shift) & _COUNT_MASK:
            return
        self._changed.add(key)
        h -= 1 << shift
        rh = h & _MASK64
        if not (h >> shift) & _COUNT_MASK:
            held = self._held[code]
            n = held.get(rh, 1) - 1
            if n <= 0:
                held.pop(rh, None)
                _touch(pending, rh, False)
            else:
                held[rh] = n
            if not h >> 64:  # no copy left on either tier
                del self._handles[key]
                self._gone[key] = rh
                return
        self._handles[key] = h

    # -- events -----------------------------------------------------------------------------------------
    def apply(self, events: list[Event]) -> Ops:
        ops = Ops()
        pending: tuple[dict, dict] = ({}, {})  # per tier code: kvgate hash -> present before << 1 | now
        g4: dict = {}  # scope -> kvgate hashes stored on G4 (in order)
        for ev in events:
            if isinstance(ev, BlockStored):
                try:
                    self._stored(ev, pending, g4)
                except (TypeError, ValueError, OverflowError):
                    self.counters["malformed"] += 1
            elif isinstance(ev, BlockRemoved):
                code = medium_code(ev.medium)
                if code is None:
                    self.counters["skipped"] += 1
                    continue
                if code == G4:
                    self._storage_removed(ev, ops, pending, g4)
                    continue
                g = ev.group_idx
                for eh in ev.block_hashes:
                    self._decr(_key(g, eh), code, pending[code])
            elif isinstance(ev, AllBlocksCleared):
                self._flush(ops, pending, g4)
                self.reset()
                ops.items.append(("clear", None, None))
            if self._storage.evicted:
                self._storage_evicted(ops, pending, g4)
        self._flush(ops, pending, g4)
        return ops

    def _storage_evicted(self, ops: Ops, pending: tuple[dict, dict], g4: dict) -> None:
        """Remove the entries of the STORAGE handles the bound evicted, after what the batch wrote so far;
        not those of a tier that never removes (its files stay: nothing to keep track of)."""
        gone: dict = {}
        for rh, _, scope in self._storage.evicted:
            if scope is not _UNTRACKED:
                gone.setdefault(scope, []).append(rh)
        self._storage.evicted.clear()
        self.counters["storage_evicted"] += sum(map(len, gone.values()))
        if gone:
            self._flush(ops, pending, g4)
            for scope, rhs in gone.items():
                ops.items.append(("g4_remove", scope, list(dict.fromkeys(rhs))))

    def _storage_removed(self, ev: BlockRemoved, ops: Ops, pending: tuple[dict, dict], g4: dict) -> None:
        """kvgate's G4 GC (kvgate hashes) or an eviction from one of vLLM's offload tiers (engine hashes,
        with a locality); a STORAGE removal without either names nothing kvgate can place."""
        if ev.ownership == G4_OWNERSHIP:
            if ev.block_hashes:
                self._flush(ops, pending, g4)
                gone = [h & _MASK64 for h in ev.block_hashes if isinstance(h, int)]
                ops.items.append(("g4_remove", None, gone))
            return
        scope = storage_scope(ev.locality)
        if scope is _BAD:
            self.counters["bad_locality"] += 1
            return
        if ev.locality is None:
            return
        keys = [_key(ev.group_idx, eh) for eh in ev.block_hashes]
        gone = [rh for rh in map(self._forget_storage, keys) if rh is not None]
        if gone:
            self._flush(ops, pending, g4)
            ops.items.append(("g4_remove", scope, gone))

    @staticmethod
    def _flush(ops: Ops, pending: tuple[dict, dict], g4: dict) -> None:
        for code, changes in enumerate(pending):
            if changes:
                gone = [h for h, v in changes.items() if v == _GONE]
                new = [h for h, v in changes.items() if v == _NEW]
                if gone:
                    ops.items.append(("remove", _TIERS[code], gone))
                if new:
                    ops.items.append(("store", _TIERS[code], new))
                changes.clear()
        for scope, hashes in g4.items():
            if hashes:
                ops.items.append(("g4", scope, list(dict.fromkeys(hashes))))
        g4.clear()

    def _stored(self, ev: BlockStored, pending: tuple[dict, dict], g4: dict) -> None:
        code = medium_code(ev.medium)
        if code is None or ev.kv_cache_spec_kind not in ACCEPTED_KINDS:
            self.counters["skipped"] += 1
            return
        g = ev.group_idx
        if code == G4:
            scope = storage_scope(ev.locality)
            if scope is _BAD:
                self.counters["bad_locality"] += 1
                return
            out = g4.setdefault(scope, [])
            # removals come only with a locality (_storage_removed)
            tracked = scope if ev.locality is not None else _UNTRACKED
            for eh, rh in zip(ev.block_hashes, self._storage_hashes(ev, g)):
                if rh is not None:
                    out.append(rh)
                    self._remember_storage(_key(g, eh), rh, tracked)
            return
        if code or not ev.token_ids:
            # an offload (CPU) copy or a placeholder: the handles the blocks had first, as for STORAGE
            # (vLLM's offload events carry no extra keys: recomputed, block 0 lost its cache_salt and the
            # chain after it was another tenant's, found by a review; a placeholder places only those)
            keys, rhs = [], []
            for eh, rh in zip(ev.block_hashes, self._storage_hashes(ev, g)):
                if rh is not None:
                    keys.append(_key(g, eh))
                    rhs.append(rh)
            if keys:
                self._incr_all(keys, rhs, code, pending[code])
            return
        rhs = self._computed(ev, g)
        if rhs is None:
            return
        keys = ev.block_hashes if g == 0 else [(g, eh) for eh in ev.block_hashes]
        self._incr_all(keys, rhs, code, pending[code])

    def _computed(self, ev: BlockStored, g: int) -> list[int] | None:
        """kvgate's hashes of a self-describing event's blocks, from its parent's handle and token ids;
        None (counted) when its shape or parent does not fit."""
        bs = ev.block_size
        if self.block_size is None and bs > 0:
            self.block_size = bs
        n = len(ev.block_hashes)
        if bs != self.block_size or n == 0 or len(ev.token_ids) != n * bs:
            self.counters["size_mismatch"] += 1
            return None
        if ev.parent_block_hash is None:
            parent = None
            salt = cache_salt_of(ev.extra_keys, ev.lora_name)
        else:
            parent = self._rh(_key(g, ev.parent_block_hash))
            if parent is None:
                self.counters["unknown_parent"] += 1
                return None
            salt = None
        return hashing.chain(hashing.local_hashes(ev.token_ids, bs, ev.lora_name, salt), parent)

    def _storage_hashes(self, ev: BlockStored, g: int) -> list[int | None]:
        """kvgate's hashes of a STORAGE event's blocks (None for a placeholder's unknown ones): the
        worker's known handles first (vLLM's offload events carry no extra keys, so recomputing block 0
        would lose its cache_salt), else computed from the parent and the token ids."""
        known = [self._rh(_key(g, eh)) for eh in ev.block_hashes]
        if all(rh is not None for rh in known):
            return known
        if not ev.token_ids:  # offload placeholder: only hashes we already know can be placed
            self.counters["unmapped"] += sum(rh is None for rh in known)
            return known
        rhs = self._computed(ev, g)
        if rhs is None:  # counted; the blocks whose handles are known still place
            return known
        # a block whose handle is known keeps it; the chain after it continues from the computed ones
        return [k if k is not None else r for k, r in zip(known, rhs)]
