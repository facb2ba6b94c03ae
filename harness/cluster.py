"""The real distributed systems kvroute runs on (Debian's etcd-server and nats-server), started
on loopback for a test or a benchmark; `kvroute-sidecar register`, the engine side of etcd
discovery, and `kvroute-sidecar relay`, the engine side of the NATS event transport."""
import os
import shutil
import subprocess
import time

from .paths import SIDECAR
from .procs import Service, free_port, ready_or_stop, wait_http_ok


def require(binary, package):
    path = shutil.which(binary)
    if not path:
        raise RuntimeError(f"{binary} not found: install it with `apt-get install -y {package}`")
    return path


class Etcd(Service):
    """A one-member etcd cluster on loopback, its data in the service's directory."""

    def __init__(self, port=None):
        self.binary = require("etcd", "etcd-server")
        self.port = port or free_port()
        self.peer_port = free_port()
        self._workdir("etcd")
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self):
        peer = f"http://127.0.0.1:{self.peer_port}"
        self._spawn([self.binary, "--name", "kvroute-test", "--data-dir", os.path.join(self.dir, "data"),
                     "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", f"kvroute-test={peer}", "--log-level", "warn"])
        ready_or_stop(self, lambda: wait_http_ok(self.proc, f"{self.url}/health", "etcd", self.logs, 20))

    def crash(self):
        """SIGKILL, keeping the data directory: start() brings the same member back."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def ctl(self, *args):
        """etcdctl against this member (v3 API); its stdout."""
        ctl = require("etcdctl", "etcd-client")
        out = subprocess.run([ctl, f"--endpoints={self.url}", *args], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "ETCDCTL_API": "3"})
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {out.stderr}")
        return out.stdout


class Registrar(Service):
    """`kvroute-sidecar register`: one engine's registration, kept alive under a lease."""

    def __init__(self, etcd_url, http, events, replay=None, ttl=2, extra=()):
        self._workdir("register")
        cmd = [str(SIDECAR), "register", "--etcd-endpoint", etcd_url, "--http", http, "--events", events,
               "--ttl", str(ttl), *extra]
        if replay:
            cmd += ["--replay", replay]
        self._spawn(cmd, env={**os.environ, "RUST_LOG": "info"})


class Nats(Service):
    """A nats-server with JetStream on loopback, its store in the service's directory."""

    def __init__(self, port=None):
        self.binary = require("nats-server", "nats-server")
        self.port = port or free_port()
        self.monitor_port = free_port()
        self._workdir("nats")
        self.url = f"nats://127.0.0.1:{self.port}"
        self.start()

    def start(self):
        self._spawn([self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port),
                     "-js", "-sd", os.path.join(self.dir, "store")])
        ready_or_stop(self, lambda: wait_http_ok(
            self.proc, f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true", "nats", self.logs, 20))

    def crash(self):
        """SIGKILL, keeping the store: start() brings the same server and streams back."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def stream_info(self, name="KVROUTE_EVENTS", part="state"):
        """The stream's state from the monitoring endpoint: {'messages', 'bytes', ...}
        (part="config": its configuration, {'storage', 'subjects', ...})."""
        import json
        import urllib.request
        url = f"http://127.0.0.1:{self.monitor_port}/jsz?streams=true&config=true"
        with urllib.request.urlopen(url, timeout=5) as r:
            jsz = json.load(r)
        for account in jsz.get("account_details", []):
            for stream in account.get("stream_detail", []):
                if stream["name"] == name:
                    return stream[part]
        return None


class Relay(Service):
    """`kvroute-sidecar relay`: one engine's ZMQ events into the NATS stream."""

    def __init__(self, nats_url, worker, events, replay=None, extra=()):
        self._workdir("relay")
        spec = f"{worker}={events}" + (f",replay={replay}" if replay else "")
        self._spawn([str(SIDECAR), "relay", "--nats-url", nats_url, "--worker", spec, *extra],
                    env={**os.environ, "RUST_LOG": "info"})
        deadline = time.time() + 15
        while "relaying" not in self.logs():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"relay did not start:\n{self.logs()}")
            time.sleep(0.02)
