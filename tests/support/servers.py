"""Run an ASGI app with uvicorn on a free loopback port in a background thread (its own event loop)."""
from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from tests.support.procs import free_port


class ThreadServer:
    def __init__(self, app, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=1,
                                                    access_log=False))
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self, timeout: float = 60.0) -> ThreadServer:
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's event loop (e.g. to touch its in-memory state)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(15)
