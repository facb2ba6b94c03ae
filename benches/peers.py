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
  dynamo_kv                      NVIDIA Dynamo 1.6.1's frontend, --router-mode kv: on the
                                 fleet, a Dynamo worker in front of each engine relays its
                                 KV events (benches/dynamo_peer.py); on the mockers, Dynamo
                                 as deployed, the mockers registered with its frontend

Reference lines, run only when --lines names them (where kvroute's CPU goes):
  envoy_round_robin, envoy_round_robin_stage
                                 Envoy alone; Envoy with the tokenizer stage (ext_proc)
  kvroute_sync_only, kvroute_filter_only
                                 kvroute without its filter, or without its sync service
                                 (the filter finds no worker table); Envoy's fallback routes
  kvroute_w1_native              kvroute_w1 with the native build (the Envoy dynamic
                                 module) in place of kvroute.wasm: the same routing, without V8
  kvroute_w1_hash_tie            kvroute_w1 with ties between equally cheap workers left to
                                 the hash (tie_break: hash), as before the cached-block counts

Engine simulators (`--sim`):
  fleet    kvroute-fleet's mock engines, reset between lines (the default)
  mocker   Dynamo's mocker (benches/dynamo_fleet.py), written by others: an independent
           model of vLLM's scheduler and cache, new engines for every line (it cannot be
           reset); load levels from its own prefill cost, measured at the start

Each peer is installed into its own virtualenv under target/peers/ on first use. Every
line gets a fleet whose caches are empty and the same requests at the same times; the
engines tokenize text as vLLM does (Qwen3's tokenizer), and the client sends plain
OpenAI completions with text prompts (`kvroute-fleet load --send text`), which every
router accepts. Besides the routing-quality metrics, each run records the router's CPU
time per request and its peak memory (kvroute: Envoy + the stage + the sidecar; Dynamo:
its frontend, with the per-engine relays reported beside it, not counted: in a Dynamo
deployment that code runs inside the engine).

    ./scripts/fetch-tokenizer.sh
    cargo build --release -p kvroute-sidecar -p kvroute-fleet -p kvroute-tokenizer -p kvroute-native
    cargo build --target wasm32-unknown-unknown --release
    python3 benches/peers.py [--sim fleet|mocker] [--workloads shared_prefix_70,...] [--lines ...] [--out docs/peers]
"""
import argparse
import functools
import json
import pathlib
import random
import re
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
from harness import (FLEET, TOKENIZER_DIR, Envoy, Processes, Tokenizer, free_port, ready_or_stop,  # noqa: E402
                     render_config, reset_fleet, start_fleet, wait_for, wait_http_ok, wait_synced)
from harness.procs import Service  # noqa: E402
import clients  # noqa: E402
import cold_path  # noqa: E402
import dynamo_fleet  # noqa: E402
import routing_quality as rq  # noqa: E402
from dynamo_peer import PINS as DYNAMO_PINS  # noqa: E402
from dynamo_peer import DynamoRouter, events_applied  # noqa: E402

PEERS = ROOT / "target" / "peers"
MODEL = "mock-llm"
# Package pins: the versions measured.
PINS = {"sglang-router": "sglang-router==0.3.2", "smg": "smg==1.13.0", "vllm-router": "vllm-router==0.1.17"}
WORKLOADS = "shared_prefix_70,shared_prefix_100,zipf_hot_70,chat_70,agentic_70,burst_70"
# What the real clients can send: uniform shared prefixes, one request at a time.
CLIENT_WORKLOADS = "shared_prefix_70,shared_prefix_100"

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
# Where kvroute's router CPU goes: Envoy alone, Envoy with the stage, and kvroute with one
# of its two wasm parts taken out (without the sync service the filter finds no worker
# table and sets no destination; either way Envoy's fallback policy routes), and kvroute
# as the native module. Run only when named in --lines.
REFERENCE_LINES = [
    ("envoy_round_robin", "envoy", {"stage": False, "filter": False, "sync": False}),
    ("envoy_round_robin_stage", "envoy", {"stage": True, "filter": False, "sync": False}),
    ("kvroute_sync_only", "envoy", {"stage": True, "filter": False, "sync": True}),
    ("kvroute_filter_only", "envoy", {"stage": True, "filter": True, "sync": False}),
    ("kvroute_w1_native", "kvroute", {"overlap_weight": 1.0}),
    ("kvroute_w1_hash_tie", "kvroute", {"overlap_weight": 1.0, "tie_break": "hash"}),
]
VERSIONS = {**PINS, "dynamo": " ".join(DYNAMO_PINS)}
# Per-process CPU that is not the router's: Dynamo's per-engine relays stand in for code
# that runs inside the engine in a Dynamo deployment.
NOT_ROUTER = {"workers"}


def kvroute_line(spec):
    """A `--kvroute LABEL=JSON` line: kvroute with those filter settings."""
    label, sep, settings = spec.partition("=")
    try:
        config = json.loads(settings) if sep else None
    except json.JSONDecodeError as e:
        sys.exit(f"--kvroute {spec}: {e}")
    if not label or not isinstance(config, dict):
        sys.exit(f"--kvroute {spec}: want LABEL={{filter settings as a JSON object}}")
    return (label, "kvroute", config)


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
        # Each on its own metrics port: the default (29000) would clash with any other
        # router on the machine.
        common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
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


def versus(results, line="kvroute_w1"):
    """One row per workload: `line` against the best peer (every line that is not
    kvroute's) in hit rate, TTFT p50 and p99, and router CPU."""
    rows = ["| workload | hit rate | best peer | TTFT p50 | best peer | TTFT p99 | best peer | CPU ms/req | least peer |",
            "|---|---:|---|---:|---|---:|---|---:|---|"]
    for w in dict.fromkeys(r["workload"] for r in results):
        rs = [r for r in results if r["workload"] == w]
        ours = next((r for r in rs if r["policy"] == line), None)
        peers = [r for r in rs if r["router"] != "kvroute"]
        if not ours or not peers:
            continue

        def ms(r, p):
            return r["ttft_ms"][p] * r["speedup"]
        hit = max(peers, key=lambda r: r["hit_rate"])
        p50, p99 = (min(peers, key=lambda r: ms(r, p)) for p in ("p50", "p99"))
        cpu = min(peers, key=lambda r: r["router_cpu_ms_per_request"])
        rows.append(f"| {w} | {ours['hit_rate']:.2f} | {hit['hit_rate']:.2f} {hit['policy']} | {ms(ours, 'p50'):.0f} | "
                    f"{ms(p50, 'p50'):.0f} {p50['policy']} | {ms(ours, 'p99'):.0f} | {ms(p99, 'p99'):.0f} {p99['policy']} | "
                    f"{ours['router_cpu_ms_per_request']:.1f} | {cpu['router_cpu_ms_per_request']:.1f} {cpu['policy']} |")
    return "\n".join(rows)


def markdown(results, failed=()):
    """One table per workload: the routing-quality columns, then the router's cost; then
    the lines that failed, and why."""
    lines = []
    for w in dict.fromkeys(r["workload"] for r in results):
        rs = [r for r in results if r["workload"] == w]
        oracle = rs[0]["oracle_hit_rate"]
        lines.append(f"\n**{w}**" + (f" (oracle hit rate {oracle:.2f})\n" if oracle else "\n"))
        lines.append("| line | hit rate | ÷ oracle | TTFT p50 | p90 | p99 | e2e p50 | p99 | req/s | busy max/mean "
                     "| failed | router CPU ms/req | router RSS MB |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rs:
            s, t, e = r["speedup"], r["ttft_ms"], r["e2e_ms"]
            busy = f"{r['busy_imbalance']:.2f}" if r["busy_imbalance"] else "–"
            ratio = f"{r['hit_rate'] / oracle:.2f}" if oracle else "–"
            lines.append(f"| {r['policy']} | {r['hit_rate']:.2f} | {ratio} | "
                         f"{t['p50'] * s:.0f} | {t['p90'] * s:.0f} | {t['p99'] * s:.0f} | {e['p50'] * s:.0f} | "
                         f"{e['p99'] * s:.0f} | {r['throughput_rps'] / s:.1f} | {busy} | {r['failed']} | "
                         f"{r['router_cpu_ms_per_request']:.2f} | {r['router_peak_rss_mb']:.0f} |")
    for f in failed:
        lines.append(f"\n{f['workload']} {f['line']}: failed, {f['reason'][-500:]}")
    return "\n".join(lines)


def merged(old, runs, failed, config):
    """`old` results.json with this run's runs and failures in place of its own for the same
    (workload, line), in the old order, new ones last. The config keeps the old one and
    adds this run's under "merged"."""
    redone = {(r["workload"], r["policy"]) for r in runs} | {(f["workload"], f["line"]) for f in failed}
    new = {(r["workload"], r["policy"]): r for r in runs}
    out = []
    for r in old["runs"]:
        key = (r["workload"], r["policy"])
        if key not in redone:
            out.append(r)
        elif key in new:
            out.append(new.pop(key))
    out += new.values()
    # Workloads stay grouped for the tables.
    order = list(dict.fromkeys(r["workload"] for r in out))
    out.sort(key=lambda r: order.index(r["workload"]))
    kept = [f for f in old.get("failed", []) if (f["workload"], f["line"]) not in redone]
    cfg = dict(old.get("config", {}))
    cfg["merged"] = cfg.get("merged", []) + [config]
    return out, kept + list(failed), cfg


def cpu_by_process(p):
    """{process: CPU seconds so far} of one metered service."""
    if hasattr(p, "cpu_seconds_by_process"):
        return p.cpu_seconds_by_process()
    return {type(p).__name__.lower(): p.cpu_seconds()}


class Fleet:
    """The engines every line of a workload runs against, empty for each line."""

    def __init__(self, procs, args):
        self.procs, self.args = procs, args
        self.settings = self.engines = self.sidecar = None

    def for_line(self, settings, kind, port):
        """(engines, sidecar, router or None): empty engines for the next line; on the
        mocker, Dynamo's line comes with its own mockers (router)."""
        a = self.args
        if a.sim == "fleet":
            if self.settings != settings:
                self.procs.stop_all()
                self.engines, self.sidecar = start_fleet(self.procs, a.workers, settings["blocks"],
                                                         settings["speedup"], tokenizer=TOKENIZER_DIR)
                self.settings = settings
            else:
                reset_fleet(self.engines, self.sidecar)
            return self.engines, self.sidecar, None
        # The mocker cannot be emptied: new engines for every line.
        self.procs.stop_all()
        if kind == "dynamo":
            return [], None, self.procs.add(dynamo_fleet.DynamoOnMockers(a.workers, settings["blocks"],
                                                                         settings["speedup"], port))
        engines, sidecar = dynamo_fleet.start_mocker_fleet(self.procs, a.workers, settings["blocks"],
                                                           settings["speedup"])
        return engines, sidecar, None


class EngineInflight:
    """Requests in flight at each mocker engine, and the requests it has started, read from
    its frontend's `dynamo_frontend_inflight_requests` and
    `dynamo_component_router_requests_started_total` every `every_s` seconds while a line
    runs: where a router put its requests when the mocker's answers do not name the engine
    (--keep-samples only; `benches/session_steps.py` prints the first, and from the second
    tells which conversations shared an engine)."""

    def __init__(self, engines, every_s=0.5):
        self.engines, self.every_s = engines, every_s
        self.t0, self.rows, self.failed, self.load_started = time.time(), [], 0, None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.wait(self.every_s):
            inflight, started = [], []
            for e in self.engines:
                try:
                    m = e.metrics()
                    inflight.append(int(m.get("dynamo_frontend_inflight_requests", 0)))
                    started.append(int(m.get("dynamo_component_router_requests_started_total", 0)))
                except OSError:
                    inflight.append(None)
                    started.append(None)
                    self.failed += 1
            self.rows.append([round(time.time() - self.t0, 3), inflight, started])

    def load_starts(self):
        """Marks the load generator's launch; its samples' clock starts some tenths of a second
        later, once it has read its tokenizer (session_steps.py finds the lag)."""
        self.load_started = round(time.time() - self.t0, 3)

    def stop(self):
        """{"engines", "every_s", "load_started_s", "samples": [[t_s, [in flight per engine],
        [requests started per engine]]], "failed_reads"}."""
        self.done.set()
        self.thread.join()
        return {"engines": [e.id for e in self.engines], "every_s": self.every_s, "load_started_s": self.load_started,
                "samples": self.rows, "failed_reads": self.failed}


def drive(args, target, label, wname, wargs, engines, out):
    """One run of the workload against target: (the load generator's summary, its
    samples), or with a real client (--client) its own figures and the engines' hit rate
    (no samples, no oracle: the client's prompts are its own)."""
    if args.client != "fleet_load":
        before = clients.engine_counters(engines)
        r = clients.run(args.client, target, MODEL, TOKENIZER_DIR, clients.SharedPrefix.from_load_args(wargs), args.seed,
                        # Its work folder (inputs, logs, a tokenizer copy) stays out of the results.
                        ROOT / "target" / "peers-clients" / out.name / f"{wname}.{label}")
        r.update(clients.engine_delta(before, clients.engine_counters(engines)))
        r["oracle_hit_rate"] = None
        return r, None
    path = out / f"{wname}.{label}.json"
    cmd = [str(FLEET), "load", "--target", target, "--label", label, "--seed", str(args.seed), "--json", str(path), "--quiet",
           "--send", "text", "--tokenizer", str(TOKENIZER_DIR), "--model", MODEL, *wargs,
           *(["--cache-key"] if args.cache_key else [])]
    if args.sim == "fleet":
        # Busy time and cache counters from the engines' own metrics.
        for e in engines:
            cmd += ["--engine", e.id]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(path.read_text())
    if args.keep_samples:
        # Every request (worker, cached tokens, send time, TTFT) for tail analysis.
        (out / "samples").mkdir(exist_ok=True)
        path.rename(out / "samples" / path.name)
    else:
        path.unlink()
    return r, r.pop("samples")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim", choices=("fleet", "mocker"), default="fleet", help="the engine simulator")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=512)
    # Lower than routing_quality's 5: here the engines (and kvroute's stage) tokenize text,
    # real CPU work that a higher speed-up would inflate into model time on 2 cores. The
    # mocker models a GPU ~10x faster at prefill than the fleet's: slowed down instead, so
    # that its arrival rates are ones this machine can drive.
    ap.add_argument("--speedup", type=float, help="engine time ÷ (default: fleet 2, mocker 0.1)")
    ap.add_argument("--client", choices=("fleet_load", "bench_serving", "aiperf"), default="fleet_load",
                    help="what sends the requests: kvroute-fleet load, or a real client (benches/clients.py; "
                         "uniform shared-prefix workloads only, on the fleet)")
    ap.add_argument("--seed", type=int, default=7, help="the workload's requests and arrival times")
    ap.add_argument("--workloads", help=f"comma-separated (default: {WORKLOADS}; with a real client "
                                        f"{CLIENT_WORKLOADS})")
    ap.add_argument("--lines", help="comma-separated line names (default: all)")
    ap.add_argument("--kvroute", action="append", default=[], metavar="LABEL=JSON",
                    help='another kvroute line: its label and filter settings, e.g. '
                         '\'kvroute_w2={"overlap_weight": 2}\', the sync service\'s under "sync", e.g. '
                         '\'eager={"sync": {"feed_linger_ms": 0}}\' (repeatable; runs unless --lines leaves it out; '
                         'named like a built-in kvroute line, it replaces that line\'s settings)')
    ap.add_argument("--keep-samples", action="store_true",
                    help="keep every run's per-request samples in <out>/samples/<workload>.<line>.json "
                         "(on the mocker also each engine's requests in flight every second, in results.json)")
    ap.add_argument("--out", help="results folder (default: target/peers-results[-mocker])")
    ap.add_argument("--background-cpu", type=float, default=0.0, metavar="CORES",
                    help="keep a busy loop on this share of one core (0-1) while each line runs: "
                         "what a router's CPU alone would do to the engines' latency")
    ap.add_argument("--warmup", type=int, default=0, metavar="BURSTS",
                    help="before each line's workload, this many bursts of 12 unrelated requests through its "
                         "router, then the engines emptied (the fleet only): what a router pays once after it "
                         "starts is left out")
    ap.add_argument("--access-log", action="store_true",
                    help="Envoy lines (kvroute, the reference lines) write an access log, one JSON line a "
                         "request with where its time went before the engine, to <out>/<workload>.<line>.access.jsonl, "
                         "and keep the stage's log with a line a request (<out>/<workload>.<line>.stage.log); "
                         "benches/access_paths.py reads both")
    ap.add_argument("--cache-key", action="store_true",
                    help="send OpenAI's prompt_cache_key with every request (the conversation in chat and the "
                         "agentic loop, the group in shared-prefix workloads), as agent clients do; every line "
                         "gets it, and kvroute places new keys apart (docs/benchmarks.md, \"Cache keys\")")
    ap.add_argument("--rotate", type=int, default=0, metavar="N",
                    help="run the lines in their order rotated by N (the first line of a run met engines "
                         "that had not tokenized its prompts yet, before the fleet's reset emptied their "
                         "tokenizer caches too: docs/benchmarks.md, \"The first line of a run met colder engines\")")
    ap.add_argument("--merge", action="store_true",
                    help="keep the runs already in <out>/results.json that this run does not redo "
                         "(same workload and line); the plots keep the earlier lines that kept samples")
    args = ap.parse_args()
    args.speedup = args.speedup or (2.0 if args.sim == "fleet" else 0.1)
    if args.client != "fleet_load" and args.sim != "fleet":
        sys.exit("a real client reads hit rates from the fleet's engine counters: --sim fleet only")
    if args.warmup and args.sim != "fleet":
        sys.exit("--warmup empties the engines after it, which the mocker cannot: --sim fleet only")
    args.workloads = args.workloads or (WORKLOADS if args.client == "fleet_load" else CLIENT_WORKLOADS)
    default_out = "peers-results" + ("" if args.sim == "fleet" else "-mocker") + \
        ("" if args.client == "fleet_load" else f"-{args.client}")
    out = pathlib.Path(args.out or ROOT / "target" / default_out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sim == "mocker":
        # Load levels from the mocker's own prefill cost (its fixed costs per step cancel
        # out of the measurement, and are left out of the capacity).
        rq.PREFILL_OVERHEAD_MS, rq.PREFILL_MS_PER_TOKEN = 0.0, dynamo_fleet.prefill_ms_per_token(args.blocks)
        print(f"mocker: {rq.PREFILL_MS_PER_TOKEN:.4f} ms per uncached prompt token (fleet: 0.2)", flush=True)
    # The routing-quality workloads, as that runner plans them.
    wl_args = argparse.Namespace(workers=args.workers, groups=args.groups, per_group=args.per_group,
                                 blocks=args.blocks, speedup=args.speedup, quick=False, workloads=args.workloads,
                                 trace=str(rq.TRACE), trace_requests=2000, mooncake_blocks=8192)
    # A --kvroute line named like a built-in one replaces it (its settings, its place).
    extra = dict(kvroute_line(spec)[::2] for spec in args.kvroute)
    if taken := [label for label, kind, _ in LINES if label in extra and kind != "kvroute"]:
        sys.exit(f"--kvroute {taken[0]}=…: {taken[0]} is a peer's line")
    lines = [(label, kind, extra.pop(label, how)) for label, kind, how in LINES]
    lines += [(label, "kvroute", how) for label, how in extra.items()]
    lines = rq.named(lines + REFERENCE_LINES, args.lines, "lines") if args.lines else lines
    lines = lines[args.rotate % len(lines):] + lines[:args.rotate % len(lines)]
    procs = Processes()
    results, failed = [], []
    t_start = time.time()
    fleet = Fleet(procs, args)
    try:
        port = free_port()
        for wname, level, wargs, settings in rq.workloads(wl_args):
            for line in lines:
                try:
                    r, samples = run_line(args, procs, fleet, port, line, wname, wargs, settings, out)
                except Exception as e:  # noqa: BLE001 (reported, and the matrix goes on)
                    # A line that fails is reported with why, never left out.
                    failed.append({"workload": wname, "line": line[0], "reason": f"{type(e).__name__}: {e}"[-2000:]})
                    print(f"{wname:18} {line[0]:26} FAILED: {failed[-1]['reason'][-300:]}", flush=True)
                    procs.stop_all()
                    fleet.settings = None  # the next line starts a new fleet
                    continue
                r["load"] = level
                results.append(r)
                speedup = r["speedup"]
                if samples is not None:
                    rq.save_samples(out, wname, line[0], samples, speedup)
                print(f"{wname:18} {line[0]:26} hit {r['hit_rate']:.2f}/{r['oracle_hit_rate'] or 0:.2f} "
                      f"ttft p50 {r['ttft_ms']['p50'] * speedup:7.0f} p99 {r['ttft_ms']['p99'] * speedup:7.0f} ms "
                      f"cpu {r['router_cpu_ms_per_request']:.2f} ms/req rss {r['router_peak_rss_mb']:.0f} MB "
                      f"failed {r['failed']}", flush=True)
            # (A real client gives no per-request samples: no plot.) Merged: plotted below,
            # with the lines this run keeps from the earlier ones.
            if not args.merge:
                rq.plot_ttft(out, wname, [label for label, *_ in lines], f"TTFT, {wname}, {args.sim} (model time)")
    finally:
        procs.stop_all()
    wall_s = round(time.time() - t_start)
    config = vars(args)
    if args.merge and (out / "results.json").exists():
        results, failed, config = merged(json.loads((out / "results.json").read_text()), results, failed, config)
    if args.merge and args.client == "fleet_load":
        plot_merged(out, results, args.workloads.split(","), args.sim)
    (out / "results.json").write_text(json.dumps(
        {"config": config, "versions": VERSIONS, "wall_s": wall_s, "runs": results, "failed": failed}, indent=1))
    (out / "tables.md").write_text(f"kvroute_w1 against the best peer:\n\n{versus(results)}\n{markdown(results, failed)}\n")
    print(markdown(results, failed))
    print(f"\n{len(results)} runs, {len(failed)} failed, in {time.time() - t_start:.0f} s; results in {out}")


def plot_merged(out, results, workloads, sim):
    """The TTFT CDFs of `workloads` with every line `results` has for them: this run's from
    its samples, earlier runs' from the samples they kept (--keep-samples). An earlier line
    that kept none is left out of the plot, and said so."""
    for w in workloads:
        runs = [r for r in results if r["workload"] == w]
        missing = []
        for r in runs:
            label = r["policy"]
            if (out / f"{w}.{label}.samples.json").exists():
                continue  # this run's
            kept = out / "samples" / f"{w}.{label}.json"
            if kept.exists():
                rq.save_samples(out, w, label, json.loads(kept.read_text())["samples"], r["speedup"])
            else:
                missing.append(label)
        if missing:
            print(f"ttft-{w}.svg: no kept samples for {', '.join(missing)} (run them with --keep-samples): "
                  "not in the plot", flush=True)
        rq.plot_ttft(out, w, [r["policy"] for r in runs], f"TTFT, {w}, {sim} (model time)")


def background_cpu(cores):
    """A busy loop on `cores` (0-1) of one core, in 10 ms periods; None for 0."""
    if cores <= 0:
        return None
    loop = ("import time\nwhile True:\n t = time.perf_counter()\n"
            f" while time.perf_counter() - t < {0.01 * min(cores, 1.0)}: pass\n"
            f" time.sleep({0.01 * (1 - min(cores, 1.0))})\n")
    return subprocess.Popen([sys.executable, "-c", loop])


# Requests in each of --warmup's bursts.
WARMUP_BURST = 12


@functools.cache
def tokenizer_words():
    """The tokenizer's one-token lower-case words (a space, then letters)."""
    vocab = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w[1:] for w in vocab if re.fullmatch("\u0120[a-z]+", w))


def warm_up(target, bursts, engines, sidecar, seed):
    """`bursts` bursts of WARMUP_BURST streamed completions at once, each burst one new text of the
    tokenizer's words, through the router just started; then the engines are emptied, so
    the workload finds them as without it. What a router pays once after it starts (new
    connections, first tokenizations, code compiled on first use) is then left out."""
    words = tokenizer_words()
    rng = random.Random(seed + 1_000_003)
    port = int(target.rsplit(":", 1)[1])
    for _ in range(bursts):
        doc = " ".join(rng.choice(words) for _ in range(1500))
        cold_path.burst_ttfts(port, [f"{doc} {' '.join(rng.choice(words) for _ in range(20))}"
                                          for _ in range(WARMUP_BURST)])
    reset_fleet(engines, sidecar)


def run_line(args, procs, fleet, port, line, wname, wargs, settings, out):
    """One line on one workload: its router started in front of empty engines, the
    workload driven through it, the router stopped. (summary, samples or None)."""
    label, kind, how = line
    speedup = settings["speedup"]
    engines, sidecar, router = fleet.for_line(settings, kind, port)
    # The parts of kvroute (and of Envoy) a line runs: all for kvroute, a reference line's own.
    parts = {"stage": True, "filter": True, "sync": True} if kind == "kvroute" else how if kind == "envoy" else None
    if parts:
        # A new stage per line, as every peer is a new process: no line starts with
        # another's tokenizer cache.
        access_log = args.access_log and out / f"{wname}.{label}.access.jsonl"
        stage = procs.add(Tokenizer(models=[(MODEL, TOKENIZER_DIR, [])], max_model_len=settings["blocks"] * 16,
                                    log_level="info,kvroute_tokenizer=debug" if access_log else "info")) \
            if parts["stage"] else None
        if access_log:
            # Envoy appends: a rerun into the same folder starts the line's log afresh.
            access_log.unlink(missing_ok=True)
        # A kvroute line's settings are its filter's, but for "sync": its sync service's.
        filter_how = {k: v for k, v in how.items() if k != "sync"} if kind == "kvroute" else {}
        sync_how = how.get("sync", {}) if kind == "kvroute" else {}
        cfg, lp, adm = render_config(engines, sidecar.port, {"block_size": 16, **filter_how},
                                     listener_port=port,
                                     policy="kvroute" if parts["filter"] or parts["sync"] else "round_robin",
                                     sync_config={"poll_timeout_ms": 5000, "stale_after_ms": 15000, **sync_how},
                                     tokenizer_port=stage.grpc_port if stage else None,
                                     kvroute_filter=parts["filter"], kvroute_sync=parts["sync"],
                                     build="native" if label.endswith("_native") else "wasm",
                                     access_log=access_log)
        router = procs.add(Envoy(cfg, lp, adm, concurrency=2))
        if parts["sync"]:
            wait_synced(router, sidecar)
        metered = [router] + ([stage] if stage else []) + ([sidecar] if parts["sync"] else [])
    elif kind == "dynamo":
        router = router or procs.add(DynamoRouter(engines, port, force_usage=args.client == "fleet_load"))
        metered = [router]
    else:
        router = procs.add(Peer(kind, how, engines, port))
        metered = [router]
    outcomes = ("spilled", "memory_limited", "kept_on_holder", "redecided", "update_failures", "layout_errors")
    sync_counts = ("polls_ok", "bucket_writes", "resyncs", "blocks_stored", "blocks_removed", "frames_bad",
                   "write_failures", "polls_failed")
    counted = ([f"kvroute.{k}" for k in ("requests", "scored", *outcomes)] if parts and parts["filter"] else []) + \
        ([f"kvroute_sync.{k}" for k in sync_counts] if parts and parts["sync"] else [])
    # Envoy's counters from here on: the warm-up's requests are not the workload's.
    before = {}
    if args.warmup:
        warm_up(f"127.0.0.1:{port}", args.warmup, engines, sidecar, args.seed)
        if parts and parts["filter"]:
            wait_for(lambda: router.stat("kvroute.requests") >= WARMUP_BURST * args.warmup,
                     what="the warm-up in the filters' counters")
        # Counters reach Envoy's stats in batches (every 100 ms): read once they hold still.
        deadline = time.time() + 5
        while True:
            before = {k: router.stat(k) for k in counted}
            time.sleep(0.3)
            if time.time() > deadline or before == {k: router.stat(k) for k in counted}:
                break

    def stat(k):
        return router.stat(k) - before.get(k, 0)
    burner = background_cpu(args.background_cpu)
    sampler = EngineInflight(engines) if args.keep_samples and args.sim == "mocker" and engines else None
    try:
        cpu0 = [cpu_by_process(p) for p in metered]
        t0 = time.time()
        if sampler:
            sampler.load_starts()
        r, samples = drive(args, f"127.0.0.1:{port}", label, wname, wargs, engines, out)
    finally:
        if burner:
            burner.kill()
            burner.wait()
        if sampler:
            inflight = sampler.stop()
    if sampler:
        r["engine_inflight"] = inflight
    # Per process (kvroute: Envoy, the stage, the sidecar), ms per request.
    per_request = {}
    for p, c0 in zip(metered, cpu0):
        for k, v in cpu_by_process(p).items():
            per_request[k] = (v - c0[k]) * 1000 / max(r["requests"], 1)
    scored, peer_events = 0, None
    if kind == "dynamo":
        # The engines' (the mockers') KV events Dynamo's router applied, by status.
        peer_events = events_applied(port)
    if parts and parts["filter"]:
        wait_for(lambda: stat("kvroute.requests") >= r["requests"], what="the filters' counters")
        scored = stat("kvroute.scored")
        # What the limits did, and each engine's capacity as the sync service learned it.
        r["kvroute_outcomes"] = {**{k: stat(f"kvroute.{k}") for k in outcomes},
                                 "kv_capacity_blocks": router.worker_gauges("kvroute.kv_capacity_blocks")}
    if parts and parts["sync"]:
        # What the sync service took from the sidecar's feed (a resync rebuilds the index).
        r["kvroute_sync"] = {k: stat(f"kvroute_sync.{k}") for k in sync_counts}
    r.update({"workload": wname, "policy": label, "router": kind, "sim": args.sim, "client": args.client,
              "wall_s": round(time.time() - t0, 1), "speedup": speedup,
              "router_cpu_ms_per_request": round(sum(v for k, v in per_request.items() if k not in NOT_ROUTER), 3),
              "router_cpu_ms_per_request_by_process": {k: round(v, 3) for k, v in per_request.items()},
              "router_peak_rss_mb": round(sum(p.peak_rss_mb() for p in metered), 1),
              "scored": scored, "peer_events_stored": peer_events})
    if parts and parts["stage"] and args.access_log:
        # The stage's log beside the access log: a line per request with its time in the stage.
        (out / f"{wname}.{label}.stage.log").write_text(stage.logs())
    for p in metered:
        if p is not sidecar:
            procs.stop(p)
    return r, samples


if __name__ == "__main__":
    main()
