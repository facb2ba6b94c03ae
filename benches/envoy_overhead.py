#!/usr/bin/env python3
"""In-Envoy overhead of the kvroute filter, side by side in one run.

The same Envoy binary and bootstrap (envoy/envoy.yaml), one worker thread, in front of 16
fast upstreams (a second Envoy answering `direct_response`), loaded by wrk (by a Python
closed-loop client for 32k-token prompts, whose ~175 KB header wrk cannot send):

  plain     no wasm filter (the cluster's override_host policy falls back to least_request)
  notokens  the filter, requests without a token header (same size header under another
            name): the fixed cost of a wasm filter that reads the table and load
  cold      the filter, with the sync service fed a fleet of 16 workers holding nothing
  warm      the filter, every worker holding part of the request's prefix: the scan reads
            every segment bucket (the most shared-data reads a request of that size makes)
  fresh     cold with predict-on-route off and --distinct N different prompts in turn: no
            request is a hit or shares a prompt in flight, so every one is charged its
            prefill and releases it at its first response bytes (the most load-term work a
            request causes). With --distinct every variant is loaded by the Python client
  cold_literal, warm_literal, fresh_literal
            the same with the specification's formula read literally (active_blocks as they
            are, no prefill term): what the load terms cost per request

for 2k- and 32k-token prompts (base64 token header; 2k also in decimal). Reports
throughput relative to plain, added latency, and shared-data reads per request.

Every variant but plain runs in each build named by `--builds` (default both): `wasm`
(kvroute.wasm in V8, envoy/envoy.yaml) and `native` (the dynamic module
libkvroute_native.so, envoy/envoy-native.yaml), as `VARIANT` and `VARIANT@native`, in the
same rounds. `--build LABEL=PATH` (repeatable) adds another kvroute.wasm or
libkvroute_native.so as `VARIANT@LABEL` (a refactor's before and after, or two releases).

    python3 benches/envoy_overhead.py [--rounds 3] [--duration 8] [--json out.json]
                                      [--builds wasm,native] [--build base=/path/to/kvroute.wasm]
"""
import argparse
import base64
import contextlib
import json
import os
import pathlib
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from harness import BUILDS, Envoy, free_port, render_config, wait_for  # noqa: E402
from harness.kvfeed import FeedServer, FeedState  # noqa: E402

N_WORKERS = 16
# The Envoy under test gets core 0 to itself; this script, its load generator, the feed
# server and the upstream Envoy share core 1. (On a machine with one core, no pinning.)
ENVOY_CPU = "0" if os.cpu_count() and os.cpu_count() >= 2 else None


class Upstream:
    """A fixed fast upstream: one Envoy, one listener per fake worker, direct responses.
    read_body: answer only once the whole request body is in, as an engine does (a
    direct_response alone answers on the headers, and the proxy in front then has to close
    a connection whose request is still arriving)."""

    def __init__(self, n, read_body=False):
        self.ports = [free_port() for _ in range(n)]
        admin = free_port()
        listeners = [{
            "name": f"w{i}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": p}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network."
                             "http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": f"w{i}",
                    "max_request_headers_kb": 8192,
                    "route_config": {"virtual_hosts": [{
                        "name": "all", "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"},
                                    "direct_response": {"status": 200,
                                                        "body": {"inline_string": "ok"}}}]}]},
                    "http_filters": ([{"name": "envoy.filters.http.buffer", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                        "max_request_bytes": 8388608}}] if read_body else []) + [
                        {"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                }}]}],
        } for i, p in enumerate(self.ports)]
        cfg = {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
               "static_resources": {"listeners": listeners}}
        self.dir = tempfile.mkdtemp(prefix="kvroute-upstream-")
        path = os.path.join(self.dir, "upstream.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.proc = subprocess.Popen(["envoy", "-c", path, "--concurrency", "1", "--base-id", str(admin),
                                      "-l", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _ok(f"http://127.0.0.1:{admin}/ready"), timeout=30, what="upstream envoy")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _ok(url):
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class Port:
    def __init__(self, port):
        self.port = port


def tokens(n):
    return [(i * 2654435761) % 151000 for i in range(n)]


def wrk(port, header_name, header_value, duration, connections):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as hv:
        hv.write(header_value)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as lua:
        lua.write(f'local f = io.open("{hv.name}"); local v = f:read("*a"); f:close()\n'
                  f'wrk.method = "POST"\nwrk.body = "{{}}"\n'
                  f'wrk.headers["{header_name}"] = v\n')
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", lua.name,
                          f"http://127.0.0.1:{port}/v1/completions"],
                         capture_output=True, text=True, timeout=duration + 60).stdout
    os.unlink(hv.name)
    os.unlink(lua.name)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def pct(p):
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)", out, re.M)
        v, unit = float(m.group(1)), m.group(2)
        return v * {"us": 0.001, "ms": 1, "s": 1000}[unit]

    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))
    return {"rps": rps, "p50_ms": pct(50), "p99_ms": pct(99), "requests": total,
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def exchange(sock, buf, request):
    """Sends one request on a keep-alive connection and reads its response: (the response
    head, bytes already read past it)."""
    sock.sendall(request)
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    head, _, buf = buf.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(buf) < length:
        buf += sock.recv(65536)
    return head, buf[length:]


def closed_loop(port, requests, duration, connections):
    """A closed-loop HTTP/1.1 keep-alive client: one thread per connection, each sending
    `requests` (bytes, built once) round after round for `duration` seconds. A connection
    that fails is counted and opened again. Requests/s and latency percentiles of the
    answers; non_2xx counts the answers that were not 2xx and the failed exchanges."""
    import socket
    import threading
    latencies, errors = [], [0]
    stop = time.time() + duration
    lock = threading.Lock()

    def connect():
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def one_connection(k):
        sock, buf, i, mine, failed = connect(), b"", k, [], 0
        while time.time() < stop:
            t0 = time.perf_counter()
            try:
                head, buf = exchange(sock, buf, requests[i % len(requests)])
                mine.append(time.perf_counter() - t0)
                failed += not head.startswith(b"HTTP/1.1 2")
            except OSError:
                sock.close()
                sock, buf = connect(), b""
                failed += 1
            i += connections
        sock.close()
        with lock:
            latencies.extend(mine)
            errors[0] += failed

    threads = [threading.Thread(target=one_connection, args=(k,)) for k in range(connections)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - start
    latencies.sort()

    def pct(p):
        return latencies[min(len(latencies) - 1, int(len(latencies) * p / 100))] * 1000 if latencies else 0.0

    return {"rps": len(latencies) / elapsed, "p50_ms": pct(50), "p99_ms": pct(99), "requests": len(latencies),
            "non_2xx": errors[0]}


def request_with(header_name, header_value):
    """The benchmark's request (as wrk sends it) with one header, as bytes."""
    return (f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: 2\r\n"
            f"{header_name}: {header_value}\r\n\r\n{{}}").encode()


def pyload(port, header_name, header_value, duration, connections):
    """`closed_loop` for what wrk cannot send (headers over ~100 KB)."""
    return closed_loop(port, [request_with(header_name, header_value)], duration, connections)


def load(port, header_name, header_value, duration, connections):
    # wrk's request buffer cannot hold a 32k-token header (~175 KB).
    if len(header_value) > 100_000:
        return pyload(port, header_name, header_value, duration, connections)
    return wrk(port, header_name, header_value, duration, connections)


def header_of(name, prompt, encoding):
    if name == "notokens":
        # The filter runs, the header is one it does not read: its fixed cost alone.
        return "x-unrelated", base64.b64encode(struct.pack(f"<{len(prompt)}I", *prompt)).decode()
    if encoding == "base64":
        return "x-prompt-token-ids-b64", base64.b64encode(struct.pack(f"<{len(prompt)}I", *prompt)).decode()
    return "x-prompt-token-ids", ",".join(map(str, prompt))


def build_of(path):
    """The build a kvroute artifact belongs to: a shared object is the native module."""
    return "native" if pathlib.Path(path).suffix == ".so" else "wasm"


@contextlib.contextmanager
def envoy_under_test(workers, state, filter_cfg, plain, artifact=None, build="wasm"):
    """The Envoy measured (one worker thread, pinned) in front of `workers`, with the sync
    service fed `state` and applied before it is used; `plain`: without kvroute.
    Yields (envoy, listener port)."""
    feed = FeedServer(state)
    try:
        cfg, lp, ap = render_config(workers, feed.port, filter_cfg, wasm=artifact, build=build,
                                    kvroute_filter=not plain, kvroute_sync=not plain)
        envoy = Envoy(cfg, lp, ap, concurrency=1, cpus=ENVOY_CPU)
        try:
            if not plain:
                wait_for(lambda: envoy.stat("kvroute_sync.version") >= state.version, what="feed applied")
            yield envoy, lp
        finally:
            envoy.stop()
    finally:
        feed.stop()


def stat_delta(before, after, stat):
    """How far the kvroute stat ending in `stat` moved between two `Envoy.stats` reads."""
    k = next((k for k in after if k.endswith(stat)), None)
    return after.get(k, 0) - before.get(k, 0) if k else 0


def run_variant(name, upstream, prompt, encoding, duration, connections, distinct=0, builds=None):
    """builds: label -> artifact path for `VARIANT@LABEL` (the label `native` without an
    entry: this checkout's module)."""
    name, _, label = name.partition("@")
    artifact = (builds or {}).get(label) or BUILDS[label or "wasm"].artifact
    build = build_of(artifact)
    workers = [Port(p) for p in upstream.ports]
    state = FeedState()
    state.set_workers([(f"127.0.0.1:{w.port}", "both", True) for w in workers])
    literal = name.endswith("_literal")
    name = name.removesuffix("_literal")
    if name == "warm":
        for i, w in enumerate(workers):
            # Worker i holds (i+1)/16 of the prompt: every segment has a holder.
            n = len(prompt) * (i + 1) // N_WORKERS // 16 * 16
            state.store(f"127.0.0.1:{w.port}", prompt[:n])
    filter_cfg = {"max_tokens": 131072}
    if name == "fresh":
        filter_cfg["predict_on_route"] = False
    if literal:
        filter_cfg.update(active_blocks="in_flight", prefill_load_weight=0)
    plain = name == "plain"
    with envoy_under_test(workers, state, filter_cfg, plain, artifact=artifact, build=build) as (envoy, lp):
        if distinct:
            # Prompts that differ from their first block on, sent in turn.
            requests = [request_with(*header_of(name, [i, *prompt[1:]], encoding)) for i in range(distinct)]

            def run(seconds):
                return closed_loop(lp, requests, seconds, connections)
        else:
            header = header_of(name, prompt, encoding)

            def run(seconds):
                return load(lp, *header, seconds, connections)
        run(2)  # warm-up
        before = envoy.stats("kvroute")
        cpu0 = envoy.cpu_seconds()
        result = run(duration)
        result["envoy_cpu_us_per_request"] = (envoy.cpu_seconds() - cpu0) / max(result["requests"], 1) * 1e6
        after = envoy.stats("kvroute")

        def delta(stat):
            return stat_delta(before, after, stat)

        reqs = delta("kvroute.requests")
        if name != "plain":
            result["shared_reads_per_request"] = round(delta("kvroute.shared_reads") / max(reqs, 1), 2)
            result["prefill_releases_per_request"] = round(delta("kvroute.prefill_releases") / max(reqs, 1), 3)
            result["hit_rate"] = round(delta("kvroute.blocks_hit") / max(delta("kvroute.blocks_requested"), 1), 3)
            result["scored"] = delta("kvroute.scored")
            result["filter_requests"] = reqs
        return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=8, help="seconds per measurement")
    ap.add_argument("--rounds", type=int, default=3,
                    help="variants are measured round-robin this many times; medians are reported")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--cases", default="2048:base64,2048:decimal,32768:base64",
                    help="comma-separated TOKENS:ENCODING")
    ap.add_argument("--distinct", type=int, default=0,
                    help="send this many different prompts in turn (the Python client for every variant)")
    ap.add_argument("--variants", default="plain,notokens,cold_literal,cold,warm_literal,warm")
    ap.add_argument("--builds", default="wasm,native",
                    help="this checkout's builds to measure: wasm (VARIANT), native (VARIANT@native)")
    ap.add_argument("--build", action="append", default=[], metavar="LABEL=PATH",
                    help="another kvroute.wasm or libkvroute_native.so, measured as VARIANT@LABEL")
    args = ap.parse_args()
    builds = {}
    own = [b for b in args.builds.split(",") if b]
    if not own or any(b not in BUILDS for b in own):
        ap.error(f"--builds {args.builds!r}: a list of {', '.join(sorted(BUILDS))}")
    for b in args.build:
        label, sep, path = b.partition("=")
        if not sep or not label or label in BUILDS or not pathlib.Path(path).is_file():
            ap.error(f"--build {b!r}: want LABEL=PATH to a kvroute.wasm or libkvroute_native.so "
                     f"(LABEL not {' or '.join(sorted(BUILDS))})")
        builds[label] = pathlib.Path(path).resolve()
    if ENVOY_CPU is not None:
        os.sched_setaffinity(0, {1})  # inherited by wrk and the upstream Envoy
    base = [v for v in args.variants.split(",") if v != "plain"]
    variants = ["plain"] + (base if "wasm" in own else [])
    variants += [f"{v}@{label}" for label in ["native"] * ("native" in own) + list(builds) for v in base]
    upstream = Upstream(N_WORKERS)
    results = []
    try:
        for case in args.cases.split(","):
            n_tokens, encoding = int(case.split(":")[0]), case.split(":")[1]
            prompt = tokens(n_tokens)
            runs = {v: [] for v in variants}
            # Round-robin, so drift in the shared machine's speed hits every variant alike;
            # each ratio is against the plain run of its own round.
            for rnd in range(args.rounds):
                for variant in variants:
                    r = run_variant(variant, upstream, prompt, encoding, args.duration, args.connections,
                                    args.distinct, builds)
                    base = runs["plain"][-1] if variant != "plain" else r
                    r["ratio"] = r["rps"] / base["rps"]
                    r["cpu_ratio"] = r["envoy_cpu_us_per_request"] / base["envoy_cpu_us_per_request"]
                    runs[variant].append(r)
                    print(f"{n_tokens} {encoding} round {rnd} {variant}: {r}", flush=True)
            row = {"tokens": n_tokens, "encoding": encoding}
            for v in variants:
                rs = runs[v]
                row[v] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
                row[v]["ratios"] = [round(r["ratio"], 3) for r in rs]
                row[v]["cpu_ratios"] = [round(r["cpu_ratio"], 3) for r in rs]
            results.append(row)
    finally:
        upstream.stop()
    print()
    print("| prompt | header | variant | req/s | vs plain (median) | per round | Envoy CPU/req | CPU vs plain "
          "| p50 ms | p99 ms | shared reads/req |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for row in results:
        for v in variants:
            r = row[v]
            print(f"| {row['tokens']} | {row['encoding']} | {v} | {r['rps']:.0f} | {r['ratio']:.2f} | "
                  f"{' '.join(f'{x:.2f}' for x in r['ratios'])} | {r['envoy_cpu_us_per_request']:.0f} µs | "
                  f"{r['cpu_ratio']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                  f"{r.get('shared_reads_per_request', '–')} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
