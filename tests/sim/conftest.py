"""Fixtures: an in-process simulated fleet on loopback (real HTTP servers and ZMQ sockets)."""
from __future__ import annotations

import pytest

from bench.sim.fleet import FleetConfig, SimFleet
from bench.sim.timing import DEFAULT_TIMING


@pytest.fixture
async def fleet():
    cfg = FleetConfig(workers=2, num_blocks=64, block_size=16, timing=DEFAULT_TIMING.with_(time_scale=1000),
                      stream_interval=4)
    async with SimFleet(cfg) as f:
        yield f
