"""The prefetch seam: when the chosen plan reads blocks from G4, the gateway orders the chosen worker to
stage them while the request is still on its way. The g4 part supplies the real implementation."""
from __future__ import annotations

from typing import Protocol


class Prefetcher(Protocol):
    async def order(self, worker, model: str, hashes: list[int]) -> bool:
        """Ask ``worker`` (a registry Worker) to stage ``hashes`` from G4; True when the order was accepted."""


class NoopPrefetcher:
    """Default: no G4 tier, nothing to stage."""

    async def order(self, worker, model: str, hashes: list[int]) -> bool:
        return False
