"""kvroute's own processes (the sidecar, the tokenizer stage) and the simulated fleet's mock engines."""
import http.client
import json
import os
import pathlib
import resource
import time
import urllib.request

from .paths import FLEET, SIDECAR, TOKENIZER, TOKENIZER_DIR
from .procs import Service, free_port, prometheus, ready_or_stop, wait_for, wait_http_ok


class Sidecar(Service):
    """The real kvroute-sidecar binary with a generated TOML config.
    workers: [(id, events_endpoint, replay_endpoint or None, role[, dp_ranks])]."""

    def __init__(self, workers, block_size=16, port=None, extra=None, args=(), wait=True, address_space=None):
        if not SIDECAR.exists():
            raise RuntimeError(f"{SIDECAR} missing: build it with `cargo build --release -p kvroute-sidecar`")
        self.port = port or free_port()
        self._workdir("sidecar")
        lines = [f"block_size = {block_size}", f'listen = "127.0.0.1:{self.port}"']
        settings = {"health_interval_ms": 200, "silent_after_ms": 1000, "replay_timeout_ms": 1000}
        settings.update(extra or {})
        for k, v in settings.items():
            lines.append(f"{k} = {json.dumps(v)}")
        for wid, events, replay, role, *dp in workers:
            lines += ["[[workers]]", f'id = "{wid}"', f'events = "{events}"', f'role = "{role}"']
            if replay:
                lines.append(f'replay = "{replay}"')
            if dp:
                lines.append(f"dp_ranks = {dp[0]}")
        self.config_path = os.path.join(self.dir, "sidecar.toml")
        pathlib.Path(self.config_path).write_text("\n".join(lines) + "\n")
        # address_space: bytes of virtual memory the process may map (RLIMIT_AS), as under a
        # container's memory limit; past it an allocation fails and the process aborts.
        limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))) \
            if address_space else None
        self._spawn([str(SIDECAR), "--config", self.config_path, *args],
                    env={**os.environ, "RUST_LOG": "info"}, preexec_fn=limit)
        if wait:
            ready_or_stop(self, self._wait_ready)

    def _wait_ready(self, timeout=15):
        wait_http_ok(self.proc, f"http://127.0.0.1:{self.port}/healthz", "sidecar", self.logs, timeout)

    def get(self, path, timeout=10):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def json(self, path):
        status, body = self.get(path)
        return status, json.loads(body)

    def block_count(self, wid):
        return self.json(f"/v1/admin/cache-view/{wid}")[1]["block_count"]

    def metrics(self):
        """{'name{labels}': value} from /metrics."""
        return prometheus(f"http://127.0.0.1:{self.port}/metrics")

    def metric(self, key):
        return self.metrics().get(key, 0.0)


class Tokenizer(Service):
    """The real kvroute-tokenizer binary (the stage), Qwen3's tokenizer by default.
    models: [(name, dir, loras)]; extra: more TOML settings; log_level: its RUST_LOG
    ("info,kvroute_tokenizer=debug": a line per request with where its time went)."""

    def __init__(self, models=None, max_model_len=40960, extra=None, wait=True, chat_template=None,
                 log_level="info"):
        if not TOKENIZER.exists():
            raise RuntimeError(f"{TOKENIZER} missing: build it with `cargo build --release -p kvroute-tokenizer`")
        if not (TOKENIZER_DIR / "tokenizer.json").exists():
            raise RuntimeError(f"{TOKENIZER_DIR} missing: run scripts/fetch-tokenizer.sh")
        self.grpc_port, self.http_port = free_port(), free_port()
        self._workdir("tokenizer")
        lines = [f'grpc_listen = "127.0.0.1:{self.grpc_port}"', f'http_listen = "127.0.0.1:{self.http_port}"']
        for k, v in (extra or {}).items():
            lines.append(f"{k} = {json.dumps(v)}")
        for name, path, loras in models or [("qwen3", TOKENIZER_DIR, [])]:
            lines += ["[[models]]", f'name = "{name}"', f'path = "{path}"', f"max_model_len = {max_model_len}",
                      f"loras = {json.dumps(loras)}"]
            if chat_template is not None:
                lines.append(f"chat_template = {json.dumps(chat_template)}")
        self.config_path = os.path.join(self.dir, "tokenizer.toml")
        pathlib.Path(self.config_path).write_text("\n".join(lines) + "\n")
        self._spawn([str(TOKENIZER), "--config", self.config_path], env={**os.environ, "RUST_LOG": log_level})
        if wait:
            ready_or_stop(self, lambda: wait_http_ok(self.proc, f"http://127.0.0.1:{self.http_port}/healthz",
                                                     "tokenizer", self.logs, 30))

    def tokenize(self, body):
        """POST /tokenize: (status, JSON answer)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            conn.request("POST", "/tokenize", body=json.dumps(body), headers={"content-type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    def metrics(self):
        return prometheus(f"http://127.0.0.1:{self.http_port}/metrics")

    def outcome(self, name):
        return self.metrics().get(f'kvroute_tokenizer_requests_total{{outcome="{name}"}}', 0.0)


class MockEngine(Service):
    """A kvroute-fleet mock engine (vLLM's API, prefix cache and KV events).
    events/replay: ZMQ endpoints to publish on (None: no events); tokenizer: a tokenizer
    directory (text prompts and chats tokenized as vLLM does), None: token ids only;
    buffer_steps: batches kept for replay (vLLM's kv-events-config key; default 10000)."""

    def __init__(self, events=None, replay=None, args=(), port=None, topic=None, tokenizer=None, buffer_steps=None):
        if not FLEET.exists():
            raise RuntimeError(f"{FLEET} missing: build it with `cargo build --release -p kvroute-fleet`")
        self.port = port or free_port()
        self.id = f"127.0.0.1:{self.port}"
        self.events, self.replay = events, replay
        cmd = [str(FLEET), "worker", "--port", str(self.port), *args]
        if tokenizer is not None:
            cmd += ["--tokenizer", str(tokenizer)]
        if events:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
            if replay:
                cfg["replay_endpoint"] = replay
            if topic is not None:
                cfg["topic"] = topic
            if buffer_steps is not None:
                cfg["buffer_steps"] = buffer_steps
            cmd += ["--kv-events-config", json.dumps(cfg)]
        self._workdir("engine")
        self._spawn(cmd)
        ready_or_stop(self, lambda: wait_http_ok(self.proc, f"http://{self.id}/health", "engine", self.logs, 15))

    def complete(self, prompt, max_tokens=4, stream=False):
        """POST /v1/completions directly; returns (seconds to first byte, response JSON)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"model": "mock-llm", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}),
                headers={"content-type": "application/json"})
            r = conn.getresponse()
            body = r.read()
            return time.perf_counter() - t0, json.loads(body) if not stream else body
        finally:
            conn.close()

    def metrics(self):
        return prometheus(f"http://{self.id}/metrics", labels=False)


def start_fleet(procs, n, blocks, speedup, tokenizer=None):
    """n mock engines publishing KV events (with replay), and a sidecar subscribed to
    them; returns (engines, sidecar). tokenizer: the engines' tokenizer directory."""
    engines, specs = [], []
    for _ in range(n):
        ev, rp = free_port(), free_port()
        e = procs.add(MockEngine(events=f"tcp://*:{ev}", replay=f"tcp://*:{rp}", tokenizer=tokenizer,
                                 args=["--num-gpu-blocks", str(blocks), "--speedup", str(speedup)]))
        engines.append(e)
        specs.append((e.id, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", "both"))
    sidecar = procs.add(Sidecar(specs))
    time.sleep(0.5)  # ZMQ subscriptions settle
    return engines, sidecar


def reset_fleet(engines, sidecar):
    """Empties every engine's prefix cache (AllBlocksCleared) and its tokenizer's caches,
    and waits for the sidecar. Without the second, a benchmark's later routers met engines
    that tokenized their prompts from cache, and only the first paid for it (~3 ms of wall
    time on a burst's last TTFT)."""
    for e in engines:
        for path in ("/reset_prefix_cache", "/reset_tokenizer_cache"):
            req = urllib.request.Request(f"http://{e.id}{path}", method="POST", data=b"")
            with urllib.request.urlopen(req, timeout=10):
                pass
    wait_for(lambda: all(sidecar.block_count(e.id) == 0 for e in engines), what="caches empty")
