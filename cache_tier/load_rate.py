"""The G4 load rate the scheduler's ``load_async: auto`` decides with (cache_tier/connector_scheduler.py).

Seconds per block of the workers' finished loads, as a decaying sum: each report (the workers' loads of one
step) weighs ``decay`` times the one after it. A running mean since the engine started would hardly move
once thousands of blocks were loaded, so a store that slows down (shared storage under another job's
reads) would keep getting loads in the step, stalling every request of it, long after each load takes
longer than ``sync_load_max_s``. With ``decay`` 0.9 the last ~10 reports make up two thirds of the rate.
Only the standard library: this module runs inside vLLM's process."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LoadRate:
    decay: float = 0.9
    blocks: float = 0.0
    seconds: float = 0.0

    def observe(self, blocks: int, seconds: float) -> None:
        """One report: ``blocks`` loaded in ``seconds`` (a report without blocks, or with a malformed time,
        says nothing and changes nothing)."""
        if not blocks > 0 or not isinstance(seconds, (int, float)):
            return
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self.blocks = self.blocks * self.decay + blocks
        self.seconds = self.seconds * self.decay + seconds

    def seconds_for(self, n_blocks: int) -> float | None:
        """Expected seconds to load ``n_blocks``; None before any load was measured."""
        if self.blocks <= 0 or self.seconds <= 0:
            return None
        return n_blocks * self.seconds / self.blocks
