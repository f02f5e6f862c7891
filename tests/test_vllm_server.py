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


def test_vllms_ipc_sockets_go_into_a_folder_of_the_servers_own_removed_at_stop(tmp_path):
    """vLLM names its ZMQ IPC sockets by uuid under VLLM_RPC_BASE_PATH (the temp dir by default) and leaves
    them there when killed: each start gets a folder of its own, gone after stop. No vLLM needed: a stand-in
    interpreter records what it was given and leaves a file where a killed vLLM leaves its sockets."""
    import os
    import stat
    import time

    out = tmp_path / "rpc-path"
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$VLLM_RPC_BASE_PATH" > "$FAKE_OUT"\n'
                    'touch "$VLLM_RPC_BASE_PATH/a-socket"\nexec sleep 60\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    server = VllmServer(str(tmp_path), workdir=tmp_path / "w", python=fake, extra_env={"FAKE_OUT": str(out)})
    assert "VLLM_RPC_BASE_PATH" not in server.environment()  # nothing made before a start
    server.start()
    try:
        deadline = time.monotonic() + 10
        while not (out.exists() and out.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        rpc = out.read_text().strip()
        assert os.path.isdir(rpc) and os.path.basename(rpc).startswith("kvgate-rpc-")
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(rpc, "a-socket")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(os.path.join(rpc, "a-socket"))
    finally:
        server.stop()
    assert not os.path.exists(rpc)
    server.close()
