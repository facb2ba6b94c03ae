#!/usr/bin/env python3
"""Dynamo's mocker (`python -m dynamo.mocker`, ai-dynamo 1.6.1) as a second engine
simulator, independent of kvroute-fleet's, for the same harness.

Each MockerEngine is one mocker worker and a Dynamo frontend of its own (its own
discovery directory, round robin over that one worker), so every engine is an OpenAI
endpoint 127.0.0.1:port of its own that Envoy with kvroute, and the peer routers, can
address as they address a kvroute-fleet engine. The mocker publishes vLLM-format KV
events (`[ts, events, dp_rank]` batches of BlockStored / BlockRemoved /
AllBlocksCleared maps) on a ZMQ PUB socket with a replay ROUTER beside it, which
kvroute's sidecar subscribes to.

Where it differs from a kvroute-fleet engine:
  - no /reset_prefix_cache, nor any other way to empty the mocker's cache: a run that
    needs empty caches starts new engines;
  - no prefix-cache counters in the mocker's own metrics: each response's usage carries
    the mocker's cached tokens, and the engine's frontend, which serves only that mocker,
    sums them (counters());
  - responses carry no `kvroute_worker`, and there is no `kvroute_mock_busy_seconds_total`;
  - its timing is Dynamo's own model of vLLM (`--speedup-ratio` scales it), not the
    fleet's calibration.

    python3 benches/dynamo_fleet.py --smoke    # 2 mockers, kvroute's sidecar on their events
"""
import json
import pathlib
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
from harness import Processes, Sidecar, free_port, ready_or_stop, wait_for  # noqa: E402
from harness.procs import prometheus  # noqa: E402
from dynamo_peer import (BLOCK_SIZE, MODEL, Deployment, frontend_cmd, frontend_env, install, model_dir,  # noqa: E402
                         registered_workers, serves_model, smoke_main)


def mocker_cmd(python, blocks, speedup, *extra):
    """`python -m dynamo.mocker` with the fleet's model, block size and cache size."""
    return [python, "-m", "dynamo.mocker", "--model-path", str(model_dir()), "--model-name", MODEL,
            "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(blocks),
            "--speedup-ratio", str(speedup), "--discovery-backend", "file", "--request-plane", "tcp",
            "--event-plane", "zmq", *extra]


class MockerEngine(Deployment):
    """One Dynamo mocker worker behind a frontend on 127.0.0.1:port. Like the harness's
    MockEngine: `id` (host:port), `port`, `events` and `replay` (ZMQ endpoints, `*` for
    the host), metrics()."""

    def __init__(self, blocks, speedup, port=None, timeout=60):
        python = str(install() / "bin" / "python")
        self.port = port or free_port()
        self.id = f"127.0.0.1:{self.port}"
        events, replay = free_port(), free_port()
        self.events, self.replay = f"tcp://*:{events}", f"tcp://*:{replay}"
        t0 = time.time()
        env = self._start("mocker")
        self._add("dynamo-mocker", mocker_cmd(python, blocks, speedup, "--zmq-kv-events-ports", str(events),
                                              "--zmq-replay-ports", str(replay)), env)
        self._add("dynamo-frontend", frontend_cmd(python, self.port, "round-robin"), frontend_env(env))
        ready_or_stop(self, lambda: self._wait(lambda: serves_model(self.port), timeout, "mocker"))
        self.startup_s = time.time() - t0

    def metrics(self):
        """The frontend's /metrics, {'name': value} (it serves only this mocker)."""
        return prometheus(f"http://{self.id}/metrics", labels=False)

    def counters(self):
        """(prompt tokens, prompt tokens found in the prefix cache) so far, as the mocker
        reported them in each response's usage."""
        m = self.metrics()
        return m.get("dynamo_frontend_input_sequence_tokens_sum", 0.0), m.get("dynamo_frontend_cached_tokens_sum", 0.0)


class DynamoOnMockers(Deployment):
    """Dynamo as its users deploy it on the mocker fleet: n mockers and one frontend with
    `--router-mode kv` on 127.0.0.1:port, in one discovery directory (the mockers publish
    their KV events on Dynamo's own event plane). `engines`: the mockers, as MockerEngine's
    stand-ins without HTTP endpoints of their own."""

    def __init__(self, n, blocks, speedup, port, timeout=120):
        python = str(install() / "bin" / "python")
        self.port = port
        env = self._start("dynamo-mockers")
        for _ in range(n):
            self._add("dynamo-mocker", mocker_cmd(python, blocks, speedup), env)
        self._add("dynamo-frontend", frontend_cmd(python, port, "kv", "--kv-cache-block-size", str(BLOCK_SIZE)),
                  frontend_env(env))
        ready_or_stop(self, lambda: self._wait(
            lambda: serves_model(port) and len(registered_workers(port)) >= n, timeout, "dynamo on mockers"))

    # The router is the frontend; the mockers are the engines, not measured.
    def cpu_seconds(self):
        return self.procs[-1].cpu_seconds()

    def cpu_seconds_by_process(self):
        return {"frontend": self.cpu_seconds()}

    def peak_rss_mb(self):
        return self.procs[-1].peak_rss_mb()

    def counters(self):
        """(prompt tokens, cached prompt tokens) the mockers reported, summed by the frontend."""
        m = prometheus(f"http://127.0.0.1:{self.port}/metrics", labels=False)
        return m.get("dynamo_frontend_input_sequence_tokens_sum", 0.0), m.get("dynamo_frontend_cached_tokens_sum", 0.0)


def prefill_ms_per_token(blocks, probe_tokens=(512, 4096)):
    """The mocker's prefill cost per uncached token at speed-up 1, from one mocker's TTFT
    for prompts of two lengths sent cold then again warm (the difference is the prefill
    of the uncached tokens; the fixed costs cancel)."""
    procs = Processes()
    try:
        e = procs.add(MockerEngine(blocks, 1.0))
        cost = []
        for n in probe_tokens:
            # The median of three pairs, each on tokens not sent before (ids in Qwen3's vocabulary).
            pairs = []
            for k in range(3):
                fresh = [1000 + (n * 7919 + 37_000 * k + i) % 150_000 for i in range(n)]
                pairs.append(_ttft_ms(e, fresh) - _ttft_ms(e, fresh[:-1] + [7]))
            cost.append(sorted(pairs)[1])
        return (cost[1] - cost[0]) / (probe_tokens[1] - probe_tokens[0])
    finally:
        procs.stop_all()


def _ttft_ms(engine, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    req = urllib.request.Request(f"http://{engine.id}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: {"):
                return (time.time() - t0) * 1000
    raise RuntimeError("no first token")


def start_mocker_fleet(procs, n, blocks, speedup):
    """n mockers and kvroute's sidecar subscribed to their events (with replay), as
    harness.start_fleet starts kvroute-fleet's engines; returns (engines, sidecar)."""
    engines, specs = [], []
    for _ in range(n):
        e = procs.add(MockerEngine(blocks, speedup))
        engines.append(e)
        specs.append((e.id, e.events.replace("*", "127.0.0.1"), e.replay.replace("*", "127.0.0.1"), "both"))
    sidecar = procs.add(Sidecar(specs, block_size=BLOCK_SIZE))
    time.sleep(0.5)  # ZMQ subscriptions settle
    return engines, sidecar


def _complete(engine, prompt):
    """A streamed OpenAI completion straight to one engine: its usage."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
    req = urllib.request.Request(f"http://{engine.id}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


def smoke():
    """2 mockers and kvroute's sidecar: a shared prefix twice to the first mocker, as text
    and as token ids; the mocker's counters show the hits, and the sidecar holds blocks of
    the first mocker only."""
    procs = Processes()
    ok = True
    try:
        t0 = time.time()
        engines, sidecar = start_mocker_fleet(procs, 2, 512, 1.0)
        print(f"2 mockers and the sidecar ready in {time.time() - t0:.1f} s "
              f"(each mocker {', '.join(f'{e.startup_s:.1f}' for e in engines)} s)")
        first, other = engines
        system = " ".join(["you are a careful assistant who answers questions about the weather"] * 10)
        ids = list(range(1000, 1100))
        hits = []
        for label, prompt in [("text", f"{system}\nwill it rain today"), ("text", f"{system}\nhow cold is it"),
                              ("token ids", ids + [7, 8, 9]), ("token ids", ids + [10, 11])]:
            usage = _complete(first, prompt)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            print(f"{label} to {first.id}: cached {cached} of {usage['prompt_tokens']}")
            hits.append(cached)
        # The second of each pair shares a 96-token prefix with the first.
        ok &= hits[1] == hits[3] == 96
        wait_for(lambda: sidecar.block_count(first.id) > 0, what="the sidecar to hold the first mocker's blocks")
        held = [sidecar.block_count(e.id) for e in engines]
        print(f"kvroute's sidecar holds {held[0]} blocks of {first.id}, {held[1]} of {other.id}")
        ok &= held[1] == 0
        for e in engines:
            q, h = e.counters()
            print(f"mocker {e.id}: prefix cache hits {h:.0f} / prompt tokens {q:.0f}")
    finally:
        procs.stop_all()
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    smoke_main(__doc__, smoke)
