#!/usr/bin/env python3
"""What a cold prompt costs on its way to the engine: one long text completion at a time,
each with a document no one has sent before, on an idle simulated fleet, sent

  direct     straight to an engine,
  envoy      through plain Envoy (round robin, no kvroute filter, no stage),
  kvroute    through Envoy with the tokenizer stage and the kvroute filter,
  kvroute_1trip  the same with the stage's one-round-trip exchange (the body STREAMED
             behind headers that wait for it; the shipped config answers the headers at
             once, then the body BUFFERED: two round trips),

and, after each kvroute request, the same document with a new question (`kvroute_warm`:
the stage's chunk cache and the engine's prefix cache hold the document). The variants
alternate request by request, so all of them see the same machine. TTFT is wall time to
the first streamed token, so the differences are what each path adds before the engine
starts; the stage's own latency comes from its histogram, cold and warm apart.

With `--burst N` each round is instead N requests at once sharing a new document (the
peers benchmark's burst: a fan-out over one RAG document), sent straight to one engine,
through kvroute (one and two round trips to the stage), through kvroute's native build
and, with `--peers`, through sglang-router and smg (`cache_aware`, installed as
benches/peers.py does; they parse the text in process). Whatever the path, the first to reach
the engine starts a step alone and the rest share the next one, so the burst's first and
last TTFT show what each path adds when N new texts arrive together.

    ./scripts/fetch-tokenizer.sh
    cargo build --release -p kvroute-sidecar -p kvroute-fleet -p kvroute-tokenizer
    cargo build --target wasm32-unknown-unknown --release
    cargo build --release -p kvroute-native                 # --burst only
    python3 benches/cold_path.py [--rounds 24] [--words 1750] [--burst 12 [--peers]] [--json out.json]
"""
import argparse
import http.client
import json
import pathlib
import random
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import (TOKENIZER_DIR, Envoy, Processes, Tokenizer, free_port, render_config,  # noqa: E402
                     start_fleet, wait_synced)

MODEL = "mock-llm"
WORDS = ("the model cache prefix router engine token block worker request system prompt answer question "
         "fleet latency during because without between several document").split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) + rng.choice(("", ",", ".", "")) for _ in range(n))


def ttft_ms(port, prompt):
    """Wall ms from sending a streamed completion to its first data line."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                     body=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}))
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        while True:
            line = r.readline()
            if not line or line.startswith(b"data:"):
                break
        dt = (time.perf_counter() - t0) * 1000
        r.read()
        return dt
    finally:
        conn.close()


def burst_ttfts(port, prompts):
    """TTFTs of `prompts` sent at once, each on its own connection, in send order."""
    go = threading.Barrier(len(prompts))
    out = [None] * len(prompts)

    def send(i):
        go.wait()
        try:
            out[i] = ttft_ms(port, prompts[i])
        except Exception as e:  # noqa: BLE001 (reported below, the round is not kept)
            out[i] = e

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in out if isinstance(e, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} burst requests failed: {failed[0]}")
    return out


def summary(v):
    return {"median": round(statistics.median(v), 2), "min": round(min(v), 2), "max": round(max(v), 2), "n": len(v)}


def stage_latency(stage):
    m = stage.metrics()
    return m["kvroute_tokenizer_latency_seconds_sum"], m["kvroute_tokenizer_latency_seconds_count"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4, help="first rounds left out")
    ap.add_argument("--words", type=int, default=1750, help="words per document (~1.5 tokens each)")
    ap.add_argument("--speedup", type=float, default=2.0, help="the engines' speed-up, as in benches/peers.py")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--burst", type=int, default=0, help="N requests at once per round (see above)")
    ap.add_argument("--peers", action="store_true", help="with --burst: sglang-router and smg lines too")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    procs = Processes()
    try:
        engines, sidecar = start_fleet(procs, 2, 512, args.speedup, tokenizer=TOKENIZER_DIR)
        stage = procs.add(Tokenizer(models=[(MODEL, TOKENIZER_DIR, [])], max_model_len=512 * 16))
        if args.burst:
            return bursts(args, rng, procs, engines, sidecar, stage)
        kv_port, kv1_port, rr_port = free_port(), free_port(), free_port()
        for port, trips in ((kv_port, 2), (kv1_port, 1)):
            cfg, lp, adm = render_config(engines, sidecar.port, {"block_size": 16}, listener_port=port,
                                         policy="kvroute", tokenizer_port=stage.grpc_port, stage_round_trips=trips)
            wait_synced(procs.add(Envoy(cfg, lp, adm, concurrency=2)), sidecar)
        cfg, lp, adm = render_config(engines, sidecar.port, listener_port=rr_port, policy="round_robin")
        procs.add(Envoy(cfg, lp, adm, concurrency=2))
        ttft = {k: [] for k in ("direct", "envoy", "kvroute", "kvroute_1trip", "kvroute_warm")}
        stage_ms = {"kvroute": [], "kvroute_1trip": [], "kvroute_warm": []}
        for i in range(args.rounds):
            keep = i >= args.warmup

            def one(kind, port, prompt):
                before = stage_latency(stage)
                t = ttft_ms(port, prompt)
                if keep:
                    ttft[kind].append(t)
                    if kind in stage_ms:
                        (s0, n0), (s1, n1) = before, stage_latency(stage)
                        stage_ms[kind].append((s1 - s0) * 1000 / max(n1 - n0, 1))
                time.sleep(0.2)  # the engine idle again

            question = lambda: " Question: " + text(rng, 30)  # noqa: E731
            one("direct", engines[i % 2].port, text(rng, args.words) + question())
            one("envoy", rr_port, text(rng, args.words) + question())
            one("kvroute_1trip", kv1_port, text(rng, args.words) + question())
            doc = text(rng, args.words)
            one("kvroute", kv_port, doc + question())
            one("kvroute_warm", kv_port, doc + question())
        out = {"config": vars(args), "ttft_wall_ms": {}, "stage_ms": {}}
        for k, v in ttft.items():
            out["ttft_wall_ms"][k] = summary(v)
        for k, v in stage_ms.items():
            out["stage_ms"][k] = round(statistics.median(v), 2)
        base = out["ttft_wall_ms"]["direct"]["median"]
        for k, v in out["ttft_wall_ms"].items():
            # A warm request starts from a cached prefix: no comparison with a cold one.
            added = "" if k == "kvroute_warm" else f", {v['median'] - base:+.1f} ms against direct"
            print(f"{k:13} TTFT median {v['median']:7.1f} ms wall (min {v['min']:.1f}, max {v['max']:.1f}){added}")
        print(f"stage latency, median: cold {out['stage_ms']['kvroute']:.2f} ms, "
              f"warm {out['stage_ms']['kvroute_warm']:.2f} ms")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    finally:
        procs.stop_all()


def bursts(args, rng, procs, engines, sidecar, stage):
    ports = {}
    for kind, build, trips in (("kvroute", "wasm", 2), ("kvroute_1trip", "wasm", 1), ("kvroute_native", "native", 2)):
        ports[kind] = free_port()
        cfg, lp, adm = render_config(engines, sidecar.port, {"block_size": 16}, listener_port=ports[kind],
                                     policy="kvroute", tokenizer_port=stage.grpc_port, build=build,
                                     stage_round_trips=trips)
        wait_synced(procs.add(Envoy(cfg, lp, adm, concurrency=2)), sidecar)
    if args.peers:
        sys.path.insert(0, str(ROOT / "benches"))
        from peers import Peer
        for package in ("sglang-router", "smg"):
            kind = package.replace("-", "_") + "_cache_aware"
            ports[kind] = free_port()
            procs.add(Peer(package, "cache_aware", engines, ports[kind]))
    paths = {"direct": lambda i: engines[i % 2].port, **{k: (lambda i, p=p: p) for k, p in ports.items()}}
    first = {k: [] for k in paths}
    last = {k: [] for k in paths}
    stage_ms = {k: [] for k in paths if k.startswith("kvroute")}
    for i in range(args.rounds):
        for kind, port in paths.items():
            doc = text(rng, args.words)
            s0, n0 = stage_latency(stage)
            t = burst_ttfts(port(i), [doc + " Question: " + text(rng, 30) for _ in range(args.burst)])
            s1, n1 = stage_latency(stage)
            if i >= args.warmup:
                first[kind].append(min(t))
                last[kind].append(max(t))
                if kind in stage_ms:
                    stage_ms[kind].append((s1 - s0) * 1000 / max(n1 - n0, 1))
            time.sleep(0.5)  # the engines idle again
    out = {"config": vars(args), "burst_first_ttft_wall_ms": {k: summary(v) for k, v in first.items()},
           "burst_last_ttft_wall_ms": {k: summary(v) for k, v in last.items()},
           "stage_ms_mean_per_request": {k: round(statistics.median(v), 2) for k, v in stage_ms.items()}}
    base_first = out["burst_first_ttft_wall_ms"]["direct"]["median"]
    base_last = out["burst_last_ttft_wall_ms"]["direct"]["median"]
    for k in paths:
        f, la = out["burst_first_ttft_wall_ms"][k], out["burst_last_ttft_wall_ms"][k]
        print(f"{k:15} burst of {args.burst}: first TTFT median {f['median']:7.1f} ms ({f['median'] - base_first:+.1f}"
              f" against direct), last {la['median']:7.1f} ms ({la['median'] - base_last:+.1f})"
              + (f"; the stage {out['stage_ms_mean_per_request'][k]:.2f} ms a request" if k in stage_ms else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
