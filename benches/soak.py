#!/usr/bin/env python3
"""Fault-injection soak: steady load through Envoy (kvroute filter + sync service) on the
simulated fleet while faults are injected at random moments, one at a time; invariants
checked while it runs and at the end.

Faults (each counted):
  engine_kill     SIGKILL a mock engine, restart it on its ports (its KV-event publisher
                  starts again from sequence 0 with an empty cache)
  zmq_chaos       drop and reorder an engine's KV-event messages for a few seconds (a tap
                  between the engine's PUB socket and the sidecar), forcing sequence gaps
                  the sidecar must repair from the engine's replay socket
  sidecar_kill    SIGKILL the sidecar, restart it (it rebuilds from its checkpoint and the
                  engines' replay); put last in its round until an engine has published
                  more batches than its replay buffer keeps
  feed_stall      hold the feed connection between Envoy and the sidecar (a gate that
                  stops forwarding bytes) for a few seconds
  unhealthy       SIGSTOP an engine for a few seconds (silent, its health probe times
                  out: the sidecar marks it down), then SIGCONT

Invariants (results["violations"] lists every breach; the test suite's short run and
`--check` fail on any):
  - every 5xx (Envoy's access log) and every failed client request is attributable to an
    engine that was dead (killed or stopped) during the request, and a connect failure was
    retried as the route's retry_policy says;
  - no request reaches a worker while the sidecar has it marked down (from the mark plus
    0.5 s for it to reach Envoy, to the last poll of the sidecar that still showed it);
  - after the faults stop and the load settles, each worker's indexed engine blocks (the
    sidecar's /v1/admin/engine-blocks/) against the engine's own cache (the mock's
    /v1/kv/blocks): the index never holds a block the engine does not ("phantom"), and
    lacks none it holds ("missing"). The sidecar keeps a checkpoint (state_file, every
    second): a restarted one resumes each engine's stream where the checkpoint left it,
    even after the engine has published more batches than its replay buffer keeps
    (--buffer-steps, vLLM's 10000), where ZMQ alone could not relearn the older blocks;
  - memory: with --churn-blocks N, a synthetic engine then stores and evicts N distinct
    blocks (a bounded live set) through the sidecar into Envoy; RSS of both is sampled
    and must stay flat (last quarter's peak within 25% of the second quarter's; the
    sidecar's change log grows to --log-max-blocks first, by design), and its
    indexed blocks must equal its live set at the end.

    python3 benches/soak.py [--seconds 600] [--churn-blocks 10000000] [--build wasm]
                            [--seed 1] [--json docs/soak-results.json] [--check]
"""
import argparse
import base64
import http.client
import json
import os
import pathlib
import random
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import msgspec  # noqa: E402
import zmq  # noqa: E402
from harness import Envoy, MockEngine, Processes, Sidecar, free_port, render_config, wait_for  # noqa: E402
from harness.kvevents import Publisher, batch, removed, stored  # noqa: E402

KINDS = ["engine_kill", "zmq_chaos", "sidecar_kill", "feed_stall", "unhealthy"]
BLOCK = 16
DOWN_GRACE_S = 0.5   # from the sidecar marking a worker down to Envoy's filter knowing it
DEAD_SLACK_S = 0.5   # a request failing this close to an engine's dead window is its


def now():
    return time.time()


def rss_mb(pid):
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class EventTap:
    """Forwards an engine's KV-event messages (SUB → PUB) to the sidecar; while chaos is on,
    drops some and swaps some with the next, as a lossy network would."""

    def __init__(self, engine_port, rng):
        self.port = free_port()
        self.rng = rng
        self.drop_p = self.reorder_p = 0.0
        self.counts = {"forwarded": 0, "dropped": 0, "reordered": 0}
        self.last_seq = -1  # the engine's latest batch sequence number seen
        self.stop = threading.Event()
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.set_hwm(0)
        self.sub.connect(f"tcp://127.0.0.1:{engine_port}")
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(0)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def chaos(self, on):
        self.drop_p, self.reorder_p = (0.2, 0.2) if on else (0.0, 0.0)

    def _run(self):
        held = None
        while not self.stop.is_set():
            if not self.sub.poll(50):
                if held is not None:  # nothing came after it: send it late anyway
                    self.pub.send_multipart(held)
                    held = None
                continue
            msg = self.sub.recv_multipart()
            if len(msg) == 3 and len(msg[1]) == 8:
                self.last_seq = int.from_bytes(msg[1], "big")
            r = self.rng.random()
            if r < self.drop_p:
                self.counts["dropped"] += 1
                continue
            if held is None and r < self.drop_p + self.reorder_p:
                held = msg
                self.counts["reordered"] += 1
                continue
            self.pub.send_multipart(msg)
            self.counts["forwarded"] += 1
            if held is not None:
                self.pub.send_multipart(held)
                held = None

    def close(self):
        self.stop.set()
        self.thread.join(timeout=2)
        self.sub.close(0)
        self.pub.close(0)


class FeedGate:
    """A TCP proxy between Envoy's feed cluster and the sidecar that can stop forwarding
    (a stalled feed: connections stay open, no bytes move)."""

    def __init__(self, target_port):
        self.target = target_port
        self.open = threading.Event()
        self.open.set()
        self.stop = threading.Event()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self, seconds):
        self.open.clear()
        time.sleep(seconds)
        self.open.set()

    def _accept(self):
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=2)
            except OSError:
                client.close()  # the sidecar is down: Envoy's poll fails and retries
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        src.settimeout(0.2)
        try:
            while not self.stop.is_set():
                self.open.wait()
                try:
                    data = src.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    break
                self.open.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.stop.set()
        self.open.set()
        self.listener.close()


class Engine:
    """A mock engine on fixed ports (its HTTP, KV-event PUB and replay ROUTER), restartable,
    behind an EventTap; its dead windows (killed or stopped) are recorded."""

    def __init__(self, procs, blocks, speedup, buffer_steps, rng):
        self.procs, self.args = procs, ["--num-gpu-blocks", str(blocks), "--speedup", str(speedup)]
        self.buffer_steps = buffer_steps
        self.port, self.ev, self.rp = free_port(), free_port(), free_port()
        self.dead = []  # [start, end] (end None while dead)
        self._start()
        self.tap = EventTap(self.ev, rng)
        self.id = self.proc.id

    def _start(self):
        self.proc = self.procs.add(MockEngine(events=f"tcp://*:{self.ev}", replay=f"tcp://*:{self.rp}",
                                              port=self.port, args=self.args, buffer_steps=self.buffer_steps))

    @property
    def spec(self):
        return (self.id, f"tcp://127.0.0.1:{self.tap.port}", f"tcp://127.0.0.1:{self.rp}", "both")

    def kill(self, down_s):
        self.dead.append([now(), None])
        self.proc.proc.kill()
        self.proc.proc.wait()
        self.procs.stop(self.proc)
        time.sleep(down_s)
        self._start()
        self.dead[-1][1] = now()

    def freeze(self, seconds):
        self.dead.append([now(), None])
        os.kill(self.proc.proc.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(self.proc.proc.pid, signal.SIGCONT)
        self.dead[-1][1] = now()

    def was_dead(self, t0, t1):
        return any(s - DEAD_SLACK_S <= t1 and (e is None or e + DEAD_SLACK_S >= t0) for s, e in self.dead)

    def outgrew_replay_buffer(self):
        return self.tap.last_seq >= self.buffer_steps

    def blocks(self):
        with urllib.request.urlopen(f"http://{self.id}/v1/kv/blocks", timeout=10) as r:
            return set(json.loads(r.read())["blocks"])


class Churn:
    """A synthetic engine that stores chains of new blocks and evicts the oldest, keeping
    `resident` chains: distinct blocks through the sidecar at a bounded live set."""

    CHAIN = 64

    def __init__(self, procs, resident=200):
        self.http = procs.add(MockEngine())  # answers requests routed to it; publishes nothing
        self.id = self.http.id
        self.ev, self.rp = free_port(), free_port()
        self.pub = Publisher(f"tcp://127.0.0.1:{self.ev}", f"tcp://127.0.0.1:{self.rp}")
        self.resident = resident
        self.live = []  # chains of hashes, oldest first
        self.sent_blocks = 0
        self.enc = msgspec.msgpack.Encoder()

    @property
    def spec(self):
        return (self.id, f"tcp://127.0.0.1:{self.ev}", f"tcp://127.0.0.1:{self.rp}", "both")

    def pump(self, n_blocks, rate, on_progress):
        j = 0
        start = time.perf_counter()
        while self.sent_blocks < n_blocks:
            due = start + self.sent_blocks / rate
            time.sleep(max(0.0, due - time.perf_counter()))
            hashes = [(1 << 62) | (j << 8) | i for i in range(self.CHAIN)]
            toks = [(j * 7 + k) % 150_000 for k in range(self.CHAIN * BLOCK)]
            toks[0] = j % 1_000_000  # distinct chains, so distinct router hashes
            toks[1] = j // 1_000_000
            events = [stored("vllm", hashes, None, toks, BLOCK)]
            self.live.append(hashes)
            if len(self.live) > self.resident:
                events.append(removed("vllm", self.live.pop(0)))
            self.pub.send_payload(self.enc.encode(batch("vllm", events)))
            self.sent_blocks += self.CHAIN
            j += 1
            on_progress(self.sent_blocks)
        self.pub.flush()

    def live_blocks(self):
        return {h for c in self.live for h in c}

    def close(self):
        self.pub.close()


def b64(toks):
    return base64.b64encode(struct.pack(f"<{len(toks)}I", *toks)).decode()


class Load:
    """Closed-loop clients through Envoy: shared-prefix prompts (a few long prefixes and a
    unique tail), token ids in the header the filter reads and in the body."""

    def __init__(self, port, clients, rng):
        self.port, self.stop = port, threading.Event()
        self.lock = threading.Lock()
        self.records = []  # (id, start, end, status or error)
        self.next_id = 0
        self.prefixes = [[p * 1_000_000 + i for i in range(256)] for p in range(8)]
        self.threads = [threading.Thread(target=self._client, args=(random.Random(rng.random()),), daemon=True)
                        for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, rng):
        conn = None
        while not self.stop.is_set():
            with self.lock:
                rid = self.next_id
                self.next_id += 1
            prompt = rng.choice(self.prefixes) + [rng.randrange(100_000, 150_000) for _ in range(2 * BLOCK)]
            body = json.dumps({"model": "mock-llm", "prompt": prompt, "max_tokens": 2})
            t0 = now()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                conn.request("POST", "/v1/completions", body=body, headers={
                    "content-type": "application/json", "x-prompt-token-ids-b64": b64(prompt),
                    "x-soak-id": str(rid)})
                r = conn.getresponse()
                r.read()
                outcome = r.status
            except (OSError, http.client.HTTPException) as e:
                outcome = f"{type(e).__name__}: {e}"
                conn = None
            with self.lock:
                self.records.append((rid, t0, now(), outcome))
            time.sleep(rng.uniform(0, 0.02))

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=35)


class DownMonitor:
    """Polls the sidecar's worker list: when each worker was marked down and up again."""

    def __init__(self, sidecar_port):
        self.port, self.stop = sidecar_port, threading.Event()
        # wid -> state; wid -> [[marked down at, last seen down at, seen up again at or None]]
        self.state, self.windows = {}, {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/admin/workers", timeout=1) as r:
                    workers = json.loads(r.read())["workers"]
            except (OSError, ValueError, KeyError):
                workers = None  # the sidecar is down: nothing new is marked
            t = now()
            for w in workers or []:
                old = self.state.get(w["id"], "up")
                if w["state"] == "down":
                    if old != "down":
                        self.windows.setdefault(w["id"], []).append([t, t, None])
                    self.windows[w["id"]][-1][1] = t
                elif old == "down":
                    self.windows[w["id"]][-1][2] = t
                self.state[w["id"]] = w["state"]
            time.sleep(0.1)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=2)


def access_log(cfg, path):
    """Envoy's access log, one JSON line per request: what reached which upstream."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(path),
        "log_format": {"json_format": {
            "id": "%REQ(X-SOAK-ID)%", "status": "%RESPONSE_CODE%", "upstream": "%UPSTREAM_HOST%",
            "flags": "%RESPONSE_FLAGS%", "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
            "start_ms": "%START_TIME(%s%3f)%", "duration_ms": "%DURATION%",
            "decision": "%RESP(X-KVROUTE-DEBUG)%"}}}}]


def run(args):
    rng = random.Random(args.seed)
    procs = Processes()
    log_path = pathlib.Path(tempfile.mkdtemp(prefix="kvroute-soak-")) / "access.jsonl"
    engines, tails, churn = [], [], None
    sidecar = envoy = load = monitor = gate = None
    faults = {k: 0 for k in KINDS}
    restarts_past_buffer = 0
    fault_log = []
    memory = {"envoy": [], "sidecar": []}
    results = {"seed": args.seed, "build": args.build, "engines": args.engines}
    try:
        engines = [Engine(procs, args.engine_blocks, args.speedup, args.buffer_steps, rng)
                   for _ in range(args.engines)]
        if args.churn_blocks:
            churn = Churn(procs)
        specs = [e.spec for e in engines] + ([churn.spec] if churn else [])
        sidecar_port = free_port()
        sidecar_extra = {"silent_after_ms": 1000, "health_interval_ms": 200, "log_max_blocks": args.log_max_blocks,
                         "state_file": str(log_path.parent / "sidecar.state"), "checkpoint_interval_ms": 1000}
        sidecar = procs.add(Sidecar(specs, port=sidecar_port, extra=sidecar_extra))
        gate = FeedGate(sidecar_port)
        upstreams = [e.proc for e in engines] + ([churn.http] if churn else [])
        cfg, lp, ap = render_config(upstreams, gate.port, {"debug_header": "x-kvroute-debug"}, build=args.build)
        access_log(cfg, log_path)
        envoy = procs.add(Envoy(cfg, lp, ap))
        time.sleep(1.0)
        monitor = DownMonitor(sidecar_port)
        load = Load(lp, args.clients, rng)
        t_start = now()
        stop_sampling = threading.Event()

        def sample():
            while not stop_sampling.is_set():
                memory["envoy"].append((round(now() - t_start, 1), rss_mb(envoy.proc.pid)))
                memory["sidecar"].append((round(now() - t_start, 1), rss_mb(sidecar.proc.pid)))
                time.sleep(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        # Faults, one at a time, each kind in turn in a shuffled order.
        order = []
        while now() - t_start < args.seconds:
            time.sleep(rng.uniform(args.gap_min, args.gap_max))
            if not order:
                order = KINDS[:]
                rng.shuffle(order)
            kind = order.pop()
            if kind == "sidecar_kill" and order and not any(e.outgrew_replay_buffer() for e in engines):
                # Later in the round: restarts that only the checkpoint makes exact come
                # once the engines outgrew their replay buffer, as a long run's do.
                order.insert(0, kind)
                kind = order.pop()
            t0 = now()
            target = None
            seqs = {e.id: e.tap.last_seq for e in engines}  # how far each engine's batches were
            if kind == "engine_kill":
                e = rng.choice(engines)
                target = e.id
                e.kill(rng.uniform(0.3, 1.5))
            elif kind == "zmq_chaos":
                e = rng.choice(engines)
                target = e.id
                e.tap.chaos(True)
                time.sleep(rng.uniform(2, 4))
                e.tap.chaos(False)
            elif kind == "sidecar_kill":
                sidecar.proc.kill()
                sidecar.proc.wait()
                procs.stop(sidecar)
                time.sleep(rng.uniform(0.3, 1.5))
                sidecar = procs.add(Sidecar(specs, port=sidecar_port, extra=sidecar_extra))
                # Restarts that only the checkpoint makes exact (ZMQ's replay cannot).
                restarts_past_buffer += sum(e.outgrew_replay_buffer() for e in engines)
            elif kind == "feed_stall":
                gate.stall(rng.uniform(2, 5))
            elif kind == "unhealthy":
                e = rng.choice(engines)
                target = e.id
                e.freeze(rng.uniform(2.5, 4))
            faults[kind] += 1
            fault_log.append({"kind": kind, "target": target, "engine_seqs": seqs,
                              "at_s": round(t0 - t_start, 2), "for_s": round(now() - t0, 2)})
        t_faults_end = now()
        # Settle: the load goes on (so a gap left by the last chaos shows and is repaired),
        # then stops, and the fleet goes quiet.
        time.sleep(args.settle)
        load.close()
        time.sleep(1.0)
        deadline = now() + 30

        def compare():
            """Per engine: blocks it holds that the index lacks, and blocks the index has that
            it does not hold (an index that invents a block is wrong; one that lacks a block
            only misses a hit)."""
            out = {}
            for e in engines:
                status, view = sidecar.json(f"/v1/admin/engine-blocks/{e.id}")
                indexed = set().union(*map(set, view["engine_blocks"])) if status == 200 else set()
                held = e.blocks()
                out[e.id] = {"missing": len(held - indexed), "phantom": len(indexed - held)}
            return out

        def settled(m):
            return all(v == {"missing": 0, "phantom": 0} for v in m.values())

        while True:
            mismatches = compare()
            if settled(mismatches) or now() > deadline:
                break
            time.sleep(0.5)
        results["converged_after_s"] = round(now() - t_faults_end - args.settle - 1.0, 2)
        results["engine_blocks"] = {e.id: len(e.blocks()) for e in engines}
        results["mismatched_blocks"] = mismatches
        # What the last sidecar saw of gaps, replays, resets and restores (since its start).
        results["sidecar_counters"] = {
            k.removeprefix("kvroute_sidecar_"): v for k, v in sidecar.metrics().items()
            if any(w in k for w in ("gaps", "replays", "resets", "duplicate", "restore", "checkpoint"))}
        if not settled(mismatches):
            results["sidecar_log_tail"] = sidecar.logs()[-6000:]

        if churn:
            marks = []
            every = max(args.churn_blocks // 10, churn.CHAIN)

            def progress(n):
                if n // every > len(marks):
                    marks.append({"blocks": n, "envoy_mb": rss_mb(envoy.proc.pid),
                                  "sidecar_mb": rss_mb(sidecar.proc.pid)})

            t0 = now()
            churn.pump(args.churn_blocks, args.churn_rate, progress)
            live = churn.live_blocks()

            def churn_indexed():
                return set().union(*map(set, sidecar.json(
                    f"/v1/admin/engine-blocks/{churn.id}")[1]["engine_blocks"]))

            wait_for(lambda: churn_indexed() == live, timeout=60, what="churn worker indexed")
            results["churn"] = {"blocks": churn.sent_blocks, "seconds": round(now() - t0, 1),
                                "live_blocks": len(live), "mismatched_blocks": len(churn_indexed() ^ live),
                                "rss_marks": marks}
        stop_sampling.set()
        sampler.join(timeout=3)
        time.sleep(1.5)  # Envoy flushes its access log every second
    finally:
        for closer in (load, monitor):
            if closer:
                closer.close()
        for e in engines:
            e.tap.close()
        if churn:
            churn.close()
        if gate:
            gate.close()
        procs.stop_all()

    records = load.records
    entries = []
    for line in log_path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        for k in ("status", "attempts", "start_ms", "duration_ms"):
            e[k] = int(e[k]) if str(e.get(k, "")).isdigit() else None
        entries.append(e)
    by_id = {e["id"]: e for e in entries}
    dead_of = {e.id: e for e in engines}
    violations, fivexx = [], {"engine_killed_or_stopped": 0, "unattributed": 0}
    client_failures = 0
    for rid, t0, t1, outcome in records:
        entry = by_id.get(str(rid))
        failed = not isinstance(outcome, int) or outcome >= 500
        if not failed:
            continue
        client_failures += 1
        up = entry["upstream"] if entry else None
        culprit = dead_of.get(up) if up else None
        if culprit is None:
            # No upstream named (Envoy answered itself): any engine dead then counts.
            culprit = next((e for e in engines if e.was_dead(t0, t1)), None) if up in (None, "-") else None
        if culprit is not None and culprit.was_dead(t0, t1):
            fivexx["engine_killed_or_stopped"] += 1
            if entry and "UF" in entry["flags"] and (entry["attempts"] or 1) < 2:
                violations.append(f"request {rid}: connect failure to {up} not retried ({entry})")
        else:
            fivexx["unattributed"] += 1
            violations.append(f"request {rid}: {outcome} at {t0 - t_start:.2f}s via {up}, no engine dead: {entry}")
    # Routed to a worker the sidecar had marked down.
    for e in entries:
        up = e["upstream"]
        start = e["start_ms"] / 1000 if e["start_ms"] is not None else None
        for down, still_down, _ in monitor.windows.get(up, []):
            # Between the mark (plus its way to Envoy) and the last poll that saw it.
            if start is not None and down + DOWN_GRACE_S < start < still_down:
                violations.append(f"request {e['id']} reached {up} {start - down:.2f}s after it was marked down")
    for wid, m in results["mismatched_blocks"].items():
        if m["phantom"]:
            violations.append(f"{wid}: the index holds {m['phantom']} blocks the engine does not")
        if m["missing"]:
            violations.append(f"{wid}: the index lacks {m['missing']} of the engine's blocks")

    if churn:
        c = results["churn"]
        if c["mismatched_blocks"]:
            violations.append(f"churn worker: {c['mismatched_blocks']} blocks differ from its live set")
        m = c["rss_marks"]
        if len(m) >= 8:
            for proc in ("envoy_mb", "sidecar_mb"):
                ratio = max(x[proc] for x in m[-len(m) // 4:]) / max(x[proc] for x in m[len(m) // 4:len(m) // 2])
                c[f"{proc[:-3]}_last_over_second_quarter"] = round(ratio, 3)
                if ratio > 1.25:
                    violations.append(f"{proc[:-3]} memory grew {ratio:.2f}x over the churn")
    results.update({
        "seconds": round(t_faults_end - t_start, 1),
        "faults": faults,
        "faults_total": sum(faults.values()),
        "sidecar_restarts_past_replay_buffer": restarts_past_buffer,
        "zmq_messages": {k: sum(e.tap.counts[k] for e in engines) for k in ("forwarded", "dropped", "reordered")},
        "requests": len(records),
        "requests_ok": sum(1 for r in records if isinstance(r[3], int) and r[3] < 500),
        "failed_requests": client_failures,
        "failures_by_cause": fivexx,
        "retried_requests": sum(1 for e in entries if (e["attempts"] or 1) > 1),
        "down_marks": sum(len(w) for w in monitor.windows.values()),
        "down_windows_s": {wid: [[round(t - t_start, 2) if t else None for t in w] for w in ws]
                           for wid, ws in monitor.windows.items()},
        "peak_rss_mb": {k: max((v for _, v in s if v is not None), default=None) for k, s in memory.items()},
        "fault_log": fault_log,
        "violations": violations,
    })
    return results


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600, help="how long faults are injected")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--engine-blocks", type=int, default=600, help="each mock engine's KV capacity")
    ap.add_argument("--speedup", type=float, default=50)
    ap.add_argument("--buffer-steps", type=int, default=10_000,
                    help="batches each engine keeps for replay (vLLM's default: 10000)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--gap-min", type=float, default=1.0, help="seconds between faults, at least")
    ap.add_argument("--gap-max", type=float, default=4.0)
    ap.add_argument("--settle", type=float, default=4.0, help="load after the last fault")
    ap.add_argument("--churn-blocks", type=int, default=0, help="distinct blocks for the memory phase")
    ap.add_argument("--churn-rate", type=float, default=50_000, help="blocks per second in the memory phase")
    ap.add_argument("--log-max-blocks", type=int, default=4_000_000,
                    help="the sidecar's change-log cap (its default): its memory grows until the log is full")
    ap.add_argument("--build", default="wasm", choices=["wasm", "native"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--check", action="store_true", help="exit 1 on any violation")
    return ap


def main():
    args = parser().parse_args()
    results = run(args)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    if args.check and results["violations"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
