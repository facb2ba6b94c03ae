"""Discovery: the sidecar follows a fleet that changes, from a real etcd (Debian's
etcd-server, registrations written by `kvroute-sidecar register`) or from DNS (the system
resolver). Publishers speak as vLLM's do (harness.kvevents)."""
import json
import socket
import time

from harness import Sidecar, free_port, wait_for
from harness.cluster import Etcd, Registrar
from harness.kvevents import Publisher, batch, chain_events
from harness.kvfeed import feed_blocks
from test_sidecar import snapshot, tokens


class Engine:
    """A KV-event publisher (with replay) standing for one engine at a loopback address."""

    def __init__(self):
        self.http = f"127.0.0.1:{free_port()}"
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.pub = Publisher(self.events, self.replay)

    def store(self, prompt):
        self.pub.publish(batch("vllm", chain_events("vllm", prompt)))
        self.pub.flush()


def engines_behind(ups, closing):
    """An Engine publishing for each upstream worker (its id is the worker's)."""
    engines = []
    for w in ups:
        closing(w)
        e = Engine()
        e.http = w.id
        closing(e.pub)
        engines.append(e)
    return engines


def workers(sc):
    return {w["id"]: w for w in sc.json("/v1/admin/workers")[1]["workers"]}


def test_etcd_registrations_join_and_leave_the_fleet(closing):
    etcd = Etcd()
    closing(etcd)
    engines = [Engine(), Engine()]
    for e in engines:
        closing(e.pub)
    sc = Sidecar([], extra={"discovery_backend": "etcd", "etcd_endpoints": [etcd.url]})
    closing(sc)
    assert workers(sc) == {}

    # History from before the engine registered: caught up by replay once it joins.
    a, b = tokens(40, 5 * 16), tokens(41, 3 * 16)
    engines[0].store(a)
    t0 = time.monotonic()
    reg0 = Registrar(etcd.url, engines[0].http, engines[0].events, engines[0].replay)
    closing(reg0)
    wait_for(lambda: engines[0].http in workers(sc), what="the registered worker")
    joined_s = time.monotonic() - t0
    time.sleep(0.3)  # the new subscription propagates (ZMQ's slow joiner)
    engines[0].store(b)
    wait_for(lambda: sc.block_count(engines[0].http) == 8, what="replayed history and the new chain")
    assert snapshot(sc)[engines[0].http] == set(feed_blocks(a)) | set(feed_blocks(b))
    assert joined_s < 2.0, f"registration to fleet took {joined_s:.2f} s"

    reg1 = Registrar(etcd.url, engines[1].http, engines[1].events, engines[1].replay)
    closing(reg1)
    wait_for(lambda: engines[1].http in workers(sc), what="the second worker")
    time.sleep(0.3)
    engines[1].store(tokens(42, 2 * 16))
    wait_for(lambda: sc.block_count(engines[1].http) == 2, what="the second worker's blocks")

    # Records that are not workers are counted and change nothing.
    etcd.ctl("put", "/kvroute/workers/garbage", "not json")
    etcd.ctl("put", "/kvroute/workers/bad-endpoint",
             json.dumps({"http": "127.0.0.1:1", "events": "udp://nowhere:1"}))
    wait_for(lambda: sc.metric("kvroute_sidecar_discovery_records_bad_total") >= 2, what="bad records counted")
    assert set(workers(sc)) == {engines[0].http, engines[1].http}

    # A registrar that stops revokes its lease: the worker leaves at once, with its blocks.
    t0 = time.monotonic()
    reg0.stop()
    wait_for(lambda: engines[0].http not in workers(sc), what="the stopped worker to leave")
    assert time.monotonic() - t0 < 1.5
    assert engines[0].http not in snapshot(sc)
    assert sc.json(f"/v1/admin/cache-view/{engines[0].http}")[0] == 404

    # One that dies leaves when its lease (ttl 2 s) ends.
    t0 = time.monotonic()
    reg1.stop(kill=True)
    wait_for(lambda: engines[1].http not in workers(sc), timeout=8, what="the dead registrar's lease to end")
    left_s = time.monotonic() - t0
    assert 1.0 < left_s < 5.0, f"lease expiry took {left_s:.2f} s"
    m = sc.metrics()
    assert (m["kvroute_sidecar_workers_added_total"], m["kvroute_sidecar_workers_removed_total"]) == (2, 2)


def test_an_etcd_outage_keeps_the_fleet(closing):
    etcd = Etcd()
    closing(etcd)
    engine = Engine()
    closing(engine.pub)
    sc = Sidecar([], extra={"discovery_backend": "etcd", "etcd_endpoints": [etcd.url]})
    closing(sc)
    reg = Registrar(etcd.url, engine.http, engine.events, engine.replay, ttl=3)
    closing(reg)
    wait_for(lambda: engine.http in workers(sc), what="the worker")
    time.sleep(0.3)
    engine.store(tokens(43, 4 * 16))
    wait_for(lambda: sc.block_count(engine.http) == 4, what="its blocks")

    # etcd down for longer than the lease's TTL: the sidecar keeps the fleet it had (and
    # counts the failures), the registrar keeps trying.
    etcd.crash()
    wait_for(lambda: sc.metric("kvroute_sidecar_discovery_errors_total") >= 1, timeout=15,
             what="the lost etcd noticed")
    time.sleep(3.5)
    assert engine.http in workers(sc) and sc.block_count(engine.http) == 4

    # etcd back with its data: etcd renews leases on restart, the registrar's keepalive
    # resumes, the sidecar lists and watches again; nothing left or was cleared.
    etcd.start()
    wait_for(lambda: sc.metric("kvroute_sidecar_discovery_errors_total") >= 1 and
             "/kvroute/workers/" + engine.http in etcd.ctl("get", "--prefix", "--keys-only", "/kvroute/workers/"),
             timeout=15, what="the registration after the restart")
    time.sleep(4)  # longer than the TTL: the lease is alive, kept by the registrar
    assert "/kvroute/workers/" + engine.http in etcd.ctl("get", "--prefix", "--keys-only", "/kvroute/workers/")
    assert engine.http in workers(sc) and sc.block_count(engine.http) == 4
    m = sc.metrics()
    assert (m["kvroute_sidecar_workers_added_total"], m["kvroute_sidecar_workers_removed_total"]) == (1, 0)
    # and the watch is live again: a new worker joins.
    other = Engine()
    closing(other.pub)
    closing(Registrar(etcd.url, other.http, other.events, other.replay))
    wait_for(lambda: other.http in workers(sc), timeout=8, what="a worker registered after the outage")


def test_dns_names_resolve_to_workers(closing):
    engine = Engine()
    closing(engine.pub)
    http_port = int(engine.http.rsplit(":", 1)[1])
    events_port = int(engine.events.rsplit(":", 1)[1])
    replay_port = int(engine.replay.rsplit(":", 1)[1])
    # The system resolver: `localhost` is 127.0.0.1 (and ::1 where IPv6 is configured).
    expected = {(f"[{a[4][0]}]" if ":" in a[4][0] else a[4][0]) + f":{http_port}"
                for a in socket.getaddrinfo("localhost", http_port, proto=socket.IPPROTO_TCP)}
    sc = Sidecar([], extra={"discovery_backend": "dns", "dns_name": "localhost", "dns_http_port": http_port,
                            "dns_events_port": events_port, "dns_replay_port": replay_port,
                            "dns_interval_ms": 200})
    closing(sc)
    wait_for(lambda: set(workers(sc)) == expected, what=f"workers {expected}")
    w = workers(sc)[engine.http]
    assert (w["events"], w["replay"]) == (engine.events, engine.replay)
    time.sleep(0.3)
    engine.store(tokens(44, 3 * 16))
    wait_for(lambda: sc.block_count(engine.http) == 3, what="blocks of the resolved worker")

    # A name that does not resolve is counted; the fleet stays as it was.
    bad = Sidecar([], extra={"discovery_backend": "dns", "dns_name": "no-such-host.invalid",
                             "dns_interval_ms": 100})
    closing(bad)
    wait_for(lambda: bad.metric("kvroute_sidecar_discovery_errors_total") >= 2, what="failed lookups counted")
    assert workers(bad) == {}


def test_envoy_follows_the_fleet_through_endpoint_discovery(closing, build):
    """Envoy's `workers` cluster from the sidecar (envoy/workers-eds.yaml): a registered
    worker gets requests, KV-aware, and one that leaves gets none."""
    from harness import Envoy, render_config, wait_synced
    from test_filter import b64
    from upstream import Worker

    etcd = Etcd()
    closing(etcd)
    ups = [Worker(), Worker()]
    engines = engines_behind(ups, closing)
    sc = Sidecar([], extra={"discovery_backend": "etcd", "etcd_endpoints": [etcd.url]})
    closing(sc)
    cfg, lp, ap = render_config([], sc.port, {"debug_header": "x-kvroute-debug"}, build=build, eds=True)
    envoy = Envoy(cfg, lp, ap)
    closing(envoy)
    assert envoy.stat("cluster.workers.membership_total") == 0

    def route(prompt):
        status, headers, body = envoy.request(headers={"x-prompt-token-ids-b64": b64(prompt)})
        return status, json.loads(body).get("worker") if status == 200 else None

    # Registered: routed to within 2 s (the target of discovery convergence).
    t0 = time.monotonic()
    closing(Registrar(etcd.url, engines[0].http, engines[0].events, engines[0].replay))
    wait_for(lambda: route(tokens(50, 64)) == (200, ups[0].id), timeout=5, interval=0.02,
             what="the first routed request")
    assert time.monotonic() - t0 < 2.0

    # A second worker holding a prefix gets the requests that share it.
    reg1 = Registrar(etcd.url, engines[1].http, engines[1].events, engines[1].replay)
    closing(reg1)
    wait_for(lambda: envoy.stat("cluster.workers.membership_total") == 2, what="two hosts in Envoy")
    time.sleep(0.3)
    prefix = tokens(51, 32 * 16)
    engines[1].store(prefix)
    wait_for(lambda: sc.block_count(ups[1].id) == 32, what="the second worker's blocks")
    # In Envoy's index too before the first request: one routed elsewhere first would leave
    # its prediction there, holding the whole prompt against the events' prefix.
    wait_synced(envoy, sc)
    wait_for(lambda: route(prefix + tokens(52, 50)) == (200, ups[1].id), what="KV-aware routing to it")

    # It leaves: within 2 s no request reaches it, even one sharing its prefix.
    t0 = time.monotonic()
    reg1.stop()
    wait_for(lambda: envoy.stat("cluster.workers.membership_total") == 1, timeout=5, what="one host left")
    assert time.monotonic() - t0 < 2.0
    before = len(ups[1].requests)
    for i in range(10):
        assert route(prefix + tokens(53 + i, 50)) == (200, ups[0].id)
    assert len(ups[1].requests) == before
    assert sc.metric("kvroute_sidecar_eds_requests_total") > 0


def test_bad_discovery_requests_are_refused_and_counted(closing):
    """The sidecar's EDS endpoint: a wrong method, a body past the limit (1 MiB), and a body
    that is no DiscoveryRequest each get a status that says why, counted; a real-sized
    request (Envoy 1.40's node lists its 516 extensions: 77 KB) is answered."""
    import http.client

    sc = Sidecar([("127.0.0.1:8101", f"tcp://127.0.0.1:{free_port()}", None, "both")])
    closing(sc)

    def post(body, method="POST"):
        conn = http.client.HTTPConnection("127.0.0.1", sc.port, timeout=10)
        try:
            conn.request(method, "/v3/discovery:endpoints", body=body,
                         headers={"content-type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    node = {"id": "gw", "cluster": "kvroute",
            "extensions": [{"name": f"envoy.extension.number_{i}", "category": "envoy.filters.http"}
                           for i in range(1000)]}
    good = json.dumps({"node": node, "resource_names": ["workers"]}).encode()
    assert 64 << 10 < len(good) < 1 << 20
    status, answer = post(good)
    assert status == 200
    eps = answer["resources"][0]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in eps] == [8101]

    assert post(b"", method="GET")[0] == 405
    status, err = post(b" " * ((1 << 20) + 1))
    assert status == 400 and "length limit" in err["error"]
    status, err = post(b'{"resource_names": []}')
    assert status == 400 and "name the cluster" in err["error"]
    assert sc.metric("kvroute_sidecar_eds_bad_requests_total") == 2
    assert sc.metric("kvroute_sidecar_eds_requests_total") == 1
    assert "endpoint discovery: request body: length limit exceeded (#1)" in sc.logs()
