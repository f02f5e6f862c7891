"""Starting and stopping the processes of a benchmark run: a simulated fleet, a kvgate gateway, a peer
router, redis-server. Each runs in its own process group and is stopped by its own pid."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.ports import free_port

REPO = Path(__file__).resolve().parent.parent.parent


class Proc:
    def __init__(self, name: str, cmd: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.p = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, **(env or {})}, cwd=str(REPO))

    def alive(self) -> bool:
        return self.p.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the process and its children have used so far; None if gone."""
        total = 0.0
        for pid in [self.p.pid, *children(self.p.pid)]:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                if pid == self.p.pid:
                    return None
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def stop(self, timeout: float = 10.0) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.p.wait(5)
        self._log.close()


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def wait_http(url: str, proc: Proc, timeout: float = 60.0, ok=(200,)) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.p.returncode}):\n{proc.tail()}")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code in ok:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name}: {url} not ready after {timeout}s ({last}):\n{proc.tail()}")


def start_fleet(log_dir: Path, workers: int, *, num_blocks: int, block_size: int, time_scale: float,
                extra: list[str] = (), timeout: float = 60.0) -> tuple[Proc, dict]:
    wf = log_dir / "workers.json"
    if wf.exists():
        wf.unlink()
    cmd = [sys.executable, "-m", "router.cli", "sim", "--workers", str(workers), "--base-port", "0",
           "--num-blocks", str(num_blocks), "--block-size", str(block_size), "--time-scale", str(time_scale),
           "--workers-file", str(wf), *extra]
    proc = Proc(f"fleet-{workers}", cmd, log_dir)
    deadline = time.monotonic() + timeout
    while not wf.exists():
        if not proc.alive():
            raise RuntimeError(f"simulated fleet exited:\n{proc.tail()}")
        if time.monotonic() > deadline:
            proc.stop()
            raise TimeoutError("simulated fleet did not start")
        time.sleep(0.1)
    return proc, json.loads(wf.read_text())


def gateway_settings(desc: dict, policy: str, port: int, tokenizer_dir: str, index: str = "memory",
                     redis_url: str | None = None) -> dict:
    s = {
        "host": "127.0.0.1", "port": port, "log_level": "warning",
        "workers": [{"url": w["url"], "name": w["name"], "events_endpoint": w["events_endpoint"],
                     "replay_endpoint": w["replay_endpoint"]} for w in desc["workers"]],
        "models": {desc["model"]: {"tokenizer": tokenizer_dir, "block_size": desc["block_size"]}},
        "routing": {"policy": policy},
        "index": {"backend": index},
        "health_interval_s": 1.0,
        # one simulator process hosts the whole fleet: on a loaded machine its answers can be slow, and a
        # benchmark of routing must not turn that into "no healthy worker"
        "health_timeout_s": 15.0,
        "unhealthy_after": 5,
    }
    if redis_url:
        s["index"]["redis_url"] = redis_url
    return s


def start_gateway(log_dir: Path, name: str, settings: dict, timeout: float = 60.0) -> Proc:
    cfg = log_dir / f"{name}.json"
    cfg.write_text(json.dumps(settings, indent=1))
    proc = Proc(name, [sys.executable, "-m", "bench.sim.gateway_proc", str(cfg)], log_dir)
    wait_http(f"http://127.0.0.1:{settings['port']}/v1/models", proc, timeout)
    return proc


def start_redis(log_dir: Path) -> tuple[Proc, str] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    port = free_port()
    d = tempfile.mkdtemp(prefix="kvgate-bench-redis-")
    proc = Proc("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", d], log_dir)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.1)
    proc.stop()
    return None
