#!/usr/bin/env python3
"""Scale: 128 workers × 50k cached blocks each (6.4M (worker, block) entries) through the
sidecar and into Envoy.

Measures: the sidecar's ingest of it all (ZMQ → index), its memory; a full feed snapshot
(all pages) — time and bytes; then an Envoy started against the loaded sidecar: time until
its sync service has the whole index in shared data, and Envoy's memory before and after.

    python3 benches/sidecar_scale.py [--workers 128] [--blocks 50000] [--json out.json]

The publishers here are bare PUB sockets sending pre-made vLLM-format batches (msgspec),
64 blocks each, as fast as the sidecar takes them.
"""
import argparse
import json
import pathlib
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
import msgspec  # noqa: E402
import zmq  # noqa: E402
from envoy_overhead import Port  # noqa: E402
from harness import WASM, Envoy, Sidecar, free_port, render_config, wait_for  # noqa: E402
from harness.kvevents import batch, stored  # noqa: E402

CHAIN = 64


def rss_mb(pid):
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=50_000, help="blocks per worker")
    ap.add_argument("--json")
    ap.add_argument("--wasm", default=str(WASM), help="the filter build to load (default: the release build)")
    ap.add_argument("--page-blocks", type=int, default=250_000, help="the sidecar's snapshot_page_blocks")
    args = ap.parse_args()
    chains = -(-args.blocks // CHAIN)
    total = args.workers * chains * CHAIN

    ctx = zmq.Context.instance()
    pubs, specs, workers = [], [], []
    for w in range(args.workers):
        port = free_port()
        sock = ctx.socket(zmq.PUB)
        sock.set_hwm(0)  # never drop: this measures ingest, not loss
        sock.bind(f"tcp://127.0.0.1:{port}")
        pubs.append(sock)
        workers.append(Port(20000 + w))
        specs.append((f"127.0.0.1:{20000 + w}", f"tcp://127.0.0.1:{port}", None, "both"))
    sidecar = Sidecar(specs, extra={"health_path": "", "snapshot_page_blocks": args.page_blocks})
    time.sleep(1.0)
    enc = msgspec.msgpack.Encoder()
    result = {"workers": args.workers, "blocks_per_worker": chains * CHAIN, "entries": total}
    envoy = None
    try:
        t0 = time.perf_counter()
        for c in range(chains):
            for w, sock in enumerate(pubs):
                base = (w * chains + c) * CHAIN * 16
                toks = [(base + k) % 2_000_000_000 for k in range(CHAIN * 16)]
                hashes = [(w << 40) | (c << 8) | i for i in range(CHAIN)]
                payload = enc.encode(batch("vllm", [stored("vllm", hashes, None, toks, 16)]))
                sock.send_multipart((b"", c.to_bytes(8, "big"), payload))
        t_sent = time.perf_counter()
        wait_for(lambda: sidecar.metric("kvroute_sidecar_blocks_stored_total") >= total, timeout=600,
                 interval=0.2, what="sidecar ingest")
        t_in = time.perf_counter()
        m = sidecar.metrics()
        assert m["kvroute_sidecar_sequence_gaps_total"] == 0 and m["kvroute_sidecar_batches_bad_total"] == 0
        result.update({
            "publish_s": round(t_sent - t0, 1),
            "sidecar_ingest_s": round(t_in - t0, 1),
            "sidecar_rss_mb": round(rss_mb(sidecar.proc.pid)),
        })

        # A full snapshot, every page, as a fresh Envoy would ask.
        t = time.perf_counter()
        size, pages, cursor, epoch, since = 0, 0, 0, 0, 0
        while True:
            url = (f"http://127.0.0.1:{sidecar.port}/v1/kv/feed?epoch={epoch}&since={since}"
                   f"&cursor={cursor}&timeout_ms=0&tiers=1")
            with urllib.request.urlopen(url, timeout=300) as r:
                body = r.read()
            size += len(body)
            pages += 1
            epoch, since, cursor = (int.from_bytes(body[8:16], "little"), int.from_bytes(body[24:32], "little"),
                                    int.from_bytes(body[32:40], "little"))
            if cursor == 0:
                break
        result.update({"snapshot_s": round(time.perf_counter() - t, 2), "snapshot_pages": pages,
                       "snapshot_mb": round(size / 2**20, 1),
                       "sidecar_rss_after_snapshot_mb": round(rss_mb(sidecar.proc.pid))})

        # Envoy's memory with no index (its feed is a closed port), then against the sidecar.
        sync = {"poll_timeout_ms": 5000, "stale_after_ms": 60000, "max_frame_bytes": 64 << 20}
        cfg, lp, ap_ = render_config(workers, free_port(), {}, sync)
        empty = Envoy(cfg, lp, ap_, concurrency=2)
        time.sleep(2)
        rss0 = rss_mb(empty.proc.pid)
        empty.stop()
        cfg, lp, ap_ = render_config(workers, sidecar.port, {}, sync, wasm=pathlib.Path(args.wasm))
        version = sidecar.json("/v1/admin/workers")[1]["version"]
        t = time.perf_counter()
        envoy = Envoy(cfg, lp, ap_, concurrency=2)
        # The admin API shares Envoy's main thread with the sync service: how long a stats
        # read waits is how long the main thread was busy applying and publishing.
        admin_waits = []

        def synced():
            t0 = time.perf_counter()
            try:
                return (envoy.stat("kvroute_sync.index_entries") >= total
                        and envoy.stat("kvroute_sync.version") >= version)
            except OSError:
                return False
            finally:
                admin_waits.append(time.perf_counter() - t0)

        wait_for(synced, timeout=900, interval=0.1, what="envoy synced")
        result.update({"envoy_sync_s": round(time.perf_counter() - t, 1),
                       "envoy_admin_wait_max_s": round(max(admin_waits), 2),
                       "envoy_rss_no_index_mb": round(rss0),
                       "envoy_rss_synced_mb": round(rss_mb(envoy.proc.pid))})
        result["envoy_bytes_per_entry"] = round((result["envoy_rss_synced_mb"] - rss0) * 2**20 / total, 1)
    finally:
        if envoy:
            envoy.stop()
        sidecar.stop()
        for s in pubs:
            s.close(linger=0)
    print(json.dumps(result, indent=1))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
