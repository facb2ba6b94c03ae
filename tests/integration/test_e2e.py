"""The whole path: engine-format KV events over ZMQ → kvroute-sidecar → the sync service in a
real Envoy → the filter routes a request to the worker holding its prefix."""
import base64
import json
import struct
import time

import pytest

from harness import Envoy, Sidecar, free_port, render_config, wait_for, wait_synced
from harness.kvevents import Publisher, batch, chain_events, stored
from upstream import Worker


def tokens(prefix, n):
    return [prefix * 100_000 + i for i in range(n)]


def b64(toks):
    return base64.b64encode(struct.pack(f"<{len(toks)}I", *toks)).decode()


class Stack:
    def __init__(self, n=3, build="wasm"):
        self.workers = [Worker() for _ in range(n)]
        self.specs, self.pubs = [], []
        for w in self.workers:
            ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            self.specs.append((w.id, ev, rp, "both"))
            self.pubs.append(Publisher(ev, rp))
        self.sidecar_port = free_port()
        self.sidecar = Sidecar(self.specs, port=self.sidecar_port)
        cfg, lp, ap = render_config(self.workers, self.sidecar_port, {"debug_header": "x-kvroute-debug"},
                                    build=build)
        self.envoy = Envoy(cfg, lp, ap)
        time.sleep(0.3)  # ZMQ subscriptions settle

    def synced(self):
        wait_synced(self.envoy, self.sidecar)

    def idle(self):
        """Until every finished request is released: the wasm filter releases ended streams
        in batches, within 100 ms; until then a finished request still counts as load."""
        time.sleep(0.3)
        wait_for(lambda: not any(self.envoy.stats("kvroute.active_blocks").values()), what="no load")

    def route(self, prompt, extra_headers=None):
        self.idle()
        status, headers, body = self.envoy.request(
            headers={"x-prompt-token-ids-b64": b64(prompt), **(extra_headers or {})})
        assert status == 200, body
        d = dict(kv.split("=", 1) for kv in headers["x-kvroute-debug"].split(";"))
        return json.loads(body)["worker"], d

    def stop(self):
        self.envoy.stop()
        self.sidecar.stop()
        for p in self.pubs:
            p.close()
        for w in self.workers:
            w.stop()


@pytest.fixture
def stack(build):
    s = Stack(build=build)
    yield s
    s.stop()


def test_events_route_requests_and_cache_view_works_through_envoy(stack):
    b = stack.workers[1]
    prefix = tokens(1, 48 * 16)  # a 48-block system prompt
    stack.pubs[1].publish(batch("vllm", chain_events("vllm", prefix)))
    wait_for(lambda: stack.sidecar.block_count(b.id) == 48, what="sidecar has B's blocks")
    stack.synced()
    for i in range(3):
        worker, d = stack.route(prefix + tokens(50 + i, 100))
        assert worker == b.id and int(d["hits"]) == 48, d

    # The specification's check, through Envoy's listener.
    status, _, body = stack.envoy.request(f"/v1/admin/cache-view/{b.id}", method="GET", body=None)
    assert status == 200 and json.loads(body) == {"worker_id": b.id, "block_count": 48}
    # Stored again (the engine reused its cache): the count stays flat.
    stack.pubs[1].publish(batch("vllm", chain_events("vllm", prefix)))
    stack.pubs[1].flush()
    time.sleep(0.3)
    _, _, body = stack.envoy.request(f"/v1/admin/cache-view/{b.id}", method="GET", body=None)
    assert json.loads(body)["block_count"] == 48
    status, _, body = stack.envoy.request("/v1/admin/cache-view/10.1.1.1:1", method="GET", body=None)
    assert status == 404


def test_traffic_survives_the_sidecar_and_kv_routing_returns_with_it(stack):
    c = stack.workers[2]
    prefix = tokens(2, 40 * 16)
    stack.pubs[2].publish(batch("sglang", chain_events("sglang", prefix)))
    wait_for(lambda: stack.sidecar.block_count(c.id) == 40, what="sidecar has C's blocks")
    stack.synced()
    assert stack.route(prefix)[0] == c.id

    stack.sidecar.stop(kill=True)
    # Requests keep flowing (by cached index, then by load once it goes stale).
    for i in range(10):
        stack.route(prefix + tokens(60 + i, 16))
        time.sleep(0.3)
    wait_for(lambda: stack.envoy.stat("kvroute_sync.index_live") == 0, timeout=10, what="index stale")
    worker, d = stack.route(prefix)
    assert d.get("fallback") == "index_stale", d

    # A new sidecar on the same port: it catches up from the engine's replay buffer and
    # Envoy resyncs from its snapshot (new epoch).
    stack.sidecar = Sidecar(stack.specs, port=stack.sidecar_port)
    time.sleep(0.3)
    stack.pubs[2].publish(batch("sglang", chain_events("sglang", tokens(3, 16))))  # any new batch
    wait_for(lambda: stack.sidecar.block_count(c.id) == 41, what="history replayed into the new sidecar")
    stack.synced()
    wait_for(lambda: stack.envoy.stat("kvroute_sync.index_live") == 1, what="index live again")
    # (Workers that served the prefix during the outage hold it too, by prediction: any of
    # them may win; what matters is that the cache term is back.)
    wait_for(lambda: stack.route(prefix)[1].get("hits") == "40", what="KV routing restored")
    assert "fallback" not in stack.route(prefix)[1]


def test_a_lora_request_matches_only_its_adapters_blocks(stack):
    a, b = stack.workers[0], stack.workers[1]
    prompt = tokens(4, 20 * 16)
    n = len(prompt) // 16
    stack.pubs[0].publish(batch("vllm", [stored("vllm", list(range(100, 100 + n)), None, prompt, 16,
                                                lora_name="sql-adapter",
                                                extra_keys=[("sql-adapter",)] * n)]))
    stack.pubs[1].publish(batch("vllm", chain_events("vllm", prompt)))
    wait_for(lambda: stack.sidecar.block_count(a.id) == n and stack.sidecar.block_count(b.id) == n,
             what="both chains")
    stack.synced()
    def where(extra=None):
        worker, d = stack.route(prompt, extra)
        return worker, int(d["hits"])

    assert where({"x-kvroute-lora": "sql-adapter"}) == (a.id, n)
    assert where() == (b.id, n)
    assert where({"x-kvroute-lora": "another-adapter"})[1] == 0
    assert where({"x-kvroute-cache-salt": "tenant-7"})[1] == 0
    # The namespace headers are the router's inputs: not forwarded to the engine.
    assert "x-kvroute-lora" not in a.requests[-1] and "x-kvroute-lora" not in b.requests[-1]


def test_offloaded_blocks_count_at_their_credit(stack):
    a, b = stack.workers[0], stack.workers[1]
    prompt = tokens(5, 20 * 16)
    n = len(prompt) // 16
    # A holds the whole prompt, but only in CPU memory; B the first 8 blocks on its GPU.
    gpu_events = chain_events("vllm", prompt, hash_of=lambda i: 500 + i)
    stack.pubs[0].publish(batch("vllm", [stored("vllm", e.block_hashes, e.parent_block_hash, e.token_ids, 16,
                                                medium="CPU") for e in gpu_events]))
    stack.pubs[1].publish(batch("vllm", chain_events("vllm", prompt[:8 * 16])))
    wait_for(lambda: stack.sidecar.block_count(a.id) == n and stack.sidecar.block_count(b.id) == 8,
             what="both workers' blocks")
    stack.synced()
    # Credit 0.5 (the default): A's 20 offloaded hits are worth 10 > B's 8.
    worker, d = stack.route(prompt)
    assert (worker, d["hits"], d.get("offloaded")) == (a.id, str(n), str(n)), d
