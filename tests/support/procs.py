"""Helpers the tests use to run real servers: free ports, waiting, stopping by PID."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from bench.ports import free_port, free_port_pair

__all__ = ["free_port", "free_port_pair", "stop", "wait_port"]


def wait_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a process group started with ``start_new_session=True``: TERM, then KILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)
