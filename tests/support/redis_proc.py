"""A redis-server of one test that the test may kill and start again on the same port (the session's
server in tests/conftest.py is shared and must stay up)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

from tests.support.procs import free_port, stop, wait_port


class RedisProc:
    def __init__(self, persistence: bool = False, port: int | None = None) -> None:
        self.port = port or free_port()
        self.persistence = persistence
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-fault-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProc:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed (make test installs it)"
        persist = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistence else \
            ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *persist, "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_port(self.port, 20, self.proc)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash (with persistence, what was fsynced survives)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
