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
        self.fixed_port = port is not None
        self._configure(port or free_port())
        self.thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def _configure(self, port: int) -> None:
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=1,
                                                    access_log=False))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve())
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        """Cancel what the app left running and close the loop in its own thread. A loop collected later
        with pending tasks finalises their coroutines wherever the collector happens to run: inside another
        thread's ``ast.parse`` (pytest rewriting an import) CPython 3.11.7 then fails that import with
        "AST constructor recursion depth mismatch" (it failed the fuzz test once)."""
        loop = self.loop
        tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=5))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def start(self, timeout: float = 60.0, attempts: int = 3) -> ThreadServer:
        """Start serving; a free port taken by another process in the meantime means another try."""
        for attempt in range(attempts):
            self.thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn-{self.port}")
            self.thread.start()
            deadline = time.monotonic() + timeout
            while not self.server.started:
                if not self.thread.is_alive() or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if self.server.started:
                return self
            if self.fixed_port or attempt == attempts - 1 or self.thread.is_alive():
                break
            self._configure(free_port())
        raise RuntimeError(f"server on port {self.port} did not start")

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's event loop (e.g. to touch its in-memory state)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(15)
