#!/usr/bin/env python3
"""The tokenizer stage's cost, side by side in one run.

1. The stage alone, in process (`cargo bench -p kvroute-tokenizer --bench stage`): one
   request body → token ids, p50/p99 and calls per second on one core, 2k and 32k tokens,
   chats and token-id prompts, with the segment cache off (cold) and with the system
   prompt cached.
2. Uncached tokenization per token against Python transformers' fast tokenizer (the
   4.x line) on the same rendered chat texts.
3. Envoy with the stage against Envoy without it, same bootstrap (envoy/envoy.yaml), same
   kvroute filter, same fast upstreams (a second Envoy answering `direct_response`):
     stage    the client sends only the OpenAI body; the stage tokenizes it
     header   no stage; the client sends the body and the token header the stage would
              have written (the same ids), so the filter does the same work
     stage_1trip  the stage with its one-round-trip exchange (the body STREAMED behind
              headers that wait for it) instead of the shipped two (headers, then the
              body BUFFERED)
   (the upstreams read the whole body before answering, as engines do).
   Latency from one connection, requests one after another (p50, p99, max); throughput
   from 4 connections; the stage's CPU per request (so requests/s per stage core).
   Chats of ~2k and ~32k tokens whose system prompt repeats (each request a new user
   question), cached and with the stage's segment cache off; token-id prompts.

    ./scripts/fetch-tokenizer.sh
    cargo build --release -p kvroute-tokenizer && cargo build --target wasm32-unknown-unknown --release
    python3 benches/stage_latency.py [--requests 300] [--json docs/stage-latency-results.json]
"""
import argparse
import base64
import json
import os
import pathlib
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
from envoy_overhead import Port, Upstream, closed_loop, exchange  # noqa: E402
from harness import TOKENIZER_DIR, Envoy, Tokenizer, render_config, wait_for  # noqa: E402
from harness.kvfeed import FeedServer, FeedState  # noqa: E402

N_WORKERS = 16
# The shipped ext_proc message_timeout (envoy/envoy.yaml).
MESSAGE_TIMEOUT_MS = 500


def stage_alone(out_dir):
    path = out_dir / "alone.json"
    subprocess.run(["cargo", "bench", "-q", "-p", "kvroute-tokenizer", "--bench", "stage", "--",
                    "--json", str(path), "--texts", str(out_dir)], check=True, cwd=ROOT)
    return json.loads(path.read_text())


def transformers_per_token(out_dir, names):
    """µs per token of transformers' fast tokenizer on each rendered text (median of 20)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    out = {}
    for name in names:
        text = (out_dir / f"{name}.txt").read_text()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            ids = tok(text, add_special_tokens=False)["input_ids"]
            times.append(time.perf_counter() - t0)
        out[name] = {"tokens": len(ids), "us_per_token": statistics.median(times) / len(ids) * 1e6,
                     "transformers": __import__("transformers").__version__}
    return out


def prose(n, seed):
    words = ("cache worker prefix request token model engine routing latency memory gateway cluster "
             "question answer system document retrieval policy eviction block stream budget").split()
    x = seed * 2654435761 % 2**32 or 1
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(words[x % len(words)])
    return " ".join(out)


def chat_bodies(system_words, n, seed=1):
    """n chats sharing one system prompt, each with a new user question."""
    system = prose(system_words, seed)
    return [json.dumps({"model": "qwen3", "max_tokens": 16, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Question {i}: {prose(20, 1000 + i)}"}]}).encode() for i in range(n)]


def token_bodies(n_tokens, n):
    base = [(i * 2654435761) % 151000 for i in range(n_tokens)]
    return [json.dumps({"model": "qwen3", "max_tokens": 16, "prompt": base[:-1] + [i % 151000]}).encode()
            for i in range(n)]


def ids_of(stage, body):
    """The ids the stage computes for a body (its /tokenize, same rules, no limits)."""
    req = json.loads(body)
    if "messages" in req:
        return stage.tokenize({"model": "qwen3", "messages": req["messages"]})[1]["tokens"]
    return req["prompt"]


def request_bytes(body, header=None):
    head = (f"POST /v1/{'chat/completions' if b'messages' in body else 'completions'} HTTP/1.1\r\n"
            f"host: bench\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n")
    if header:
        head += f"x-prompt-token-ids-b64: {header}\r\n"
    return (head + "\r\n").encode() + body


def sequential(port, requests):
    """One connection, one request after another: each request's latency (ms)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, times = b"", []
    for i, r in enumerate(requests):
        t0 = time.perf_counter()
        try:
            head, buf = exchange(sock, buf, r)
        except OSError as e:
            raise OSError(f"request {i} of {len(requests)} ({len(r)} bytes): {e}") from e
        times.append((time.perf_counter() - t0) * 1000)
        assert head.startswith(b"HTTP/1.1 200"), head[:100]
    sock.close()
    return times


def cpu_seconds(pid):
    f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(round((len(v) - 1) * p / 100)))]


def measure(envoy, stage, requests, connections, duration):
    seq = sequential(envoy.port, requests)
    cpu0 = cpu_seconds(stage.proc.pid) if stage else 0
    loop = closed_loop(envoy.port, requests, duration, connections)
    rps, n, errors = loop["rps"], loop["requests"], loop["non_2xx"]
    stage_cpu_us = (cpu_seconds(stage.proc.pid) - cpu0) / max(n, 1) * 1e6 if stage else None
    warm = seq[len(seq) // 10:]  # the first tenth warms the connection and caches
    return {"p50_ms": round(pct(warm, 50), 3), "p99_ms": round(pct(warm, 99), 3), "max_ms": round(max(seq), 3),
            "rps": round(rps), "sent": len(seq) + n, "errors": errors, "stage_cpu_us_per_request": round(stage_cpu_us) if stage_cpu_us else None,
            "stage_requests_per_core_s": round(1e6 / stage_cpu_us) if stage_cpu_us else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="sequential requests per variant")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds of the throughput run")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="variants alternate this many times; medians reported")
    ap.add_argument("--skip-alone", action="store_true", help="only the Envoy comparison")
    ap.add_argument("--cases", default="chat_2k,chat_32k,token_array_2k,token_array_32k")
    ap.add_argument("--json")
    args = ap.parse_args()
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="kvroute-stage-bench-"))
    result = {}
    if not args.skip_alone:
        result["alone"] = stage_alone(out_dir)
        ours = {r["case"]: r for r in result["alone"]["uncached_encode"]}
        theirs = transformers_per_token(out_dir, list(ours))
        result["per_token"] = [{"case": c, "tokens": ours[c]["tokens"], "kvroute_us": round(ours[c]["us_per_token"], 3),
                                "transformers_us": round(theirs[c]["us_per_token"], 3),
                                "transformers_tokens": theirs[c]["tokens"],
                                "ratio": round(ours[c]["us_per_token"] / theirs[c]["us_per_token"], 2)}
                               for c in ours]
        for r in result["per_token"]:
            print(f"uncached {r['case']}: kvroute {r['kvroute_us']} µs/token, transformers {r['transformers_us']} "
                  f"µs/token ({r['ratio']}×; {r['tokens']} vs {r['transformers_tokens']} tokens)", flush=True)

    upstream = Upstream(N_WORKERS, read_body=True)
    workers = [Port(p) for p in upstream.ports]
    state = FeedState()
    state.set_workers([(f"127.0.0.1:{w.port}", "both", True) for w in workers])
    feed = FeedServer(state)
    stages = {"cached": Tokenizer(models=[("qwen3", TOKENIZER_DIR, [])]),
              "cold": Tokenizer(models=[("qwen3", TOKENIZER_DIR, [])], extra={"cache_bytes": 0})}
    n = args.requests
    cases = [("chat_2k", chat_bodies(1800, n)), ("chat_32k", chat_bodies(29000, n)),
             ("token_array_2k", token_bodies(2048, n)), ("token_array_32k", token_bodies(32768, n))]
    cases = [c for c in cases if c[0] in args.cases.split(",")]
    rows = []
    try:
        for name, bodies in cases:
            ids = [ids_of(stages["cached"], b) for b in bodies]
            headers = [base64.b64encode(struct.pack(f"<{len(x)}I", *x)).decode() for x in ids]
            variants = [("header", None), ("stage", "cached")]
            if name.startswith("chat"):
                variants += [("stage", "cold"), ("stage_1trip", "cached")]
            runs = {v: [] for v in variants}
            for _ in range(args.rounds):
                for via, cache in variants:
                    stage = stages[cache] if cache else None
                    cfg, lp, adm = render_config(workers, feed.port, {"max_tokens": 131072},
                                                 tokenizer_port=stage.grpc_port if stage else None,
                                                 stage_round_trips=1 if via == "stage_1trip" else 2)
                    envoy = Envoy(cfg, lp, adm, concurrency=1)
                    try:
                        wait_for(lambda: envoy.stat("kvroute_sync.version") >= state.version, what="feed applied")
                        reqs = [request_bytes(b, None if stage else h) for b, h in zip(bodies, headers)]
                        tokenized0 = stage.outcome("tokenized") if stage else 0
                        r = measure(envoy, stage, reqs, args.connections, args.duration)
                        ext = envoy.stats("ext_proc")
                        r["message_timeouts"] = sum(v for k, v in ext.items() if k.endswith("ext_proc.message_timeouts"))
                        r["routed_by_load"] = sum(v for k, v in ext.items() if k.endswith("ext_proc.failure_mode_allowed"))
                        if stage:
                            # Every request should have been tokenized (none left to load).
                            r["tokenized_share"] = round((stage.outcome("tokenized") - tokenized0) / r["sent"], 4)
                        runs[(via, cache)].append(r)
                    finally:
                        envoy.stop()
            base = runs[("header", None)]
            for (via, cache), rs in runs.items():
                med = {k: statistics.median(x[k] for x in rs) for k in ("p50_ms", "p99_ms", "rps")}
                row = {"case": name, "tokens": len(ids[0]), "via": via, "cache": cache or "–", **med,
                       "max_ms": max(x["max_ms"] for x in rs),
                       "added_p50_ms": round(statistics.median(x["p50_ms"] - b["p50_ms"] for x, b in zip(rs, base)), 3),
                       "rps_ratio": round(statistics.median(x["rps"] / b["rps"] for x, b in zip(rs, base)), 3),
                       "message_timeouts": sum(x["message_timeouts"] for x in rs),
                       "errors": sum(x["errors"] for x in rs),
                       "routed_by_load": sum(x["routed_by_load"] for x in rs)}
                if via != "header":
                    row["stage_cpu_us_per_request"] = statistics.median(x["stage_cpu_us_per_request"] for x in rs)
                    row["stage_requests_per_core_s"] = statistics.median(x["stage_requests_per_core_s"] for x in rs)
                    row["tokenized_share"] = min(x["tokenized_share"] for x in rs)
                rows.append(row)
                print(f"{name:16} {via:11} {row['cache']:6} p50 {row['p50_ms']:7.3f} ms (+{row['added_p50_ms']:.3f}) "
                      f"p99 {row['p99_ms']:7.3f} max {row['max_ms']:7.2f} ms  {row['rps']:6.0f} req/s "
                      f"({row['rps_ratio']:.2f}×)  stage {row.get('stage_requests_per_core_s', '–')} req/s/core  "
                      f"timeouts {row['message_timeouts']} errors {row['errors']}", flush=True)
    finally:
        for s in stages.values():
            s.stop()
        feed.stop()
        upstream.stop()
    result["envoy"] = rows
    print("\n| prompt | tokens | path | segment cache | p50 ms | added p50 ms | p99 ms | max ms | req/s (4 conns) "
          "| vs header | stage CPU µs/req | stage req/s per core | timeouts |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['tokens']} | {r['via']} | {r['cache']} | {r['p50_ms']:.3f} | {r['added_p50_ms']:+.3f} | "
              f"{r['p99_ms']:.3f} | {r['max_ms']:.2f} | {r['rps']:.0f} | {r['rps_ratio']:.2f} | "
              f"{r.get('stage_cpu_us_per_request') or '–'} | {r.get('stage_requests_per_core_s') or '–'} | "
              f"{r['message_timeouts']} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
