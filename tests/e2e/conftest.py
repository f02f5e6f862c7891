"""Fixtures for the end-to-end tests against real vLLM servers on the CPU (marker ``vllm``).

Two servers run the tiny model built offline by ``bench.tiny_model`` (cached under ``$KVGATE_CACHE``),
one per core (``VLLM_CPU_OMP_THREADS_BIND`` "0" and "1", from ``bench.vllm_server.one_core_each``: vLLM's
"auto" would bind the first to both cores), started side by side, with
a KV cache of ``E2E_GPU_BLOCKS`` blocks so the eviction test can fill it. They are shared by every test
of this package and stopped by process group when it is done, even when tests fail. A server that does not
start fails the tests with its log; nothing is skipped.
"""

from __future__ import annotations

import pytest

from bench.vllm_server import one_core_each
from tests.support.vllm_server import VllmServer, start_all

E2E_MODEL_NAME = "tiny"
E2E_MAX_MODEL_LEN = 4096
# 400 blocks x 32 tokens = 12,800 tokens per server: room for the tests' sessions, small enough to evict.
E2E_GPU_BLOCKS = 400

# Figures the tests report (e.g. round_robin's hit rate beside kv's), printed at the end of the session.
_REPORT: list[str] = []


def e2e_report(line: str) -> None:
    _REPORT.append(line)


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("kvgate against real vLLM")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The tiny model's directory (built once per machine, then reused)."""
    from bench import tiny_model

    return str(tiny_model.ensure("tiny"))


@pytest.fixture(scope="package")
def vllm_fleet(tiny_model_dir) -> list[VllmServer]:
    """Two real vLLM servers, ``vllm-0`` on core 0 and ``vllm-1`` on core 1 (``one_core_each``), shared by every test of
    tests/e2e and stopped when the package is done (before other packages start servers of their own:
    two more would not fit beside them on a 2-core, 24 GiB machine)."""
    binds = one_core_each(2)
    servers = [
        VllmServer(
            tiny_model_dir,
            name=f"vllm-{i}",
            served_model_name=E2E_MODEL_NAME,
            omp_threads_bind=bind,
            max_model_len=E2E_MAX_MODEL_LEN,
            num_gpu_blocks=E2E_GPU_BLOCKS,
            # The Responses API's store (previous_response_id chains, GET/cancel by id), and the render
            # endpoints (/v1/responses/render, /v1/messages/render: vLLM's own tokens of a body).
            extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
            extra_args=["--enable-scale-out"],
        )
        for i, bind in enumerate(binds)
    ]
    try:
        start_all(servers)
        yield servers
    finally:
        for s in servers:
            s.close()


@pytest.fixture
def vllm_servers(vllm_fleet) -> list[VllmServer]:
    """The session's two servers, each restarted first if an earlier test left it down."""
    for server in vllm_fleet:
        if not server.healthy(timeout_s=10.0):
            server.restart()
    return vllm_fleet


@pytest.fixture
def vllm_server(vllm_servers) -> VllmServer:
    """The first server."""
    return vllm_servers[0]


@pytest.fixture
def kvgate(vllm_servers, redis_url, tiny_model_dir):
    """Factory: ``kvgate(policy="kv", **settings)`` starts a gateway (Redis index, the tiny model's
    tokenizer) in front of the two servers and waits until it is ready; stopped after the test."""
    from tests.e2e.kvgate import kvgate_settings, start_kvgate

    started = []

    def start(
        policy: str = "kv",
        *,
        tokenizer: str | None = None,
        block_size: int | None = None,
        wait_parity: bool = True,
        **kw,
    ):
        settings = kvgate_settings(
            vllm_servers,
            redis_url,
            tokenizer or tiny_model_dir,
            E2E_MODEL_NAME,
            policy=policy,
            block_size=block_size,
            **kw,
        )
        gw = start_kvgate(settings, vllm_servers, E2E_MODEL_NAME)
        started.append(gw)
        gw.wait_ready(parity=wait_parity)
        return gw

    yield start
    for gw in started:
        gw.stop()
