"""kvroute's filter and sync service inside a real Envoy, with real HTTP upstreams and a
feed server speaking the documented protocol."""
import base64
import socket
import struct
import subprocess
import threading
import time

import pytest

from harness import ENVOY_NATIVE_YAML, ENVOY_YAML, ROOT, envoy_binary, wait_for
from harness.kvfeed import block_hashes, namespace


def tokens(prefix, n):
    return [prefix * 100_000 + i for i in range(n)]


def b64(toks):
    return base64.b64encode(struct.pack(f"<{len(toks)}I", *toks)).decode()


def dec(toks):
    return ",".join(map(str, toks))


def debug(headers):
    return dict(kv.split("=", 1) for kv in headers["x-kvroute-debug"].split(";"))


def served_by(s, body):
    import json
    return s.by_id(json.loads(body)["worker"])


def test_request_goes_to_the_worker_holding_its_prefix(setup):
    s = setup(n_workers=4)
    prompt = tokens(1, 640)  # 40 blocks
    s.state.store(s.workers[2].id, prompt[:512])  # the first 32 blocks
    s.wait_synced()
    for encoding in (b64, dec):
        status, headers, body = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)}
                                                if encoding is b64 else
                                                {"x-prompt-token-ids": dec(prompt)})
        assert status == 200
        assert served_by(s, body) is s.workers[2]
        d = debug(headers)
        assert (d["worker"], d["blocks"]) == (s.workers[2].id, "40")
        assert int(d["hits"]) >= 32
    upstream = s.workers[2].requests[-1]
    ranked = upstream["x-gateway-destination-endpoint"].split(",")
    assert ranked[0] == s.workers[2].id and len(ranked) == 3
    # The token headers are not forwarded to the engine by default.
    assert "x-prompt-token-ids" not in upstream and "x-prompt-token-ids-b64" not in upstream
    # Filter stats reach Envoy in batches (every 200 ms at most).
    wait_for(lambda: s.envoy.stat("kvroute.scored") == 2, what="scored == 2")
    assert s.envoy.stat("kvroute.blocks_hit") >= 64


def test_removed_blocks_stop_attracting(setup):
    s = setup(n_workers=3, filter_config={"predict_on_route": False})
    prompt = tokens(2, 320)
    blocks = s.state.store(s.workers[1].id, prompt)
    s.wait_synced()
    _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    assert debug(h)["worker"] == s.workers[1].id
    s.state.remove(s.workers[1].id, blocks)
    s.state.store(s.workers[0].id, prompt)
    s.wait_synced()
    _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    assert debug(h)["worker"] == s.workers[0].id


def test_at_weight_zero_only_load_counts(setup):
    # The specification's formula read literally: active_blocks as they are, no prefill term.
    s = setup(n_workers=2, filter_config={"overlap_weight": 0, "active_blocks": "in_flight",
                                          "prefill_load_weight": 0, "wait_slack_per_hit": None,
                                          "holder_tie_per_hit": None})
    prompt = tokens(3, 320)
    s.state.store(s.workers[0].id, prompt)
    s.wait_synced()
    # Both idle: a cost tie, broken toward more cache hits, so this one lands on worker 0
    # and keeps it busy.
    busy = threading.Thread(target=s.envoy.request, kwargs={"headers": {
        "x-prompt-token-ids-b64": b64(prompt), "x-test-delay-ms": "1500"}})
    busy.start()
    wait_for(lambda: _active(s).get(_stat_id(s.workers[0])) == 20, what="worker 0 busy")
    # Now worker 0 holds the whole prefix but has 20 active blocks: at weight 0 the
    # cache does not count, and idle worker 1 (cost 0) wins.
    _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    d = debug(h)
    assert (d["worker"], float(d["cost"]), d["hits"]) == (s.workers[1].id, 0.0, "0")
    busy.join()


def test_prefill_ends_at_the_first_response_bytes(setup):
    s = setup(n_workers=2)
    prompt = tokens(11, 320)  # 20 blocks, none cached: all 20 are prefill work
    hdr = {"x-prompt-token-ids-b64": b64(prompt)}

    def load():
        return _load(s)

    # Streamed: prefilling until the first body bytes, then decoding until the end.
    t = threading.Thread(target=s.envoy.request, kwargs={"headers": {**hdr, "x-test-stream-ms": "1000,1500"}})
    t.start()
    wait_for(lambda: load() == (20, 20), what="20 blocks in flight, all prefilling")
    wait_for(lambda: load() == (20, 0), what="prefill over at the first bytes, still in flight")
    t.join()
    wait_for(lambda: load() == (0, 0), what="release at the end")

    # A second request sharing 16 blocks while the first prefills them: it follows the
    # first, and is charged only for its own 4 blocks (the first computes the rest).
    # (A new prefix: the first one's blocks linger as predictions, cached as far as routing
    # knows.)
    prompt = tokens(13, 320)
    sibling = tokens(13, 256) + tokens(14, 64)
    answers = {}

    def send(name, toks, stream):
        answers[name] = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(toks), "x-test-stream-ms": stream})

    first = threading.Thread(target=send, args=("first", prompt, "2500,0"))
    first.start()
    wait_for(lambda: load() == (20, 20), what="first request prefilling")
    second = threading.Thread(target=send, args=("second", sibling, "800,0"))
    second.start()
    wait_for(lambda: load() == (24, 24), what="sibling charged 4 blocks")
    second.join()
    first.join()
    assert debug(answers["second"][1])["worker"] == debug(answers["first"][1])["worker"]
    wait_for(lambda: load() == (0, 0), what="both released")
    # (Aborts and resets while prefilling: test_active_blocks_return_to_zero.)
    assert s.envoy.stat("kvroute.update_failures") == 0


def _load(s):
    """(in-flight blocks, outstanding prefill) over all workers."""
    return sum(_active(s).values()), sum(_prefill(s).values())


def _prefill(s):
    return s.envoy.worker_gauges("kvroute.prefill_blocks")


def _stat_id(worker):
    return worker.id.replace(".", "_").replace(":", "_")


def _active(s):
    return s.envoy.worker_gauges("kvroute.active_blocks")


def test_pd_mode_sets_both_headers(setup):
    s = setup(n_workers=4, roles=["prefill", "prefill", "decode", "decode"],
              filter_config={"mode": "pd", "prefill_overlap_weight": 20, "decode_overlap_weight": 2})
    prompt = tokens(4, 480)
    s.state.store(s.workers[1].id, prompt)  # prefill worker 1 holds the prefix
    s.state.store(s.workers[3].id, prompt)  # decode worker 3 too
    s.wait_synced()
    status, h, body = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    assert status == 200
    assert served_by(s, body) is s.workers[3]
    up = s.workers[3].requests[-1]
    assert up["x-prefiller-host-port"] == s.workers[1].id
    ranked = up["x-gateway-destination-endpoint"].split(",")
    assert set(ranked) <= {s.workers[2].id, s.workers[3].id}, "only decode workers are destinations"


def test_client_cannot_pick_the_host(setup):
    s = setup(n_workers=3)
    prompt = tokens(5, 320)
    s.state.store(s.workers[0].id, prompt)
    s.wait_synced()
    forged = {"x-gateway-destination-endpoint": s.workers[2].id,
              "x-prefiller-host-port": s.workers[2].id,
              "x-kvroute-debug": "forged",
              "x-prompt-token-ids-b64": b64(prompt)}
    for _ in range(5):
        status, h, body = s.envoy.request(headers=forged)
        assert status == 200
        assert served_by(s, body) is s.workers[0]
        up = s.workers[0].requests[-1]
        assert up["x-gateway-destination-endpoint"].split(",")[0] == s.workers[0].id
        assert "x-prefiller-host-port" not in up
        assert "x-kvroute-debug" not in up
    # Without tokens the forged header is still dropped (routing by load).
    status, _, body = s.envoy.request(headers={"x-gateway-destination-endpoint": "10.9.9.9:1"})
    assert status == 200


@pytest.mark.parametrize("headers,reason", [
    ({}, "no_tokens"),
    ({"x-prompt-token-ids": "1,2,,3"}, "bad_tokens"),
    ({"x-prompt-token-ids": "1,2,99999999999"}, "bad_tokens"),
    ({"x-prompt-token-ids": " "}, "bad_tokens"),
    ({"x-prompt-token-ids-b64": "!!!!"}, "bad_tokens"),
    ({"x-prompt-token-ids-b64": "AAAA"}, "bad_tokens"),
    ({"x-prompt-token-ids-b64": b64(list(range(5000)))}, "bad_tokens"),  # > max_tokens 4096
    ({"x-prompt-token-ids": "\u00e9\u00e9"}, "bad_tokens"),
])
def test_bad_token_headers_route_by_load(setup, headers, reason):
    s = setup(n_workers=2, filter_config={"max_tokens": 4096})
    status, h, body = s.envoy.request(headers=headers)
    assert status == 200, body
    assert debug(h)["fallback"] == reason
    wait_for(lambda: s.envoy.stat(f"kvroute.fallback.{reason}") == 1, what=f"{reason} counted")
    assert s.envoy.stat("kvroute.requests") == 1
    errors = sum(v for k, v in s.envoy.stats("token_errors").items())
    assert errors == (1 if reason == "bad_tokens" else 0)


def test_huge_token_header(setup):
    """A 32k-token prompt as base64 (175 KB) is accepted and scored."""
    s = setup(n_workers=2)
    prompt = tokens(6, 32768)
    s.state.store(s.workers[1].id, prompt[:16384])
    s.wait_synced()
    status, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    assert status == 200
    d = debug(h)
    assert (d["worker"], d["blocks"], d["hits"]) == (s.workers[1].id, "2048", "1024")


def burst(s, prefix, n=12):
    """n requests with `prefix` and a 2-block question each, 10 ms apart, none answered
    for 800 ms (so no prefill ends while they are routed): their debug headers, in
    the order sent."""
    decided = [None] * n

    def one(i):
        _, h, _ = s.envoy.request(headers={
            "x-prompt-token-ids-b64": b64(prefix + tokens(100 + i, 32)), "x-test-delay-ms": "800"})
        decided[i] = debug(h)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    return decided


def test_burst_before_any_event_lands_on_one_worker(setup):
    s = setup(n_workers=4, filter_config={"overlap_weight": 4})
    # A 64-block prefix and 2-block questions, as a system prompt and its questions are:
    # the holder's queue (64 + 2 per sibling) stays within the wait limit's 0.5 blocks per
    # hit (32) of a cold worker's 66 for all 12. With a prefix not much longer than its
    # questions the limit rightly splits the burst (the next test).
    workers = [d["worker"] for d in burst(s, tokens(7, 64 * 16))]
    assert len(set(workers)) == 1, workers


def test_the_wait_limit_spills_a_burst_whose_queue_outweighs_its_prefix(setup):
    """The shipped wait limit at the shipped weight, with idle workers about (0.45 blocks of
    extra queueing per hit, `idle_wait_slack_per_hit`): 12 requests share a 30-block prefix
    and bring 2 blocks each. The holder's queue grows by 2 blocks a request; once it would
    keep a request waiting more than 13.5 blocks longer than an idle worker (the 8th), that
    request goes elsewhere, and its successors follow it there (they hit its in-flight
    blocks with nothing long queued ahead)."""
    s = setup(n_workers=4)
    decided = burst(s, tokens(7, 30 * 16))
    workers = [d["worker"] for d in decided]
    # Request i waits for 32 + 2i blocks on the holder against 32 on an idle worker:
    # within 32 + 0.45 × 30 = 45.5 up to i = 6.
    assert len(set(workers[:7])) == 1 and len(set(workers[7:])) == 1 and workers[7] != workers[0], workers
    assert [d.get("spilled") for d in decided] == [None] * 7 + ["1"] + [None] * 4, decided
    wait_for(lambda: s.envoy.stat("kvroute.spilled") == 1, what="kvroute.spilled == 1")


@pytest.mark.parametrize("capacity", ["configured", "learned"])
def test_the_memory_limit_splits_a_burst_an_engine_cannot_hold(setup, capacity):
    """The burst that stays whole on one worker above (a 64-block prefix, 2-block
    questions, weight 4), with engines of 74 blocks: a worker holding the prefix and k of
    the burst in flight would hold 64 + 2k + 2 with the next added, so five fit and the
    sixth goes elsewhere (memory=1, counted); no worker ever carries more than five.
    Configured, every engine holds 74; learned (the default), each engine evicted a block
    of other prompts when it held 74, and the sync service took that for its capacity."""
    fc = {"overlap_weight": 4}
    if capacity == "configured":
        fc["kv_capacity_blocks"] = 74
    s = setup(n_workers=4, filter_config=fc)
    if capacity == "learned":
        for i, w in enumerate(s.workers):
            held = s.state.store(w.id, tokens(50 + i, 74 * 16))
            s.state.remove(w.id, held[-1:])
        s.wait_synced()
        want = {_stat_id(w): 74 for w in s.workers}
        wait_for(lambda: s.envoy.worker_gauges("kvroute.kv_capacity_blocks") == want, what=f"capacities {want}")
    decided = burst(s, tokens(7, 64 * 16))
    workers = [d["worker"] for d in decided]
    assert len(set(workers[:5])) == 1 and workers[5] != workers[0], workers
    assert max(workers.count(w) for w in set(workers)) == 5, workers
    assert [d.get("memory") for d in decided[:6]] == [None] * 5 + ["1"], decided
    assert not any(d.get("spilled") for d in decided), decided
    limited = sum(d.get("memory") == "1" for d in decided)
    wait_for(lambda: s.envoy.stat("kvroute.memory_limited") == limited, what=f"kvroute.memory_limited == {limited}")


@pytest.mark.parametrize("tie", [True, False])
def test_the_holder_tie_keeps_a_prefix_on_its_busy_holder(setup, tie):
    """Worker 0 holds a 64-block prefix P and is prefilling another prompt Q (64 uncached
    blocks, 66 in flight). A request P + 2 blocks costs 2 + 132 + 66 = 200 there against
    66 + 66 + 66 = 198 on idle worker 1, and would wait 66 blocks on either. At the
    shipped τ (0.25 × 64 hits = 16 ≥ 2) it stays with worker 0; without the tie worker 1
    computes P a second time."""
    s = setup(n_workers=2, filter_config={} if tie else {"holder_tie_per_hit": None})
    prefix, other = tokens(21, 64 * 16), tokens(22, 66 * 16)
    s.state.store(s.workers[0].id, prefix)
    s.state.store(s.workers[0].id, other[:32])  # Q's first 2 blocks: Q goes to worker 0
    s.wait_synced()
    busy = threading.Thread(target=s.envoy.request, kwargs={"headers": {
        "x-prompt-token-ids-b64": b64(other), "x-test-delay-ms": "1500"}})
    busy.start()
    wait_for(lambda: _prefill(s).get(_stat_id(s.workers[0])) == 64, what="worker 0 prefilling Q")
    _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prefix + tokens(23, 32))})
    busy.join()
    d = debug(h)
    if tie:
        assert (d["worker"], d["hits"], d.get("holder")) == (s.workers[0].id, "64", "1"), d
        wait_for(lambda: s.envoy.stat("kvroute.kept_on_holder") == 1, what="kvroute.kept_on_holder == 1")
    else:
        assert (d["worker"], d["hits"], d.get("holder")) == (s.workers[1].id, "0", None), d


def test_agents_without_a_key_get_implicit_keys_once_their_prompt_is_seen_continued(setup):
    """Agents that send no cache key share a 32-block system prompt on worker 0. Two start
    and stay in flight there; each one's next step runs past the prompt (its own first
    step, in flight), which marks the prompt, and the second confirms it: both steps take
    implicit keys without a charge and stay. A third agent then leaves the confirmed
    prompt with a new implicit key, charged for the two on worker 0: it goes elsewhere."""
    s = setup(n_workers=3)
    system = tokens(31, 32 * 16)
    s.state.store(s.workers[0].id, system)
    s.wait_synced()

    def agent(a, own_blocks):
        return system + tokens(40 + a, own_blocks * 16)

    firsts = [threading.Thread(target=s.envoy.request, kwargs={"headers": {
        "x-prompt-token-ids-b64": b64(agent(a, 2)), "x-test-delay-ms": "4000"}}) for a in (1, 2)]
    for t in firsts:
        t.start()
    wait_for(lambda: _active(s).get(_stat_id(s.workers[0]), 0) >= 32 + 2 * 2, what="two agents in flight on worker 0")
    steps = []
    for a in (1, 2):
        _, h, body = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(agent(a, 2) + tokens(50 + a, 32))})
        steps.append((served_by(s, body), debug(h)))
    assert [w for w, _ in steps] == [s.workers[0]] * 2, steps
    assert "implicit_key" not in steps[0][1], "one conversation's continuation only marks the prompt"
    assert steps[1][1].get("implicit_key") == "1" and "new_key" not in steps[1][1], steps[1][1]
    _, h, body = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(agent(3, 2))})
    d = debug(h)
    assert (d.get("implicit_key"), d.get("new_key")) == ("1", "1"), d
    assert served_by(s, body) is not s.workers[0]
    for t in firsts:
        t.join()
    wait_for(lambda: s.envoy.stat("kvroute.new_cache_keys") == 1, what="one new (implicit) key counted")


@pytest.mark.parametrize("tie_break", ["least_cached", "hash"])
def test_a_cold_prompt_goes_to_the_idle_worker_holding_the_fewest_blocks(setup, tie_break):
    """Four idle workers hold 30, 20, 0 and 10 blocks of other prefixes. A prompt none of
    them holds costs the same on each: by default it goes to the empty one (the sync
    service's count from the index), each of six different prompts; by the hash alone the
    six spread."""
    s = setup(n_workers=4, filter_config={"tie_break": tie_break})
    for w, (prefix, blocks) in zip(s.workers, [(31, 30), (32, 20), (33, 0), (34, 10)]):
        if blocks:
            s.state.store(w.id, tokens(prefix, blocks * 16))
    s.wait_synced()
    want = {_stat_id(w): n for w, n in zip(s.workers, [30, 20, 0, 10])}
    wait_for(lambda: s.envoy.worker_gauges("kvroute.cached_blocks") == want, what=f"cached-block gauges {want}")
    decided = []
    for prefix in range(40, 46):
        _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(tokens(prefix, 8 * 16))})
        decided.append(debug(h))
        # Idle again before the next: the wasm build releases within 100 ms, and the
        # gauges follow within 100 ms more.
        time.sleep(0.3)
        wait_for(lambda: not any(_active(s).values()) and not any(_prefill(s).values()), what="an idle fleet")
    workers = [d["worker"] for d in decided]
    if tie_break == "least_cached":
        assert workers == [s.workers[2].id] * 6, decided
        assert all(d.get("least_cached") == "1" for d in decided), decided
        wait_for(lambda: s.envoy.stat("kvroute.least_cached") == 6, what="kvroute.least_cached == 6")
    else:
        assert len(set(workers)) > 1 and not any("least_cached" in d for d in decided), decided


def test_active_blocks_return_to_zero(setup):
    s = setup(n_workers=2)
    # 20 blocks each, a new prompt per case: released blocks linger as predictions, which
    # count as cached (no prefill) for the next request with the same prompt.
    hdr = {"x-prompt-token-ids-b64": b64(tokens(8, 320))}

    def total():
        # Nothing here answers before its end: a request's 20 uncached blocks are
        # prefilling until then.
        return _load(s)

    # Completed.
    t = threading.Thread(target=s.envoy.request, kwargs={"headers": {**hdr, "x-test-delay-ms": "700"}})
    t.start()
    wait_for(lambda: total() == (20, 20), what="20 blocks in flight")
    t.join()
    wait_for(lambda: total() == (0, 0), what="release after completion")

    # Client abort: send the request, then close the socket before the answer.
    raw = socket.create_connection(("127.0.0.1", s.envoy.port))
    req = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n"
           f"x-test-delay-ms: 2000\r\nx-prompt-token-ids-b64: {b64(tokens(16, 320))}\r\n\r\n")
    raw.sendall(req.encode())
    wait_for(lambda: total() == (20, 20), what="aborted request in flight")
    raw.close()
    wait_for(lambda: total() == (0, 0), what="release after client abort")

    # Upstream reset: every worker closes the connection; Envoy retries, then 503.
    status, _, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(tokens(17, 320)), "x-test-reset": "1"})
    assert status == 503
    wait_for(lambda: total() == (0, 0), what="release after upstream reset")
    wait_for(lambda: s.envoy.stat("kvroute.requests") == 3, what="stats flushed")
    assert s.envoy.stat("kvroute.update_failures") == 0


def test_traffic_flows_without_the_feed(setup):
    s = setup(n_workers=3, feed=False)
    # Several sync ticks pass without an answer: still no table (an empty one would read
    # as "no worker up").
    wait_for(lambda: s.envoy.stat("kvroute_sync.polls_failed") >= 3, what="failed polls")
    for _ in range(6):
        status, h, _ = s.envoy.request(headers={"x-prompt-token-ids": dec(tokens(1, 64))})
        assert status == 200
        assert debug(h)["fallback"] == "no_table"
    assert sum(len(w.requests) for w in s.workers) == 6


def test_feed_outage_routes_by_load_then_recovers(setup):
    s = setup(n_workers=2, filter_config={"predict_on_route": False})
    prompt = tokens(10, 320)
    s.state.store(s.workers[1].id, prompt)
    s.wait_synced()
    _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    assert debug(h)["worker"] == s.workers[1].id
    s.feed.fail_with = 503
    wait_for(lambda: s.envoy.stat("kvroute_sync.index_live") == 0, timeout=15, what="index stale")
    for _ in range(4):
        status, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
        assert status == 200
        assert debug(h)["fallback"] == "index_stale"
    s.feed.fail_with = None
    wait_for(lambda: s.envoy.stat("kvroute_sync.index_live") == 1, timeout=15, what="index live")
    _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    assert debug(h)["worker"] == s.workers[1].id and "fallback" not in debug(h)


def test_sidecar_restart_resyncs_from_snapshot(setup):
    s = setup(n_workers=2, filter_config={"predict_on_route": False})
    prompt = tokens(11, 320)
    s.state.store(s.workers[0].id, prompt)
    s.wait_synced()
    # New epoch, and meanwhile the prefix moved to worker 1.
    s.state.restart()
    s.state.clear(s.workers[0].id)
    s.state.store(s.workers[1].id, prompt)
    s.wait_synced()
    _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
    assert debug(h)["worker"] == s.workers[1].id
    assert s.envoy.stat("kvroute_sync.resyncs") >= 1


def test_garbage_feed_is_counted_and_survived(setup):
    s = setup(n_workers=2)
    s.feed.garbage = b"KVRF\x01\x00\x00\x00" + b"\xff" * 40
    wait_for(lambda: s.envoy.stat("kvroute_sync.frames_bad") >= 2, what="bad frames counted")
    s.feed.garbage = None
    status, _, _ = s.envoy.request(headers={"x-prompt-token-ids": dec(tokens(1, 64))})
    assert status == 200


def test_down_workers_are_never_chosen(setup):
    s = setup(n_workers=3, filter_config={"max_endpoints": 16})
    prompt = tokens(12, 320)
    s.state.store(s.workers[0].id, prompt)
    s.state.set_workers([(s.workers[0].id, "both", False), (s.workers[1].id, "both", True),
                         (s.workers[2].id, "both", True)])
    s.wait_synced()
    for _ in range(5):
        _, h, body = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
        assert served_by(s, body) is not s.workers[0]
    up = s.workers[1].requests + s.workers[2].requests
    assert all(s.workers[0].id not in r["x-gateway-destination-endpoint"] for r in up)


@pytest.mark.parametrize("bad, says", [
    ({"overlap_wieght": 2}, "overlap_wieght"),                          # an unknown key
    ({"kv_capacity_blocks": -1}, "`kv_capacity_blocks`: invalid value"),  # a bad value, named
    ({"mode": "disagg"}, "`mode`: unknown variant"),
], ids=["unknown_key", "negative_count", "bad_variant"])
def test_bad_plugin_configuration_refuses_to_load(tmp_path, build, bad, says):
    from harness import render_config, free_port
    import json
    cfg, _, _ = render_config([], free_port(), bad, build=build)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode != 0
    assert says in r.stdout + r.stderr


@pytest.mark.parametrize("config", [ENVOY_YAML, ENVOY_NATIVE_YAML], ids=["wasm", "native"])
def test_envoy_configs_validate(config):
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout + r.stderr


def test_the_native_config_is_the_wasm_config_with_the_module_in_place_of_the_wasm():
    """envoy-native.yaml differs from envoy.yaml only where kvroute is loaded: the bootstrap
    extension, the HTTP filter and the filter's name in per-route settings."""
    import json
    import yaml
    wasm, native = (yaml.safe_load(p.read_text()) for p in (ENVOY_YAML, ENVOY_NATIVE_YAML))
    ws, ns = wasm["bootstrap_extensions"][0]["typed_config"], native["bootstrap_extensions"][0]["typed_config"]
    assert json.loads(ws["config"]["configuration"]["value"]) == json.loads(ns["extension_config"]["value"])
    assert ws["config"]["vm_config"]["vm_id"] == ns["extension_name"]
    hcm = [c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
           for c in (wasm, native)]
    wf, nf = hcm[0]["http_filters"][1], hcm[1]["http_filters"][1]
    assert json.loads(wf["typed_config"]["config"]["configuration"]["value"]) == \
        json.loads(nf["typed_config"]["filter_config"]["value"])
    assert nf["typed_config"]["filter_name"] == ns["extension_name"]
    for f in (ns, nf["typed_config"]):
        assert f["dynamic_module_config"]["do_not_close"] is True
    # Everything else is the same document.
    for c, name in ((wasm, "envoy.filters.http.wasm"), (native, "envoy.filters.http.dynamic_modules")):
        del c["bootstrap_extensions"]
        listener_hcm = c["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        del listener_hcm["http_filters"][1]
        text = json.dumps(c).replace(name, "KVROUTE_FILTER")
        c.clear()
        c.update(json.loads(text))
    assert wasm == native


def test_router_hashes_match_the_published_vectors():
    import json
    v = json.loads((ROOT / "tests" / "vectors" / "block_hashes.json").read_text())
    assert any("namespace" in c for c in v["cases"])
    for case in v["cases"]:
        ns = namespace(case.get("lora"), case.get("cache_salt"))
        assert str(ns) == case.get("namespace", "0")
        assert [str(h) for h in block_hashes(case["tokens"], case["block_size"], ns)] == case["seq_hashes"]


def test_admin_route_reaches_the_sidecar_through_envoy(setup):
    """The specification's `curl localhost:8000/v1/admin/cache-view/<worker>` works on Envoy's port."""
    import json
    s = setup(n_workers=2)
    s.state.store(s.workers[0].id, tokens(13, 160))
    status, _, body = s.envoy.request(f"/v1/admin/cache-view/{s.workers[0].id}", method="GET", body=None)
    assert status == 200
    assert json.loads(body) == {"worker_id": s.workers[0].id, "block_count": 10}
    status, _, body = s.envoy.request("/v1/admin/cache-view/10.9.9.9:1", method="GET", body=None)
    assert status == 404 and "error" in json.loads(body)
    # Only that view, and only GET: Envoy answers the rest of /v1/admin/ itself.
    for method, path in [("GET", "/v1/admin/workers"), ("GET", f"/v1/admin/engine-blocks/{s.workers[0].id}"),
                         ("POST", f"/v1/admin/cache-view/{s.workers[0].id}")]:
        status, _, body = s.envoy.request(path, method=method, body=None if method == "GET" else b"{}")
        assert status == 404 and "through the gateway" in json.loads(body)["error"], (method, path, body)
    # Admin requests are not routed by the filter.
    assert all(len(w.requests) == 0 for w in s.workers)


def test_bad_sync_configuration_stops_envoy_with_a_clear_error(tmp_path, build):
    from harness import render_config, free_port
    import json
    cfg, _, admin = render_config([], free_port(), sync_config={"n_buckets": 1000}, build=build)
    path = tmp_path / "bad-sync.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([envoy_binary(), "-c", str(path), "--base-id", str(admin)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode != 0
    assert "n_buckets" in r.stdout + r.stderr


def test_paged_snapshot(setup):
    """A snapshot larger than one page arrives in pages (cursor protocol) and is complete."""
    s = setup(n_workers=3, sync_config={}, filter_config={"predict_on_route": False})
    s.state.page_blocks = 100
    prompts = [tokens(20 + i, 1600) for i in range(3)]  # 100 blocks each
    for w, p in zip(s.workers, prompts):
        s.state.store(w.id, p)
    s.state.restart()  # forces a fresh (paged) snapshot
    # The version is reached with the first page; the index is complete with the last.
    wait_for(lambda: s.envoy.stat("kvroute_sync.index_entries") == 300, what="all pages applied")
    assert s.state.snapshot_pages_served >= 3
    for w, p in zip(s.workers, prompts):
        _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(p)})
        assert (debug(h)["worker"], debug(h)["hits"]) == (w.id, "100")


def test_a_paged_snapshot_shows_only_when_complete(setup):
    """While a resync's pages arrive, the filters route on the previous index, not on a
    half-built one; the new index shows whole after the last page."""
    s = setup(n_workers=3, sync_config={}, filter_config={"predict_on_route": False})
    prompts = [tokens(40 + i, 1600) for i in range(3)]  # 100 blocks each
    for w, p in zip(s.workers, prompts):
        s.state.store(w.id, p)
    wait_for(lambda: s.envoy.stat("kvroute_sync.index_entries") == 300, what="index synced")

    def route(p):
        _, h, _ = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(p)})
        return debug(h)["worker"], debug(h)["hits"]

    assert route(prompts[0]) == (s.workers[0].id, "100")
    # The sidecar restarts, and meanwhile prompt 0 moved to worker 1. The snapshot comes in
    # pages of 100 blocks — worker 1's own prompt first, then prompt 0 — and stalls after
    # the first.
    with s.state.cond:
        s.state.page_blocks = 100
        s.state.hold_pages = True
        s.state.page_requests = 0
        s.state.clear(s.workers[0].id)
        s.state.store(s.workers[1].id, prompts[0])
        s.state.restart()
    try:
        # Envoy asks for the second page once it has applied the first.
        wait_for(lambda: s.state.page_requests >= 1, what="first page applied")
        for _ in range(3):
            assert route(prompts[0]) == (s.workers[0].id, "100"), "the previous index still routes"
    finally:
        s.state.release_pages()
    wait_for(lambda: s.envoy.stat("kvroute_sync.index_entries") == 300, what="all pages applied")
    wait_for(lambda: route(prompts[0]) == (s.workers[1].id, "100"), what="the new index routes")
    assert route(prompts[1]) == (s.workers[1].id, "100")


def _native_override_envoy(workers, feed, cluster_policy=None):
    """The native build handing Envoy the best worker itself (destination_via
    upstream_override); cluster_policy: one of Envoy's own policies on `workers` in place
    of override_host."""
    from harness import ENVOY_POLICIES, Envoy, render_config
    cfg, lp, ap = render_config(workers, feed.port, {"debug_header": "x-kvroute-debug",
                                                     "destination_via": "upstream_override"}, build="native")
    if cluster_policy:
        cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "workers")
        cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies." + cluster_policy,
            "typed_config": {"@type": "type.googleapis.com/" + ENVOY_POLICIES[cluster_policy]}}}]}
    return Envoy(cfg, lp, ap)


@pytest.mark.parametrize("cluster_policy", [None, "round_robin"], ids=["override_host", "round_robin"])
def test_the_native_build_hands_envoy_the_upstream_host(cluster_policy):
    """destination_via upstream_override: the best worker goes to Envoy directly, so the
    cluster needs no override_host policy (here also plain round robin), and the rest of
    the ranking rides in the header for the retries."""
    from conftest import Setup
    s = Setup(n_workers=4, feed=True, build="native")
    s.envoy.stop()
    try:
        s.envoy = _native_override_envoy(s.workers, s.feed, cluster_policy)
        prompt = tokens(31, 480)
        s.state.store(s.workers[2].id, prompt)
        s.state.store(s.workers[1].id, prompt[:240])
        s.wait_synced()
        for _ in range(6):
            status, h, body = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
            assert status == 200 and served_by(s, body) is s.workers[2], debug(h)
        rest = s.workers[2].requests[-1]["x-gateway-destination-endpoint"].split(",")
        assert rest[0] == s.workers[1].id and s.workers[2].id not in rest, rest
        wait_for(lambda: s.envoy.stat("kvroute.scored") == 6, what="scored == 6")
        assert s.envoy.stat("kvroute.upstream_override_refused") == 0
    finally:
        s.stop()


def test_with_the_upstream_override_a_retry_follows_the_ranking():
    """The best worker dies unannounced: the first attempt, sent to it by the override,
    fails to connect; the retry asks the cluster's override_host policy, which takes the
    next worker of the ranking from the header."""
    from conftest import Setup
    s = Setup(n_workers=4, feed=True, build="native")
    s.envoy.stop()
    try:
        s.envoy = _native_override_envoy(s.workers, s.feed)
        prompt = tokens(32, 480)
        s.state.store(s.workers[2].id, prompt)
        s.state.store(s.workers[1].id, prompt[:240])
        s.wait_synced()
        s.workers[2].stop()
        for _ in range(3):
            status, h, body = s.envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
            assert status == 200 and debug(h)["worker"] == s.workers[2].id
            assert served_by(s, body) is s.workers[1]
        # One retry each: the header left the dead worker out (the override had it).
        assert s.envoy.stats("cluster.workers.upstream_rq_retry$")["cluster.workers.upstream_rq_retry"] == 3
    finally:
        s.stop()


def _gateway_fragments():
    """The native build's parts in the Istio and Envoy Gateway manifests, as (label,
    bootstrap extension, HTTP filter) Envoy fragments: what those control planes hand
    Envoy (Envoy Gateway passes the policy's config as a google.protobuf.Struct)."""
    import yaml
    istio = list(yaml.safe_load_all((ROOT / "envoy" / "istio" / "native.yaml").read_text()))
    boot = istio[0]["spec"]["configPatches"][0]["patch"]["value"]["bootstrap_extensions"][0]
    filt = istio[1]["spec"]["configPatches"][0]["patch"]["value"]
    yield "istio", boot, filt
    eg_proxy, eg_policy = yaml.safe_load_all((ROOT / "envoy" / "envoy-gateway" / "kvroute-native.yaml").read_text())
    boot = yaml.safe_load(eg_proxy["spec"]["bootstrap"]["value"])["bootstrap_extensions"][0]
    [module] = eg_policy["spec"]["dynamicModule"]
    [entry] = [m for m in eg_proxy["spec"]["dynamicModules"] if m["name"] == module["name"]]
    filt = {"name": "envoy.filters.http.dynamic_modules", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
        "dynamic_module_config": {"module": {"local": {"filename": entry["source"]["local"]["path"]}},
                                  "do_not_close": entry["doNotClose"]},
        "filter_name": module["filterName"],
        "filter_config": {"@type": "type.googleapis.com/google.protobuf.Struct", "value": module["config"]}}}
    yield "envoy-gateway", boot, filt


def test_the_gateway_manifests_load_the_module(tmp_path):
    """The Istio and Envoy Gateway manifests' Envoy parts, with this checkout's module in
    place of the mounted path, load into Envoy 1.40 (validate mode configures the filter
    and the sync service), and name one store."""
    import json
    import yaml
    from harness import NATIVE
    for label, boot, filt in _gateway_fragments():
        assert boot["typed_config"]["extension_name"] == filt["typed_config"]["filter_name"], label
        cfg = yaml.safe_load(ENVOY_NATIVE_YAML.read_text())
        text = json.dumps([boot, filt]).replace("/var/lib/kvroute/libkvroute_native.so", str(NATIVE))
        boot, filt = json.loads(text)
        cfg["bootstrap_extensions"] = [boot]
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"][1] = filt
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(cfg).replace("envoy.filters.http.dynamic_modules\"", f"{filt['name']}\""))
        r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 0 and "OK" in r.stdout + r.stderr, label + r.stdout[-2000:] + r.stderr[-2000:]


def test_two_native_sync_services_may_not_share_a_name(tmp_path):
    """Two bootstrap extensions writing one store would overwrite each other's index: the
    second with the same extension_name is refused, and Envoy with it."""
    import copy
    import json
    from harness import free_port, render_config
    cfg, _, _ = render_config([], free_port(), build="native")
    cfg["bootstrap_extensions"].append(copy.deepcopy(cfg["bootstrap_extensions"][0]))
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "already runs in this Envoy" in r.stdout + r.stderr, r.stdout[-2000:]


def test_in_flight_load_is_exact_across_worker_threads(setup):
    """48 requests at once over four Envoy worker threads, each a prompt of its own (20
    blocks): while they are held upstream every block is counted once, on one worker,
    whatever thread routed it; when they end, nothing is left."""
    from concurrent.futures import ThreadPoolExecutor
    s = setup(n_workers=3, concurrency=4)
    n = 48

    def one(i):
        return s.envoy.request(headers={"x-prompt-token-ids-b64": b64(tokens(100 + i, 320)),
                                        "x-test-delay-ms": "1500"}, timeout=30)[0]

    with ThreadPoolExecutor(n) as pool:
        answers = pool.map(one, range(n))
        wait_for(lambda: _load(s) == (n * 20, n * 20), what=f"{n * 20} blocks in flight")
        assert all(status == 200 for status in answers)
    wait_for(lambda: _load(s) == (0, 0), what="every block released")
    wait_for(lambda: s.envoy.stat("kvroute.requests") == n, what="every request counted")
    assert s.envoy.stat("kvroute.scored") == n and s.envoy.stat("kvroute.update_failures") == 0
