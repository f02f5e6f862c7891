"""Who may call ``/admin``: bearer token (401 without or with a wrong one), loopback-only without a token
(403 from elsewhere), or explicitly opened."""
from __future__ import annotations

import socket

import httpx
import pytest
import uvicorn

from indexer.index.memory import MemoryIndex
from router.admin.auth import is_loopback
from router.app import create_app
from router.config import AdminConfig, Settings
from tests.admin.conftest import MODEL, TOKEN
from tests.support.procs import free_port
from tests.support.servers import ThreadServer


def test_token_required_and_compared(admin_env):
    env = admin_env(1, token=TOKEN)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": "Bearer"}, {"Authorization": f"Bearer {TOKEN}x"}):
        for method, path in (("GET", "/admin/workers"), ("POST", "/admin/explain"),
                             ("DELETE", f"/admin/index/{MODEL}"), ("GET", "/admin/g4")):
            r = env.anon.request(method, path, headers=headers, json={} if method == "POST" else None)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and "token" in err["message"]
    # The right token opens everything; the scheme is case-insensitive.
    assert env.http.get("/admin/workers").status_code == 200
    assert env.anon.get("/admin/workers", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    # The flush above never ran: the model's index is untouched by refused calls.
    assert env.http.get("/admin/index").status_code == 200
    # The OpenAI surface and /metrics are not behind the admin token.
    assert env.anon.get("/v1/models").status_code == 200
    assert env.anon.get("/metrics").status_code == 200


def test_no_token_answers_loopback(admin_env):
    env = admin_env(1, token=None)
    r = env.anon.get("/admin/workers")
    assert r.status_code == 200 and r.json()["workers"][0]["name"] == "w1"


def _asgi_client(app, host: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(host, 40000)),
                             base_url="http://gateway")


@pytest.mark.parametrize("opened,status", [(False, 403), (True, 200)])
async def test_non_loopback_client_without_token(opened, status):
    """In-process ASGI transport with a forged peer address (no second host exists in a test); the real
    socket case is :func:`test_non_loopback_socket`. The app is not started: auth needs only settings."""
    app = create_app(Settings(admin=AdminConfig(open_without_token=opened)), index=MemoryIndex(),
                     with_events=False)
    async with _asgi_client(app, "203.0.113.7") as c:
        r = await c.get("/admin/workers")
        assert r.status_code == status, r.text
        if status == 403:
            err = r.json()["error"]
            assert err["type"] == "permission_error" and "loopback" in err["message"]
    # A token configured: a remote client with the token is fine, without it 401 (not 403).
    app = create_app(Settings(admin=AdminConfig(token=TOKEN)), index=MemoryIndex(), with_events=False)
    async with _asgi_client(app, "203.0.113.7") as c:
        assert (await c.get("/admin/workers")).status_code == 401
        r = await c.get("/admin/workers", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200


def _local_non_loopback_ip() -> str | None:
    """This host's address on its default route (UDP connect sends nothing), if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if is_loopback(ip) or ip == "0.0.0.0" else ip


def test_non_loopback_socket():
    """A real TCP connection to the gateway on this host's non-loopback address is refused with 403."""
    ip = _local_non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    app = create_app(Settings(), index=MemoryIndex(), with_events=False)
    srv = ThreadServer(app)
    srv.server = uvicorn.Server(uvicorn.Config(app, host="0.0.0.0", port=free_port(), log_level="warning",
                                               lifespan="on", access_log=False))
    srv.port = srv.server.config.port
    srv.start()
    try:
        with httpx.Client(timeout=30, trust_env=False) as c:
            r = c.get(f"http://{ip}:{srv.port}/admin/workers")
            assert r.status_code == 403, r.text
            assert c.get(f"http://127.0.0.1:{srv.port}/admin/workers").status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("host,expected", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("::ffff:127.0.0.1", True), ("localhost", True),
    ("10.0.0.1", False), ("203.0.113.7", False), ("::ffff:10.0.0.1", False), ("", False), (None, False),
    ("not-an-ip", False),
])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected
