#!/usr/bin/env python3
"""Discovery convergence at the default settings: etcd discovery in the sidecar
(`kvroute-sidecar register`, lease TTL 5 s), Envoy's `workers` cluster from the sidecar
over EDS (envoy/workers-eds.yaml, refresh 0.5 s), Debian's etcd on loopback.

Per round, with one worker always registered and a client sending requests back to back
(each a new prompt, so the filter spreads them by load):
  join:  `register` starts for a second worker → the first response from it;
  leave: the registrar is killed (SIGKILL: no revoke, the lease must expire) → etcd
         deletes the key (polled on etcd's JSON gateway every 10 ms) → the last response
         from it. Reported: expiry → last request, and kill → expiry (the TTL's share).

    cargo build --release -p kvroute-sidecar && cargo build --target wasm32-unknown-unknown --release
    python3 benches/discovery_convergence.py [--rounds 5] [--json docs/discovery-convergence.json]
"""
import argparse
import base64
import json
import pathlib
import statistics
import struct
import sys
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from harness import Envoy, Sidecar, free_port, render_config  # noqa: E402
from harness.cluster import Etcd, Registrar  # noqa: E402
from upstream import Worker  # noqa: E402

PREFIX = "/kvroute/workers/"


def key_exists(etcd, key):
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    req = urllib.request.Request(f"{etcd.url}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(json.load(r).get("count", 0)) > 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ttl", type=int, default=5, help="the registrar's lease (its default)")
    ap.add_argument("--json")
    args = ap.parse_args()

    items = []
    try:
        etcd = Etcd()
        items.append(etcd)
        ups = [Worker(), Worker()]
        items += ups
        sc = Sidecar([], extra={"discovery_backend": "etcd", "etcd_endpoints": [etcd.url]})
        items.append(sc)
        cfg, lp, ap_ = render_config([], sc.port, {"debug_header": "x-kvroute-debug"}, eds=True)
        envoy = Envoy(cfg, lp, ap_)
        items.append(envoy)

        def events():
            return f"tcp://127.0.0.1:{free_port()}"  # no publisher: routed by load
        items.append(Registrar(etcd.url, ups[0].id, events(), ttl=args.ttl))

        hits = []  # (time, worker) of each response
        stop = threading.Event()

        def client():
            n = 0
            while not stop.is_set():
                n += 1
                toks = [n * 1000 + i for i in range(32)]
                h = base64.b64encode(struct.pack("<32I", *toks)).decode()
                try:
                    status, _, body = envoy.request(headers={"x-prompt-token-ids-b64": h}, timeout=5)
                    if status == 200:
                        hits.append((time.monotonic(), json.loads(body)["worker"]))
                except OSError:
                    pass
        threading.Thread(target=client, daemon=True).start()
        deadline = time.monotonic() + 10
        while not any(w == ups[0].id for _, w in hits):
            if time.monotonic() > deadline:
                raise RuntimeError("the first worker got no request in 10 s")
            time.sleep(0.05)

        rounds = []
        for r in range(args.rounds):
            t0 = time.monotonic()
            reg = Registrar(etcd.url, ups[1].id, events(), ttl=args.ttl)
            while not any(ts > t0 and w == ups[1].id for ts, w in hits):
                if time.monotonic() - t0 > 15:
                    raise RuntimeError("the registered worker got no request in 15 s")
                time.sleep(0.005)
            join = min(ts for ts, w in hits if ts > t0 and w == ups[1].id) - t0
            time.sleep(1)
            t_kill = time.monotonic()
            reg.stop(kill=True)
            while key_exists(etcd, PREFIX + ups[1].id):
                time.sleep(0.01)
            t_expired = time.monotonic()
            time.sleep(3)
            last = max(ts for ts, w in hits if w == ups[1].id)
            rounds.append({"join_s": round(join, 3), "kill_to_expiry_s": round(t_expired - t_kill, 3),
                           "expiry_to_last_request_s": round(max(0.0, last - t_expired), 3)})
            print(json.dumps(rounds[-1]), flush=True)
        stop.set()
    finally:
        for i in reversed(items):
            i.stop()

    def summary(k):
        v = [x[k] for x in rounds]
        return {"median": round(statistics.median(v), 3), "max": round(max(v), 3)}
    result = {"ttl_s": args.ttl, "eds_refresh_s": 0.5, "rounds": rounds,
              "join_s": summary("join_s"), "expiry_to_last_request_s": summary("expiry_to_last_request_s"),
              "kill_to_expiry_s": summary("kill_to_expiry_s")}
    print(json.dumps(result, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
