#!/usr/bin/env python3
"""Several gateways: what running kvroute in two Envoy replicas costs against one, on the
same simulated fleet, and a sidecar restart under load through NATS JetStream.

Setup (once): 8 mock engines (kvroute-fleet worker) publishing KV events; a nats-server
(Debian's, JetStream on); one `kvroute-sidecar relay` for all engines (as one per host
would); two sidecars reading the stream (`kv_event_transport = "nats"`).

1. Per workload (routing_quality.py's definitions, same seed, a freshly reset fleet):
   one Envoy (2 worker threads) on sidecar 1, then two Envoys (2 worker threads each), one
   per sidecar, the load generator spreading requests over both in turn (as a layer-4
   balancer does), then the same with each conversation (or prompt group) kept on one
   gateway (`--sticky`, a balancer's session affinity). Each Envoy counts the load of
   the requests it routed, so each replica sees about half of what it routes to; the
   `_peer_load` lines add the other gateway's (filter setting `peer_load`: each sync
   service reports its own load to its sidecar ten times a second, the sidecars exchange
   the reports on NATS).
2. The restart: the two-gateway setup under shared_prefix_70; a third of the way through,
   sidecar 2 is stopped and started again on its port. Measured: the time from its start
   until its index equals sidecar 1's (every worker at the same last batch and block
   count: both apply the same stream), and the failed requests of the whole run.

    cargo build --release -p kvroute-sidecar -p kvroute-fleet
    cargo build --target wasm32-unknown-unknown --release
    python3 benches/gateways.py [--workloads shared_prefix_70,zipf_hot_70,agentic_70]
                                [--lines 1gw,2gw,2gw_sticky,2gw_peer_load,2gw_sticky_peer_load]
                                [--no-restart] [--json docs/gateways-results.json] [--keep-samples DIR]

With --keep-samples, `benches/session_steps.py DIR/samples/*.json` reads where each
conversation went with one gateway and with two.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
from harness import FLEET, Envoy, Processes, Sidecar, free_port, render_config, wait_for, wait_synced  # noqa: E402
from harness.cluster import Nats, Relay  # noqa: E402
from harness.services import MockEngine, reset_fleet  # noqa: E402
from routing_quality import workloads  # noqa: E402


def sidecar(engines, nats, port=None):
    return Sidecar([(e.id, e.events_connect, e.replay_connect, "both") for e in engines], port=port,
                   extra={"kv_event_transport": "nats", "nats_url": nats.url})


def index(sc):
    """{worker: (last_seq, blocks)}: equal for two sidecars that applied the same stream."""
    return {w["id"]: (w["last_seq"], w["blocks"]) for w in sc.json("/v1/admin/workers")[1]["workers"]}


def caught_up(behind, ahead):
    """`behind` has applied at least what `ahead` had a moment before, for every worker
    (under load the two are never read at the same instant)."""
    a = index(ahead)
    b = index(behind)
    return all(b.get(w, (None,))[0] is not None and (v[0] is None or b[w][0] >= v[0]) for w, v in a.items())


def load(engines, targets, wargs, out, label, sticky=False, cache_key=False):
    cmd = [str(FLEET), "load", "--target", ",".join(f"127.0.0.1:{t}" for t in targets), "--label", label,
           "--seed", "7", "--json", str(out), "--quiet", "--token-header", *wargs]
    if sticky:
        cmd.append("--sticky")
    if cache_key:
        cmd.append("--cache-key")
    for e in engines:
        cmd += ["--engine", e.id]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


# Setup per line: gateways, sticky clients, the other gateway's load added (`peer_load`).
LINES = {
    "1gw": (1, False, False),
    "2gw": (2, False, False),
    "2gw_sticky": (2, True, False),
    "2gw_peer_load": (2, False, True),
    "2gw_sticky_peer_load": (2, True, True),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--speedup", type=float, default=5.0)
    ap.add_argument("--workloads", default="shared_prefix_70,zipf_hot_70,agentic_70")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--cache-key", action="store_true",
                    help="send each request's cache key (the conversation, the group) in x-kvroute-cache-key, "
                         "as a client that tokenizes itself would (docs/configuration.md, \"Cache keys\")")
    ap.add_argument("--keep-samples", metavar="DIR",
                    help="keep every request's sample in DIR/samples/<workload>.<line>.json, with DIR/results.json, "
                         "as peers.py --keep-samples does (for benches/session_steps.py)")
    ap.add_argument("--lines", default=",".join(LINES),
                    help="which setups to run per workload (default: all of " + ", ".join(LINES) + ")")
    ap.add_argument("--no-restart", action="store_true", help="leave out the sidecar restart under load")
    ap.add_argument("--kvroute", metavar="JSON", default="{}",
                    help="more filter settings for every Envoy, as a JSON object (e.g. '{\"implicit_cache_keys\": true}')")
    args = ap.parse_args()
    try:
        filter_settings = json.loads(args.kvroute)
    except json.JSONDecodeError as e:
        sys.exit(f"--kvroute: {e}")
    if not isinstance(filter_settings, dict):
        sys.exit("--kvroute: want a JSON object of filter settings")
    lines = [x for x in args.lines.split(",") if x]
    if not lines or any(x not in LINES for x in lines):
        sys.exit(f"--lines: each of {', '.join(LINES)}")
    # routing_quality's workload table reads these.
    args.quick, args.trace, args.mooncake_blocks, args.trace_requests = False, "", 8192, 2000
    chosen = workloads(args)

    procs = Processes()
    out = ROOT / "target" / "gateways"
    out.mkdir(parents=True, exist_ok=True)
    results = {"runs": []}
    try:
        engines = []
        for _ in range(args.workers):
            ev, rp = free_port(), free_port()
            e = procs.add(MockEngine(events=f"tcp://*:{ev}", replay=f"tcp://*:{rp}",
                                     args=["--num-gpu-blocks", str(args.blocks), "--speedup", str(args.speedup)]))
            e.events_connect, e.replay_connect = f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}"
            engines.append(e)
        nats = procs.add(Nats())
        extra = [a for e in engines[1:] for a in ("--worker", f"{e.id}={e.events_connect},replay={e.replay_connect}")]
        procs.add(Relay(nats.url, engines[0].id, engines[0].events_connect, engines[0].replay_connect, extra=extra))
        sidecars = [procs.add(sidecar(engines, nats)), procs.add(sidecar(engines, nats))]
        time.sleep(0.5)

        def envoys(n, peer_load=False):
            es = []
            settings = {"block_size": 16, **filter_settings}
            if peer_load:
                settings["peer_load"] = True
            for sc in sidecars[:n]:
                cfg, lp, adm = render_config(engines, sc.port, settings,
                                             sync_config={"poll_timeout_ms": 5000, "stale_after_ms": 15000})
                es.append((procs.add(Envoy(cfg, lp, adm, concurrency=2)), lp, sc))
            for envoy, _, sc in es:
                wait_synced(envoy, sc)
            return es

        def reset():
            reset_fleet(engines, sidecars[0])
            wait_for(lambda: all(sidecars[1].block_count(e.id) == 0 for e in engines), what="sidecar 2 empty")

        for wname, level, wargs, settings in chosen:
            if settings.get("speedup", args.speedup) != args.speedup or settings.get("blocks", args.blocks) != args.blocks:
                print(f"{wname}: needs another fleet; skipped", flush=True)
                continue
            for label in lines:
                n, sticky, peer_load = LINES[label]
                reset()
                es = envoys(n, peer_load)
                path = out / f"{wname}.{label}.json"
                load(engines, [lp for _, lp, _ in es], wargs, path, label, sticky, args.cache_key).wait()
                for envoy, _, _ in es:
                    procs.stop(envoy)
                r = json.loads(path.read_text())
                samples = r.pop("samples")
                if args.keep_samples:
                    kept = pathlib.Path(args.keep_samples) / "samples"
                    kept.mkdir(parents=True, exist_ok=True)
                    (kept / f"{wname}.{label}.json").write_text(json.dumps({"label": label, "samples": samples}))
                run = {"workload": wname, "label": label, "speedup": args.speedup,
                       "gateways": n, "sticky": sticky, "peer_load": peer_load, "hit_rate": r["hit_rate"],
                       "oracle_hit_rate": r["oracle_hit_rate"], "failed": r["failed"],
                       "ttft_p50_ms": round(r["ttft_ms"]["p50"] * args.speedup),
                       "ttft_p99_ms": round(r["ttft_ms"]["p99"] * args.speedup)}
                results["runs"].append(run)
                print(json.dumps(run), flush=True)

        if not args.no_restart:
            # The restart under load.
            wname, _, wargs, _ = next((w for w in chosen if w[0] == "shared_prefix_70"), chosen[0])
            reset()
            es = envoys(2)
            path = out / "restart.json"
            t0 = time.time()
            client = load(engines, [lp for _, lp, _ in es], wargs, path, "restart")
            time.sleep(8)
            port = sidecars[1].port
            procs.stop(sidecars[1])
            t_stop = time.time()
            sidecars[1] = procs.add(sidecar(engines, nats, port=port))
            t_start = time.time()
            wait_for(lambda: caught_up(sidecars[1], sidecars[0]), timeout=60, interval=0.01,
                     what="the restarted sidecar's index")
            resync = time.time() - t_start
            client.wait()
            # Quiet again: the two indexes are equal, block for block.
            wait_for(lambda: index(sidecars[1]) == index(sidecars[0]), what="equal indexes")
            r = json.loads(path.read_text())
            r.pop("samples")
            stats = [(envoy.stat("cluster.workers.upstream_rq_5xx"), envoy.stat("kvroute.requests")) for envoy, _, _ in es]
            results["restart"] = {
                "workload": wname, "requests": r["requests"], "failed": r["failed"],
                "stopped_at_s": round(t_stop - t0, 1), "sidecar_down_s": round(t_start - t_stop, 2),
                "resync_s": round(resync, 2), "envoy_upstream_5xx": [s[0] for s in stats],
                "stream_messages": nats.stream_info()["messages"], "hit_rate": r["hit_rate"],
                "indexes_equal_after": True}
            print(json.dumps(results["restart"]), flush=True)
    finally:
        procs.stop_all()
    print(json.dumps(results, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.keep_samples:
        (pathlib.Path(args.keep_samples) / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
