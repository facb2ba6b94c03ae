#!/usr/bin/env python3
"""Freshness: from a publisher's send of a BlockStored to the block being visible to the
filter in Envoy, while 16 publishers keep the sidecar busy with background events; per
event transport, side by side in one run.

Path measured: pyzmq PUB → kvroute-sidecar (decode, index, change log) → long-poll feed →
Envoy's sync service (apply, write shared data) → the filter's next routing decision.
With --transport nats, the sidecar reads a NATS JetStream stream (Debian's nats-server)
that one `kvroute-sidecar relay` (all 16 engines, as one per host would) fills from the
publishers: pyzmq PUB → relay → nats-server → sidecar → ... (`nats`: the stream in files,
the default; `nats-memory`: `nats_storage = "memory"`). The CPU of the event path
(sidecar; plus relay and nats-server) gives stored blocks per CPU-second.

Each probe publishes one new block on one worker's stream, then sends requests carrying
that block's tokens (back to back) until the debug header says the filter routed it to that
worker with 1 cache hit; the probe's latency is that moment minus the send. Resolution is
one request round trip (~1 ms here): the numbers are upper bounds.

Background: each publisher sends batches of one BlockStored of 64 new blocks plus a
BlockRemoved of an older chain (an engine at capacity, storing and evicting), paced to
--rate stored blocks per second in all. Beside the latencies: the sync service's polls per
second and Envoy's CPU, which `--feed-linger-ms 0,2,5` compares (the sidecar holds each
answer that long once it has a change, gathering more into it).

    python3 benches/sidecar_freshness.py [--rate 100000] [--probes 300] [--transport zmq,nats,nats-memory]
                                         [--feed-linger-ms 0,2,5] [--json out.json]
"""
import argparse
import base64
import http.client
import json
import pathlib
import random
import statistics
import struct
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
import msgspec  # noqa: E402
from envoy_overhead import Port, Upstream  # noqa: E402
from harness import Envoy, Sidecar, free_port, render_config  # noqa: E402
from harness.cluster import Nats, Relay  # noqa: E402
from harness.kvevents import Publisher, batch, removed, stored  # noqa: E402

N_WORKERS = 16
CHAIN = 64          # blocks per background BlockStored
POOL = 400          # chains per publisher, cycled
RESIDENT = 200      # chains an engine keeps before evicting the oldest


def background_payloads(w, rng):
    """Pre-encoded batches for publisher w: store chain j, evict chain j - RESIDENT."""
    enc = msgspec.msgpack.Encoder()
    chains = []
    for j in range(POOL):
        toks = [rng.randrange(150_000) for _ in range(CHAIN * 16)]
        hashes = [(w << 48) | (j << 16) | i for i in range(CHAIN)]
        chains.append((toks, hashes))
    out = []
    for j in range(POOL):
        toks, hashes = chains[j]
        events = [stored("vllm", hashes, None, toks, 16)]
        old = chains[(j - RESIDENT) % POOL][1]
        events.append(removed("vllm", old))
        out.append(enc.encode(batch("vllm", events)))
    return out


def pump(pubs, payloads, rate, stop, sent):
    """Sends background batches round-robin over the publishers at `rate` blocks/s."""
    per_sec = rate / CHAIN
    start = time.perf_counter()
    n = 0
    while not stop.is_set():
        due = start + n / per_sec
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        w = n % len(pubs)
        pubs[w].send_payload(payloads[w][(n // len(pubs)) % POOL])
        n += 1
        sent[0] = n * CHAIN


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=100_000, help="background stored blocks per second")
    ap.add_argument("--probes", type=int, default=300)
    ap.add_argument("--transport", default="zmq,nats", help="comma-separated, run in this order")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--feed-linger-ms", default=None,
                    help="the sync service's feed_linger_ms (default: its own default); comma-separated, "
                         "each transport once per value, the results keyed TRANSPORT@lingerN")
    args = ap.parse_args()
    transports = args.transport.split(",")
    if any(t not in ("zmq", "nats", "nats-memory") for t in transports):
        sys.exit("--transport: each of zmq, nats, nats-memory")
    lingers = [None] if args.feed_linger_ms is None else [int(v) for v in args.feed_linger_ms.split(",")]
    results = {}
    for t in transports:
        for linger in lingers:
            key = t if len(lingers) == 1 else f"{t}@linger{linger}"
            results[key] = run(t, args, linger)
    for t in ("nats", "nats-memory"):
        if "zmq" in results and t in results:
            name = t.replace("-", "_")
            results[f"{name}_over_zmq_p99"] = round(results[t]["p99_ms"] / results["zmq"]["p99_ms"], 2)
            results[f"{name}_over_zmq_blocks_per_cpu_s"] = round(
                results[t]["blocks_per_cpu_s"] / results["zmq"]["blocks_per_cpu_s"], 2)
    print(json.dumps(results, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def run(transport, args, linger):
    print(f"== {transport}" + ("" if linger is None else f", feed_linger_ms {linger}"), flush=True)
    rng = random.Random(11)
    upstream = Upstream(N_WORKERS)
    workers = [Port(p) for p in upstream.ports]
    pubs, specs = [], []
    for w in workers:
        ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        pubs.append(Publisher(ev, rp))
        specs.append((f"127.0.0.1:{w.port}", ev, rp, "both"))
    path = []  # the event path's processes, for their CPU
    nats = None
    if transport in ("nats", "nats-memory"):
        storage = "memory" if transport == "nats-memory" else "file"
        nats = Nats()
        relay = Relay(nats.url, specs[0][0], specs[0][1], specs[0][2],
                      extra=[a for sp in specs[1:] for a in ("--worker", f"{sp[0]}={sp[1]},replay={sp[2]}")]
                      + ["--nats-storage", storage])
        path += [relay, nats]
        sidecar = Sidecar(specs, extra={"health_path": "", "kv_event_transport": "nats", "nats_url": nats.url,
                                        "nats_storage": storage})
    else:
        sidecar = Sidecar(specs, extra={"health_path": ""})
    path.insert(0, sidecar)
    cfg, lp, ap_ = render_config(workers, sidecar.port,
                                 {"debug_header": "x-kvroute-debug", "predict_on_route": False},
                                 {"poll_timeout_ms": 5000, "stale_after_ms": 15000,
                                  **({} if linger is None else {"feed_linger_ms": linger})})
    envoy = Envoy(cfg, lp, ap_, concurrency=1)
    time.sleep(0.5)
    print("encoding background batches ...", flush=True)
    payloads = [background_payloads(i, rng) for i in range(N_WORKERS)]
    stop, sent = threading.Event(), [0]
    bg = threading.Thread(target=pump, args=(pubs, payloads, args.rate, stop, sent), daemon=True)
    latencies = []
    try:
        m0 = sidecar.metric("kvroute_sidecar_blocks_stored_total")
        cpu0 = [p.cpu_seconds() for p in path]
        envoy_cpu0, polls0 = envoy.cpu_seconds(), envoy.stat("kvroute_sync.polls_ok")
        t_bg = time.perf_counter()
        bg.start()
        time.sleep(2)  # let the background reach its rate
        conn = http.client.HTTPConnection("127.0.0.1", lp, timeout=10)
        for i in range(args.probes):
            w = i % N_WORKERS
            toks = [200_000 + i * 16 + k for k in range(16)]
            header = base64.b64encode(struct.pack("<16I", *toks)).decode()
            want = f"127.0.0.1:{workers[w].port}"
            t0 = time.perf_counter()
            pubs[w].publish(batch("vllm", [stored("vllm", [(1 << 62) + i], None, toks, 16)]))
            while True:
                conn.request("POST", "/v1/completions", body=b"{}", headers={"x-prompt-token-ids-b64": header})
                r = conn.getresponse()
                r.read()
                d = dict(kv.split("=", 1) for kv in r.getheader("x-kvroute-debug").split(";"))
                if d.get("hits") == "1" and d.get("worker") == want:
                    break
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError(f"probe {i} not visible after 10 s: {d}")
            latencies.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)
        elapsed = time.perf_counter() - t_bg
        applied = sidecar.metric("kvroute_sidecar_blocks_stored_total") - m0
        cpu = [p.cpu_seconds() - c for p, c in zip(path, cpu0)]
        # The gateway's side of the path: its polls, and Envoy's CPU (its main thread's
        # sync service, and the probes' requests on its worker).
        envoy_cpu, polls = envoy.cpu_seconds() - envoy_cpu0, envoy.stat("kvroute_sync.polls_ok") - polls0
        stream = nats.stream_info() if nats else None
        # A resync (the relay re-publishing after a batch the stream did not take) would
        # be part of what was measured: say so.
        resyncs = relay.logs().count("resync: the stream") if nats else None
    finally:
        stop.set()
        envoy.stop()
        for p in path:
            p.stop()
        for p in pubs:
            p.close()
        upstream.stop()

    q = statistics.quantiles(latencies, n=100, method="inclusive")
    result = {
        "transport": transport,
        "feed_linger_ms": linger,
        "background_rate_target": args.rate,
        "background_rate_applied": round(applied / elapsed),
        "probes": len(latencies),
        "p50_ms": round(q[49], 2),
        "p90_ms": round(q[89], 2),
        "p99_ms": round(q[98], 2),
        "max_ms": round(max(latencies), 2),
        # Stored blocks applied per CPU-second of the whole event path (each process's).
        "cpu_s": {type(p).__name__.lower(): round(c, 2) for p, c in zip(path, cpu)},
        "blocks_per_cpu_s": round(applied / sum(cpu)),
        "feed_polls_per_s": round(polls / elapsed),
        "envoy_cpu_share": round(envoy_cpu / elapsed, 3),
    }
    if stream:
        result["stream_bytes_per_stored_block"] = round(stream["bytes"] / max(1, sent[0]), 1)
        result["relay_resyncs"] = resyncs
    print(json.dumps(result, indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
