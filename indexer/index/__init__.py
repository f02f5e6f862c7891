"""The global block index: one interface (:class:`BlockIndex`), two backends (memory, Redis)."""
from indexer.index.base import BlockIndex, BlockLocation, LookupResult, Tier, WorkerMatch

__all__ = ["BlockIndex", "BlockLocation", "LookupResult", "Tier", "WorkerMatch"]
