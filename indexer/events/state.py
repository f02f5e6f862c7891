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


@dataclass(slots=True)
class Ops:
    """Index writes for one batch, in order: ``("store"|"remove", Tier, hashes)``, ``("g4"|"g4_remove",
    None, hashes)``, ``("clear", None, None)`` (drop the worker's local tiers)."""

    items: list[tuple[str, Tier | None, list[int] | None]] = field(default_factory=list)


_MASK64 = (1 << 64) - 1
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


def _touch(changes: dict[int, tuple[bool, bool]], rh: int, on: bool) -> None:
    """Record a presence change; the first touch also tells the presence before the batch."""
    prev = changes.get(rh)
    changes[rh] = (not on if prev is None else prev[0], on)


def _key(group: int, eh: int):
    """Handle key: the engine hash alone for group 0 (the common case, no tuple), else (group, hash)."""
    return eh if group == 0 else (group, eh)


class WorkerState:
    """State of one event source (one worker, one data-parallel rank).

    ``_handles``: handle key -> ``[kvgate hash, count on GPU, count on CPU]``;
    ``_held[code]``: kvgate hash -> number of handles holding it on that tier (an index entry exists
    while it is > 0).
    """

    def __init__(self, block_size: int | None = None, storage_handles: int = 100_000) -> None:
        self.block_size = block_size
        self._handles: dict = {}
        self._held: tuple[dict[int, int], dict[int, int]] = ({}, {})
        # STORAGE blocks are never removed by vLLM; remember a bounded number of their handles so that
        # later events can chain from them.
        self._storage: LRUCache = LRUCache(maxsize=storage_handles)
        self.counters = {"unknown_parent": 0, "size_mismatch": 0, "unmapped": 0, "skipped": 0,
                         "malformed": 0}
        self._changed: set = set()  # handle keys changed since take_changes (the index keeps the map too)

    def __len__(self) -> int:
        return len(self._handles)

    def held(self, tier: Tier) -> list[int]:
        """kvgate hashes the worker holds on ``tier`` (what the index should hold for it)."""
        return list(self._held[_TIERS.index(Tier(tier))])

    def reset(self) -> None:
        """Forget everything but the G4 handles (the worker restarted or the index was cleared)."""
        self._handles.clear()
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
                ups[self._norm(key)] = (h[0], h[1], h[2])
        self._changed.clear()
        return ups, dels

    def export(self) -> dict:
        """The whole handle map (what a new writer pushes)."""
        self._changed.clear()
        return {self._norm(k): (h[0], h[1], h[2]) for k, h in self._handles.items()}

    def adopt(self, handles: dict) -> None:
        """Take over a handle map saved by another gateway (replaces the local tiers' state)."""
        self.reset()
        for (g, eh), (rh, gpu, cpu) in handles.items():
            if gpu <= 0 and cpu <= 0:
                continue
            self._handles[_key(g, eh)] = [rh, gpu, cpu]
            for code, c in ((0, gpu), (1, cpu)):
                if c > 0:
                    self._held[code][rh] = self._held[code].get(rh, 0) + 1

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _rh(self, key) -> int | None:
        h = self._handles.get(key)
        if h is not None:
            return h[0]
        return self._storage.get(key)

    def _remember_storage(self, key, rh: int) -> None:
        self._storage[key] = rh

    def _incr(self, key, rh: int, code: int, pending: dict[int, tuple[bool, bool]]) -> None:
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = [rh, 0, 0]
        self._changed.add(key)
        c = h[code + 1] + 1
        h[code + 1] = c
        if c == 1:
            held = self._held[code]
            rh = h[0]
            n = held.get(rh, 0) + 1
            held[rh] = n
            if n == 1:
                _touch(pending, rh, True)

    def _decr(self, key, code: int, pending: dict[int, tuple[bool, bool]]) -> None:
        h = self._handles.get(key)
        if h is None or h[code + 1] == 0:
            return
        self._changed.add(key)
        c = h[code + 1] - 1
        h[code + 1] = c
        if c == 0:
            held = self._held[code]
            rh = h[0]
            n = held.get(rh, 1) - 1
            if n <= 0:
                held.pop(rh, None)
                _touch(pending, rh, False)
            else:
                held[rh] = n
            if h[1] == 0 and h[2] == 0:
                del self._handles[key]

    # -- events -----------------------------------------------------------------------------------------
    def apply(self, events: list[Event]) -> Ops:
        ops = Ops()
        pending: tuple[dict, dict] = ({}, {})  # per tier code: kvgate hash -> (present before, present now)
        g4: list[int] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                try:
                    self._stored(ev, pending, g4)
                except (TypeError, ValueError, OverflowError):
                    self.counters["malformed"] += 1
            elif isinstance(ev, BlockRemoved):
                code = medium_code(ev.medium)
                if code is None or code == G4:  # only kvgate's G4 GC removes G4 entries
                    if code == G4 and ev.ownership == G4_OWNERSHIP and ev.block_hashes:
                        self._flush(ops, pending, g4)
                        gone = [h & _MASK64 for h in ev.block_hashes if isinstance(h, int)]
                        ops.items.append(("g4_remove", None, gone))
                    continue
                g = ev.group_idx
                for eh in ev.block_hashes:
                    self._decr(_key(g, eh), code, pending[code])
            elif isinstance(ev, AllBlocksCleared):
                self._flush(ops, pending, g4)
                self.reset()
                ops.items.append(("clear", None, None))
        self._flush(ops, pending, g4)
        return ops

    @staticmethod
    def _flush(ops: Ops, pending: tuple[dict, dict], g4: list[int]) -> None:
        for code, changes in enumerate(pending):
            if changes:
                gone = [h for h, (was, on) in changes.items() if was and not on]
                new = [h for h, (was, on) in changes.items() if on and not was]
                if gone:
                    ops.items.append(("remove", _TIERS[code], gone))
                if new:
                    ops.items.append(("store", _TIERS[code], new))
                changes.clear()
        if g4:
            ops.items.append(("g4", None, list(dict.fromkeys(g4))))
            g4.clear()

    def _stored(self, ev: BlockStored, pending: tuple[dict, dict], g4: list[int]) -> None:
        code = medium_code(ev.medium)
        if code is None or ev.kv_cache_spec_kind not in ACCEPTED_KINDS:
            self.counters["skipped"] += 1
            return
        g = ev.group_idx
        if not ev.token_ids:  # offload placeholder: only hashes we already know can be placed
            for eh in ev.block_hashes:
                key = _key(g, eh)
                rh = self._rh(key)
                if rh is None:
                    self.counters["unmapped"] += 1
                elif code == G4:
                    g4.append(rh)
                    self._remember_storage(key, rh)
                else:
                    self._incr(key, rh, code, pending[code])
            return
        bs = ev.block_size
        if self.block_size is None and bs > 0:
            self.block_size = bs
        n = len(ev.block_hashes)
        if bs != self.block_size or n == 0 or len(ev.token_ids) != n * bs:
            self.counters["size_mismatch"] += 1
            return
        if ev.parent_block_hash is None:
            parent = None
            salt = cache_salt_of(ev.extra_keys, ev.lora_name)
        else:
            parent = self._rh(_key(g, ev.parent_block_hash))
            if parent is None:
                self.counters["unknown_parent"] += 1
                return
            salt = None
        rhs = hashing.chain(hashing.local_hashes(ev.token_ids, bs, ev.lora_name, salt), parent)
        if code == G4:
            for eh, rh in zip(ev.block_hashes, rhs):
                g4.append(rh)
                self._remember_storage(_key(g, eh), rh)
            return
        changes = pending[code]
        if g == 0:
            for eh, rh in zip(ev.block_hashes, rhs):
                self._incr(eh, rh, code, changes)
        else:
            for eh, rh in zip(ev.block_hashes, rhs):
                self._incr((g, eh), rh, code, changes)
