"""The eviction model (router/eviction.py): what survives at a pressure, and the pressure scale each worker
learns from what vLLM delivered."""
from __future__ import annotations

import math

import pytest

from indexer.index.base import WorkerMatch
from router.config import RoutingConfig
from router.eviction import SCALE_RANGE, EvictionCalibration, pressure, surviving
from router.kv_room import kv_room
from router.worker import WorkerLoad
from tests.gateway.test_cost import model, worker


def test_the_prior_keeps_a_prefix_below_half_the_free_blocks_and_none_past_all_of_them():
    def room(usage, blocks):  # the free room in tokens at block size 16 (router/kv_room.py)
        return kv_room(WorkerLoad(kv_usage=usage, num_gpu_blocks=blocks, updated_at=1.0), 16)[1]

    # 50 blocks of demand, 100 free (of 1,000: vLLM's null block is the 1,001st)
    assert pressure(800, room(0.9, 1001)) == pytest.approx(0.5)
    assert surviving(40, 0.5) == 40 and surviving(40, 0.75) == 20 and surviving(40, 1.0) == 0
    assert surviving(40, 0.0) == 40 and surviving(40, math.inf) == 0
    assert pressure(800, room(0.9, None)) == 0.0 and pressure(800, room(float("nan"), 1000)) == 0.0
    assert pressure(800, room(1.0, 1000)) == math.inf and pressure(0, room(1.0, 1000)) == 0.0
    never = kv_room(WorkerLoad(kv_usage=0.0, num_gpu_blocks=1000), 16)[1]  # never scraped: no evidence
    assert pressure(800, never) == 0.0


def test_a_shortfall_raises_the_scale_until_the_model_predicts_it():
    """The prefix was priced whole at pressure 0.3 (the prior keeps it) but vLLM delivered none of it:
    the queue ahead evicted it. A few such requests and the model discounts it at that pressure."""
    ev = EvictionCalibration()
    assert surviving(40, 0.3, ev.scale) == 40
    for _ in range(8):
        ev.observe(0.3, indexed=40, delivered=0)
    assert ev.shortfalls == 8 and ev.scale > 2.5
    assert surviving(40, 0.3, ev.scale) <= 10
    assert surviving(40, 0.05, ev.scale) == 40  # a small queue still keeps it


def test_a_prefix_delivered_whole_where_the_model_discounted_it_lowers_the_scale():
    ev = EvictionCalibration(scale=4.0)
    assert surviving(40, 0.3, ev.scale) == 0
    for _ in range(12):
        ev.observe(0.3, indexed=40, delivered=40)
    assert surviving(40, 0.3, ev.scale) == 40 and ev.scale < 1.8
    before = ev.scale
    ev.observe(0.1, indexed=40, delivered=40)  # consistent with the scale: no information
    assert ev.scale == before


@pytest.mark.parametrize("p,indexed,delivered", [
    (0.0, 40, 0), (math.inf, 40, 0), (float("nan"), 40, 0), (0.3, 0, 0), (-1.0, 40, 0),
])
def test_observations_that_say_nothing_leave_the_scale_alone(p, indexed, delivered):
    ev = EvictionCalibration()
    ev.observe(p, indexed, delivered)
    assert ev.scale == 1.0 and ev.samples == 0


def test_the_scale_stays_in_its_range_whatever_is_observed():
    ev = EvictionCalibration()
    for _ in range(100):
        ev.observe(1e-9, indexed=40, delivered=0)
    assert ev.scale == pytest.approx(SCALE_RANGE[1])
    for _ in range(200):
        ev.observe(1e9, indexed=40, delivered=40)
    assert ev.scale == pytest.approx(SCALE_RANGE[0])


def test_the_cost_model_prices_the_prefix_at_the_workers_learnt_scale():
    """Same worker state (80 free blocks of 800, 400 tokens = 25 blocks queued: pressure 0.31), two
    scales: the prior keeps the 40-block prefix; a worker that has been evicting loses it, and the
    candidate records the unscaled pressure for the next observation."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    calm, evicting = worker("a", prefilling=[400]), worker("b", prefilling=[400])
    for w in (calm, evicting):
        w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.9, 801, 1.0  # and the null block
    evicting.eviction.scale = 4.0
    a = cm.score(calm, WorkerMatch(gpu=40, local=40), 0, 1000, 16)
    b = cm.score(evicting, WorkerMatch(gpu=40, local=40), 0, 1000, 16)
    assert a.evicted_blocks == 0 and a.cached_tokens == 640
    assert b.evicted_blocks == 40 and b.cached_tokens == 0 and b.predicted_ttft_ms > a.predicted_ttft_ms
    assert a.eviction_pressure == pytest.approx(b.eviction_pressure) == pytest.approx(25 / 80)


async def test_a_worker_that_keeps_evicting_what_the_index_shows_is_priced_without_it(fleet, start_gateway):
    """Through the gateway, on a fake vLLM worker (a stand-in: a real vLLM cannot be made to evict on
    cue) whose index entries claim 60 blocks of every prompt while its own cache delivers none of them,
    with two requests waiting and half its 800 blocks free (pressure 0.32: the prior keeps a prefix).
    What vLLM reports cached teaches the gateway to stop predicting the prefix: the predicted cached
    tokens (the response header) fall from the index's 960 toward what is delivered."""
    from indexer.hashing import sequence_hashes
    from indexer.index.base import Tier
    from tests.gateway.conftest import BLOCK, MODEL
    from tests.gateway.test_policy_behaviour import ids, scraped
    from tests.gateway.test_proxy import wait_until as until
    import httpx

    fleet.add("h", waiting=2, kv_usage=0.5, num_gpu_blocks=800)
    gw = start_gateway(fleet, routing={"pending_ttl_s": 0, "parity_check": False})
    await until(lambda: scraped(gw, "h", waiting=2) and gw.state.registry.get("h").load.num_gpu_blocks == 800)
    predicted = []
    async with httpx.AsyncClient(timeout=30) as c:
        for seed in range(10, 22):
            prompt = ids(seed, 64)
            gw.call(gw.state.index.store(MODEL, "h", Tier.GPU, sequence_hashes(prompt, BLOCK)[:60]))
            r = await c.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            predicted.append(int(r.headers["x-kvgate-cached-tokens"]))
        workers = (await c.get(gw.url + "/admin/workers")).json()
    assert predicted[0] == 60 * BLOCK
    assert predicted[-1] <= predicted[0] // 4 and predicted == sorted(predicted, reverse=True), predicted
    ev = next(w for w in (workers if isinstance(workers, list) else workers["workers"]) if w["name"] == "h")
    assert ev["load"]["eviction"]["shortfalls"] >= 3 and ev["load"]["eviction"]["pressure_scale"] > 1.5


def test_a_prefix_released_before_most_of_the_free_room_goes_first():
    """vLLM evicts free blocks oldest release first. Same worker (2,000 free tokens, a 640-token prefix,
    300 tokens of demand queued ahead): released just now, 1,360 older free tokens absorb the demand; released
    before 1,200 other tokens, only 160 do, and the demand's excess cuts the prefix from its tail."""
    from router.eviction import lru_surviving

    assert lru_surviving(40, 16, 300, 2000, age_tokens=0) == (40, 1360)
    kept, older = lru_surviving(40, 16, 300, 2000, age_tokens=1200)
    assert older == 160 and kept == 40 - math.ceil(140 / 16)
    assert lru_surviving(40, 16, 300, 2000, age_tokens=5000)[0] == 40 - math.ceil(300 / 16)  # at the head
    assert lru_surviving(40, 16, 3000, 2000, age_tokens=0)[0] == 0
    assert lru_surviving(40, 16, 300, 2000, age_tokens=1200, scale=0.25)[0] == 40  # a learnt smaller demand


def test_the_workers_releases_place_a_prefix_in_the_lru_order():
    """Two sessions on one worker, each prompt 40 blocks: after A's turn and then B's, B's prefix is the
    recent one and A's the old one; a third request still holding A's prefix keeps it whole."""
    from router.load import HELD

    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    w = worker("a")
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.0, 126, 1.0  # 2,000 free tokens
    a_hashes, b_hashes = list(range(100, 140)), list(range(200, 240))
    for hashes in (a_hashes, b_hashes):
        w.active.finish(w.active.add(0, 0.0, 1.0, tokens=640, max_tokens=0, hashes=hashes))
    assert w.active.prefix_age(a_hashes, 40) == 640 and w.active.prefix_age(b_hashes, 40) == 0
    assert w.active.prefix_age(list(range(300, 340)), 40) is None  # never released here
    queued = w.active.add(300, 300.0, 1e6)  # 300 tokens ahead of the next request, prefilling
    old = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=a_hashes)
    new = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=b_hashes)
    assert new.eviction_model == old.eviction_model == "lru"
    assert new.evicted_blocks == 0 and new.lru_older_tokens == 2000 - 640 - 0
    # A's prefix: 2,000 - 640 - 640 released after it = 720 older free tokens, which absorb the 300
    assert old.evicted_blocks == 0 and old.lru_older_tokens == 720
    w.load.kv_usage = 0.5  # 1,000 free tokens: none older than A's prefix, B's keeps 360
    old = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=a_hashes)
    new = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=b_hashes)
    assert old.lru_older_tokens == 0 and old.evicted_blocks == math.ceil(300 / 16)
    assert new.evicted_blocks == 0
    holder = w.active.add(0, 0.0, 1e6, tokens=640, hashes=a_hashes[:30] + [999] * 10)
    assert w.active.prefix_age(a_hashes, 30) == HELD
    held = cm.score(w, WorkerMatch(gpu=30, local=30), 0, 1000, 16, hashes=a_hashes)
    assert held.eviction_model == "held" and held.evicted_blocks == 0 and held.prefix_age_tokens is None
    w.active.finish(holder), w.active.finish(queued)
    idle = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=a_hashes)
    assert idle.eviction_model == "" and idle.evicted_blocks == 0  # no queue ahead: nothing to price


def test_releases_count_what_a_request_generated_not_its_max_tokens():
    """Clients ask for more than they get: two sessions of 40-block prompts with ``max_tokens`` 4,096 that
    answer in 15 tokens. A's prefix sits behind B's release of 640 + 14 tokens, of which 40 full blocks go
    behind it in vLLM's free queue (the last, unfilled block has no hash: vLLM frees it to the queue's
    front), so the 720 older free tokens absorb the 300 queued ahead and it is priced whole; counted at
    ``max_tokens``, B's release would be 4,735 tokens and A's prefix priced evicted. A response that does not say what it
    generated is counted at the worker's average answer (at ``max_tokens`` before any response said)."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    w = worker("a")
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.0, 126, 1.0  # 2,000 free tokens
    a_hashes, b_hashes = list(range(100, 140)), list(range(200, 240))
    for hashes in (a_hashes, b_hashes):
        seq = w.active.add(0, 0.0, 1.0, streamed=True, tokens=640, max_tokens=4096, hashes=hashes,
                           block_size=16)
        w.active.first_token(seq)
        w.active.finish(seq, completion_tokens=15)
    assert w.active.prefix_age(a_hashes, 40) == 40 * 16
    w.active.add(300, 300.0, 1e6)  # 300 tokens ahead of the next request, prefilling
    old = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=a_hashes)
    assert old.eviction_model == "lru" and old.evicted_blocks == 0
    assert old.lru_older_tokens == 2000 - 640 - 640
    # the record carries what priced it: the age the releases gave the prefix and the worker's scale
    assert old.to_dict()["prefix_age_tokens"] == 40 * 16 and old.to_dict()["eviction_scale"] == 1.0
    # the KV the gateway's requests took and freed since the last scrape: each at the length it had
    assert w.active.kv_since_scrape() == 0
    unknown = w.active.add(0, 0.0, 1.0, streamed=True, tokens=640, max_tokens=4096,
                           hashes=list(range(300, 340)), block_size=16)
    w.active.first_token(unknown)
    w.active.finish(unknown)
    assert w.active.prefix_age(a_hashes, 40) == 40 * 16 + 40 * 16
    assert w.active.kv_since_scrape() == 0


def test_a_decode_in_flight_is_priced_at_the_workers_answers_not_max_tokens():
    """A request decoding on a 2,000-token worker with ``max_tokens`` 4,096, where answers have been 15
    tokens: beside its 41 blocks a 40-block cached prefix fits and the free room (1,344 tokens) takes the
    300 queued ahead, so it is priced whole; counted at ``max_tokens`` the decode would hold all 2,000 and
    the prefix would be priced evicted. Before any response said what it generated, ``max_tokens`` is all
    there is, and where answers use all of theirs (``ignore_eos``, a replayed trace) it is what it says."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))

    def decoding_worker(answers: tuple[int, int] | None):
        w = worker("a")
        w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.0, 126, 1.0
        if answers:  # (max_tokens, completion_tokens) of an earlier request
            done = w.active.add(0, 0.0, 1.0, streamed=True, tokens=64, max_tokens=answers[0], block_size=16)
            w.active.first_token(done)
            w.active.finish(done, completion_tokens=answers[1])
        w.active.first_token(w.active.add(0, 0.0, 1.0, streamed=True, tokens=640, max_tokens=4096,
                                          hashes=list(range(500, 540)), block_size=16))
        w.active.add(300, 300.0, 1e6)  # queued ahead: there is a queue to price
        return w

    prefix = list(range(100, 140))
    c = cm.score(decoding_worker((4096, 15)), WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=prefix)
    assert c.evicted_blocks == 0 and c.cached_tokens == 640 and c.kv_free_tokens == 2000 - 656
    for answers in (None, (15, 15)):
        c = cm.score(decoding_worker(answers), WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=prefix)
        assert c.evicted_blocks == 40 and c.kv_free_tokens == 0
    # a decode sent before any answer came back is priced again when one does (its KV taken since the last
    # scrape at 4,096 is taken again at the length it had when it ends)
    w = decoding_worker(None)
    w.active.mark_scrape()
    early = w.active.add(0, 0.0, 1.0, streamed=True, tokens=64, max_tokens=4096, block_size=16)
    w.active.first_token(early)
    w.active.finish(early, completion_tokens=15)
    assert w.active.kv_since_scrape() == 0
    c = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 1000, 16, hashes=prefix)
    assert c.evicted_blocks == 0 and c.cached_tokens == 640


def test_the_scale_learns_from_what_the_lru_model_priced():
    ev = EvictionCalibration()
    for _ in range(10):  # 300 tokens ahead, 160 older: the model cuts 9 blocks; vLLM evicted all 40
        ev.observe_lru(300, 160, indexed=40, delivered=0, block_size=16)
    assert ev.scale > 2.0 and ev.shortfalls == 10
    calm = EvictionCalibration(scale=4.0)
    for _ in range(10):  # the model, at scale 4, expected evictions; vLLM delivered the whole prefix
        calm.observe_lru(300, 160, indexed=40, delivered=40, block_size=16)
    assert calm.scale < 1.0 and calm.shortfalls == 0
    same = EvictionCalibration()
    same.observe_lru(300, 500, indexed=40, delivered=40, block_size=16)  # consistent: nothing learnt
    same.observe_lru(0, 500, indexed=40, delivered=0, block_size=16)  # no demand: says nothing
    assert (same.scale, same.samples) == (1.0, 0)


def test_a_follow_up_turn_finds_the_release_of_the_turn_it_extends():
    """A chat's next prompt is the last prompt plus the answer plus a new message: the index shows the
    answer's blocks too (vLLM announced them while decoding), past the last request's prompt blocks."""
    from router.load import ActiveSequences, shared_blocks

    a = ActiveSequences()
    turn1 = list(range(100, 130))  # 30 prompt blocks
    a.finish(a.add(0, 0.0, 1.0, tokens=480, max_tokens=64, hashes=turn1, block_size=16))
    turn2 = turn1 + [500, 501, 502, 503, 504]  # + the answer's 4 blocks + the new message
    assert a.prefix_age(turn2, 34) == 0  # the indexed 34 blocks: turn 1's prompt and answer
    assert a.prefix_age(list(range(700, 735)), 34) is None  # another conversation (chained: all differ)
    assert shared_blocks(turn1, turn2) == 30 and shared_blocks(turn1, [1, 2]) == 0
    assert shared_blocks(turn2, turn2[:12] + [9] * 20) == 12


def test_a_document_released_by_several_requests_is_counted_once():
    """Four RAG requests over one 1,000-token document (62 blocks) and their own questions: the LRU clock
    counts the document once, not four times (its blocks only move to the free queue's recent end), and
    not at all while a request in flight still holds it."""
    from router.load import ActiveSequences

    a = ActiveSequences()
    doc = list(range(1000, 1062))
    first = None
    for q in range(4):
        prompt = doc + [2000 + 10 * q, 2001 + 10 * q]  # + a 2-block question
        a.finish(a.add(0, 0.0, 1.0, tokens=64 * 16, max_tokens=16, hashes=prompt, block_size=16))
        if first is None:
            first = a.released_tokens
    assert first == 64 * 16  # the answer's 15 tokens fill no block: vLLM frees that one to the queue's front
    assert a.released_tokens == first + 3 * 2 * 16  # each later one: its question
    holding = a.add(0, 0.0, 1e6, tokens=63 * 16, hashes=doc + [3000], block_size=16)
    before = a.released_tokens
    a.finish(a.add(0, 0.0, 1.0, tokens=64 * 16, max_tokens=16, hashes=doc + [4000, 4001], block_size=16))
    assert a.released_tokens - before == 2 * 16  # the document stays held
    a.finish(holding)


def test_requests_vllm_runs_at_a_scrape_are_in_its_usage_not_demand_on_the_room():
    """Three requests sent and prefilling; at the scrape vLLM waits with one of them: the first two are
    running, their KV is in the usage the room comes from, so only the last one's prompt is demand."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    w = worker("a")
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at, w.load.waiting = 0.5, 250, 1.0, 1.0
    for uncached in (400, 300, 200):
        w.active.add(uncached, float(uncached), 1e6, streamed=True)
    assert w.view().kv_demand_tokens == 900  # no scrape since they were sent: all of it
    w.active.mark_scrape(w.load.waiting)
    v = w.view()
    assert v.kv_demand_tokens == 200 and v.queue_tokens == 900  # their prefill time still queues
    c = cm.score(w, WorkerMatch(), 0, 100, 16)
    assert c.kv_demand_tokens == 200 and c.queue_tokens == 900
    later = w.active.add(150, 150.0, 1e6, streamed=True)  # sent after the scrape: demand until the next
    assert w.view().kv_demand_tokens == 350
    w.active.mark_scrape(float("nan"))  # a malformed gauge marks nothing
    assert w.view().kv_demand_tokens == 350 and not later.admitted


def test_only_the_tail_past_what_a_request_in_flight_holds_can_be_evicted():
    """A 40-block document prefix; a request in flight reads its first 30 blocks (and its own question), so
    those are held; the demand ahead can only cut the 10 blocks past them."""
    cm = model(RoutingConfig(prefill_tokens_per_s=1000.0, attention_knee_tokens=0))
    w = worker("a")
    w.load.kv_usage, w.load.num_gpu_blocks, w.load.updated_at = 0.75, 125, 1.0  # 500 free tokens
    doc = list(range(100, 140))
    w.active.finish(w.active.add(0, 0.0, 1.0, tokens=640, hashes=doc, block_size=16))
    w.active.add(2000, 2000.0, 1e6, streamed=True)  # far more demand than the free room
    cut = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 700, 16, hashes=doc)
    assert cut.eviction_model == "lru" and cut.local_blocks == 0
    w.active.add(0, 0.0, 1e6, streamed=True, tokens=500, hashes=doc[:30] + [7, 8], block_size=16)
    assert w.active.held_blocks(doc, 40) == 30 and w.active.held_blocks(doc, 20) == 20
    kept = cm.score(w, WorkerMatch(gpu=40, local=40), 0, 700, 16, hashes=doc)
    assert kept.eviction_model == "lru" and kept.local_blocks == 30


def test_the_queues_own_prefixes_cascade_into_the_demand_behind_them():
    """Two sessions' prefixes sit in the free queue, A's released before B's. The queue ahead: a request
    that allocates 300 new tokens, then A's next turn (its 320-token prefix predicted cached, 100 new
    tokens). Past the free tokens older than A's prefix, the 300 cut A's prefix from its tail, so A's turn
    recomputes that part too: the request behind them sees that much more demand."""
    from router.load import ActiveSequences

    a = ActiveSequences()
    old, recent = list(range(100, 120)), list(range(200, 240))  # 20 and 40 blocks of 16
    a.finish(a.add(0, 0.0, 1.0, tokens=320, hashes=old, block_size=16))
    a.finish(a.add(0, 0.0, 1.0, tokens=640, hashes=recent, block_size=16))
    a.add(300, 300.0, 1e6, streamed=True)
    a_turn = a.add(100, 100.0, 1e6, streamed=True, tokens=420, hashes=old + [1, 2, 3, 4, 5, 6], block_size=16,
                   prefix_blocks=20)
    assert (a_turn.prefix_at, a.released_tokens) == (320, 960)  # on the LRU clock: B's 640 released after it
    assert a.queue_losses(1200.0) == 64  # A's 320 + B's 640 + 240 older: 60 past them cut 4 blocks
    assert a.queue_losses(1000.0) == 272  # 40 older: 260 past them cut 17 of A's 20 blocks
    assert a.queue_losses(5000.0) == 0  # room to spare: nothing lost
    a.mark_scrape(waiting=1)  # vLLM runs the first one: its 300 are in the usage, A's turn still waits
    assert a.queue_losses(1000.0) == 0


def test_a_short_chat_of_the_system_prompt_holds_no_other_conversation():
    """A chat in flight whose blocks are only the system prompt every conversation starts with (its question
    in the last, partial block) made every conversation read as held (priced never evicted), and once it
    ended as just used (found by a review). A request holds a prefix it has whole, or, released, one its
    prompt and answer covered: a conversation's last turn."""
    from router.load import HELD, ActiveSequences

    a = ActiveSequences()
    system = [7, 8]
    chat = a.add(40, 40.0, 1.0, streamed=True, tokens=40, max_tokens=16, hashes=list(system), block_size=16)
    other = system + list(range(1000, 1098))  # another user's 100 blocks
    assert a.prefix_age(other, 100) is None and a.held_blocks(other, 100) == 2
    assert a.prefix_age(other, 2) == HELD  # the system prompt itself is held
    a.first_token(chat)
    a.finish(chat, 16)
    assert a.prefix_age(other, 100) is None and a.prefix_age(other, 2) == 0


def test_a_short_delivery_with_g4_blocks_priced_says_nothing_about_local_eviction():
    """A candidate priced with its local prefix and G4 blocks beyond it that vLLM delivered short of both: a
    local eviction or a G4 load that did not happen, which ``cached_tokens`` cannot tell apart. Read as the
    first, six failed loads of a whole local prefix drove the worker's scale from 1.0 to 2.1 (found by a
    review); it learns nothing from them. Delivered whole, the sample still counts."""
    from router.cost import Candidate
    from router.eviction import EvictionCalibration, observe_delivery

    cal = EvictionCalibration()
    c = Candidate(worker="a", local_blocks=10, g4_blocks=10, eviction_model="pressure", eviction_pressure=0.9)
    for _ in range(6):
        observe_delivery(cal, c, 10 * 16, 16)  # the local 10 came, the G4 10 did not
    assert (cal.scale, cal.samples) == (1.0, 0)
    observe_delivery(cal, c, 20 * 16, 16)  # all of it: nothing evicted at a pressure the model discounted
    assert cal.samples == 1 and cal.scale < 1.0


def test_held_requests_cascade_in_the_order_the_gate_sends_them():
    """At the prefill gate a request held after another (planned on its blocks) goes right behind that one,
    not by its own length; the cascade of the queue's own losses took it by its own length, so its short
    prompt counted as demand ahead of requests the gate sends first (found by a review)."""
    from router.load import ActiveSequences

    a = ActiveSequences()
    prefix = list(range(100, 110))  # 10 blocks of 16, released first, 640 tokens released after it
    a.finish(a.add(0, 0.0, 1.0, tokens=160, hashes=prefix, block_size=16))
    a.finish(a.add(0, 0.0, 1.0, tokens=640, hashes=list(range(200, 240)), block_size=16))
    lead = a.add(1000, 1000.0, 1e6, streamed=True, hashes=list(range(300, 370)), block_size=16)
    turn = a.add(200, 200.0, 1e6, streamed=True, tokens=360, hashes=prefix + [1, 2, 3], block_size=16,
                 prefix_blocks=10)
    follower = a.add(60, 60.0, 1e6, streamed=True)
    follower.after = lead
    for s in (lead, turn, follower):
        s.gated = True
    # the gate sends the turn (200), then the lead (1,000) and the follower behind it: nothing passes the
    # 20 free tokens older than the turn's prefix before it (free 820 - 160 prefix - 640 after it)
    assert a.queue_losses(820.0) == 0
    follower.after = None  # on its own, the follower (60) goes first and cuts the prefix by 40: 3 blocks
    assert a.queue_losses(820.0) == 48


def test_the_pressure_scale_learns_from_the_tail_it_priced_not_the_held_blocks():
    """The pressure model keeps the leading blocks a request in flight holds and discounts only the tail past
    them, but its scale learnt from the whole prefix: deliveries exactly as predicted read as shortfalls
    and pulled the scale from 1.0 to 0.73 in twelve (found by a review), under-pricing eviction wherever
    prefixes are shared with running requests. It learns from the tail."""
    import time

    from router import eviction
    from router.config import WorkerConfig
    from router.cost import CostModel
    from router.worker import Worker

    cm = CostModel(RoutingConfig(occupancy_evicts=False))  # the pressure model alone
    w = Worker("w", "http://w:8000", WorkerConfig(url="http://w:8000"))
    bs, prompt = 16, list(range(1000, 1020))  # 20 blocks, the first 10 cached on the worker
    running = w.active.add(64, 64.0, 1.0, streamed=True, tokens=6 * bs + 64, hashes=prompt[:6] + [1, 2, 3, 4],
                           block_size=bs)
    w.active.first_token(running)  # holds the first 6 blocks
    w.load = WorkerLoad(running=1, waiting=1, kv_usage=0.355, updated_at=time.time(), num_gpu_blocks=101)
    w.active.mark_scrape(1)
    c = cm.score(w, WorkerMatch(gpu=10, local=10), 0, 20 * bs, bs, hashes=prompt)
    assert c.eviction_model == "pressure" and c.eviction_held_blocks == 6 and 6 <= c.local_blocks < 10
    for _ in range(12):  # vLLM delivers exactly what the model predicted
        eviction.observe_delivery(w.eviction, c, c.local_blocks * bs, bs)
    assert w.eviction.scale == pytest.approx(1.0, abs=0.1)
