"""The capacity-bound benchmark's workload and summary (no vLLM): bench.mixed_workload, bench.capacity_bound."""
from __future__ import annotations

import pytest

from bench import capacity_bound as cb
from bench import mixed_workload as mw
from bench import tiny_model

SPEC = mw.MixSpec(rag_docs=2, rag_users=3, rag_questions=3, doc_tokens=200, question_tokens=20, agents=2,
                  agent_turns=3, task_tokens=60, tool_tokens=50, chats=2, chat_turns=3, first_tokens=100,
                  turn_tokens=40)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok")
    tiny_model.build_tokenizer(out)
    return str(out)


def texts(clients: list[mw.Client]) -> list[tuple]:
    return [(c.cid, c.kind, s.sid, s.system, tuple(s.users)) for c in clients for s in c.sessions]


def test_mixed_workload_is_deterministic_by_seed(tok):
    a, b, c = (mw.make_mixed(tok, SPEC, seed) for seed in (0, 0, 1))
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    assert {k: sum(x.kind == k for x in a) for k in ("rag", "agent", "chat")} == {"rag": 3, "agent": 2, "chat": 2}
    kind_of = mw.kinds(a)
    assert len(kind_of) == 3 * 3 + 2 + 2 and set(kind_of.values()) == {"rag", "agent", "chat"}


def test_rag_requests_are_a_shared_document_plus_a_new_question(tok):
    rag = [c for c in mw.make_mixed(tok, SPEC, 0) if c.kind == "rag"]
    users = [s.users[0] for c in rag for s in c.sessions]
    assert all(len(c.sessions) == 3 and all(len(s.users) == 1 for s in c.sessions) for c in rag)
    docs = {u.split("\n\nQuestion")[0] for u in users}
    assert len(docs) <= SPEC.rag_docs and len(set(users)) == len(users)


def test_agent_turns_append_tool_results(tok):
    agent = next(c for c in mw.make_mixed(tok, SPEC, 0) if c.kind == "agent")
    (s,) = agent.sessions
    assert len(s.users) == SPEC.agent_turns
    assert s.users[0].startswith("Task") and all(u.startswith("Tool result") for u in s.users[1:])


def test_working_set_counts_shared_prefixes_once(tok):
    clients = mw.make_mixed(tok, SPEC, 0)
    ws = mw.working_set(tok, clients, block_size=32, answer_tokens=8)
    assert ws["requests"] == 3 * 3 + 2 * 3 + 2 * 3
    # every request resends its prefix: the distinct blocks are far fewer than all prompts' blocks
    assert 0 < ws["distinct_prefix_tokens"] < ws["prompt_tokens"] / 2
    assert ws["distinct_prefix_tokens"] == 32 * ws["distinct_blocks"]
    only_rag = [c for c in clients if c.kind == "rag"]
    rag = mw.working_set(tok, only_rag, block_size=32, answer_tokens=8)
    assert rag["distinct_prefix_tokens"] < SPEC.rag_docs * SPEC.doc_tokens + 9 * (SPEC.question_tokens + 120)


def test_the_lru_reference_falls_with_the_cache_and_reaches_the_ceiling_when_everything_fits(tok):
    """The hit rate the capacity-bound run's routers are measured against: one LRU cache of both servers."""
    clients = mw.make_mixed(tok, SPEC, 0)
    ws = mw.working_set(tok, clients, block_size=32, answer_tokens=8)
    roomy = mw.lru_reference(tok, clients, 32, ws["distinct_blocks"], 8, orders=5)
    assert roomy["min"] == roomy["max"] == roomy["ceiling"] > 0.3  # nothing is ever evicted
    tight = mw.lru_reference(tok, clients, 32, ws["distinct_blocks"] // 3, 8, orders=5)
    assert tight["min"] <= tight["median"] <= tight["max"] < roomy["ceiling"]
    assert tight["ceiling"] == roomy["ceiling"] and tight["orders"] == 5
    assert "ceiling" in cb.lru_line(tight)
    rows = [{"target": "kvgate kv", "cached_share": tight["median"] + 0.02}, {"target": "sglang-router",
            "cached_share": tight["median"] - 0.05}, {"target": "failed", "cached_share": None}]
    assert cb.reference_line(rows, tight).endswith("points: kvgate kv +2.0, sglang-router -5.0")


def test_kv_blocks_for():
    assert mw.kv_blocks_for(600, 3.0, 32, 2048) == 200
    assert mw.kv_blocks_for(90, 3.0, 32, 2048) == 65  # at least one block more than max_model_len needs


def decision(rid, pred_ms, obs_ms, pred_cached, delivered):
    return {"request_id": rid, "predicted_ttft_ms": pred_ms, "observed_ttft_ms": obs_ms, "outcome": "ok",
            "predicted_cached_tokens": pred_cached, "delivered_cached_tokens": delivered}


def test_prediction_stats():
    ds = [decision("a", 100, 100, 64, 64), decision("b", 100, 200, 64, 0), decision("c", 100, 50, 0, 32),
          decision("d", 100, None, 32, 32), decision("e", 100, 300, 0, None)]
    st = cb.prediction_stats(ds, {"a": "rag", "b": "rag", "c": "chat"})
    assert st["ttft_ratio_samples"] == 4 and st["ttft_ratio_p50"] == pytest.approx(1.5)
    assert 2.0 < st["ttft_ratio_p90"] <= 3.0
    assert st["cached_samples"] == 4
    assert (st["cached_exact_share"], st["cached_over_share"], st["cached_under_share"]) == (0.5, 0.25, 0.25)
    assert st["by_kind"]["rag"]["cached_exact_share"] == 0.5 and st["by_kind"]["?"]["decisions"] == 2
    assert st["cached_predicted_sum"] == 160 and st["cached_delivered_sum"] == 128
    assert cb.prediction_stats([])["ttft_ratio_p50"] is None


def row(target, share, mean, p90=1.0, total=10.0, prediction=None):
    return {"target": target, "label": target, "cached_share": share, "ttft_mean_s": mean, "ttft_p90_s": p90,
            "total_s": total, "prediction": prediction}


def test_ratios_and_goals():
    good = {"ttft_ratio_p50": 1.1, "ttft_ratio_p90": 1.9, "cached_exact_share": 0.95}
    rows = [row("kv", 0.60, 0.7, prediction=good), row("round_robin", 0.30, 1.4, total=20.0),
            row("least_loaded", 0.35, 1.2), row(cb.PEER, 0.50, 1.0)]
    cb.add_ratios(rows)
    kv = rows[0]
    assert kv["vs_sglang"]["hit_rate_points"] == pytest.approx(10.0)
    assert kv["vs_sglang"]["ttft_mean"] == pytest.approx(0.7)
    assert kv["vs_round_robin"]["ttft_mean"] == pytest.approx(0.5)
    assert kv["vs_round_robin"]["total"] == pytest.approx(0.5)
    assert all(cb.goals(rows).values())
    rows[0]["prediction"] = {"ttft_ratio_p50": 3.0, "ttft_ratio_p90": 9.0, "cached_exact_share": 0.7}
    rows[2]["ttft_mean_s"] = 0.5
    g = cb.goals(rows)
    assert not g["kv_lowest_mean_ttft_of_kvgate_policies"]
    assert not g["kv_observed_over_predicted_median_in_0.8_1.25"]
    assert not g["kv_predicted_cached_eq_delivered_ge_90pct"]
    assert g["kv_hit_rate_vs_sglang_ge_plus_5_points"]
    assert "| kvgate" not in cb.table(rows) and "| kv |" in cb.table(rows)


def test_g4_goals_are_on_mean_ttft_against_round_robin_and_the_peer():
    """With G4 on both servers every router reaches the same hit rate, so the G4 run's goals are TTFT
    ratios (issue #11: kv <= 0.85x round_robin and <= 0.8x sglang-router), not the hit-rate margin."""
    rows = [row("kv", 0.80, 0.8), row("round_robin", 0.80, 1.0), row(cb.PEER, 0.80, 1.1)]
    cb.add_ratios(rows)
    g = cb.goals(rows, g4=True)
    assert "kv_hit_rate_vs_sglang_ge_plus_5_points" not in g
    assert g["g4_kv_mean_ttft_vs_sglang_le_0.8x"] and g["g4_kv_mean_ttft_vs_round_robin_le_0.85x"]
    rows[1]["ttft_mean_s"] = 0.9  # kv at 0.89x round_robin: not enough
    cb.add_ratios(rows)
    g = cb.goals(rows, g4=True)
    assert not g["g4_kv_mean_ttft_vs_round_robin_le_0.85x"] and g["g4_kv_mean_ttft_vs_sglang_le_0.8x"]


def test_rounds_summarize_as_medians_of_per_round_ratios():
    """``--rounds``: whoever runs last in a round is faster, so each round rotates the order and a ratio is
    taken inside a round only; the summary's ratio is the median of the per-round ratios, with its range."""
    pred = {"ttft_ratio_p50": 1.0, "ttft_ratio_p90": 2.0, "cached_exact_share": 0.8}
    rounds = []
    for kv_mean, peer_mean in ((0.9, 1.5), (1.5, 0.9), (1.0, 1.0)):  # the later one faster each time
        rows = [row("kv", 0.55, kv_mean, prediction=pred), row(cb.PEER, 0.50, peer_mean),
                row("round_robin", 0.30, 2.0)]
        cb.add_ratios(rows)
        rounds.append(rows)
    s = cb.summarize_rounds(rounds)
    kv = next(r for r in s if r["target"] == "kv")
    assert kv["rounds"] == 3 and kv["ttft_mean_s"] == pytest.approx(1.0)
    assert kv["vs_sglang"]["ttft_mean"] == pytest.approx(1.0)  # median of 0.6, 1.67, 1.0
    assert kv["vs_sglang_range"]["ttft_mean"] == (pytest.approx(0.6), pytest.approx(1.5 / 0.9))
    assert kv["vs_sglang"]["hit_rate_points"] == pytest.approx(5.0)
    assert kv["prediction"] == pred
    g = cb.goals(s)
    assert g["kv_hit_rate_vs_sglang_ge_plus_5_points"] and not g["kv_mean_ttft_vs_sglang_le_0.8x"]
    assert "| kv |" in cb.table(s)
    # over rounds the goals also hold over the median's interval (3 rounds: the range, a 75% interval)
    lo, hi, cov = kv["vs_sglang_interval"]["ttft_mean"]
    assert (lo, hi, cov) == (pytest.approx(0.6), pytest.approx(1.5 / 0.9), pytest.approx(0.75))
    assert kv["vs_sglang_faster_rounds"] == 1
    assert g["kv_hit_rate_vs_sglang_ge_plus_5_points_over_the_interval"]
    assert not g["kv_mean_ttft_vs_sglang_le_0.8x_over_the_interval"]
    lines = cb.interval_lines(s)  # every target against the peer, then against round_robin
    assert [x.split(" over ")[0] for x in lines] == ["kv vs sglang-router", "round_robin vs sglang-router",
                                                      "kv vs round_robin", "sglang-router vs round_robin"]
    line = lines[0]
    # with G4 the goals are on mean TTFT, over the interval too: kv is 0.45-0.75x round_robin's every round
    g4 = cb.goals(s, g4=True)
    assert g4["g4_kv_mean_ttft_vs_round_robin_le_0.85x"]
    assert g4["g4_kv_mean_ttft_vs_round_robin_le_0.85x_over_the_interval"]
    assert not g4["g4_kv_mean_ttft_vs_sglang_le_0.8x_over_the_interval"]
    assert "kv vs sglang-router over 3 rounds: mean TTFT 1.00x (0.60-1.67x, a 75% interval" in line
    assert "faster in 1 rounds" in line and "hit rate +5.0 points (+5.0 to +5.0)" in line


def test_a_round_where_the_peer_failed_has_no_ratio_and_the_line_says_over_how_many():
    """A target that failed in a round leaves that round without a ratio against it: the median and the
    "over N rounds" of the interval line count the rounds that have one (it said the target's own count)."""
    rounds = []
    for kv_mean, peer_ok in ((0.8, True), (0.9, True), (1.2, False)):
        rows = [row("kv", 0.55, kv_mean)] + ([row(cb.PEER, 0.50, 1.0)] if peer_ok else [])
        cb.add_ratios(rows)
        rounds.append(rows)
    kv = next(r for r in cb.summarize_rounds(rounds) if r["target"] == "kv")
    assert kv["rounds"] == 3 and kv["vs_sglang_rounds"] == 2
    assert kv["vs_sglang"]["ttft_mean"] == pytest.approx(0.85)
    (line,) = cb.interval_lines([kv])
    assert line.startswith("kv vs sglang-router over 2 rounds: mean TTFT 0.85x"), line


def test_the_median_of_a_few_rounds_comes_with_an_interval_that_covers_it():
    """The k-th smallest and k-th largest of n per-round ratios, k as large as keeps 90% coverage."""
    assert cb.median_interval([1.0]) is None and cb.median_interval([None, 2.0]) is None
    assert cb.median_interval([1.7, 0.5, 1.1]) == (0.5, 1.7, pytest.approx(0.75))
    lo, hi, cov = cb.median_interval([0.52, 0.59, 1.08, 1.10, 1.10, 1.30, 1.75, 0.9])
    assert (lo, hi) == (0.59, 1.30) and cov == pytest.approx(1 - 2 * 9 / 256)
    lo, hi, cov = cb.median_interval(list(range(15)))
    assert (lo, hi) == (3, 11) and 0.9 <= cov < 0.97


def test_a_kv_variant_runs_beside_kv_but_is_not_one_of_its_policies():
    """``--kv-variant future_turns=5,stay_margin=0.5`` adds target ``kv[...]``: kv with those routing settings.
    It is compared in the same rounds, but kv's goal "lowest mean TTFT of kvgate's policies" is not about it."""
    assert cb.variant_of("kv[future_turns=5,stay_margin=0.5]") == ("kv", {"future_turns": 5.0, "stay_margin": 0.5})
    assert cb.variant_of("round_robin") == ("round_robin", {})
    rows = [row("kv", 0.60, 0.7), row("kv[future_turns=5]", 0.62, 0.6), row("round_robin", 0.30, 1.4),
            row(cb.PEER, 0.50, 1.0)]
    cb.add_ratios(rows)
    assert cb.goals(rows)["kv_lowest_mean_ttft_of_kvgate_policies"]
    rows[2]["ttft_mean_s"] = 0.65
    assert not cb.goals(rows)["kv_lowest_mean_ttft_of_kvgate_policies"]
    # a run of kv (and its variants) beside the peer alone does not measure it: no line, not a "met"
    assert "kv_lowest_mean_ttft_of_kvgate_policies" not in cb.goals([rows[0], rows[1], rows[3]])


def test_eviction_timing_tells_index_lag_from_eviction_while_waiting():
    """``--event-log``: an over-predicted decision is matched with the blocks its server stored again at its
    first token; their removal before the decision is index lag, after it an eviction while it waited."""
    from bench.eviction_timing import REMOVED, STORED, attribute

    events = [
        (0.0, 0, STORED, [1, 2, 3]),  # a conversation's prefix on server 0
        (10.5, 0, REMOVED, [2, 3]),  # evicted after the decision at 10 s
        (11.0, 0, STORED, [2, 3, 4]),  # stored again at its first token (11 s): recomputed
        (0.0, 1, STORED, [7, 8]),
        (19.5, 1, REMOVED, [8]),  # evicted before the decision at 20 s: the index had not caught up
        (21.0, 1, STORED, [8, 9]),
        (30.9, 0, STORED, [50]),  # new blocks only: nothing to match
    ]
    decisions = [
        {"ts": 10.0, "chosen": "a", "predicted_cached_tokens": 96, "delivered_cached_tokens": 32,
         "observed_ttft_ms": 1000.0},
        {"ts": 20.0, "chosen": "b", "predicted_cached_tokens": 64, "delivered_cached_tokens": 32,
         "observed_ttft_ms": 1000.0},
        {"ts": 30.0, "chosen": "a", "predicted_cached_tokens": 64, "delivered_cached_tokens": 0,
         "observed_ttft_ms": 1000.0},
        {"ts": 40.0, "chosen": "a", "predicted_cached_tokens": 64, "delivered_cached_tokens": 64,
         "observed_ttft_ms": 1000.0},  # exact: not looked at
    ]
    out = attribute(events, decisions, ["a", "b"])
    assert (out["over_predicted"], out["matched"]) == (3, 2)
    assert (out["blocks_removed_before_decision"], out["blocks_removed_after_decision"]) == (1, 2)
    first, second, third = out["decisions"]
    assert first["restored_blocks"] == 2 and first["removed_after_s_median"] == 0.5
    assert second["removed_before_decision"] == 1 and second["removed_after_s_median"] == -0.5
    assert third["restored_blocks"] == 0


def test_window_removals_count_what_the_server_evicted_while_each_request_waited(tmp_path, capsys):
    """The raw event log beside the decision records (``--event-log``): per request, the blocks its server
    removed between the decision and the first token, by what priced it and how the prediction erred."""
    import json

    from bench.eviction_timing import REMOVED, STORED, main, summarize_window, window_removals

    events = [
        (0.0, 0, STORED, [1, 2, 3, 4]),
        (10.2, 0, REMOVED, [1, 2]),  # while the first request waited (10-11 s) on server 0
        (10.4, 1, REMOVED, [9]),  # another server: not counted for it
        (10.8, 0, REMOVED, [3]),
        (12.0, 0, REMOVED, [4]),  # after its first token
    ]
    cand = {"worker": "a", "eviction_model": "occupancy", "evicted_blocks": 1, "kv_demand_tokens": 64.0}
    decisions = [
        {"ts": 10.0, "chosen": "a", "block_size": 32, "predicted_cached_tokens": 96,
         "delivered_cached_tokens": 32, "observed_ttft_ms": 1000.0, "candidates": [cand]},
        {"ts": 11.5, "chosen": "a", "block_size": 32, "predicted_cached_tokens": 32,
         "delivered_cached_tokens": 32, "observed_ttft_ms": 1000.0, "candidates": []},
        {"ts": 13.0, "chosen": "a", "outcome": "error", "delivered_cached_tokens": None},  # no outcome
    ]
    rows = window_removals(events, decisions, ["a", "b"])
    assert [(r["model"], r["error_blocks"], r["removed_while_waiting"]) for r in rows] == [
        ("occupancy", 2, 3), ("none", 0, 1)]
    assert rows[0]["predicted_evicted_blocks"] == 1 and rows[0]["predicted_demand_blocks"] == 2.0
    assert summarize_window(rows) == {"none exact": {"n": 1, "removed_while_waiting_median": 1},
                                      "occupancy over": {"n": 1, "removed_while_waiting_median": 3}}
    # offline, on a run's work directory
    (tmp_path / "events-kv-round1.json").write_text(json.dumps(events))
    (tmp_path / "decisions-kv-round1.json").write_text(json.dumps({"decisions": decisions}))
    assert main([str(tmp_path), "--servers", "a,b"]) == 0
    assert "occupancy over" in capsys.readouterr().out
    assert main([str(tmp_path / "none")]) == 1


def test_the_event_log_records_a_servers_kv_events():
    """The side subscriber decodes vLLM's frames from a real ZMQ PUB socket (the server's publisher)."""
    import time

    import msgspec
    import zmq

    from bench.eviction_timing import REMOVED, STORED, EventLog
    from bench.ports import free_port

    port = free_port()
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    payload = msgspec.msgpack.encode([time.time(), [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": [],
         "block_size": 16},
        {"type": "BlockRemoved", "block_hashes": [11]}], 0])
    try:
        with EventLog([f"tcp://127.0.0.1:{port}"]) as log:
            deadline = time.time() + 10.0
            while len(log.events) < 2 and time.time() < deadline:
                pub.send_multipart([b"kv-events", (1).to_bytes(8, "big"), payload])
                time.sleep(0.1)
        kinds = [(k, h) for _, i, k, h in log.events[:2]]
        assert kinds == [(STORED, [11, 12]), (REMOVED, [11])]
    finally:
        pub.close()


def test_a_server_that_died_fails_the_target_with_its_log():
    """The gateway holds requests for want of a healthy worker until the clients' timeout (600 s): a dead
    server must fail the target at once, with its log (a real child process that has exited)."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from bench.capacity_bound import check_alive

    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    done.wait(30)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        up = SimpleNamespace(name="vllm-0", proc=alive, log_path="/x/0.log", log_tail=lambda: "")
        dead = SimpleNamespace(name="vllm-1", proc=done, log_path="/x/1.log", log_tail=lambda: "engine died")
        check_alive([up])
        with pytest.raises(RuntimeError, match=r"(?s)vllm-1 is not running .exit status 3.*engine died"):
            check_alive([up, dead])
    finally:
        alive.kill()
        alive.wait(30)


def test_a_targets_summary_counts_vllms_preemptions_per_server():
    """The rows carry each server's vllm:num_preemptions_total delta beside its finished requests (a
    preempted request stalls for its recompute: a slow round is told from a placement that was slow)."""
    from bench.bench_vllm_policies import summarize
    from bench.chat_workload import TurnResult

    turns = [TurnResult("s", 0, 0.5, 1.0, 100, 0), TurnResult("s", 1, 0.3, 1.0, 200, 96)]
    before = [(1000.0, 200.0, 10.0, 2.0), (500.0, 0.0, 4.0, 0.0)]
    after = [(1200.0, 296.0, 12.0, 5.0), (600.0, 0.0, 5.0, 0.0)]
    row = summarize(turns, 2.0, before, after)
    assert row["requests_per_server"] == [2, 1] and row["preemptions_per_server"] == [3, 0]
    assert row["cached_share"] == pytest.approx(96 / 300) and row["vllm_prefix_cache_hit_rate"] == 96 / 300


def test_a_servers_cpu_is_split_between_its_api_process_and_its_engine_descendants():
    """The API server shares the cores with the engines: the bench reports the two apart. A real process
    (the "API server", idle) whose grandchild (the "engine worker") burns CPU."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    child = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {burn!r}])\n"
             "time.sleep(30)")
    api = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                            f"subprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(30)"],
                           start_new_session=True)
    try:
        server = SimpleNamespace(proc=api)
        deadline = time.monotonic() + 20
        while cb.server_cpu_s(server)[1] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.1)
        api_s, engine_s = cb.server_cpu_s(server)
        assert engine_s >= 0.3 and api_s < 0.3
        assert cb.server_cpu_s(SimpleNamespace(proc=None)) == (0.0, 0.0)
    finally:
        os.killpg(api.pid, signal.SIGKILL)
        api.wait(30)


def test_peer_policies_and_connector_settings_from_the_command_line():
    assert cb.peer_of("sglang-router") == ("sglang-router cache_aware", "cache_aware", [])
    assert cb.peer_of("sglang-router[round_robin]") == ("sglang-router round_robin", "round_robin", [])
    assert cb.peer_of("sglang-router[cache_aware;max-tree-size=27000,eviction-interval-secs=1]") == (
        "sglang-router cache_aware (max-tree-size=27000,eviction-interval-secs=1)", "cache_aware",
        ["--max-tree-size", "27000", "--eviction-interval-secs", "1"])
    assert cb.g4_config(["load_async=false", "read_threads=2", "kv_layout=nhd"]) == {
        "load_async": False, "read_threads": 2, "kv_layout": "nhd"}
    assert cb.g4_config([]) is None


def test_rounds_balance_every_target_s_position_and_every_pair_s_order():
    """The rounds of the capacity-bound mode and of the side-by-side (bench.sim.harness.order_of). The order
    moved a target as much as the router did (kv / sglang-router 0.79x in the rounds kv ran first, 1.05x
    where the peer did), and rotation by one left three targets' pairs unbalanced over 8 rounds (the peer
    before kv in 6 of them). Over 2 x targets rounds each target runs in each position twice and before
    each other target in half the rounds."""
    from bench.sim.harness import order_of

    for targets in (["kv", "sglang-router"], ["kv", "kv[x=1]", "sglang-router"], list("abcd")):
        n = len(targets)
        orders = [order_of(targets, r) for r in range(2 * n)]
        assert all(sorted(o) == sorted(targets) for o in orders)
        for t in targets:
            assert sorted(o.index(t) for o in orders) == sorted(list(range(n)) * 2)
            for u in targets:
                if u != t:
                    assert sum(o.index(t) < o.index(u) for o in orders) == n


def test_order_lines_split_a_ratio_by_who_ran_first():
    rounds = []
    for order, kv_s, peer_s in ((["kv", cb.PEER], 0.8, 1.0), ([cb.PEER, "kv"], 1.1, 1.0),
                                (["kv", cb.PEER], 0.6, 1.0)):
        means = {"kv": kv_s, cb.PEER: peer_s}
        rounds.append([row(t, 0.6 if t == "kv" else 0.55, means[t]) for t in order])
    lines = cb.order_lines(rounds)
    assert lines[0].startswith("kv vs sglang-router: mean TTFT 0.80x, hit rate +5.0 points over 3 rounds")
    assert "before it 2: 0.70x, +5.0 pts; after it 1: 1.10x, +5.0 pts" in lines[0]
