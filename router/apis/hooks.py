"""What the proxy's :class:`~router.proxy.Forwarder` asks a Responses or Messages request while its
answer passes through unchanged: the usage to record (in the chat form of the decision record), the
error event that ends a stream whose worker failed, and (Responses) the response id to remember with
its owner. SSE events are read incrementally, each at most ``responses.stream_event_max_bytes`` long
(a longer one is skipped), and only those named below are decoded.
"""
from __future__ import annotations

import asyncio
import json
import logging

from router.apis import messages as msg_api
from router.apis import responses as resp_api
from router.errors import sse_error_event

log = logging.getLogger("kvgate.apis")


class SSEReader:
    """Splits a byte stream into SSE events; yields (event name, data bytes) of the wanted ones."""

    def __init__(self, wanted: tuple[bytes, ...], max_event: int) -> None:
        self.wanted, self.max_event = wanted, max_event
        self._buf = bytearray()
        self._skip = False

    def feed(self, chunk: bytes):
        self._buf += chunk
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                if len(self._buf) > self.max_event:
                    # the rest of this event is dropped; a trailing newline may be half of its end
                    del self._buf[:-1 if self._buf.endswith(b"\n") else None]
                    self._skip = True
                return
            if self._skip or end > self.max_event:
                del self._buf[:end + 2]
                self._skip = False
                continue
            raw = bytes(self._buf[:end])
            del self._buf[:end + 2]
            name, data = b"", []
            for line in raw.split(b"\n"):
                if line.startswith(b"event:"):
                    name = line[6:].strip()
                elif line.startswith(b"data:"):
                    data.append(line[5:].strip())
            if name in self.wanted:
                yield name.decode(), b"\n".join(data)


def _json(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return None


def _guarded(fn):
    """A hook never breaks the answer it reads: whatever it fails on is logged, the bytes flow on."""
    async def wrapper(self, *args):
        try:
            return await fn(self, *args)
        except Exception as e:
            log.warning("%s.%s failed: %s: %s", type(self).__name__, fn.__name__, type(e).__name__, e)
            return args[-1] if fn.__name__ == "on_body" else None

    wrapper.__name__ = fn.__name__
    return wrapper


class Hooks:
    """Defaults: the chat shapes (used by the proxy when a request has no hooks)."""

    def __init__(self, state) -> None:
        self.st = state
        self.usage: dict | None = None
        self.complete = False  # the stream's final event was seen (a client may close right after it)

    async def on_body(self, status: int, raw: bytes) -> bytes:
        return raw

    async def on_chunk(self, chunk: bytes) -> None:
        return None

    def stream_error(self, message: str) -> bytes:
        return sse_error_event(message)


class ResponsesHooks(Hooks):
    """Remembers each created response id with the worker that made it (and the conversation a follow-up
    will carry), before the client can see the id."""

    _FINAL = (b"response.completed", b"response.incomplete", b"response.failed")

    def __init__(self, state, decision, body: dict) -> None:
        super().__init__(state)
        self.d, self.body = decision, body
        self.store = body.get("store", True) is not False
        self.reader = SSEReader((b"response.created",) + self._FINAL,
                                state.settings.responses.stream_event_max_bytes)

    async def _remember(self, response: dict, final: bool) -> None:
        rid = response.get("id")
        if not self.store or not isinstance(rid, str) or not self.d.chosen:
            return
        delta = None
        if final and response.get("status") in ("completed", "incomplete"):
            delta = resp_api.turn_messages(self.body, response)
            if delta is not None and len(json.dumps(delta)) > self.st.settings.responses.turn_max_bytes:
                delta = None
        parent = self.body.get("previous_response_id")
        await put_owner(self.st, rid, {"worker": self.d.chosen, "model": self.d.model,
                                       "parent": parent if isinstance(parent, str) else None, "delta": delta})

    @_guarded
    async def on_body(self, status: int, raw: bytes) -> bytes:
        if status >= 400:
            return raw
        obj = _json(raw)
        if isinstance(obj, dict):
            self.usage = resp_api.usage_as_chat(obj.get("usage"))
            await self._remember(obj, final=obj.get("status") not in ("queued", "in_progress"))
        return raw

    @_guarded
    async def on_chunk(self, chunk: bytes) -> None:
        for name, data in self.reader.feed(chunk):
            obj = _json(data)
            resp = obj.get("response") if isinstance(obj, dict) else None
            if not isinstance(resp, dict):
                continue
            final = name != "response.created"
            if final:
                self.usage = resp_api.usage_as_chat(resp.get("usage"))
                self.complete = True
            await self._remember(resp, final=final)

    def stream_error(self, message: str) -> bytes:
        body = {"type": "error", "code": "upstream_error", "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


class MessagesHooks(Hooks):
    """Anthropic usage (``message_delta`` carries the cache figures) and error shapes."""

    def __init__(self, state) -> None:
        super().__init__(state)
        self.reader = SSEReader((b"message_start", b"message_delta", b"message_stop"),
                                state.settings.responses.stream_event_max_bytes)

    @_guarded
    async def on_body(self, status: int, raw: bytes) -> bytes:
        obj = _json(raw)
        if status >= 400:
            if isinstance(obj, dict) and obj.get("type") == "error":
                return raw
            err = obj.get("error") if isinstance(obj, dict) else None
            message = err.get("message") if isinstance(err, dict) else None
            if not isinstance(message, str):
                message = (obj.get("detail") if isinstance(obj, dict) and isinstance(obj.get("detail"), str)
                           else raw.decode("utf-8", "replace")[:2000])
            return json.dumps(msg_api.error_body(status, message)).encode()
        if isinstance(obj, dict):
            self.usage = msg_api.usage_as_chat(obj.get("usage"))
        return raw

    @_guarded
    async def on_chunk(self, chunk: bytes) -> None:
        for name, data in self.reader.feed(chunk):
            if name == "message_stop":
                self.complete = True
                continue
            obj = _json(data)
            if not isinstance(obj, dict):
                continue
            usage = obj.get("usage") if name == "message_delta" else (obj.get("message") or {}).get("usage")
            u = msg_api.usage_as_chat(usage)
            if u is not None:
                self.usage = u

    def stream_error(self, message: str) -> bytes:
        return msg_api.sse_error_event(message)


async def put_owner(st, response_id: str, record: dict) -> None:
    """Record an owner; an unreachable store costs the chain, never the response being answered."""
    try:
        await asyncio.wait_for(st.owners.put(response_id, record), st.settings.index.timeout_s)
    except Exception as e:
        log.warning("could not record the owner of response %s: %s: %s", response_id, type(e).__name__, e)
