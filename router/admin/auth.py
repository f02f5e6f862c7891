"""Who may call ``/admin``: a bearer token when one is configured, else loopback clients only.

- ``settings.admin.token`` set: every call needs ``Authorization: Bearer <token>``; the comparison is
  constant-time (``hmac.compare_digest``) so response timing leaks nothing about the token. Missing or wrong
  -> 401 with ``WWW-Authenticate: Bearer``.
- No token: only clients on a loopback address are answered (403 otherwise), unless
  ``settings.admin.open_without_token`` says the operator has put the API behind something else.
"""
from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request
from starlette.exceptions import HTTPException


class AdminAuthError(HTTPException):
    """401/403, rendered in the OpenAI error format by the app's handlers; 401 carries the challenge."""

    def __init__(self, status: int, message: str) -> None:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        super().__init__(status, detail=message, headers=headers)


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_admin(settings_admin, authorization: str | None, client_host: str | None) -> None:
    """Raise :class:`AdminAuthError` unless the caller may use the admin API."""
    token = settings_admin.token
    if token:
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise AdminAuthError(401, "the admin API needs 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise AdminAuthError(401, "invalid admin token")
        return
    if settings_admin.open_without_token or is_loopback(client_host):
        return
    raise AdminAuthError(
        403, "no admin token is configured, so the admin API answers loopback clients only "
             "(set admin.token, or admin.open_without_token to open it)")


async def require_admin(request: Request) -> None:
    """FastAPI dependency guarding every admin route."""
    state = request.app.state.kv
    client = request.client.host if request.client else None
    check_admin(state.settings.admin, request.headers.get("authorization"), client)
