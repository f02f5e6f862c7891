"""A real Redis Cluster for the tests: 3 primaries and 3 replicas (``redis-server --cluster-enabled yes``,
joined by ``redis-cli --cluster create``), each node on a free loopback port, stopped by its own pid."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.procs import free_port_pair, stop, wait_port


class RedisCluster:
    def __init__(self, nodes: int = 6) -> None:
        self.ports = [free_port_pair(10000) for _ in range(nodes)]  # bus port = port + 10000
        self.dir = Path(tempfile.mkdtemp(prefix="kvgate-redis-cluster-"))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout: float = 60.0) -> RedisCluster:
        try:
            return self._start(timeout)
        except BaseException:
            self.close()  # never leave nodes behind
            raise

    def _start(self, timeout: float) -> RedisCluster:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        assert exe and cli, "redis-server and redis-cli are needed (make test installs them)"
        for port in self.ports:
            d = self.dir / str(port)
            d.mkdir()
            self.procs[port] = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000", "--save", "",
                 "--appendonly", "no", "--repl-diskless-sync-delay", "0", "--dir", str(d)],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        for port in self.ports:
            wait_port(port, 20, self.procs[port])
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)
        deadline = time.monotonic() + timeout
        while not all(self.ok(p) for p in self.ports):
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not reach cluster_state:ok with every replica in sync")
            time.sleep(0.2)
        return self

    def _cli(self, port: int, *args: str) -> str:
        return subprocess.run([shutil.which("redis-cli"), "-p", str(port), *args],
                              capture_output=True, text=True, timeout=10).stdout

    def ok(self, port: int) -> bool:
        """The node sees the cluster as ok and, if it is a replica, its link to the primary is up (a
        replica that never synced cannot take over)."""
        if "cluster_state:ok" not in self._cli(port, "cluster", "info"):
            return False
        repl = self._cli(port, "info", "replication")
        return "role:master" in repl or "master_link_status:up" in repl

    def kill(self, port: int) -> None:
        import os
        import signal

        p = self.procs.pop(port)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            stop(p)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
