"""Session-wide fixtures: a real redis-server on a free loopback port."""
from __future__ import annotations

import shutil
import subprocess
import tempfile

import pytest

from tests.support.procs import free_port, stop, wait_port


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server for this test session; ``make test`` installs it when missing."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run `make test` (it installs it) or tests/support/install-redis.sh")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvgate-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_port(port, 20, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster (3 primaries, 3 replicas) for this test session, started on first use."""
    from tests.support.redis_cluster import RedisCluster

    c = RedisCluster().start()
    yield c
    c.close()


@pytest.fixture
async def redis_url(redis_server):
    """The session's Redis, flushed before each test that asks for it."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_server)
    await client.flushall()
    await client.aclose()
    return redis_server
