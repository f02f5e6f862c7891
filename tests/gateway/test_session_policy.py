"""The session policy's memory of which worker serves a session: sticky, bounded, least recently used out."""
from __future__ import annotations

from router.cost import Candidate
from router.policies.base import RouteRequest
from router.policies.session import SessionPolicy


def order(policy: SessionPolicy, sid: str | None, workers=("a", "b", "c")) -> list[str]:
    headers = {"x-session-id": sid} if sid else {}
    # a is predicted fastest, then b, then c: the kv fallback's order without a session
    cands = [Candidate(worker=w, predicted_ttft_ms=10.0 * (1 + "abc".index(w))) for w in workers]
    return [c.worker for c in policy.order(RouteRequest("m", "/v1/chat/completions", headers), cands)]


def chosen(policy: SessionPolicy, sid: str, worker: str) -> None:
    policy.chosen(RouteRequest("m", "/v1/chat/completions", {"x-session-id": sid}), worker)


def test_a_session_sticks_to_its_worker_and_the_oldest_is_forgotten_first():
    p = SessionPolicy(max_sessions=2)
    chosen(p, "s1", "c")
    chosen(p, "s2", "b")
    assert order(p, "s1")[0] == "c" and order(p, "s2")[0] == "b"  # s1 was used after s2: s2 is the oldest
    assert order(p, "s1")[0] == "c"
    chosen(p, "s3", "b")  # a third session: s2, least recently used, is forgotten
    assert order(p, "s2")[0] == "a" and order(p, "s1")[0] == "c" and order(p, "s3")[0] == "b"
    assert order(p, None)[0] == "a"


def test_a_session_whose_worker_is_gone_follows_the_fallback_and_moves():
    p = SessionPolicy(max_sessions=10)
    chosen(p, "s1", "c")
    assert order(p, "s1", workers=("a", "b")) == ["a", "b"]
    chosen(p, "s1", "a")
    assert order(p, "s1")[0] == "a"
