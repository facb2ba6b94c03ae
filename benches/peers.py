#!/usr/bin/env python3
"""Head to head: kvroute and the KV-aware routers users could install instead, in front of
the same simulated fleet, driven by the same client with the same seeded workloads.

Lines:
  kvroute_w1, kvroute_w4         Envoy + the tokenizer stage + kvroute, at its shipped
                                 defaults (the specification's weight 1) and at weight 4
  sglang_router_cache_aware, sglang_router_round_robin
                                 sglang-router 0.3.2 (SGLang's gateway): an approximate radix
                                 tree on the request text
  smg_cache_aware, smg_prefix_hash
                                 smg 1.13.0, its successor
  vllm_router_kv_aware, vllm_router_cache_aware
                                 vllm-router 0.1.17: kv_aware reads the engines' vLLM ZMQ KV
                                 events (the same publishers the sidecar reads) and tokenizes
                                 through the engine's /tokenize
  dynamo_kv                      NVIDIA Dynamo 1.6.1's KV router: not run yet (reported)

Each peer is installed into its own virtualenv under target/peers/ on first use. Every
line gets a fleet whose caches were reset and the same requests at the same times; the
engines tokenize text as vLLM does (Qwen3's tokenizer), and the client sends plain
OpenAI completions with text prompts (`kvroute-fleet load --send text`), which every
router accepts. Besides the routing-quality metrics, each run records the router's CPU
time per request and its peak memory (kvroute: Envoy + the stage + the sidecar).

    ./scripts/fetch-tokenizer.sh
    cargo build --release -p kvroute-sidecar -p kvroute-fleet -p kvroute-tokenizer
    cargo build --target wasm32-unknown-unknown --release
    python3 benches/peers.py [--workloads shared_prefix_70,...] [--lines ...] [--out docs/peers]
"""
import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
from harness import (FLEET, TOKENIZER_DIR, Envoy, Processes, Tokenizer, free_port, ready_or_stop,  # noqa: E402
                     render_config, reset_fleet, start_fleet, wait_for, wait_http_ok, wait_synced)
from harness.procs import Service  # noqa: E402
import routing_quality as rq  # noqa: E402

PEERS = ROOT / "target" / "peers"
MODEL = "mock-llm"
# Package pins: the versions measured.
PINS = {"sglang-router": "sglang-router==0.3.2", "smg": "smg==1.13.0", "vllm-router": "vllm-router==0.1.17"}
# The workloads that the load generator has today (an agentic loop is not one yet).
WORKLOADS = "shared_prefix_70,shared_prefix_100,zipf_hot_70,chat_70,burst_70"

LINES = [
    ("kvroute_w1", "kvroute", {"overlap_weight": 1.0}),
    ("kvroute_w4", "kvroute", {"overlap_weight": 4.0}),
    ("sglang_router_cache_aware", "sglang-router", "cache_aware"),
    ("sglang_router_round_robin", "sglang-router", "round_robin"),
    ("smg_cache_aware", "smg", "cache_aware"),
    ("smg_prefix_hash", "smg", "prefix_hash"),
    ("vllm_router_kv_aware", "vllm-router", "kv_aware"),
    ("vllm_router_cache_aware", "vllm-router", "cache_aware"),
    ("dynamo_kv", "dynamo", None),
]
NOT_RUN = {
    "dynamo": "not run yet: Dynamo routes only to Dynamo workers, so each engine needs a Dynamo worker "
              "in front that relays its ZMQ events; that relay is not written yet",
}


def install(package):
    """The peer's virtualenv, created and the pinned package installed on first use."""
    venv = PEERS / package
    if not (venv / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                        PINS[package]], check=True)
        (venv / ".installed").write_text(PINS[package] + "\n")
    return venv


class Peer(Service):
    """One peer router on 127.0.0.1:port in front of the engines."""

    def __init__(self, package, policy, engines, port):
        venv = install(package)
        urls = [f"http://{e.id}" for e in engines]
        common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy]
        if package == "sglang-router":
            cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common]
        elif package == "smg":
            cmd = [str(venv / "bin" / "smg"), "launch", *common]
        else:
            cmd = [str(venv / "bin" / "vllm-router"), *common]
            if policy == "kv_aware":
                # The engines' own KV-event publishers, which the sidecar subscribes to too.
                for e in engines:
                    cmd += ["--kv-event-source", f"http://{e.id}={e.events.replace('*', '127.0.0.1')}"]
                cmd += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
        self.port = port
        self._workdir(package)
        self._spawn(cmd)
        ready_or_stop(self, lambda: wait_http_ok(self.proc, f"http://127.0.0.1:{port}/health", package,
                                                 self.logs, 60))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=512)
    # Lower than routing_quality's 5: here the engines (and kvroute's stage) tokenize text,
    # real CPU work that a higher speed-up would inflate into model time on 2 cores.
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--workloads", default=WORKLOADS)
    ap.add_argument("--lines", help="comma-separated line names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "target" / "peers-results"))
    args = ap.parse_args()
    # The routing-quality workloads, as that runner plans them.
    wl_args = argparse.Namespace(workers=args.workers, groups=args.groups, per_group=args.per_group,
                                 blocks=args.blocks, speedup=args.speedup, quick=False, workloads=args.workloads,
                                 trace=str(rq.TRACE), trace_requests=2000, mooncake_blocks=8192)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = rq.named(LINES, args.lines, "lines")
    procs = Processes()
    results, skipped = [], []
    for label, kind, _ in lines:
        if kind in NOT_RUN:
            skipped.append({"line": label, "reason": NOT_RUN[kind]})
            print(f"{label}: {NOT_RUN[kind]}", flush=True)
    t_start = time.time()
    fleet = {"settings": None}
    try:
        port = free_port()
        for wname, level, wargs, settings in rq.workloads(wl_args):
            if fleet["settings"] != settings:
                procs.stop_all()
                engines, sidecar = start_fleet(procs, args.workers, settings["blocks"], settings["speedup"],
                                               tokenizer=TOKENIZER_DIR)
                fleet = {"settings": settings, "engines": engines, "sidecar": sidecar}
            engines, sidecar = fleet["engines"], fleet["sidecar"]
            speedup = settings["speedup"]
            for label, kind, how in lines:
                if kind in NOT_RUN:
                    continue
                reset_fleet(engines, sidecar)
                if kind == "kvroute":
                    # A new stage per line, as every peer is a new process: no line starts
                    # with another's tokenizer cache.
                    stage = procs.add(Tokenizer(models=[(MODEL, TOKENIZER_DIR, [])],
                                                max_model_len=settings["blocks"] * 16))
                    cfg, lp, adm = render_config(engines, sidecar.port, {"block_size": 16, **how}, listener_port=port,
                                                 policy="kvroute",
                                                 sync_config={"poll_timeout_ms": 5000, "stale_after_ms": 15000},
                                                 tokenizer_port=stage.grpc_port)
                    router = procs.add(Envoy(cfg, lp, adm, concurrency=2))
                    wait_synced(router, sidecar)
                    metered = [router, stage, sidecar]
                else:
                    router = procs.add(Peer(kind, how, engines, port))
                    metered = [router]
                path = out / f"{wname}.{label}.json"
                cmd = [str(FLEET), "load", "--target", f"127.0.0.1:{port}", "--label", label, "--seed", "7",
                       "--json", str(path), "--quiet", "--send", "text", "--tokenizer", str(TOKENIZER_DIR),
                       "--model", MODEL, *wargs]
                for e in engines:
                    cmd += ["--engine", e.id]
                cpu0 = [p.cpu_seconds() for p in metered]
                t0 = time.time()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                r = json.loads(path.read_text())
                r.pop("samples")
                # Per process (kvroute: Envoy, the stage, the sidecar), ms per request.
                per_request = {type(p).__name__.lower(): (p.cpu_seconds() - c0) * 1000 / max(r["requests"], 1)
                               for p, c0 in zip(metered, cpu0)}
                scored = 0
                if kind == "kvroute":
                    wait_for(lambda: router.stat("kvroute.requests") >= r["requests"], what="the filters' counters")
                    scored = router.stat("kvroute.scored")
                r.update({"workload": wname, "load": level, "policy": label, "router": kind,
                          "wall_s": round(time.time() - t0, 1), "speedup": speedup,
                          "router_cpu_ms_per_request": round(sum(per_request.values()), 3),
                          "router_cpu_ms_per_request_by_process": {k: round(v, 3) for k, v in per_request.items()},
                          "router_peak_rss_mb": round(sum(p.peak_rss_mb() for p in metered), 1),
                          "scored": scored})
                for p in metered:
                    if p is not sidecar:
                        procs.stop(p)
                path.unlink()
                results.append(r)
                print(f"{wname:18} {label:26} hit {r['hit_rate']:.2f}/{r['oracle_hit_rate']:.2f} "
                      f"ttft p50 {r['ttft_ms']['p50'] * speedup:7.0f} p99 {r['ttft_ms']['p99'] * speedup:7.0f} ms "
                      f"cpu {r['router_cpu_ms_per_request']:.2f} ms/req rss {r['router_peak_rss_mb']:.0f} MB "
                      f"failed {r['failed']}", flush=True)
    finally:
        procs.stop_all()
    (out / "results.json").write_text(json.dumps(
        {"config": vars(args), "versions": PINS, "wall_s": round(time.time() - t_start), "runs": results,
         "not_run": skipped}, indent=1))
    print(rq.markdown(results))
    for s in skipped:
        print(f"\n{s['line']}: {s['reason']}")
    print(f"\n{len(results)} runs in {time.time() - t_start:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
