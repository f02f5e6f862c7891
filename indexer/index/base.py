"""The index seam: which worker holds which block on which tier, and which blocks are on G4.

Semantics every backend honours (the contract tests in tests/index/ run against each):
- keys are kvgate sequence hashes (``indexer.hashing``), namespaced by model;
- ``store``/``remove`` have set semantics per (model, worker, tier, hash): idempotent. Reference counting of
  vLLM's duplicate announcements happens before the index, in the per-worker event state;
- G4 blocks belong to the model, not to a worker (any worker of the model can load them);
- ``lookup`` returns, per worker, the longest *leading* run of the given hashes held per tier, and the
  longest leading run on G4; it is answered in one round trip whatever the prompt's length;
- ``clear_worker`` removes a worker's entries without scanning the whole keyspace (and, for all tiers, its
  handle map);
- the *handle map* of a worker -- vLLM's (group, engine hash) -> (kvgate hash, GPU count, CPU count) and the
  last applied event sequence -- lives in the index too (``save_handles``/``load_handles``), so a gateway
  process that starts later can apply a ``BlockRemoved`` for a block stored before it started;
- beside it the worker's *incarnation* (the engine process the map was written for: ``save_handles``
  records it with the map, ``incarnation`` reads it), so that a gateway starting later does not adopt the
  map and entries of a process that is gone;
- one writer per worker: ``acquire_lease`` grants (and renews) a worker's lease to one owner; writes by an
  index whose lease was taken over raise :class:`LeaseLost` (fencing), so a stale writer cannot undo
  the new one's work; ``sweep`` drops the entries of workers nobody has held a lease for in a while.
"""
from __future__ import annotations

import abc
import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


class Tier(str, enum.Enum):
    """Where a worker holds a block. G4 is model-wide and is not a worker tier."""

    GPU = "GPU"
    CPU = "CPU"


@dataclass(frozen=True)
class WorkerMatch:
    """Leading blocks of a prompt a worker holds: on GPU, on CPU, and on either (the usable local prefix)."""

    gpu: int = 0
    cpu: int = 0
    local: int = 0


@dataclass(frozen=True)
class LookupResult:
    """Answer of :meth:`BlockIndex.lookup` for one prompt."""

    num_blocks: int
    workers: dict[str, WorkerMatch] = field(default_factory=dict)
    g4: int = 0

    def match(self, worker: str) -> WorkerMatch:
        return self.workers.get(worker, WorkerMatch())


@dataclass(frozen=True)
class BlockLocation:
    """Where one block lives: worker -> tiers, and whether it is on G4."""

    workers: dict[str, frozenset[Tier]]
    g4: bool


HandleKey = tuple[int, int]  # (kv cache group, engine block hash)
Handle = tuple[int, int, int]  # (kvgate sequence hash, count on GPU, count on CPU)


class LeaseLost(Exception):
    """This index's writes for a worker were fenced off: another owner holds its lease now."""


class BlockIndex(abc.ABC):
    """The index backend interface (in-memory default, Redis for fleets of gateways)."""

    name: str = "abstract"

    @abc.abstractmethod
    async def store(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        """Record that ``worker`` holds ``hashes`` on ``tier``."""

    @abc.abstractmethod
    async def remove(self, model: str, worker: str, tier: Tier, hashes: Sequence[int]) -> None:
        """Forget that ``worker`` holds ``hashes`` on ``tier`` (unknown hashes are ignored)."""

    @abc.abstractmethod
    async def store_g4(self, model: str, hashes: Sequence[int]) -> None:
        """Record that ``hashes`` are on the model's G4 store."""

    @abc.abstractmethod
    async def remove_g4(self, model: str, hashes: Sequence[int]) -> None:
        """Forget G4 blocks (evicted by the store's GC)."""

    @abc.abstractmethod
    async def clear_worker(self, model: str, worker: str, tier: Tier | None = None) -> int:
        """Drop a worker's entries (all tiers, or one); returns the number of entries removed."""

    @abc.abstractmethod
    async def clear_model(self, model: str) -> int:
        """Drop every entry of a model, G4 included; returns the number of entries removed."""

    @abc.abstractmethod
    async def lookup(
        self, model: str, hashes: Sequence[int], workers: Collection[str] | None = None
    ) -> LookupResult:
        """Longest leading run of ``hashes`` per worker and tier, and on G4, in one round trip."""

    @abc.abstractmethod
    async def locate(self, model: str, block_hash: int) -> BlockLocation:
        """Which workers and tiers hold one block, and whether it is on G4."""

    @abc.abstractmethod
    async def stats(self, model: str | None = None) -> dict:
        """Counts per model: blocks per tier, G4 blocks, entries per worker (and backend memory)."""

    # -- handle maps, leases, sweep (single-process defaults; RedisIndex shares them between gateways) -----
    async def save_handles(self, model: str, worker: str, upserts: dict[HandleKey, Handle],
                           deletes: Collection[HandleKey], seq: int | None, *, replace: bool = False,
                           incarnation: str | None = None) -> None:
        """Update a worker's handle map (upserts win over deletes of the same key) and its last sequence
        (``seq`` None: an update keeps the stored one); ``replace``: the map becomes exactly ``upserts``, in
        one step (a new writer pushing its state: a gateway adopting the map meanwhile never sees it half
        written), and its sequence ``seq`` (None: none, the old one no longer describes the map).
        ``incarnation``: the engine process the map now describes, recorded in the same step (None: the
        recorded one stays)."""
        hm, old = self._handles.setdefault((model, worker), ({}, None))
        if replace:
            hm = {}
        for k in deletes:
            hm.pop(k, None)
        hm.update(upserts)
        self._handles[(model, worker)] = (hm, seq if seq is not None or replace else old)
        if incarnation is not None:
            self._incarnations[(model, worker)] = incarnation

    async def load_handles(self, model: str, worker: str) -> tuple[dict[HandleKey, Handle], int | None]:
        """The map and its sequence as one snapshot (what a gateway subscribing to the worker starts from)."""
        hm, seq = self._handles.get((model, worker), ({}, None))
        return dict(hm), seq

    async def _drop_handles(self, model: str, worker: str) -> None:
        self._handles.pop((model, worker), None)

    async def incarnation(self, model: str, worker: str) -> str | None:
        """The engine process (vLLM's ``process_start_time_seconds``) the worker's handle map and entries were
        written for; None: not recorded. Why: sequence numbers alone cannot tell a gateway that restarted
        from a worker that restarted while no gateway watched. Only the writer records it, with the map it
        pushes (``save_handles``): a gateway that merely subscribed and saw a new process must not mark the
        old map as the new process's before the writer has replaced it (a second gateway starting then
        would adopt it)."""
        return self._incarnations.get((model, worker))

    async def acquire_lease(self, model: str, worker: str, owner: str, ttl_s: float) -> bool:
        """Take or renew ``worker``'s lease for ``owner``; False while another owner holds it."""
        import time

        now = time.monotonic()
        cur = self._leases.get((model, worker))
        if cur is not None and cur[0] != owner and cur[1] > now:
            return False
        self._leases[(model, worker)] = (owner, now + ttl_s)
        self._seen[(model, worker)] = now
        return True

    async def release_lease(self, model: str, worker: str, owner: str) -> None:
        cur = self._leases.get((model, worker))
        if cur is not None and cur[0] == owner:
            del self._leases[(model, worker)]

    async def sweep(self, model: str, idle_s: float) -> list[str]:
        """Drop the entries (and handle maps) of workers whose lease nobody renewed for ``idle_s``."""
        import time

        now = time.monotonic()
        gone = [w for (m, w), t in list(self._seen.items())
                if m == model and now - t >= idle_s and (self._leases.get((m, w)) or ("", 0))[1] <= now]
        for w in gone:
            await self.clear_worker(model, w)
            self._seen.pop((model, w), None)
            self._incarnations.pop((model, w), None)
        return gone

    @property
    def _handles(self) -> dict:
        return self.__dict__.setdefault("_handle_maps", {})

    @property
    def _leases(self) -> dict:
        return self.__dict__.setdefault("_lease_table", {})

    @property
    def _seen(self) -> dict:
        return self.__dict__.setdefault("_lease_seen", {})

    @property
    def _incarnations(self) -> dict:
        return self.__dict__.setdefault("_incarnation_table", {})

    async def epoch(self) -> str | None:
        """Changes when the backend lost or may have lost its data (a Redis restart); None if it never does.
        Writers that see it change push their state back."""
        return None

    async def models(self) -> list[str]:
        """Models that have entries."""
        return []

    async def close(self) -> None:
        """Release connections."""
