"""ZMQ sockets of one event source: a SUB for the live stream and a DEALER for replay (vllm-interface 1.7).

Replay: the DEALER sends ``[b"", start_seq_be8]``; the publisher's ROUTER answers one message per buffered
batch with ``seq >= start``, ``[b"", topic, seq_be8, payload]`` (``[b"", seq_be8, payload]`` in an older
revision), then the end marker ``[b"", b"", ff*8, b""]``. Every receive has a timeout; after a timeout the
DEALER is closed (a late answer must not be mistaken for the next replay's).

Live: the SUB sends nothing after its subscription, so a publisher whose host vanished without a FIN or
RST (a partition that outlived the publisher's TCP retries, a power-cycled host) left it waiting on a dead
connection for ever, also once the publisher was back. ZMTP heartbeats (``heartbeat_s``): the SUB pings
every ``heartbeat_s``, and a connection silent for 3 x that (no pong, no message) is dropped and dialled
again; the publisher (libzmq answers pings itself) is told to drop ours after as long.
"""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

END_SEQ = b"\xff" * 8


class ReplayError(RuntimeError):
    """The replay endpoint did not answer in time or answered garbage."""


def resolve_endpoint(endpoint: str | None, worker_url: str | None) -> str | None:
    """Replace a wildcard host (``tcp://*:5557``, ``0.0.0.0``, ``::``) by the worker's host, as vLLM
    reports the configured endpoint unchanged when it binds every interface. The worker is a URL or a
    bare host; no endpoint stays None."""
    if not endpoint or not worker_url or not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep:
        return endpoint
    if host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        whost = urlsplit(worker_url if "//" in worker_url else f"http://{worker_url}").hostname
        if not whost:
            return endpoint
        if ":" in whost:
            whost = f"[{whost}]"
        return f"tcp://{whost}:{port}"
    return endpoint


class Subscriber:
    """The sockets of one source. Not thread-safe; used by one asyncio task at a time per socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        timeout_s: float = 5.0,
        max_replay: int = 100_000,
        heartbeat_s: float | None = 5.0,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.timeout_s = timeout_s
        self.max_replay = max_replay
        self.connected = False
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        if heartbeat_s:
            ivl = max(1, round(heartbeat_s * 1000))
            self.sub.setsockopt(zmq.HEARTBEAT_IVL, ivl)
            self.sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
            self.sub.setsockopt(zmq.HEARTBEAT_TTL, min(3 * ivl, 6_553_500))  # the option's limit
        if "[" in endpoint:
            self.sub.setsockopt(zmq.IPV6, 1)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._monitor = self.sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        )
        self.sub.connect(endpoint)
        self._dealer: zmq.asyncio.Socket | None = None
        self._watch = asyncio.ensure_future(self._watch_connection())

    async def _watch_connection(self) -> None:
        try:
            while True:
                msg = parse_monitor_message(await self._monitor.recv_multipart())
                if msg["event"] == zmq.EVENT_CONNECTED:
                    self.connected = True
                elif msg["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    self.connected = False
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    async def recv(self) -> list[bytes]:
        """The next live message's frames (waits as long as the source is quiet)."""
        return await self.sub.recv_multipart()

    def _dealer_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            d = self.ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            if "[" in (self.replay_endpoint or ""):
                d.setsockopt(zmq.IPV6, 1)
            d.connect(self.replay_endpoint)
            self._dealer = d
        return self._dealer

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None

    async def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Buffered batches with ``seq >= start_seq``, in order, from the replay endpoint."""
        if not self.replay_endpoint:
            raise ReplayError("no replay endpoint")
        d = self._dealer_socket()
        out: list[tuple[int, bytes]] = []
        try:
            await asyncio.wait_for(d.send_multipart([b"", start_seq.to_bytes(8, "big")]), self.timeout_s)
            while True:
                frames = await asyncio.wait_for(d.recv_multipart(), self.timeout_s)
                if len(frames) < 3 or frames[0] != b"":
                    raise ReplayError(f"unexpected replay reply of {len(frames)} frames")
                seq_b, payload = frames[-2], frames[-1]
                if seq_b == END_SEQ:
                    return out
                if len(seq_b) != 8:
                    raise ReplayError("bad sequence frame in replay")
                if len(out) >= self.max_replay:
                    raise ReplayError("replay longer than max_replay")
                out.append((int.from_bytes(seq_b, "big"), payload))
        except TimeoutError:
            self._drop_dealer()
            raise ReplayError(f"replay from {self.replay_endpoint} timed out") from None
        except ReplayError:
            self._drop_dealer()
            raise

    def close(self) -> None:
        self._watch.cancel()
        self._drop_dealer()
        try:
            self.sub.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self.sub.close(0)
