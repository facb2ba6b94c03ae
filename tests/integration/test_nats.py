"""The NATS JetStream event transport: engines' ZMQ events through `kvroute-sidecar relay`
into a real nats-server (Debian's, JetStream on), read by sidecars with
`kv_event_transport = "nats"`. Publishers speak as vLLM's do (harness.kvevents)."""
import socket
import time

import pytest

from harness import Sidecar, free_port, wait_for
from harness.cluster import Nats, Relay
from harness.kvevents import Publisher
from harness.kvfeed import feed_blocks
from test_discovery import Engine, engines_behind
from test_sidecar import snapshot, tokens


def nats_sidecar(nats, engines, **extra):
    return Sidecar([(e.http, e.events, e.replay, "both") for e in engines],
                   extra={"kv_event_transport": "nats", "nats_url": nats.url, "health_path": "", **extra})


def blocks(sc, engine):
    return snapshot(sc).get(engine.http, set())


def one_engine(closing, sidecar=True):
    """nats-server, one engine with its relay and (sidecar) a sidecar reading the stream,
    the relay's subscription settled: (nats, engine, relay, sidecar or None)."""
    nats = Nats()
    closing(nats)
    e = Engine()
    closing(e.pub)
    relay = Relay(nats.url, e.http, e.events, e.replay)
    closing(relay)
    sc = None
    if sidecar:
        sc = nats_sidecar(nats, [e])
        closing(sc)
    time.sleep(0.3)  # ZMQ's slow joiner
    return nats, e, relay, sc


def test_every_sidecar_reads_the_same_index_from_the_stream(closing):
    """Two engines, a relay each; a sidecar started before the events and one started after
    them end with the same blocks, and a restarted sidecar rebuilds them from the stream
    alone (the engines' replay buffers are not asked)."""
    nats = Nats()
    closing(nats)
    engines = [Engine(), Engine()]
    for e in engines:
        closing(e.pub)
        closing(Relay(nats.url, e.http, e.events, e.replay))
    early = nats_sidecar(nats, engines)
    closing(early)
    time.sleep(0.3)  # ZMQ's slow joiner: the relays' subscriptions reach the publishers
    prompts = [tokens(60, 8 * 16), tokens(61, 5 * 16)]
    for e, p in zip(engines, prompts):
        e.store(p)
    want = {e.http: set(feed_blocks(p)) for e, p in zip(engines, prompts)}
    wait_for(lambda: all(blocks(early, e) == want[e.http] for e in engines), what="the early sidecar's index")

    late = nats_sidecar(nats, engines)
    closing(late)
    wait_for(lambda: all(blocks(late, e) == want[e.http] for e in engines), what="the late sidecar's index")
    replays = sum(e.pub.replays_served for e in engines)

    early.stop()
    again = nats_sidecar(nats, engines)
    closing(again)
    wait_for(lambda: snapshot(again) == snapshot(late), what="the restarted sidecar to equal the other")
    assert sum(e.pub.replays_served for e in engines) == replays, "the stream, not the engine, replayed"
    assert nats.stream_info()["messages"] == 2


def test_a_stream_kept_in_memory(closing):
    """`nats_storage = "memory"`: the relay creates the stream in the server's memory and a
    sidecar reads it as from files; a sidecar configured for files finds the stream as it
    is and says so."""
    nats = Nats()
    closing(nats)
    e = Engine()
    closing(e.pub)
    closing(Relay(nats.url, e.http, e.events, e.replay, extra=["--nats-storage", "memory"]))
    sc = nats_sidecar(nats, [e], nats_storage="memory")
    closing(sc)
    time.sleep(0.3)  # ZMQ's slow joiner
    prompt = tokens(98, 4 * 16)
    e.store(prompt)
    wait_for(lambda: blocks(sc, e) == set(feed_blocks(prompt)), what="the blocks through a memory stream")
    assert nats.stream_info(part="config")["storage"] == "memory"
    files = nats_sidecar(nats, [e])
    closing(files)
    wait_for(lambda: blocks(files, e) == set(feed_blocks(prompt)), what="the second sidecar's index")
    assert "exists with Memory storage, not the File configured" in files.logs()


def test_a_stream_lost_with_its_server_is_made_again_by_its_relay_and_read_anew(closing):
    """A stream kept in memory is gone when its (lone) server restarts. The relay's next
    batch finds no stream: the relay (still running) makes the stream again and replays the
    engines' buffers into it, numbered afresh, the lost batch too. The sidecar reads the
    new stream from its first message, not from where it was in the old one (which here
    would skip the batch it never saw and clear the worker at the gap): it ends with every
    block the engines hold."""
    nats = Nats()
    closing(nats)
    e1, e2 = Engine(), Engine()
    for e in (e1, e2):
        closing(e.pub)
    relay = Relay(nats.url, e1.http, e1.events, e1.replay,
                  extra=["--worker", f"{e2.http}={e2.events},replay={e2.replay}", "--nats-storage", "memory"])
    closing(relay)
    sc = nats_sidecar(nats, [e1, e2], nats_storage="memory")
    closing(sc)
    time.sleep(0.3)  # ZMQ's slow joiner
    # e2's batch first, then e1's three: e1's next stream position (5) is past where a
    # replay puts e1's batches.
    x = tokens(70, 2 * 16)
    e2.store(x)
    wait_for(lambda: blocks(sc, e2) == set(feed_blocks(x)), what="e2's batch")
    chains = [tokens(71 + i, 2 * 16) for i in range(5)]
    held = set()
    for c in chains[:3]:
        e1.store(c)
        held |= set(feed_blocks(c))
    wait_for(lambda: blocks(sc, e1) == held, what="e1's three batches")

    nats.crash()
    nats.start()
    e1.store(chains[3])  # finds no stream
    wait_for(lambda: "resync: the stream" in relay.logs(), timeout=20, what="the relay to make the stream again")
    wait_for(lambda: nats.stream_info() and nats.stream_info()["messages"] >= 5, timeout=20,
             what="the engines' buffers replayed into the new stream")
    e1.store(chains[4])
    want = held | set(feed_blocks(chains[3])) | set(feed_blocks(chains[4]))
    wait_for(lambda: blocks(sc, e1) == want, timeout=20, what="every batch of e1, the lost one too")
    assert blocks(sc, e2) == set(feed_blocks(x))
    assert nats.stream_info()["messages"] == 6  # each batch once: e2's 1 and e1's 5
    assert sc.metric('kvroute_sidecar_resets_total{reason="gap_not_replayed"}') == 0
    assert "stream made anew" in sc.logs()


def test_a_relay_restart_loses_nothing_and_duplicates_nothing(closing):
    """The relay dies; the engine goes on. The restarted relay continues after the last
    batch the stream holds, from the engine's replay socket: every batch is in the stream
    exactly once and the sidecar's index is the engine's."""
    nats = Nats()
    closing(nats)
    e = Engine()
    closing(e.pub)
    relay = Relay(nats.url, e.http, e.events, e.replay)
    sc = nats_sidecar(nats, [e])
    closing(sc)
    time.sleep(0.3)
    prompts = [tokens(70 + i, 2 * 16) for i in range(6)]
    for p in prompts[:2]:
        e.store(p)
    wait_for(lambda: nats.stream_info()["messages"] == 2, what="two batches in the stream")
    relay.stop(kill=True)
    for p in prompts[2:4]:
        e.store(p)  # nobody relays these
    relay = Relay(nats.url, e.http, e.events, e.replay)
    closing(relay)
    time.sleep(0.3)
    for p in prompts[4:]:
        e.store(p)
    want = set().union(*(feed_blocks(p) for p in prompts))
    wait_for(lambda: blocks(sc, e) == want, what="every batch in the sidecar")
    assert nats.stream_info()["messages"] == 6
    assert "holds up to batch 1; continuing after it" in relay.logs()
    assert e.pub.replays_served >= 1


def test_an_engine_restart_and_a_nats_restart(closing):
    """An engine that restarts numbers its batches from 0 again: every sidecar clears that
    worker and takes what follows. A nats-server that restarts (store kept) loses nothing
    the relay had published, and the relay and sidecar carry on by themselves."""
    nats, e, _, sc = one_engine(closing)
    first, second = tokens(80, 4 * 16), tokens(81, 3 * 16)
    e.store(first)
    wait_for(lambda: blocks(sc, e) == set(feed_blocks(first)), what="the first chain")

    # The engine restarts: a new publisher on the same endpoints, counting from 0.
    e.pub.close()
    time.sleep(0.2)
    e.pub = Publisher(e.events, e.replay)
    closing(e.pub)
    time.sleep(0.5)
    e.store(second)
    wait_for(lambda: blocks(sc, e) == set(feed_blocks(second)), what="only the restarted engine's chain")
    assert sc.metric('kvroute_sidecar_resets_total{reason="publisher_restart"}') >= 1

    # nats-server restarts with its store: the relay reconnects and publishes the next batch.
    nats.crash()
    nats.start()
    third = tokens(82, 2 * 16)
    time.sleep(0.5)
    e.store(third)
    want = set(feed_blocks(second)) | set(feed_blocks(third))
    wait_for(lambda: blocks(sc, e) == want, timeout=20, what="events after the NATS restart")


def test_bad_messages_on_a_subject_are_counted_and_dropped(closing):
    """A message on a worker's subject that no relay wrote (no Kvroute-Seq header) is
    counted as a bad frame; the worker's index is untouched and later batches apply."""
    nats, e, _, sc = one_engine(closing)
    a, b = tokens(90, 3 * 16), tokens(91, 2 * 16)
    e.store(a)
    wait_for(lambda: blocks(sc, e) == set(feed_blocks(a)), what="the first chain")
    host, port = e.http.rsplit(":", 1)
    subject = f"kvroute.events.{host.replace('.', '_')}-{port}.0"
    with socket.create_connection(("127.0.0.1", nats.port), timeout=5) as s:
        s.recv(4096)  # INFO
        s.sendall(b'CONNECT {"verbose":false}\r\nPUB ' + subject.encode() + b" 7\r\ngarbage\r\nPING\r\n")
        assert b"PONG" in s.recv(4096)
    wait_for(lambda: sc.metric("kvroute_sidecar_frames_bad_total") == 1, what="the bad message counted")
    e.store(b)
    wait_for(lambda: blocks(sc, e) == set(feed_blocks(a)) | set(feed_blocks(b)), what="the next batch applied")


def test_a_bad_nats_configuration_refuses_to_start():
    """Settings are checked before anything connects."""
    for extra, says in [({"kv_event_transport": "nats", "nats_url": "http://x:1"}, "nats_url"),
                        ({"nats_stream": "S"}, "nats_*")]:
        sc = Sidecar([("127.0.0.1:8101", f"tcp://127.0.0.1:{free_port()}", None, "both")], extra=extra, wait=False)
        try:
            assert sc.proc.wait(timeout=10) == 2
            assert says in sc.logs()
        finally:
            sc.stop()


def two_gateways(closing, build, filter_config=None):
    """nats-server, two upstream workers with their engines and relays, and two gateways
    (each a sidecar reading the stream and an Envoy on it): (nats, ups, engines,
    [[sidecar, envoy], ...])."""
    from harness import Envoy, render_config
    from upstream import Worker

    nats = Nats()
    closing(nats)
    ups = [Worker(), Worker()]
    engines = engines_behind(ups, closing)
    for e in engines:
        closing(Relay(nats.url, e.http, e.events, e.replay))
    gateways = []
    for _ in range(2):
        sc = nats_sidecar(nats, engines)
        closing(sc)
        cfg, lp, ap = render_config(ups, sc.port, filter_config, build=build)
        envoy = Envoy(cfg, lp, ap)
        closing(envoy)
        gateways.append([sc, envoy])
    return nats, ups, engines, gateways


@pytest.mark.parametrize("build", ["wasm"])
def test_two_gateways_route_alike_and_survive_a_sidecar_restart(closing, build):
    """Two Envoys, each with its own sidecar reading the same stream, in front of one fleet:
    both send a prefix to the worker that holds it, and both keep answering while one
    sidecar restarts (the other gateway unaffected, the restarted one re-learns the index
    from the stream)."""
    import json

    from harness import wait_synced
    from test_filter import b64

    nats, ups, engines, gateways = two_gateways(closing, build)

    def route(envoy, prompt):
        status, _, body = envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
        return status, json.loads(body).get("worker") if status == 200 else None

    time.sleep(0.3)
    prefix = tokens(95, 32 * 16)
    engines[1].store(prefix)
    # Both learn it before the first request: one routed earlier would go by load, and the
    # filter's prediction would then make that worker a holder too (as a real engine's
    # events would confirm).
    for sc, envoy in gateways:
        wait_for(lambda: sc.block_count(ups[1].id) == 32, what="the prefix in each sidecar")
        wait_synced(envoy, sc)
    for sc, envoy in gateways:
        wait_for(lambda: route(envoy, prefix + tokens(96, 40)) == (200, ups[1].id), what="KV-aware routing")

    # Gateway 0's sidecar restarts on the same port; both gateways keep answering.
    sc0 = gateways[0][0]
    port = sc0.port
    sc0.stop()
    statuses = [route(envoy, prefix + tokens(97 + i, 40))[0] for i in range(10) for _, envoy in gateways]
    restarted = Sidecar([(e.http, e.events, e.replay, "both") for e in engines], port=port,
                        extra={"kv_event_transport": "nats", "nats_url": nats.url, "health_path": ""})
    closing(restarted)
    gateways[0][0] = restarted
    wait_for(lambda: snapshot(restarted) == snapshot(gateways[1][0]), what="the restarted sidecar's index")
    for i in range(10):
        for _, envoy in gateways:
            status, worker = route(envoy, prefix + tokens(120 + i, 40))
            statuses.append(status)
    assert set(statuses) == {200}
    for _, envoy in gateways:
        wait_for(lambda: route(envoy, prefix + tokens(140, 40)) == (200, ups[1].id), what="prefix routing again")


@pytest.mark.parametrize("build", ["wasm", "native"])
def test_two_gateways_share_their_load(closing, build):
    """Two Envoys, each with its own sidecar, `peer_load` on; the sidecars exchange the
    gateways' load reports on NATS. Both workers hold one prefix. A request held in flight through gateway
    A goes to one of them by the tie-break; gateway B, which routed nothing, sees A's load
    there (its `kvroute.peer_active_blocks` gauge) and sends the next request of the prefix
    to the other worker, where on its own load alone the same tie-break would have chosen
    the busy one. When A's request ends, B's view of it goes back to zero."""
    import json
    import threading

    from harness import wait_synced
    from test_filter import b64

    _, ups, engines, gateways = two_gateways(closing, build, {"peer_load": True})
    time.sleep(0.3)
    prefix = tokens(150, 32 * 16)
    for e in engines:
        e.store(prefix)
    for sc, envoy in gateways:
        wait_for(lambda: all(sc.block_count(u.id) == 32 for u in ups), what="the prefix on both, in each sidecar")
        wait_synced(envoy, sc)
    (_, a), (sc_b, b) = gateways

    def served(envoy, prompt, delay_ms=0):
        headers = {"x-prompt-token-ids-b64": b64(prompt)}
        if delay_ms:
            headers["x-test-delay-ms"] = str(delay_ms)
        status, _, body = envoy.request(headers=headers)
        assert status == 200, body
        return json.loads(body)["worker"]

    def sid(worker_id):
        return worker_id.replace(".", "_").replace(":", "_")

    held = {}
    t = threading.Thread(target=lambda: held.update(worker=served(a, prefix + tokens(151, 2 * 16), 3000)))
    t.start()
    # A's own gauge says where it went (34 blocks in flight); B must see the same.
    wait_for(lambda: any(v >= 34 for v in a.worker_gauges("kvroute.active_blocks").values()), what="A's request in flight")
    busy = next(u for u in ups if a.worker_gauges("kvroute.active_blocks").get(sid(u.id), 0) >= 34)
    wait_for(lambda: b.worker_gauges("kvroute.peer_active_blocks").get(sid(busy.id), 0) >= 34,
             what="A's load in B's view")
    assert served(b, prefix + tokens(152, 2 * 16)) != busy.id, "B went where A's request runs"
    t.join()
    assert held["worker"] == busy.id
    wait_for(lambda: not any(b.worker_gauges("kvroute.peer_active_blocks").values()), what="A's load released in B's view")
    assert b.stat("kvroute_sync.load_reports_ok") > 0 and b.stat("kvroute_sync.load_reports_failed") == 0
    assert b.stat("kvroute_sync.peer_gateways") == 1
    assert sc_b.metric("kvroute_sidecar_load_exchanged_in_total") > 0
    assert sc_b.metric("kvroute_sidecar_load_gateways") == 2


def test_batches_the_stream_did_not_store_are_reported(closing):
    """With the stream deleted under a running relay, what it publishes is not stored:
    JetStream's acknowledgement fails and the relay says so (logged and counted), instead
    of going on silently."""
    nats, e, relay, _ = one_engine(closing, sidecar=False)
    e.store(tokens(93, 2 * 16))
    wait_for(lambda: nats.stream_info()["messages"] == 1, what="the first batch")
    with socket.create_connection(("127.0.0.1", nats.port), timeout=5) as s:
        s.recv(4096)  # INFO
        s.sendall(b'CONNECT {"verbose":false}\r\nSUB _INBOX.t 1\r\n'
                  b"PUB $JS.API.STREAM.DELETE.KVROUTE_EVENTS _INBOX.t 0\r\n\r\n")
        reply = b""
        while b'"success":true' not in reply:
            chunk = s.recv(4096)
            assert chunk, reply
            reply += chunk
    e.store(tokens(94, 2 * 16))
    wait_for(lambda: "not stored" in relay.logs(), timeout=10, what="the relay to report the lost batch")
