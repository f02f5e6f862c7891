"""The floor of a Python gateway on kvgate's stack, for ``bench.bench_gateway --floor`` (issue #15).

A plain ASGI app on uvicorn (httptools, uvloop: the settings ``kvgate serve`` uses) that reads the body,
decodes it as JSON (a gateway must read ``model``), and forwards it round-robin through kvgate's own
upstream client (router/upstream.py), relaying the answer. No tokenization, index, policy, metrics or
headers: whatever kvgate adds above this is its routing; what this adds above sglang-router is the price of
serving HTTP from one Python process at all. ``python -m bench.floor_proxy --port P --workers URL,URL``.
"""
from __future__ import annotations

import argparse
import itertools
import json

from bench.sim.asgi import read_body, serve_lifespan
from router.config import Settings
from router.upstream import Upstream


def make_app(urls: list[str]):
    upstream = Upstream(Settings())
    rotation = itertools.cycle(urls)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            return await serve_lifespan(receive, send)
        body = await read_body(receive)
        if scope["path"] in ("/health", "/ready"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        json.loads(body or b"{}")
        resp = await upstream.open(scope["method"], next(rotation) + scope["path"], body,
                                   {"content-type": "application/json"})
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": [(b"content-type", resp.headers.get("content-type", "application/json").encode())]})
        try:
            async for chunk in resp.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            resp.close()
        await send({"type": "http.response.body", "body": b""})

    return app


def main(argv=None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", required=True, help="comma-separated worker base URLs")
    a = p.parse_args(argv)
    uvicorn.run(make_app(a.workers.split(",")), host="127.0.0.1", port=a.port, log_level="warning",
                access_log=False, http="httptools", loop="uvloop", lifespan="on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
