"""The worker registry: which vLLM servers exist, which models they serve, their block size, load and
health, and the subscription of their KV events.

Per worker it reads ``/v1/models``, ``/kv_event_sources`` (unless the events endpoint is configured) and
``/metrics`` (``vllm:cache_config_info`` for the block size; running/waiting/KV usage gauges), and checks
``/health`` periodically. A worker that fails ``unhealthy_after`` checks in a row, or refuses a connection,
leaves the candidate set; it returns when a check passes.

Coming back is not evidence of a restart (a flap, a keep-alive race, a readiness blip): the worker's index
entries stay and its event stream is asked to replay what it missed (``EventIngestor.resync``). A worker
whose port refuses ``unhealthy_after`` health checks in a row is down (the process is gone, and its KV
cache with it): its entries are dropped then. Only
evidence counts as a restart: vLLM's ``process_start_time_seconds`` on ``/metrics`` changing (then the
entries are dropped and the events re-subscribed from scratch), or the event stream itself (its sequence
going backwards, ``AllBlocksCleared``), which the ingestor handles in its apply order. A worker that
leaves discovery (Kubernetes readiness) stops taking requests at once and is removed only after
``lost_grace_s``; back within it, it keeps its entries.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import weakref

from indexer.events.state import local_g4_member
from indexer.events.subscriber import resolve_endpoint
from router.calibrate import EngineCalibration
from router.config import Settings, WorkerConfig
from router.load import ActiveSequences
from router.upstream import Upstream, UpstreamError
from router.vllm_metrics import parse_metrics, wanted_metrics
from router.worker import RankTarget, Worker, WorkerLoad, index_names, resolve_g4, worker_name

log = logging.getLogger("kvgate.registry")

# The most entries of one worker's ``/kv_event_sources`` read. Each rank is a routing target with its own
# event subscription (two ZMQ sockets) and its own parse of every ``/metrics`` scrape, and each left-out
# entry a line in ``skipped_sources``: a malformed or hostile worker listing millions took the gateway's
# memory and loop with it. vLLM's data-parallel sizes behind one API server are far below this.
MAX_DP_RANKS = 1024


_RANK_NAME = re.compile(r".+@dp\d+")


class DuplicateWorker(ValueError):
    """A worker name or URL that is registered already; ``param`` says which."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class WorkerRegistry:
    """Workers by name. ``add``/``remove``/``drain`` work at run time (the admin API calls them)."""

    def __init__(self, settings: Settings, index, ingestor=None, metrics=None):
        self.settings = settings
        # health checks, scrapes, models and event sources: their own pool (router/upstream.py)
        self.control = Upstream(settings, timeout_s=settings.health_timeout_s)
        self.index = index
        self.ingestor = ingestor
        self.metrics = metrics
        self._workers: dict[str, Worker] = {}
        self._task: asyncio.Task | None = None
        self._last_refresh: dict[str, float] = {}
        self._subscribed: dict[str, dict[str, tuple]] = {}  # server -> {index name: its subscribed source}
        self._targets: dict[str, RankTarget] = {}  # rank targets of data-parallel servers, by name
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # Called with a worker each time it becomes routable (first time, or back after a failure), once
        # its events are subscribed: the gateway runs the parity check there (router/parity.py).
        self.on_ready = None
        self.on_removed = None  # called with each index name of a removed worker (the parity checker's)
        # Called with a worker's name whenever its index entries are dropped (restart, removal).
        self.on_cleared = None
        # Called with (worker, computed tokens, seconds, requests, prompt tokens) of prefills vLLM finished
        # between two scrapes.
        self.on_prefill = None
        self.on_engine = None  # (worker, EngineSample) per scrape
        self._discovery = None

    # --- queries -------------------------------------------------------------------------------
    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def get(self, name: str) -> Worker | None:
        """The server named ``name``, or the server of the rank target named so."""
        t = self._targets.get(name)
        return t.server if t is not None else self._workers.get(name)

    def target(self, name: str):
        """The routing target named ``name`` (a candidate's ``worker``): a rank of a data-parallel server
        (:class:`RankTarget`) or a server."""
        return self._targets.get(name) or self._workers.get(name)

    def models(self) -> dict[str, list[Worker]]:
        """Every model id (base models and LoRA adapters) -> workers that list it."""
        out: dict[str, list[Worker]] = {}
        for w in self._workers.values():
            for mid in w.models:
                out.setdefault(mid, []).append(w)
        return out

    def knows_model(self, model: str) -> bool:
        return any(model in w.models for w in self._workers.values()) or model in self.settings.models

    def candidates(self, model: str) -> list[Worker]:
        """Routing targets serving ``model`` on healthy, non-draining servers: each rank of a data-parallel
        server, every other server itself."""
        return [t for w in self._workers.values() if w.routable and model in w.models for t in w.targets()]

    def namespace(self, model: str) -> tuple[str, str | None]:
        """(index namespace, LoRA name) of a model id: a LoRA adapter lives in its base model's namespace."""
        for w in self._workers.values():
            info = w.models.get(model)
            if info is not None and info.get("parent"):
                return info["parent"], model
        return model, None

    def block_size(self, model: str) -> int:
        cfg = self.settings.models.get(model)
        if cfg is not None and cfg.block_size:
            return cfg.block_size
        ns, _ = self.namespace(model)
        if ns != model and ns in self.settings.models and self.settings.models[ns].block_size:
            return self.settings.models[ns].block_size
        for w in self._workers.values():
            if w.block_size and (model in w.models):
                return w.block_size
        return 16

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start discovery (static workers or Kubernetes), probe what it announced, start health checks."""
        from router.discovery import create_discovery

        self._discovery = create_discovery(self.settings, self._on_discovered, self._on_lost)
        await self._discovery.start()
        await asyncio.gather(*(self._probe(w, full=True) for w in self.workers() if not w.last_check),
                             return_exceptions=True)
        self._task = asyncio.create_task(self._loop(), name="kvgate-health")

    async def _on_discovered(self, cfg: WorkerConfig) -> None:
        w = self._workers.get(worker_name(cfg))
        if w is not None and w.lost_at is not None:
            if w.url == cfg.url.rstrip("/") and w.config == cfg:
                w.lost_at = None  # back within the grace period: a readiness flap, entries kept
                log.info("worker %s back in discovery", w.name)
                return
            await self._remove(w)
        await self.add(cfg, probe=self._task is not None)

    async def _on_lost(self, name: str) -> None:
        """Out of routing now; removed (and its entries dropped) only if it stays away ``lost_grace_s``."""
        w = self._workers.get(name)
        if w is None:
            return
        if self.settings.lost_grace_s <= 0:
            await self._remove(w)
        elif w.lost_at is None:
            w.lost_at = time.monotonic()
            self._unhold(w)
            log.info("worker %s left discovery; removed in %.0f s unless it returns", name,
                     self.settings.lost_grace_s)

    async def stop(self) -> None:
        if self._discovery is not None:
            try:
                await self._discovery.stop()
            except Exception as e:
                log.warning("stopping discovery: %s", e)
            self._discovery = None
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        await self.control.close()

    async def add(self, cfg: WorkerConfig, *, probe: bool = True) -> Worker:
        name = worker_name(cfg)
        if _RANK_NAME.fullmatch(name):  # <server>@dp<r> names a data-parallel rank's stream and index key
            raise DuplicateWorker(f"worker name {name!r} is reserved for data-parallel ranks "
                                  "(<server>@dp<r>)", "name")
        url = cfg.url.rstrip("/")
        same = self._check_free(name, url, lost=True)
        if same is not None:
            await self._remove(same)  # a pod gone from discovery whose IP a new pod reuses
        r = self.settings.routing
        w = Worker(name=name, url=url, config=cfg,
                   active=ActiveSequences(float(r.queued_request_tokens)),
                   engine=EngineCalibration(r.step_ms / 1000.0, r.per_decode_ms / 1000.0,
                                            r.request_overhead_ms / 1000.0))
        w.prefetch_url, w.g4_tier, w.g4_member = resolve_g4(cfg, self.settings, w.host)
        # A removal of this name still clearing its entries finishes first (they would be this worker's);
        # checked again then: the awaits let a concurrent add of the name or URL in.
        async with self._lock(name):
            self._check_free(name, url, lost=False)
            self._workers[name] = w
            if self.metrics is not None:
                self.metrics.revive_worker(name)
        if probe:
            await self._probe(w, full=True)
            if not self._present(w):
                raise DuplicateWorker(f"worker {name!r} was removed while it was being added", "name")
        return w

    def _check_free(self, name: str, url: str, *, lost: bool) -> Worker | None:
        """Raises :class:`DuplicateWorker` when the name or the URL is registered already (one server
        counted twice would get twice its share); with ``lost``, a worker gone from discovery on the URL is
        returned instead, for the caller to remove."""
        if name in self._workers or name in self._targets:
            raise DuplicateWorker(f"worker {name!r} already exists", "name")
        same = next((o for o in self._workers.values() if o.url == url), None)
        if same is not None and not (lost and same.lost_at is not None):
            raise DuplicateWorker(f"worker {same.name!r} already has the URL {url}", "url")
        return same

    def _lock(self, name: str) -> asyncio.Lock:
        """The lock of a worker name, held across the awaits that add, clear or (re)subscribe it: a removal
        still clearing the name's entries and forgetting its series must not meet a same-name worker added
        meanwhile (a StatefulSet pod back on a new IP), whose entries and verdict it would wipe. Kept while
        held or awaited (weak values): one lock per name in use, not per name ever seen."""
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    @staticmethod
    def _unhold(w: Worker) -> None:
        """Out of routing: the requests held at its prefill gates (router/admission.py), every rank's of a
        data-parallel server, go elsewhere now."""
        for t in getattr(w, "server", w).targets():
            t.gate.release_all()

    async def remove(self, name: str) -> Worker:
        w = self._workers.get(name)
        if w is None:
            raise KeyError(name)
        await self._remove(w)
        return w

    async def _remove(self, w: Worker) -> None:
        """Out of the registry at once (the name free for a new worker); its events, entries and series
        dropped under the name's lock, so a same-name worker added meanwhile is registered only after."""
        if not self._present(w):
            return  # removed already (another removal of it got here first)
        del self._workers[w.name]
        self._last_refresh.pop(w.name, None)
        w.draining = True  # what still holds it (a request in flight, one held at its gate) sees it gone
        self._unhold(w)
        async with self._lock(w.name):
            await self._unsubscribe(w)
            await self._clear_index(w, local_g4=True)
            for n in index_names(w):
                self._forget(n)
            for t in w.ranks:
                self._targets.pop(t.name, None)

    def _forget(self, name: str) -> None:
        """A routing target gone (a removed worker, a rank its server no longer lists): its metric series
        and parity verdict go with it."""
        if self.metrics is not None:
            self.metrics.forget_worker(name)
        if self.on_removed is not None:
            self.on_removed(name)

    async def drain(self, name: str, draining: bool = True) -> Worker:
        """No new requests go to a draining worker; in-flight ones finish."""
        w = self._workers.get(name)
        if w is None:
            raise KeyError(name)
        w.draining = draining
        if draining:
            self._unhold(w)
        return w

    def mark_failed(self, w: Worker, reason: str) -> None:
        """Passive health: a refused connection takes the worker out until a health check passes."""
        w.last_error = reason
        if w.healthy:
            log.warning("worker %s unhealthy: %s", w.name, reason)
        w.healthy = False
        w.failures = max(w.failures, self.settings.unhealthy_after)
        self._unhold(w)

    async def on_events_reset(self, worker: str, reason: str = "restart") -> None:
        """The ingestor reset the worker's entries (sequence went backwards: a restart; or an unfillable
        gap). The ingestor already cleared the index in its apply order: clearing again here would race
        with what it stores next, so only the gateway-side bookkeeping follows."""
        w = self.target(worker)  # the stream of one rank: that rank's entries were reset
        if w is None:
            return
        if reason == "restart":
            w.restarts += 1
        if self.on_cleared is not None:
            self.on_cleared(w.name)

    async def _down(self, w: Worker) -> None:
        """Nothing listens on the worker's port any more, check after check: the process is gone and its
        KV cache with it. Drop the entries now (not only when a new process shows up) and stay subscribed
        for the one that comes back; its first scrape is not compared with the old process's start."""
        async with self._lock(w.name):
            if not self._present(w):
                return  # removed while this probe waited: its entries went with it
            log.info("worker %s is down (connection refused): dropping its index entries", w.name)
            w.down = True
            await self._unsubscribe(w)
            await self._clear_index(w)
            await self._subscribe(w)
            w.load.process_start = None

    async def _restarted(self, w: Worker, reason: str) -> None:
        """Evidence of a restart outside the event stream: drop the entries and subscribe afresh (the
        new source replays what the new process's publisher already buffers)."""
        async with self._lock(w.name):
            if not self._present(w):
                return
            log.info("worker %s restarted (%s): dropping its index entries", w.name, reason)
            await self._unsubscribe(w)
            await self._clear_index(w)
            await self._subscribe(w)
            w.restarts += 1

    # --- probing -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        interval = max(0.05, self.settings.health_interval_s)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            jobs = []
            for w in self.workers():
                if w.lost_at is not None and now - w.lost_at >= self.settings.lost_grace_s:
                    jobs.append(self._remove_lost(w.name))
                    continue
                full = now - self._last_refresh.get(w.name, 0.0) >= self.settings.refresh_interval_s
                jobs.append(self._probe(w, full=full))
            for res in await asyncio.gather(*jobs, return_exceptions=True):
                if isinstance(res, Exception):  # a bug: said, not swallowed (the next tick probes again)
                    log.error("health check failed: %s: %s", type(res).__name__, res, exc_info=res)

    async def _remove_lost(self, name: str) -> None:
        w = self._workers.get(name)
        if w is not None and w.lost_at is not None:
            log.info("worker %s did not return to discovery: removed", name)
            await self._remove(w)

    async def _get(self, w: Worker, path: str) -> tuple[int, bytes]:
        """``GET`` a worker's control path: (status, body); raises UpstreamError."""
        return await self.control.get(w.url + path)

    async def _probe(self, w: Worker, *, full: bool) -> None:
        """Health check, load scrape, and (``full``) models and event sources."""
        w.last_check = time.time()
        try:
            status, _ = await self._get(w, "/health")
            ok = status == 200
            reason = None if ok else f"/health answered {status}"
        except UpstreamError as e:
            ok, reason = False, f"/health: {e.kind}: {e}"
            # only a refused port says the process is gone (its entries dropped, a restart counted when it
            # answers again); a DNS or routing blip on a live worker did both
            refused = e.refused
        else:
            refused = False
        if not ok:
            w.failures += 1
            w.last_error = reason
            if w.healthy and w.failures >= self.settings.unhealthy_after:
                log.warning("worker %s unhealthy: %s", w.name, reason)
                w.healthy = False
                self._unhold(w)
            w.refused = w.refused + 1 if refused else 0
            if w.refused >= self.settings.unhealthy_after and w.ever_healthy and not w.down:
                await self._down(w)
            return
        returning = not w.healthy
        if w.down:
            w.restarts += 1  # nothing listened, now something does: a new process
        w.failures = w.refused = 0
        w.down = False
        flapped = returning and w.ever_healthy
        if flapped:
            full = True  # refresh models and event sources; the scrape below tells a restart
        if full or not w.models:
            await self._refresh_models(w)
            if self._present(w):  # a removed worker's entry would never be dropped
                self._last_refresh[w.name] = time.monotonic()
        block_size = w.block_size
        await self._scrape(w)
        if not self._present(w):
            return  # removed while this probe waited on the worker: nothing more to do for it
        if returning:
            if not w.models:
                return  # healthy but serves nothing we know yet: try again next tick
            w.healthy = True
            w.ever_healthy = True
            w.last_error = None
            log.info("worker %s healthy (%s)", w.name, ", ".join(w.models))
        # a block size changed without a process start read (vLLM with --api-server-count > 1 exports
        # none): a new process the subscription's size is wrong for
        resized = block_size is not None and w.block_size != block_size
        subscribed = False
        if full or returning or resized:
            async with self._lock(w.name):  # not into a removal's unsubscribe, nor a same-name worker's
                if not self._present(w):
                    return
                subscribed = await self._subscribe(w)
                resync = getattr(self.ingestor, "resync", None)
                if flapped and resync is not None:  # no restart seen: keep the entries, replay what was missed
                    for name in self._subscribed.get(w.name, ()):
                        resync(name)
        # Ready again, or ready with a new event stream (its sources could not be read when it came up,
        # or they changed): the parity check (router/parity.py) needs the stream it checks.
        if (returning or subscribed) and self.on_ready is not None:
            self.on_ready(w)

    async def _refresh_models(self, w: Worker) -> None:
        try:
            status, body = await self._get(w, "/v1/models")
            if status != 200:
                raise ValueError(f"answered {status}")
            data = json.loads(body).get("data", [])
            if not isinstance(data, list):
                raise ValueError("`data` is not a list")
            w.models = {m["id"]: {"parent": m.get("parent"), "root": m.get("root"),
                                  "max_model_len": m.get("max_model_len"), "card": m}
                        for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]}
        except (UpstreamError, ValueError, AttributeError) as e:
            w.last_error = f"/v1/models: {e}"
        if w.config.events_endpoint:
            w.event_sources = [{"rank": 0, "endpoint": resolve_endpoint(w.config.events_endpoint, w.url),
                                "replay_endpoint": resolve_endpoint(w.config.replay_endpoint, w.url),
                                "topic": ""}]
            return
        try:
            status, body = await self._get(w, "/kv_event_sources")
            if status == 200 and self._present(w):  # a removed worker's ranks are no targets any more
                self._set_sources(w, json.loads(body))
        except (UpstreamError, ValueError) as e:
            w.last_error = f"/kv_event_sources: {e}"

    def _set_sources(self, w: Worker, data) -> None:
        """Take ``/kv_event_sources`` (``{"<dp rank>": KVEventsConfig}``): one event source per rank, and
        with more than one rank listed a :class:`RankTarget` per rank. A rank that cannot be subscribed (no
        endpoint, events off, a value that is no object) stays a target without events; a key that is no
        rank number is ignored. Each left-out rank is listed in ``w.skipped_sources`` and logged when that
        list changes; the other ranks stand. Only the first ``MAX_DP_RANKS`` entries are read; a rank no
        longer listed loses its metric series."""
        srcs: dict[int, dict] = {}
        skipped: list[dict] = []
        for i, (key, cfg) in enumerate(data.items() if isinstance(data, dict) else [(None, data)]):
            if i == MAX_DP_RANKS:
                skipped.append({"rank": None, "reason": f"{len(data) - i} more entries not read (at most "
                                                        f"{MAX_DP_RANKS})"})
                break
            if not (isinstance(key, str) and key.isascii() and key.isdigit()):
                skipped.append({"rank": key, "reason": "not a data-parallel rank"})
                continue
            rank = int(key)
            endpoint = cfg.get("endpoint") if isinstance(cfg, dict) else None
            if not isinstance(cfg, dict):
                skipped.append({"rank": rank, "reason": "no config"})
                srcs[rank] = {}
            elif not cfg.get("enable_kv_cache_events", True):
                skipped.append({"rank": rank, "reason": "KV events off"})
                srcs[rank] = {}
            elif not endpoint or not isinstance(endpoint, str):
                skipped.append({"rank": rank, "reason": "no endpoint"})
                srcs[rank] = {}
            else:
                replay = cfg.get("replay_endpoint")
                replay = resolve_endpoint(replay, w.url) if isinstance(replay, str) else None
                srcs[rank] = {"rank": rank, "endpoint": resolve_endpoint(endpoint, w.url),
                              "replay_endpoint": replay, "topic": str(cfg.get("topic") or "")}
        if skipped != w.skipped_sources and skipped:
            log.warning("worker %s: event sources left out: %s", w.name,
                        ", ".join(f"rank {s['rank']!r} ({s['reason']})" for s in skipped))
        w.skipped_sources = skipped
        w.event_sources = [srcs[r] for r in sorted(srcs) if srcs[r]]
        old = {t.dp_rank: t for t in w.ranks}
        w.ranks = [] if len(srcs) < 2 else [old.get(r) or RankTarget(w, r) for r in sorted(srcs)]
        for t in old.values():
            self._targets.pop(t.name, None)
            if t.dp_rank not in srcs or not w.ranks:
                self._forget(t.name)
        for t in w.ranks:
            t.event_sources = [srcs[t.dp_rank]] if srcs[t.dp_rank] else []
            self._targets[t.name] = t
            if self.metrics is not None:
                self.metrics.revive_worker(t.name)

    async def _scrape(self, w: Worker) -> None:
        ranks = list(w.ranks)
        # the page describes the moment it is asked for: the trackers' state then, not after the awaits
        snaps = [t.active.scrape_snapshot() for t in ranks or [w]]
        try:
            status, body = await self._get(w, "/metrics")
            if status != 200:
                return

            def parse(text: str = body.decode("utf-8", "replace")) -> list:
                text = wanted_metrics(text)  # once for the server and its ranks
                return [parse_metrics(text, kept=True)] + [parse_metrics(text, str(t.dp_rank), kept=True)
                                                           for t in ranks]

            (load, bs), *per_rank = await asyncio.to_thread(parse)
        except (UpstreamError, ValueError) as e:
            w.last_error = f"/metrics: {e}"
            return
        w.metrics_rejected += load.rejected
        before = w.load.process_start
        # Prefills finished since the last scrape calibrate the target that ran them: each rank, or the
        # server. The first scrape compares with zero: what the server did before this gateway saw it
        # (warm-up, earlier traffic) calibrates it at once, instead of the priors routing the first burst.
        done = []
        for (t, tload), snap in zip(list(zip(ranks, (lo for lo, _ in per_rank))) or [(w, load)], snaps):
            then = t.load if t.load.updated_at else WorkerLoad(running=tload.running, computed_tokens=(
                None if tload.computed_tokens is None else 0.0))
            done.append((t, tload.prefill_since(then), tload.engine_since(then)))
            t.load = tload
            t.active.mark_scrape(tload.waiting, snap)  # the usage includes what the gateway's requests took
        w.load = load
        if bs:  # before the restart check: a new process's events are subscribed with its own block size
            w.block_size = bs
        if before is not None and load.process_start is not None and load.process_start != before:
            await self._restarted(w, "process_start_time_seconds changed")
        elif self.ingestor is not None and not w.down:
            record = getattr(self.ingestor, "record_incarnation", None)
            for name in self._subscribed.get(w.name, ()) if record is not None else ():
                inc = self._incarnation(w, name)
                if inc is not None:
                    await record(name, inc)
        for t, d, engine in done:
            if d is not None and self.on_prefill is not None:
                self.on_prefill(t, *d)
            if self.on_engine is not None:
                self.on_engine(t, engine)

    async def _subscribe(self, w: Worker) -> bool:
        """Subscribe to each of the worker's event streams (one per routing target: the server, or each
        rank, under its index name) unless already subscribed to it; True when a new subscription was
        made. A stream that fails to subscribe leaves the others subscribed; a stream no longer listed
        (a rank gone, or left without an endpoint) is unsubscribed and its entries dropped."""
        model = w.base_model()
        if self.ingestor is None or model is None or not self._present(w):
            return False
        from indexer.events import EventSource

        # The block size is part of the subscription: a new process may run another (a rolling restart with
        # another --block-size). None while the worker is down: the process that comes back tells its own,
        # its source learns it from that process's events.
        bs = None if w.down else w.block_size
        want = {t.name: (model, s["endpoint"], s["replay_endpoint"], s["topic"], bs)
                for t in w.targets() for s in t.event_sources[:1]}
        if not want:  # no stream known (yet): what is subscribed stays
            return False
        have = self._subscribed.setdefault(w.name, {})
        for name in [n for n in have if n not in want]:
            await self._remove_source(have, name, clear=True)
        new = False
        for name, key in want.items():
            old = have.get(name)
            if old == key:
                continue
            if old is not None and old[:-1] == key[:-1] and old[-1] is None:
                have[name] = key  # subscribed before the size was known: its source learns it from events
                continue
            have.pop(name, None)  # add_source replaces the old stream of that name, entries kept
            try:
                await self.ingestor.add_source(EventSource(
                    worker=name, model=model, endpoint=key[1], replay_endpoint=key[2], topic=key[3],
                    block_size=bs, worker_url=w.url, g4_member=self._g4_writes(w, name),
                    incarnation=self._incarnation(w, name)))
            except Exception as e:  # a bad endpoint must not take the worker (or its other ranks) out
                w.last_error = f"events of {name}: {type(e).__name__}: {e}"
                log.warning("subscribing to the events of %s: %s", name, e)
                continue
            if not self._present(w):  # removed while this subscribed: nothing would ever unsubscribe it
                await self._remove_source(have, name, clear=True)
                return False
            have[name] = key
            new = True
        return new

    def _present(self, w: Worker) -> bool:
        """``w`` is still this registry's worker of its name: a probe in flight when it was removed (an admin
        add's own, or a health check of a worker coming back) resumes after the removal and must not
        subscribe it again (its source would write entries for a worker nobody knows)."""
        return self._workers.get(w.name) is w

    @staticmethod
    def _target(w: Worker, name: str) -> Worker:
        """The routing target (the server, or one of its ranks) whose event stream is ``name``."""
        return next((t for t in w.targets() if t.name == name), w)

    def _incarnation(self, w: Worker, name: str) -> str | None:
        """The engine process behind the stream (its process start, from the last scrape); None while
        unknown, and for a worker that is down (the start read last is the dead process's)."""
        start = self._target(w, name).load.process_start
        return None if start is None or w.down else repr(start)

    def _g4_writes(self, w: Worker, name: str) -> str | None:
        return self._target(w, name).g4_writes()

    async def _remove_source(self, have: dict[str, tuple], name: str, clear: bool) -> None:
        have.pop(name, None)
        try:
            await self.ingestor.remove_source(name, clear=clear)
        except Exception as e:  # never let the event side break the registry
            log.warning("removing event source of %s: %s", name, e)

    async def _unsubscribe(self, w: Worker, clear: bool = True) -> None:
        have = self._subscribed.pop(w.name, None)
        if self.ingestor is None or not have:
            return
        for name in list(have):
            await self._remove_source(have, name, clear)

    async def _clear_index(self, w: Worker, local_g4: bool = False) -> None:
        """Drop the worker's entries; ``local_g4`` (it leaves the fleet) also its LOCAL G4 entries, which
        a restart keeps (the files outlive the process)."""
        names = index_names(w)
        if self.on_cleared is not None:
            for n in names:
                self.on_cleared(n)
        models = {self.namespace(m)[0] for m in w.models} or set()
        try:
            models.update(await self.index.models())
        except Exception:
            pass
        if local_g4:
            names = names + [local_g4_member(n) for n in names]
        for m in models:
            for n in names:
                try:
                    await self.index.clear_worker(m, n)
                except Exception as e:
                    log.warning("clearing index entries of %s/%s: %s", n, m, e)
