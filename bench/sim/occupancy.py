"""How much of the fleet's KV cache holds the same blocks twice, sampled during a replay.

A fixed fleet capacity serves the most prompts when each block is resident on one worker only: every
duplicate copy is capacity that no other prefix can use. This is a property of the router's placement, so
it is measured the same way for every target, peers included, from the simulated workers' own caches
(``GET /sim/cached``), never from the router's view of them.
"""
from __future__ import annotations

import threading

import httpx


def cached_hashes(client: httpx.Client, url: str) -> list[int]:
    """The engine block hashes a simulated worker's prefix cache holds (``GET /sim/cached``)."""
    return client.get(url.rstrip("/") + "/sim/cached").json()["hashes"]


def duplication(per_worker: list[list[int]]) -> dict:
    """``resident``: blocks held, summed over workers; ``distinct``: blocks held by at least one;
    ``dup_share``: the share of resident blocks that are a second or later copy (0: no block twice)."""
    resident = sum(len(h) for h in per_worker)
    distinct = len(set().union(*per_worker))
    return {"resident": resident, "distinct": distinct,
            "dup_share": (resident - distinct) / resident if resident else 0.0}


class OccupancySampler:
    """Samples every ``every_s`` wall seconds in a thread (the replay owns the event loop) and once more
    at :meth:`stop`. A worker that does not answer is left out of that sample."""

    def __init__(self, worker_urls: list[str], every_s: float = 15.0, timeout_s: float = 10.0) -> None:
        self.urls, self.every_s, self.timeout_s = list(worker_urls), every_s, timeout_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="occupancy", daemon=True)

    def sample(self) -> dict | None:
        per_worker = []
        with httpx.Client(timeout=self.timeout_s) as client:
            for u in self.urls:
                try:
                    per_worker.append(cached_hashes(client, u))
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    continue
        if not per_worker:
            return None
        s = duplication(per_worker)
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> OccupancySampler:
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stops sampling, takes the last sample, and summarises: the mean duplicated share over the
        samples that held anything, and the last sample's figures."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s * (len(self.urls) + 1))
        self.sample()
        held = [s for s in self.samples if s["resident"]]
        if not held:
            return {}
        end = held[-1]
        return {"dup_share_mean": sum(s["dup_share"] for s in held) / len(held), "dup_share_end": end["dup_share"],
                "resident_blocks_end": end["resident"], "distinct_blocks_end": end["distinct"],
                "samples": len(held)}
