"""The real-vLLM launcher (bench/vllm_server.py) tells the gateway the step budget it gives vLLM: the
gateway's scheduler model steps a worker's queue by ``max_num_batched_tokens``, which vLLM does not export,
so a worker entry without it is priced at the routing default (8192) against the CPU server's 2048."""
from bench.vllm_server import CPU_MAX_NUM_BATCHED_TOKENS, VllmServer
from router.config import WorkerConfig


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_worker_entry_carries_the_budget_vllm_is_started_with(tmp_path):
    default = VllmServer(str(tmp_path), workdir=tmp_path / "a")
    wide = VllmServer(str(tmp_path), workdir=tmp_path / "b", max_num_batched_tokens=8192)
    assert default.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS == 2048
    for server in (default, wide):
        cfg = WorkerConfig(**server.worker_config())
        assert cfg.max_num_batched_tokens == int(_flag(server.command(), "--max-num-batched-tokens"))
    assert WorkerConfig(**wide.worker_config()).max_num_batched_tokens == 8192
