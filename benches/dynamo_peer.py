#!/usr/bin/env python3
"""NVIDIA Dynamo 1.6.1's KV router in front of the simulated fleet, as a peer router for
benches/peers.py.

Dynamo's frontend routes only to workers registered in Dynamo's own discovery, so each
fleet engine gets a Dynamo worker in front of it (benches/dynamo_worker.py): it registers
the model, forwards the frontend's token ids to the engine's /v1/completions and relays
the engine's vLLM ZMQ KV events (the publisher kvroute's sidecar reads too) to Dynamo's
router. The frontend runs `--router-mode kv` with file discovery, the TCP request plane
and the ZMQ event plane, so no etcd or NATS is needed; every run has its own discovery
directory, so runs never see each other's workers.

    ./scripts/fetch-tokenizer.sh
    cargo build --release -p kvroute-fleet -p kvroute-sidecar
    python3 benches/dynamo_peer.py --smoke    # 2 engines, a few shared-prefix completions

Dynamo is installed into target/peers/dynamo/ on first use (see install()).
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import TOKENIZER_DIR, Processes, free_port, ready_or_stop, start_fleet, wait_for  # noqa: E402
from harness.procs import Service, prometheus  # noqa: E402

PEERS = ROOT / "target" / "peers"
MODEL = "mock-llm"
BLOCK_SIZE = 16
WORKER = ROOT / "benches" / "dynamo_worker.py"
PINS = ["ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1"]
# ai-dynamo requires aisimulate, whose PyPI release is a stub that fetches the real wheel
# from NVIDIA's own index at build time, which this machine cannot reach. So the two
# packages go in without dependencies, plus what the frontend, the mocker and
# dynamo_worker.py import (the simulator core is compiled into ai-dynamo-runtime).
DEPS = ["pydantic==2.13.5", "uvloop==0.23.0", "msgspec==0.23.0", "pyyaml==6.0.4", "packaging==26.4",
        "typing-extensions==4.16.0", "aiohttp==3.14.5"]
# Qwen3-0.6B's shape (the fleet tokenizes with Qwen3's tokenizer): Dynamo reads the
# context length from here, the mocker the KV bytes per token.
MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "vocab_size": 151936, "torch_dtype": "bfloat16",
}


def install():
    """Dynamo's virtualenv, created and the pinned packages installed on first use."""
    venv = PEERS / "dynamo"
    if not (venv / ".installed").exists():
        pip = [str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "--no-deps", *PINS], check=True)
        subprocess.run([*pip, *DEPS], check=True)
        (venv / ".installed").write_text("\n".join(PINS + DEPS) + "\n")
    return venv


def model_dir():
    """The model folder Dynamo registers: the fleet's tokenizer files and a config.json."""
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        raise RuntimeError(f"{TOKENIZER_DIR} missing: run scripts/fetch-tokenizer.sh")
    d = PEERS / "dynamo-model"
    d.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        link = d / name
        if not link.is_symlink():
            link.symlink_to(TOKENIZER_DIR / name)
    (d / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=1) + "\n")
    return d


def dynamo_env(directory):
    """The environment every Dynamo process of one deployment shares."""
    return {
        **os.environ,
        # Discovery in this deployment's own directory.
        "DYN_FILE_KV": os.path.join(directory, "discovery"),
        # Advertise loopback: by default Dynamo advertises the machine's first interface.
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
        # The model folder is local: never ask a hub.
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        # The frontend copies each registered model's files to $HOME/.cache/dynamo/mdc (a
        # path it derives from HOME alone): into this deployment's directory, not root's.
        "HOME": directory,
    }


def frontend_env(env, force_usage=True):
    """A frontend's environment: OpenAI clients answered as vLLM answers them.
    force_usage: usage (with the engine's cached tokens, which `kvroute-fleet load` reads)
    in every stream, in a last chunk of its own with no choices, not only when the client
    asks with stream_options; off for a client that reads no usage and trips on that
    chunk (SGLang's bench_serving 0.4.6)."""
    out = {
        **env,
        # `kvroute-fleet load` asks for vLLM's return_token_ids, which Dynamo refuses (400)
        # unless told to ignore the fields it does not support.
        "DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS": "1",
    }
    if force_usage:
        out["DYN_ENABLE_FORCE_INCLUDE_USAGE"] = "1"
    return out


def frontend_cmd(python, port, router_mode, *extra):
    """`python -m dynamo.frontend` on 127.0.0.1:port, file discovery, TCP and ZMQ planes."""
    return [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
            "--router-mode", router_mode, "--discovery-backend", "file", "--request-plane", "tcp",
            "--event-plane", "zmq", *extra]


def serves_model(port):
    """Whether the frontend on `port` lists the model."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
            return any(m["id"] == MODEL for m in json.load(r)["data"])
    except OSError:
        return False


def registered_workers(port):
    """The worker ids the KV router of the frontend on `port` has registered."""
    try:
        metrics = prometheus(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return set()
    return {int(m.group(1)) for k, v in metrics.items() if v == 1
            and (m := re.match(r'dynamo_component_router_worker_registered\{.*router_worker_id="(\d+)"', k))}


class _Process(Service):
    """One of a Dynamo deployment's processes."""

    def __init__(self, name, cmd, env):
        self.name = name
        self._workdir(name)
        self._spawn(cmd, env=env)


class Deployment(Service):
    """Dynamo processes that share one discovery directory (`self.dir`), measured and
    stopped together."""

    def _start(self, name):
        self.dir = self._workdir(name)
        self.procs = []
        return dynamo_env(self.dir)

    def _add(self, name, cmd, env):
        try:
            self.procs.append(_Process(name, cmd, env))
        except BaseException:
            self.stop()
            raise

    def _wait(self, ready, timeout, what):
        """Until ready() is true; an error with every log if a process exits or time runs out."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs:
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited {p.proc.returncode}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{what} not ready in {timeout} s:\n{self.logs()}")

    def logs(self):
        return "\n".join(f"--- {p.name} ---\n{p.logs()}" for p in self.procs)

    def cpu_seconds(self):
        return sum(p.cpu_seconds() for p in self.procs)

    def peak_rss_mb(self):
        return sum(p.peak_rss_mb() for p in self.procs)

    def stop(self, kill=False):
        for p in reversed(self.procs):
            p.stop(kill)
        shutil.rmtree(self.dir, ignore_errors=True)


class DynamoRouter(Deployment):
    """Dynamo's frontend (`--router-mode kv`) on 127.0.0.1:port, and a Dynamo worker in
    front of each engine. `workers` maps each Dynamo worker id (what the router and a
    response's nvext.worker_id name) to its engine's id (host:port)."""

    def __init__(self, engines, port, force_usage=True, timeout=120):
        python = str(install() / "bin" / "python")
        model = model_dir()
        self.port = port
        t0 = time.time()
        env = self._start("dynamo")
        self._add("dynamo-frontend", frontend_cmd(python, port, "kv", "--kv-cache-block-size", str(BLOCK_SIZE)),
                  frontend_env(env, force_usage))
        id_files = {}
        for i, e in enumerate(engines):
            id_file = os.path.join(self.dir, f"worker-{i}.id")
            id_files[id_file] = e.id
            self._add("dynamo-worker", [
                python, str(WORKER), "--engine", e.id, "--events", e.events.replace("*", "127.0.0.1"),
                "--model-dir", str(model), "--block-size", str(BLOCK_SIZE), "--id-file", id_file], env)

        def ready():
            # A worker writes its id, newline-terminated, once it has registered.
            written = {f: pathlib.Path(f).read_text() for f in id_files if os.path.exists(f)}
            if len(written) < len(id_files) or not all(t.endswith("\n") for t in written.values()):
                return False
            self.workers = {int(t): id_files[f] for f, t in written.items()}
            return serves_model(port) and self.workers.keys() <= registered_workers(port)

        ready_or_stop(self, lambda: self._wait(ready, timeout, "dynamo"))
        self.startup_s = time.time() - t0


    def cpu_seconds_by_process(self):
        """{'frontend': s, 'workers': s}: the router itself, and the per-engine relays."""
        return {"frontend": self.procs[0].cpu_seconds(), "workers": sum(p.cpu_seconds() for p in self.procs[1:])}


def _engine_counters(engine):
    m = engine.metrics()
    return m.get("vllm:prefix_cache_queries_total", 0.0), m.get("vllm:prefix_cache_hits_total", 0.0)


def _complete(port, prompt):
    """A streamed OpenAI completion through the frontend: (Dynamo worker id, the router's
    predicted KV hit rate, usage)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True,
            # Dynamo's extension: which worker served and the router's view, in the response.
            "nvext": {"extra_fields": ["worker_id", "timing"]}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    nvext, usage = {}, None
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                nvext.update(chunk.get("nvext") or {})
                usage = chunk.get("usage") or usage
    return nvext["worker_id"]["decode_worker_id"], nvext["timing"]["kv_hit_rate"], usage


def events_applied(port, event_type="stored"):
    """{status: count} of the KV events the KV router of the frontend on `port` has
    applied to its index ("ok", or why not; statuses never seen left out): proof it
    decoded the engines' events."""
    out = {}
    for k, v in prometheus(f"http://127.0.0.1:{port}/metrics").items():
        m = re.match(r'dynamo_component_kv_cache_events_applied\{(.*)\}', k)
        if m and v and f'event_type="{event_type}"' in m.group(1):
            status = re.search(r'status="([^"]*)"', m.group(1))
            out[status.group(1) if status else ""] = out.get(status.group(1) if status else "", 0) + v
    return out


def smoke():
    """2 engines behind Dynamo. Prefix a goes through Dynamo twice; prefix b is first sent
    to the other engine directly, so only that engine's KV events can tell Dynamo where it
    is. Each second request should go to the engine holding its prefix, and hit."""
    procs = Processes()
    ok = True
    try:
        engines, _ = start_fleet(procs, 2, 512, 4.0, tokenizer=TOKENIZER_DIR)
        router = procs.add(DynamoRouter(engines, free_port()))
        print(f"dynamo ready in {router.startup_s:.1f} s: workers " +
              ", ".join(f"{w} -> {e}" for w, e in router.workers.items()))
        a = " ".join(["you are a careful assistant who answers questions about the weather"] * 10)
        b = " ".join(["translate every sentence into plain english and explain the grammar"] * 10)

        def through_dynamo(label, prompt):
            before = [_engine_counters(e) for e in engines]
            worker, predicted, usage = _complete(router.port, prompt)
            after = [_engine_counters(e) for e in engines]
            # The engines' own counters say who served (one request at a time).
            grew = [e for e, x, y in zip(engines, before, after) if y[0] > x[0]]
            hits = sum(y[1] - x[1] for x, y in zip(before, after))
            named = router.workers.get(worker)
            print(f"{label}: served by {','.join(e.id for e in grew)} (nvext worker {worker} = {named}; "
                  f"router's predicted hit rate {predicted:.2f}), engine hits {hits:.0f} tokens, usage cached "
                  f"{usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']}")
            return grew, hits, [e.id for e in grew] == [named]

        first, _, agrees = through_dynamo("prefix a, 1st", f"{a}\nwill it rain today")
        again, hits, agrees2 = through_dynamo("prefix a, 2nd", f"{a}\nhow cold is it tonight")
        ok &= agrees and agrees2 and again == first and hits > 0
        other = next(e for e in engines if e not in first)
        stored = events_applied(router.port).get("ok", 0)
        other.complete(f"{b}\nthe cat sat on the mat")
        wait_for(lambda: events_applied(router.port).get("ok", 0) > stored, what="the direct request's KV events at Dynamo's router")
        print(f"prefix b, 1st: sent to {other.id} directly")
        held, hits, agrees = through_dynamo("prefix b, 2nd", f"{b}\nthe dog ran in the park")
        ok &= agrees and held == [other] and hits > 0
        for e in engines:
            q, h = _engine_counters(e)
            print(f"engine {e.id}: prefix cache hits {h:.0f} / queries {q:.0f}")
        cpu = router.cpu_seconds_by_process()
        print(f"router processes: cpu frontend {cpu['frontend']:.2f} s, workers {cpu['workers']:.2f} s; "
              f"peak rss {router.peak_rss_mb():.0f} MB in all")
    finally:
        procs.stop_all()
    print("ok: each repeated prefix went to the engine holding it" if ok else "FAILED")
    return 0 if ok else 1


def smoke_main(doc, smoke_test):
    """A script whose one command is `--smoke`: runs smoke_test(), exits with its status."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="run the end-to-end smoke test")
    if not ap.parse_args().smoke:
        ap.print_help()
        sys.exit(2)
    sys.exit(smoke_test())


if __name__ == "__main__":
    smoke_main(__doc__, smoke)
