"""One real vLLM server on the CPU, run as a subprocess of the tests, the benchmarks or the demo.

It lives in its own virtual environment (``tests/support/vllm-env.sh``; ``$VLLM_VENV``, default
``$KVGATE_CACHE/vllm-venv``) and is started through ``bench/vllm_launch.py`` with the environment and
flags from ``../shared/vllm-cpu.md``: block size 32, prefix caching, ``--enable-prompt-tokens-details``,
KV events on a ZMQ PUB endpoint with a replay endpoint (free ports, kept across restarts so a gateway's
worker entry stays valid), ``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``) and, optionally,
``--num-gpu-blocks-override`` for a KV cache small enough to evict, and kvgate's G4 connector on a
directory (``g4_path``). A server that does not become
healthy raises :class:`VllmStartError` carrying the tail of its log: callers fail, never skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from bench.ports import free_port

LAUNCHER = Path(__file__).with_name("vllm_launch.py")
# Where ``cache_tier`` lives: put on vLLM's PYTHONPATH so its processes can import kvgate's connector.
PROJECT_ROOT = Path(__file__).resolve().parents[1]


# vLLM's own per-step token budget for an OpenAI API server on the CPU (``EngineArgs.get_batch_defaults``:
# 2048 per rank; 8192 on most GPUs). Passed explicitly, and the same figure goes into the server's kvgate
# worker entry: the gateway's scheduler model steps its queue by this budget, and vLLM does not export it.
CPU_MAX_NUM_BATCHED_TOKENS = 2048


class VllmStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message ends with its log's tail."""


def vllm_python() -> Path:
    """The vLLM environment's interpreter (``$VLLM_VENV`` or ``$KVGATE_CACHE/vllm-venv``)."""
    venv = os.environ.get("VLLM_VENV")
    if not venv:
        cache = os.environ.get("KVGATE_CACHE") or str(Path.home() / ".cache" / "kvgate")
        venv = str(Path(cache) / "vllm-venv")
    return Path(venv) / "bin" / "python"


def one_core_each(n: int) -> list[str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``n`` servers side by side: one core each ("0", "1", ...) while the
    machine has cores for them, else "auto". Not "auto" for the first of two: vLLM 0.32 binds it to every
    core ([0, 1] here, 2 OpenMP threads), so its second thread shares the other server's core and its
    spin-waiting parallel regions stall while that server computes (capacity-bound runs: a first server
    answering its first requests after 20-40 s)."""
    cores = os.cpu_count() or 1
    return [str(i) if n <= cores else "auto" for i in range(n)]


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The dtype a CPU vLLM server computes in here: the models are saved in bfloat16, which vLLM 0.32 keeps
    on the CPU, but without native bfloat16 (AVX512-BF16 or AMX) its matmuls are emulated. Measured on an
    AVX2-only EPYC core, 152M model, 1,000-token prompt alone: bfloat16 27.5 s, float32 4.7 s (5.8x)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "float32"
    flags = set(cpuinfo.split())
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


class VllmServer:
    """A vLLM OpenAI-compatible server on loopback with KV events. ``start()`` returns at once;
    ``wait_ready()`` blocks until ``/health`` answers 200.

    With ``g4_path`` it runs kvgate's KV connector (``cache_tier.connector``) on that G4 directory, with
    its prefetch/stats endpoint on ``prefetch_port`` and ``g4_config`` as further
    ``kv_connector_extra_config`` keys (e.g. ``capacity_bytes``).

    ``obey_file_permissions`` runs it, when root, without ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH``
    (``setpriv``), so file permission bits bind it as they bind any other user: a test can make its G4
    directory unwritable with ``chmod`` (``self.obeys_file_permissions`` says whether that holds)."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        name: str = "vllm-0",
        served_model_name: str = "tiny",
        omp_threads_bind: str = "auto",
        block_size: int = 32,
        max_model_len: int = 4096,
        max_num_batched_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS,
        dtype: str | None = None,
        num_gpu_blocks: int | None = None,
        kv_cache_gib: int = 1,
        topic: str = "kv-events",
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        python: str | os.PathLike | None = None,
        startup_timeout_s: float = 300.0,
        workdir: str | os.PathLike | None = None,
        g4_path: str | os.PathLike | None = None,
        g4_config: Mapping[str, object] | None = None,
        obey_file_permissions: bool = False,
    ) -> None:
        self.model_dir = str(model_dir)
        self.name = name
        self.served_model_name = served_model_name
        self.omp_threads_bind = omp_threads_bind
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.dtype = dtype or cpu_dtype()  # an explicit --dtype in extra_args wins
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_cache_gib = kv_cache_gib
        self.topic = topic
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.python = Path(python) if python else vllm_python()
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port()
        self.events_port = free_port()
        self.replay_port = free_port()
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"kvgate-{name}-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "vllm.log"
        # vLLM's ZMQ IPC sockets (uuid-named, left behind when the server is killed): a short folder of their
        # own (a socket path is at most 107 bytes), made at start and removed at stop
        self.rpc_dir: Path | None = None
        self.g4_path = None if g4_path is None else str(g4_path)
        self.g4_config = dict(g4_config or {})
        self.prefetch_port = free_port() if g4_path is not None else None
        self._drop_dac = obey_file_permissions and os.geteuid() == 0 and shutil.which("setpriv") is not None
        self.obeys_file_permissions = obey_file_permissions and (os.geteuid() != 0 or self._drop_dac)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.port_moves = 0
        self.startup_s: float | None = None  # seconds its last start took to answer /health

    # -- addresses -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def worker_config(self) -> dict:
        """This server as a kvgate ``WorkerConfig`` mapping."""
        return {
            "name": self.name,
            "url": self.url,
            "events_endpoint": self.events_endpoint,
            "replay_endpoint": self.replay_endpoint,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }

    # -- command line ----------------------------------------------------------------------------
    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",
            "replay_endpoint": f"tcp://*:{self.replay_port}",
            "topic": self.topic,
        }
        cmd = [
            str(self.python),
            str(LAUNCHER),
            "serve",
            self.model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_model_name,
            "--block-size",
            str(self.block_size),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--enforce-eager",
            "--enable-server-load-tracking",
            *(() if "--dtype" in self.extra_args else ("--dtype", self.dtype)),
            "--kv-events-config",
            json.dumps(events),
        ]
        if self.num_gpu_blocks is not None:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        if self.g4_path is not None:
            extra = {
                "g4_path": self.g4_path,
                "prefetch_port": self.prefetch_port,
                "stats_path": str(self.workdir / "g4-stats.json"),
                **self.g4_config,
            }
            transfer = {
                "kv_connector": "KvgateConnector",
                "kv_connector_module_path": "cache_tier.connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        if self._drop_dac:
            caps = "-dac_override,-dac_read_search"
            cmd = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--", *cmd]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=self.omp_threads_bind,
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CACHE_ROOT=str(self.workdir / "vllm-cache"),
            PYTHONHASHSEED="0",
            VLLM_SERVER_DEV_MODE="1",
            PYTHONUNBUFFERED="1",
        )
        if self.g4_path is not None:
            env["PYTHONPATH"] = str(PROJECT_ROOT)
        if self.rpc_dir is not None:
            env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        env.update(self.extra_env)
        return env

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "VllmServer":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        if not self.python.exists():
            raise VllmStartError(
                f"{self.name}: no vLLM environment at {self.python}; run tests/support/vllm-env.sh "
                f"{self.python.parent.parent} (make test does)"
            )
        self.starts += 1
        if self.rpc_dir is None:
            self.rpc_dir = Path(tempfile.mkdtemp(prefix="kvgate-rpc-"))
        log = open(self.log_path, "ab")
        log.write(f"\n==== start {self.starts}: {' '.join(self.command())}\n".encode())
        log.flush()
        try:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.environment(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self._started_at = time.monotonic()
        return self

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def g4_stats(self, timeout_s: float = 10.0) -> dict:
        """The connector's counters (``GET /kvgate/g4/stats`` on ``prefetch_port``)."""
        if self.prefetch_port is None:
            raise RuntimeError(f"{self.name} runs without the G4 connector")
        url = f"http://127.0.0.1:{self.prefetch_port}/kvgate/g4/stats"
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.load(r)

    def g4_metrics(self, timeout_s: float = 10.0) -> str:
        """The connector's counters in Prometheus' text format (``GET /metrics`` on ``prefetch_port``)."""
        if self.prefetch_port is None:
            raise RuntimeError(f"{self.name} runs without the G4 connector")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prefetch_port}/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    def wait_ready(self, timeout_s: float | None = None) -> "VllmServer":
        """Block until /health answers 200; raise :class:`VllmStartError` with the log on failure."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._port_taken():
                    continue
                raise VllmStartError(
                    f"{self.name} exited with status {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.startup_s = time.monotonic() - self._started_at
                return self
            time.sleep(0.5)
        self.stop()
        raise VllmStartError(
            f"{self.name} did not answer /health within {timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 20.0) -> None:
        """TERM the process group, KILL what is left after ``timeout_s`` (vLLM's engine core included)."""
        proc, self.proc = self.proc, None
        if proc is None:
            self._drop_rpc_dir()
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc.pid, signal.SIGKILL)  # children that outlived the leader
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        _wait_group_gone(proc.pid, 10.0)
        self._drop_rpc_dir()

    def _drop_rpc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def restart(self, timeout_s: float | None = None) -> "VllmServer":
        """Stop and start again on the same ports (its event sequence numbers start over at 0)."""
        self.stop()
        return self.start().wait_ready(timeout_s)

    def close(self) -> None:
        """Stop and delete the working directory (log and vLLM cache)."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _last_start_log(self) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return text.rpartition("\n==== start ")[2].splitlines()

    def _port_taken(self) -> bool:
        """After a first start died because one of its ports was taken meanwhile: move to fresh ports and
        start again (at most twice; never once the server was up, whose clients know its ports)."""
        if self.startup_s is not None or self.port_moves >= 2:
            return False
        if not any("Address already in use" in line for line in self._last_start_log()):
            return False
        self.port_moves += 1
        self.stop()
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        if self.prefetch_port is not None:
            self.prefetch_port = free_port()
        print(f"{self.name}: a port was taken while it started; starting again on {self.port}", file=sys.stderr)
        self.start()
        return True

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` of the log, after the ERROR lines of the last start (vLLM's API server ends
        with "Engine core initialization failed. See root cause above": that cause is in the ERROR lines
        of the engine core's process, further up)."""
        log = self._last_start_log()
        if not log:
            return "(no log)"
        errors = [line for line in log[:-lines] if " ERROR " in line][-40:]
        head = ["(ERROR lines above the tail:)", *errors, "(tail:)"] if errors else []
        return "\n".join(head + log[-lines:])

    def __enter__(self) -> "VllmServer":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VllmServer({self.name!r}, {self.url}, events={self.events_endpoint})"


def start_all(servers: Iterable[VllmServer], timeout_s: float | None = None) -> list[VllmServer]:
    """Start several servers side by side and wait for all; on any failure stop them all and raise."""
    servers = list(servers)
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout_s)
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)
