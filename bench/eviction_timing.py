"""When did vLLM evict the blocks a request was predicted to find? (``--event-log`` of the capacity-bound run.)

A decision whose predicted ``cached_tokens`` exceed vLLM's delivered ones found part of its prefix gone.
Two causes need different fixes: the index was stale (vLLM had evicted the blocks before the decision and
the gateway had not applied the ``BlockRemoved`` yet: event lag), or the blocks were there at the decision
and were evicted while the request waited to be scheduled (the eviction model's error). A side subscriber
on every server's KV-event stream (ZMQ SUB beside the gateway's own; PUB sockets serve both) records each
event with its arrival time; after the target ran, each over-predicted decision is matched with the blocks
its server stored again at its first token (a ``BlockStored`` of a hash stored and removed before: the
prefix computed a second time), and the removal times of those blocks, relative to the decision, tell
which cause it was. Only engine hashes are needed (the stream's own), nothing of the gateway's.

Session 20's capacity-bound runs (7-12 over-predicted decisions per kv target): 83-100% of the matched
blocks were removed after their decision (0.5-1.0 s, median per target), the rest before it: mostly
evicted while the request waited, a little missed by an index about a step behind.

Every decision, over-predicted or not: the blocks its server evicted between the decision and its first
token (:func:`window_removals`), by eviction model and error sign. The bench writes the raw events beside
the decision records; ``python -m bench.eviction_timing DIR`` summarizes a run's work directory again.
"""
from __future__ import annotations

import statistics
import threading
import time
from bisect import bisect_left, bisect_right
from collections import defaultdict

STORED, REMOVED = "S", "R"
# a re-stored prompt's blocks arrive with the step that computed them: from shortly before the first
# token was seen by the client to just after it
WINDOW_BEFORE_S, WINDOW_AFTER_S = 0.6, 0.15


class EventLog:
    """Records ``(arrival wall time, server index, kind, block hashes)`` from each endpoint while open."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.events: list[tuple[float, int, str, list[int]]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.malformed = 0

    def _listen(self, i: int, endpoint: str) -> None:
        import zmq

        from indexer.events.wire import BlockRemoved, BlockStored, DecodeError, decode_batch

        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 200)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            while not self._stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue
                t = time.time()
                try:
                    batch = decode_batch(frames[-1])
                except DecodeError:
                    self.malformed += 1
                    continue
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        self.events.append((t, i, STORED, list(ev.block_hashes)))
                    elif isinstance(ev, BlockRemoved):
                        self.events.append((t, i, REMOVED, list(ev.block_hashes)))
        finally:
            sock.close()

    def __enter__(self) -> EventLog:
        self._threads = [threading.Thread(target=self._listen, args=(i, e), daemon=True)
                         for i, e in enumerate(self.endpoints)]
        for t in self._threads:
            t.start()
        if self._threads:
            time.sleep(0.3)  # the subscriptions take effect before the first request
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5.0)


def _served(decisions: list[dict], server_names: list[str]):
    """``(decision, server index, decision time, first-token time)`` for each decision with delivered
    cached tokens and an observed TTFT on one of ``server_names``."""
    for d in decisions:
        ttft = d.get("observed_ttft_ms")
        if d.get("delivered_cached_tokens") is None or ttft is None or d.get("chosen") not in server_names:
            continue
        yield d, server_names.index(d["chosen"]), d["ts"], d["ts"] + ttft / 1000.0


def attribute(events, decisions: list[dict], server_names: list[str]) -> dict:
    """For each decision with predicted cached tokens above the delivered: the removal times (seconds after
    the decision; negative: before it) of the blocks its server stored again at its first token. A summary
    and one row per decision."""
    history: dict[tuple[int, int], list[tuple[float, str]]] = defaultdict(list)
    stored = []
    for t, i, kind, hashes in events:
        for h in hashes:
            history[(i, h)].append((t, kind))
        if kind == STORED:
            stored.append((t, i, hashes))
    for v in history.values():
        v.sort()
    rows = []
    for d, i, t0, first in _served(decisions, server_names):
        pred, got = d.get("predicted_cached_tokens") or 0, d["delivered_cached_tokens"]
        if pred <= got:
            continue
        removed = []
        for t, j, hashes in stored:
            if j != i or not first - WINDOW_BEFORE_S <= t <= first + WINDOW_AFTER_S:
                continue
            for h in hashes:
                before = [e for e in history[(i, h)] if e[0] < t]
                if any(k == STORED for _, k in before):
                    gone = [e[0] for e in before if e[1] == REMOVED]
                    if gone:
                        removed.append(gone[-1] - t0)
        rows.append({"ts": t0, "worker": d["chosen"], "predicted": pred, "delivered": got,
                     "restored_blocks": len(removed),
                     "removed_before_decision": sum(r < 0 for r in removed),
                     "removed_after_s_median": statistics.median(removed) if removed else None})
    matched = [r for r in rows if r["restored_blocks"]]
    return {
        "over_predicted": len(rows),
        "matched": len(matched),
        "blocks_removed_before_decision": sum(r["removed_before_decision"] for r in matched),
        "blocks_removed_after_decision": sum(r["restored_blocks"] - r["removed_before_decision"] for r in matched),
        "removal_delay_s_median": (statistics.median(r["removed_after_s_median"] for r in matched)
                                   if matched else None),
        "decisions": rows,
    }


def window_removals(events, decisions: list[dict], server_names: list[str]) -> list[dict]:
    """Per decision with an outcome: the blocks its server removed (evicted) between the decision and its
    first token, all prompts' together: the demand that really hit the free queue's head while the request
    waited, against what the eviction model priced (``evicted_blocks``, ``kv_demand_tokens``, its cached
    tokens against the delivered). One row each, in the order given."""
    times: dict[int, list[float]] = defaultdict(list)
    counts: dict[int, list[int]] = defaultdict(list)
    for t, i, _, hashes in sorted((e for e in events if e[2] == REMOVED), key=lambda e: e[0]):
        times[i].append(t)
        counts[i].append((counts[i][-1] if counts[i] else 0) + len(hashes))  # running total
    rows = []
    for d, i, t0, t1 in _served(decisions, server_names):
        lo, hi = bisect_left(times[i], t0), bisect_right(times[i], t1)
        c = next((c for c in d.get("candidates") or () if c.get("worker") == d["chosen"]), {})
        bs = d.get("block_size") or 1
        error = (d.get("predicted_cached_tokens") or 0) - d["delivered_cached_tokens"]
        total = counts[i]
        rows.append({"ts": t0, "worker": d["chosen"], "model": c.get("eviction_model") or "none",
                     "error_blocks": error // bs,
                     "predicted_evicted_blocks": c.get("evicted_blocks", 0),
                     "predicted_demand_blocks": (c.get("kv_demand_tokens") or 0.0) / bs,
                     "removed_while_waiting": (total[hi - 1] if hi else 0) - (total[lo - 1] if lo else 0)})
    return rows


def summarize_window(rows: list[dict]) -> dict:
    """Rows of :func:`window_removals` by eviction model and by the prediction's error (over, exact,
    under): how many, and the median removals while waiting."""
    out: dict[str, dict] = {}
    for r in rows:
        e = r["error_blocks"]
        key = f"{r['model']} {'over' if e > 0 else 'under' if e < 0 else 'exact'}"
        out.setdefault(key, []).append(r["removed_while_waiting"])
    return {k: {"n": len(v), "removed_while_waiting_median": statistics.median(v)}
            for k, v in sorted(out.items())}


def main(argv=None) -> int:
    """``python -m bench.eviction_timing DIR``: a capacity-bound run's work directory (``--event-log``):
    each round's decision records with the raw events beside them, summarized per eviction model."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m bench.eviction_timing",
                                description=main.__doc__.split("\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--servers", default="vllm-0,vllm-1", help="the servers' names, in the event log's order")
    args = p.parse_args(argv)
    rows = []
    for ev in sorted(args.dir.glob("events-*-round*.json")):
        dec = args.dir / ev.name.replace("events-", "decisions-", 1)
        if dec.exists():
            rows += window_removals(json.loads(ev.read_text()), json.loads(dec.read_text())["decisions"],
                                    args.servers.split(","))
    if not rows:
        print(f"no events-*-round*.json with decision records beside them under {args.dir}")
        return 1
    for k, v in summarize_window(rows).items():
        print(f"{k:20s} {v['n']:4d} requests, blocks removed while waiting (median) "
              f"{v['removed_while_waiting_median']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
