#!/usr/bin/env python3
"""What a streamed answer costs Envoy per chunk, with and without kvroute, side by side.

An engine streams its answer a token (an SSE event) at a time, and Envoy passes each
piece through every filter in the chain: for the wasm build that is one call into V8 per
piece (proxy-wasm has no way for a filter to stop receiving a response's body), for the
native module one call into the shared object. envoy_overhead.py answers in one piece; this
bench answers in pieces.

The same bootstrap as envoy_overhead.py (one pinned Envoy worker thread, 16 upstream
workers, a 2k-token base64 header, the `cold` setup: the sync service fed 16 workers that
hold nothing), in front of an asyncio upstream that answers each request with SSE events
of ~100 bytes spread evenly over `--answer-ms` (so each arrives in its own read, as tokens
do), chunked. A closed-loop client on `--connections` keep-alive connections reads every
answer to its end, so the request rate is the same at every chunk count and only the
chunks per answer change. Each variant runs at both counts of `--chunks` (A,B) in the same
rounds; the cost of a chunk is (CPU per request at B − at A) / (B − A), for plain Envoy
and for each build, and the filter's share is the difference from plain's.

    python3 benches/stream_chunks.py [--chunks 8,64] [--rounds 3] [--duration 8] [--json out.json]
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import pathlib
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from harness import BUILDS, free_port  # noqa: E402
from harness.kvfeed import FeedState  # noqa: E402
from envoy_overhead import ENVOY_CPU, N_WORKERS, Port, envoy_under_test, header_of, stat_delta, tokens  # noqa: E402

END = b"\r\n0\r\n\r\n"


def serve(ports, answer_s, ready):
    """The upstream: every request on every port answered with the SSE events its
    `x-chunks` header asks for, each flushed on its own, spread over `answer_s`."""

    async def answer(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
                fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
                length = int(fields.get(b"content-length", b"0"))
                if length:
                    await reader.readexactly(length)
                chunks = fields.get(b"x-chunks", b"")
                if not chunks.isdigit() or not 1 <= int(chunks) <= 1_000_000:
                    # Answered, not dropped: the load generator counts it as failed.
                    body = b"x-chunks must be a count of answer chunks, 1 to 1000000\n"
                    writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
                    await writer.drain()
                    continue
                n = int(chunks)
                gap_s = answer_s / max(n - 1, 1)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for i in range(n):
                    event = b'data: {"choices":[{"index":0,"text":" token%04d"}]}\n\n' % i
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    if i + 1 < n:
                        await asyncio.sleep(gap_s)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main():
        for p in ports:
            await asyncio.start_server(answer, "127.0.0.1", p)
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def closed_loop(port, request, duration, connections):
    """Keep-alive connections, one thread each, sending `request` and reading each chunked
    answer to its last chunk. Requests done, and failures (a connection that broke, or an
    answer that did not end within 10 s: an error answer is not chunked)."""
    done, failed, lock = [0], [0], threading.Lock()
    stop = time.time() + duration

    def one():
        sock, n, bad = None, 0, 0
        while time.time() < stop:
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(request)
                buf = b""
                while not buf.endswith(END):
                    got = sock.recv(65536)
                    if not got:
                        raise ConnectionError("closed")
                    buf += got
                if not buf.startswith(b"HTTP/1.1 200"):
                    bad += 1
                n += 1
            except OSError:
                bad += 1
                if sock:
                    sock.close()
                sock = None
        if sock:
            sock.close()
        with lock:
            done[0] += n
            failed[0] += bad

    threads = [threading.Thread(target=one) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0], failed[0]


def measure(variant, ports, prompt, chunks, duration, connections):
    """Envoy's CPU per request for `variant` (plain, or a build name) at `chunks` chunks."""
    state = FeedState()
    state.set_workers([(f"127.0.0.1:{p}", "both", True) for p in ports])
    plain = variant == "plain"
    name, value = header_of("cold", prompt, "base64")
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: 2\r\nx-chunks: {chunks}\r\n"
               f"{name}: {value}\r\n\r\n{{}}").encode()
    with envoy_under_test([Port(p) for p in ports], state, {"max_tokens": 131072}, plain,
                          build="wasm" if plain else variant) as (envoy, lp):
        closed_loop(lp, request, 2, connections)  # warm-up
        before = envoy.stats("kvroute")
        cpu0 = envoy.cpu_seconds()
        t0 = time.time()
        n, failed = closed_loop(lp, request, duration, connections)
        elapsed = time.time() - t0
        out = {"requests": n, "failed": failed, "rps": n / elapsed,
               "envoy_cpu_us_per_request": (envoy.cpu_seconds() - cpu0) / max(n, 1) * 1e6}
        if not plain:
            out["filter_requests"] = stat_delta(before, envoy.stats("kvroute"), "kvroute.requests")
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="8,64", help="A,B: SSE events per answer, the two counts compared")
    ap.add_argument("--answer-ms", type=float, default=64.0, help="an answer's first event to its last")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=8, help="seconds per measurement")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--builds", default="wasm,native")
    ap.add_argument("--json")
    args = ap.parse_args()
    builds = [b for b in args.builds.split(",") if b]
    counts = [int(c) for c in args.chunks.split(",")]
    if not builds or any(b not in BUILDS for b in builds) or len(counts) != 2 or not 1 <= counts[0] < counts[1]:
        ap.error(f"--builds: a list of {', '.join(sorted(BUILDS))}; --chunks: A,B with 1 <= A < B")
    lo, hi = counts
    ports = [free_port() for _ in range(N_WORKERS)]
    ready = multiprocessing.Event()
    upstream = multiprocessing.Process(target=serve, args=(ports, args.answer_ms / 1000, ready),
                                       daemon=True)
    upstream.start()
    if not ready.wait(30):
        sys.exit("the upstream did not start")
    if ENVOY_CPU:
        # Envoy has core 0; the upstream shares the other with the client.
        os.sched_setaffinity(upstream.pid, {1})
    prompt = tokens(2048)
    variants = ["plain", *builds]
    runs = {(v, c): [] for v in variants for c in counts}
    try:
        for r in range(args.rounds):
            for v in variants:
                for c in counts:
                    res = measure(v, ports, prompt, c, args.duration, args.connections)
                    runs[(v, c)].append(res)
                    print(f"round {r + 1} {v:>6} {c:>3} chunks: {res['rps']:7.1f} req/s, "
                          f"Envoy {res['envoy_cpu_us_per_request']:6.1f} µs/req, {res['failed']} failed",
                          flush=True)
    finally:
        upstream.terminate()

    def med(v, c):
        return statistics.median(x["envoy_cpu_us_per_request"] for x in runs[(v, c)])

    per_chunk = {v: (med(v, hi) - med(v, lo)) / (hi - lo) for v in variants}
    print(f"\nEnvoy CPU per request (µs, medians of {args.rounds} rounds) and per chunk:")
    print(f"| variant | {lo} chunks | {hi} chunks | per chunk | per chunk over plain |")
    print("|---|---:|---:|---:|---:|")
    for v in variants:
        extra = "" if v == "plain" else f"{per_chunk[v] - per_chunk['plain']:+.2f}"
        print(f"| {v} | {med(v, lo):.0f} | {med(v, hi):.0f} | {per_chunk[v]:.2f} | {extra} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "args": vars(args),
            "runs": {f"{v}/{c}": rs for (v, c), rs in runs.items()},
            "per_chunk_us": per_chunk,
        }, indent=1))


if __name__ == "__main__":
    main()
