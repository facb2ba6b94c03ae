"""The simulated fleet's mock engine: vLLM's API and KV events as vLLM's own structs decode
them, and the specification's "Verify it's working" end to end through Envoy and the sidecar."""
import base64
import http.client
import json
import os
import struct
import time

import msgspec
import pytest
import zmq

import engine_wheels
from harness import TOKENIZER_DIR, Envoy, MockEngine, Sidecar, free_port, render_config, wait_for, wait_synced


def tokens(prefix, n):
    return [prefix * 100_000 + i for i in range(n)]


class Subscriber:
    """A SUB socket decoding with vLLM 0.33's own classes (msgspec, strict types)."""

    def __init__(self, endpoint):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(engine_wheels.vllm_kv_events().KVEventBatch)
        time.sleep(0.3)  # the subscription reaches the publisher

    def next(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "no event batch"
        topic, seq, payload = self.sock.recv_multipart()
        return int.from_bytes(seq, "big"), self.decoder.decode(payload)

    def close(self):
        self.sock.close(linger=0)


@pytest.fixture
def engine():
    made = []

    def make(**kw):
        port = free_port()
        replay = free_port()
        e = MockEngine(events=f"tcp://*:{port}", replay=f"tcp://*:{replay}", **kw)
        e.sub_endpoint, e.replay_connect = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


def test_kv_events_decode_with_vllms_own_structs(engine):
    kv = engine_wheels.vllm_kv_events()
    e = engine(args=["--num-gpu-blocks", "10", "--speedup", "50"])
    sub = Subscriber(e.sub_endpoint)
    try:
        a = tokens(1, 100)  # 6 full blocks and 4 tokens
        e.complete(a, max_tokens=2)
        seq, batch = sub.next()
        assert seq == 0 and batch.data_parallel_rank == 0 and batch.ts > 1e9
        [stored] = batch.events
        assert isinstance(stored, kv.BlockStored)
        assert (stored.parent_block_hash, stored.block_size, stored.medium) == (None, 16, "GPU")
        assert len(stored.block_hashes) == 6 and stored.token_ids == a[:96]
        assert all(isinstance(h, int) for h in stored.block_hashes)

        # A second prompt needs 7 of the 10 blocks: 3 of the first one's go, tail first.
        b = tokens(2, 100)
        e.complete(b, max_tokens=2)
        _, batch = sub.next()  # one scheduler step: the evictions, then the new blocks
        assert [type(ev) for ev in batch.events] == [kv.BlockRemoved, kv.BlockStored]
        assert batch.events[0].block_hashes == stored.block_hashes[:2:-1]

        # reset_prefix_cache with nothing running: AllBlocksCleared.
        conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=5)
        conn.request("POST", "/reset_prefix_cache")
        assert conn.getresponse().status == 200
        _, batch = sub.next()
        assert [type(ev) for ev in batch.events] == [kv.AllBlocksCleared]
        # The mock's own reset of its tokenizer's caches: POST only, and no KV event.
        for method, status in (("POST", 200), ("GET", 405)):
            conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=5)
            conn.request(method, "/reset_tokenizer_cache")
            r = conn.getresponse()
            r.read()
            assert r.status == status, (method, r.status)

        # The replay socket, spoken to as vLLM's protocol says: each reply the live layout
        # [topic, seq, payload] behind the envelope, then [b"", b"", END, b""].
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(e.replay_connect)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(5000)
            _, topic, s, payload = dealer.recv_multipart()
            if s == b"\xff" * 8:
                assert (topic, payload) == (b"", b"")
                break
            sub.decoder.decode(payload)
            seqs.append(int.from_bytes(s, "big"))
        dealer.close(linger=0)
        assert seqs == list(range(len(seqs))) and len(seqs) >= 3
    finally:
        sub.close()


def _post(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body if isinstance(body, bytes) else json.dumps(body),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_openai_api_and_metrics(engine):
    e = engine(args=["--speedup", "50"], tokenizer=TOKENIZER_DIR)
    _, r = e.complete("Hello there, how are you", max_tokens=3)
    assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 3
    assert r["usage"]["prompt_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
    # The answer is text of the tokenizer's words, one per generated token.
    assert len(r["choices"][0]["text"].split()) == 3
    _, body = e.complete(tokens(1, 40), max_tokens=2, stream=True)  # ids within Qwen3's vocabulary
    chunks = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and len(chunks) == 4  # 2 tokens, the final chunk, [DONE]
    assert json.loads(chunks[-2])["usage"]["completion_tokens"] == 2
    status, r = _post(e.port, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_token_ids": True})
    assert status == 200 and r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    # vLLM's return_token_ids: the prompt's ids (the chat template's) and the answer's.
    status, tok = _post(e.port, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and r["prompt_token_ids"] == tok["tokens"] and tok["count"] == 9
    assert len(r["choices"][0]["token_ids"]) == 2
    status, r = _post(e.port, "/v1/completions", b"not json")
    assert status == 400 and r["object"] == "error"
    status, r = _post(e.port, "/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and r["message"] == "The model `other` does not exist."
    m = e.metrics()
    assert m["vllm:prompt_tokens_total"] >= 6 + 40 + 9 and m["vllm:request_success_total"] == 3
    assert 0 < m["vllm:kv_cache_usage_perc"] <= 1


def test_without_a_tokenizer_an_engine_takes_token_ids_only(engine):
    """As vLLM with --skip-tokenizer-init: text and chats are refused, saying why."""
    e = engine(args=["--speedup", "50"])
    status, r = _post(e.port, "/v1/completions", {"model": "mock-llm", "prompt": "Hello"})
    assert status == 400 and "token ids" in r["message"]
    status, r = _post(e.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "token ids" in r["message"]
    status, r = _post(e.port, "/v1/completions", {"prompt": tokens(1, 20), "max_tokens": 2, "return_token_ids": True})
    assert status == 200 and r["choices"][0]["prompt_token_ids"] == tokens(1, 20)
    assert r["choices"][0]["text"] == "" and len(r["choices"][0]["token_ids"]) == 2


def test_the_seeds_verification_through_envoy(build):
    """Two requests with the same long prefix: the second lands on the same worker, reports
    cached tokens and a lower TTFT, and block_count stays flat."""
    engines, specs = [], []
    for _ in range(3):
        ev, rp = free_port(), free_port()
        e = MockEngine(events=f"tcp://*:{ev}", replay=f"tcp://*:{rp}")
        engines.append(e)
        specs.append((e.id, f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}", "both"))
    sidecar = Sidecar(specs)
    cfg, lp, ap = render_config(engines, sidecar.port, {"debug_header": "x-kvroute-debug"}, build=build)
    envoy = Envoy(cfg, lp, ap)
    try:
        prompt = tokens(7, 1000)  # 62 full blocks
        # The token header a tokenizer stage would write (this test runs Envoy without one).
        header = base64.b64encode(struct.pack(f"<{len(prompt)}I", *prompt)).decode()

        def ask():
            conn = http.client.HTTPConnection("127.0.0.1", lp, timeout=30)
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"model": "mock-llm", "prompt": prompt, "max_tokens": 4, "stream": True}),
                headers={"x-prompt-token-ids-b64": header, "content-type": "application/json"})
            r = conn.getresponse()
            first = r.readline()  # the first SSE line arrives when the prefill ends
            ttft = time.perf_counter() - t0
            rest = r.read()
            conn.close()
            last = [json.loads(x[6:]) for x in (first + rest).decode().split("\n\n")
                    if x.startswith("data: {")][-1]
            return ttft, last["kvroute_worker"], last["usage"]["prompt_tokens_details"]["cached_tokens"]

        ttft1, w1, cached1 = ask()
        assert cached1 == 0
        wait_for(lambda: sidecar.block_count(w1) == 62, what="the worker's blocks reach the sidecar")
        wait_synced(envoy, sidecar)
        time.sleep(0.3)  # the first request's in-flight entries are released
        ttft2, w2, cached2 = ask()
        assert w2 == w1 and cached2 == 992
        assert ttft2 < ttft1 / 2, (ttft1, ttft2)
        # The specification's check, through Envoy's port: the count stayed flat.
        status, _, body = envoy.request(f"/v1/admin/cache-view/{w1}", method="GET", body=None)
        assert status == 200 and json.loads(body) == {"worker_id": w1, "block_count": 62}
    finally:
        envoy.stop()
        sidecar.stop()
        for e in engines:
            e.stop()


DEMO_PROCESSES = ("kvroute-fleet worker", "kvroute-sidecar --config", "kvroute-tokenizer", "envoy -c")


def _marked_env():
    """The environment for a demo run, marked so that the processes it starts, and only
    those, can be found again (other tests run beside this one)."""
    import uuid
    return {**os.environ, "KVROUTE_TEST_RUN": uuid.uuid4().hex}


def _left_running(env):
    """The demo's processes (engines, sidecar, stage, Envoy) still running with `env`'s
    mark: {pid: command line}."""
    import pathlib
    mark = f"KVROUTE_TEST_RUN={env['KVROUTE_TEST_RUN']}".encode()
    out = {}
    for p in pathlib.Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not any(n in cmd for n in DEMO_PROCESSES):
                continue
            if mark in (p / "environ").read_bytes().split(b"\0"):
                out[int(p.name)] = cmd
        except OSError:
            continue
    return out


DEMO_SMALL = ["--workers", "3", "--groups", "3", "--prompts-per-group", "4", "--speedup", "8"]


def test_a_short_demo_run_completes_and_leaves_nothing_behind(tmp_path, build):
    import subprocess
    import sys
    from harness import ROOT
    env = _marked_env()
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), *DEMO_SMALL, "--build", build,
                        "--port", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "round robin" in r.stdout and "prefix cache hit rate" in r.stdout
    assert '"block_count"' in r.stdout  # the specification's curl, through Envoy
    for f in ("kvroute.json", "round_robin.json", "ttft.svg"):
        assert (tmp_path / f).exists()
    k = json.loads((tmp_path / "kvroute.json").read_text())
    assert k["failed"] == 0 and k["requests"] == 12
    time.sleep(0.5)
    assert _left_running(env) == {}


def test_ctrl_c_stops_everything_the_demo_started(tmp_path):
    import signal
    import subprocess
    import sys
    from harness import ROOT
    env = _marked_env()
    p = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "demo.py"), *DEMO_SMALL,
                          "--port", "0", "--out", str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        for line in p.stdout:
            if line.startswith("kvroute:"):  # the fleet is up and the first run started
                break
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.5)
    assert _left_running(env) == {}


def test_ctrl_c_also_ends_a_child_no_object_holds():
    """A signal during subprocess.Popen's wait for exec leaves a child outside the
    registry; the signal handler ends it too."""
    import os
    import signal
    import subprocess
    import sys
    from harness import ROOT
    script = ("import subprocess, sys, time\n"
              f"sys.path.insert(0, {str(ROOT)!r})\n"
              "from harness import Processes\n"
              "procs = Processes()\n"
              "print(subprocess.Popen(['sleep', '60']).pid, flush=True)\n"
              "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(p.stdout.readline())
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 128 + signal.SIGINT
    finally:
        if p.poll() is None:
            p.kill()
    assert not os.path.exists(f"/proc/{child}"), "the unregistered child outlived the script"


def test_docker_compose_file_is_consistent():
    """docker-compose.yml: what it mounts and builds exists, its workers are the ones
    envoy/envoy.yaml routes to, and `docker compose config` accepts it where Docker
    Compose is installed (not on the test machine: no Docker engine there)."""
    import shutil
    import subprocess
    import yaml
    from harness import ENVOY_YAML, ROOT
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert services["envoy"]["image"] == "envoyproxy/envoy:v1.40.0"  # the version tested here
    assert (ROOT / services["worker-1"]["build"]["dockerfile"]).exists()
    for v in services["envoy"]["volumes"]:
        src = v.split(":")[0]
        if src.startswith("./"):
            assert (ROOT / src).exists(), src
    envoy = yaml.safe_load(ENVOY_YAML.read_text())
    workers = next(c for c in envoy["static_resources"]["clusters"] if c["name"] == "workers")
    ids = {f'{e["endpoint"]["address"]["socket_address"]["address"]}:'
           f'{e["endpoint"]["address"]["socket_address"]["port_value"]}'
           for e in workers["load_assignment"]["endpoints"][0]["lb_endpoints"]}
    sidecar_ids = {a.split("=")[0] for a in services["sidecar"]["command"] if "=tcp://" in a}
    assert sidecar_ids == ids
    worker_ports = {f'127.0.0.1:{s["command"][s["command"].index("--port") + 1]}'
                    for n, s in services.items() if n.startswith("worker-")}
    assert worker_ports == ids
    for n, s in services.items():
        if n.startswith("worker-"):
            cfg = json.loads(s["command"][s["command"].index("--kv-events-config") + 1])
            ev_port = cfg["endpoint"].rsplit(":", 1)[1]
            assert any(f"=tcp://127.0.0.1:{ev_port}" in a for a in services["sidecar"]["command"]), n
    stage = next(c for c in envoy["static_resources"]["clusters"] if c["name"] == "kvroute_tokenizer")
    addr = stage["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    cmd = services["tokenizer"]["command"]
    assert cmd[cmd.index("--grpc-listen") + 1] == f'{addr["address"]}:{addr["port_value"]}'
    # Every flag a service passes to one of our binaries is one that binary takes.
    from harness import FLEET, SIDECAR, TOKENIZER
    binaries = {"kvroute-fleet": FLEET, "kvroute-sidecar": SIDECAR, "kvroute-tokenizer": TOKENIZER}
    for n, svc in services.items():
        cmd = svc.get("command") or []
        if not cmd or cmd[0] not in binaries:
            continue
        sub = [cmd[1]] if cmd[0] == "kvroute-fleet" else []
        helptext = subprocess.run([str(binaries[cmd[0]]), *sub, "--help"], capture_output=True, text=True).stdout
        for flag in (a for a in cmd if a.startswith("--")):
            assert f"{flag} " in helptext or f"{flag}\n" in helptext, f"{n}: {cmd[0]} {' '.join(sub)} has no {flag}"
    compose = (["docker-compose"] if shutil.which("docker-compose") else
               ["docker", "compose"] if shutil.which("docker") and subprocess.run(
                   ["docker", "compose", "version"], capture_output=True).returncode == 0 else None)
    if compose is None:
        pytest.skip("docker compose is not installed here; the file's structure was checked above")
    r = subprocess.run([*compose, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr


def test_sixteen_engines_share_two_cores_idle():
    """Engines wait on timers and sockets, never spin: sixteen idle ones (KV events on)
    cost next to nothing, and they still answer."""
    import os
    import pathlib

    def cpu(pid):
        f = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    engines = []
    try:
        for _ in range(16):
            engines.append(MockEngine(events=f"tcp://*:{free_port()}", args=["--speedup", "20"]))
        time.sleep(1)
        before = [cpu(e.proc.pid) for e in engines]
        time.sleep(3)
        used = sum(cpu(e.proc.pid) - b for e, b in zip(engines, before))
        assert used < 0.3, f"{used:.2f} s of CPU in 3 s for 16 idle engines"
        for e in engines:
            assert e.complete(tokens(9, 64), max_tokens=2)[1]["usage"]["completion_tokens"] == 2
    finally:
        for e in engines:
            e.stop()
