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


def test_the_server_computes_in_the_dtype_this_cpu_runs_natively(tmp_path):
    """bfloat16 without AVX512-BF16/AMX is emulated (5.8x slower here): such a CPU gets float32; an explicit
    ``--dtype`` (the G4 tests pin bfloat16 payloads) is passed once, as given."""
    import bench.vllm_server as vs

    cmd = VllmServer(str(tmp_path), workdir=tmp_path / "a").command()
    assert _flag(cmd, "--dtype") == vs.cpu_dtype() in ("float32", "bfloat16")
    pinned = VllmServer(str(tmp_path), workdir=tmp_path / "b", extra_args=["--dtype", "bfloat16"]).command()
    assert pinned.count("--dtype") == 1 and _flag(pinned, "--dtype") == "bfloat16"
    flags = {"avx2 fma": "float32", "avx2 avx512f avx512_bf16": "bfloat16", "avx2 amx_bf16 amx_tile": "bfloat16"}
    for line, want in flags.items():
        assert vs.cpu_dtype(f"processor : 0\nflags : {line}\n") == want
