"""Helpers for the raw ASGI apps of the simulator and the benchmark's mock worker (no framework)."""
from __future__ import annotations


async def serve_lifespan(receive, send) -> None:
    """Answer ASGI lifespan messages until shutdown."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive) -> bytes:
    """The whole request body from ASGI ``http.request`` messages."""
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    return body
