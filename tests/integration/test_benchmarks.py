"""The benchmark scripts still run: a tiny routing-quality run end to end (every policy
through a real Envoy and the simulated fleet). The measurements themselves are in
docs/benchmarks.md; this only keeps the command there working."""
import json
import socket
import subprocess
import sys
import threading

from harness import ROOT, free_port
from harness.paths import WASM


def test_routing_quality_runs_every_policy(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "routing_quality.py"), "--workloads", "burst_70",
         "--workers", "3", "--groups", "3", "--per-group", "4", "--speedup", "8", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [x["policy"] for x in runs] == [
        "round_robin", "least_request", "random", "prefix_hash",
        "kvroute_w0", "kvroute_w1", "kvroute_w4", "kvroute_w1_literal", "kvroute_w4_literal",
        "kvroute_w1_nopredict", "kvroute_w1_nolimit", "kvroute_w1_notie", "kvroute_w1_native"]
    for x in runs:
        assert x["requests"] == 12 and x["failed"] == 0, x
        # Token-id bodies, through the stage: every request tokenized, and kvroute scored
        # every one by its blocks (none routed by load for want of tokens).
        assert x["via"] == "stage" and x["tokenized"] == 12, x
        assert x["scored"] == (12 if x["policy"].startswith("kvroute") else 0), x
        # The oracle (one infinite cache that saw every request) bounds every policy.
        assert 0 <= x["hit_rate"] <= x["oracle_hit_rate"] + 1e-9, x
        for metric in ("ttft_ms", "e2e_ms"):
            assert 0 < x[metric]["p50"] <= x[metric]["p99"], x
        assert x["throughput_rps"] > 0 and x["busy_imbalance"] >= 1.0, x
    assert "| kvroute_w4 |" in r.stdout  # the Markdown table
    for f in ("ttft-burst_70.svg", "hit-rate-vs-load.svg"):
        assert (tmp_path / f).read_text().startswith("<svg")


def test_routing_quality_runs_the_header_path_too(tmp_path):
    """--via header: no stage, the client writes the token header (the comparison in
    docs/benchmarks.md); a chat workload, so answers come back into the next prompt."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "routing_quality.py"), "--workloads", "chat_70", "--via", "header",
         "--policies", "round_robin,kvroute_w1", "--workers", "2", "--groups", "1", "--speedup", "8",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(x["policy"], x["via"], x["tokenized"], x["failed"]) for x in runs] == [
        ("round_robin", "header", None, 0), ("kvroute_w1", "header", None, 0)]
    assert runs[1]["scored"] == runs[1]["requests"] == 8
    # Later turns reuse earlier ones: the engines' answers came back as token ids.
    assert runs[1]["hit_rate"] > 0.5, runs[1]


def test_envoy_overhead_measures_both_builds_and_another_beside_them(tmp_path):
    """benches/envoy_overhead.py: every variant in the wasm and the native build, and with
    --build a second artifact, in the same rounds (here the same .wasm again: the same
    routing, counted the same; the native build routes alike). A 32k prompt, whose header
    only the benchmark's Python client sends (no wrk needed)."""
    out = tmp_path / "overhead.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "envoy_overhead.py"), "--rounds", "1", "--duration", "1",
         "--cases", "32768:base64", "--variants", "plain,warm", "--build", f"again={WASM}", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert set(row) == {"tokens", "encoding", "plain", "warm", "warm@native", "warm@again"}
    for v in ("warm", "warm@native", "warm@again"):
        assert row[v]["filter_requests"] == row[v]["scored"] > 0, row[v]
        assert row[v]["hit_rate"] > 0.5, row[v]
        assert row[v]["envoy_cpu_us_per_request"] > 0, row[v]
    reads = {row[v]["shared_reads_per_request"] for v in ("warm", "warm@native", "warm@again")}
    assert len(reads) == 1, reads
    for bad_args, why in ((["--build", "nolabel"], "LABEL=PATH"), (["--builds", "jvm"], "--builds")):
        bad = subprocess.run([sys.executable, str(ROOT / "benches" / "envoy_overhead.py"), *bad_args],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and why in bad.stderr, bad.stderr


def test_stream_chunks_streams_every_answer_through_each_build(tmp_path):
    """benches/stream_chunks.py: plain Envoy and both builds at two chunk counts, every
    streamed answer read to its last chunk, the filter on every request of the builds."""
    out = tmp_path / "chunks.json"
    bench = str(ROOT / "benches" / "stream_chunks.py")
    r = subprocess.run([sys.executable, bench, "--rounds", "1", "--duration", "1", "--chunks", "2,8",
                        "--answer-ms", "8", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert set(d["runs"]) == {f"{v}/{c}" for v in ("plain", "wasm", "native") for c in (2, 8)}
    for key, [run] in d["runs"].items():
        assert run["requests"] > 0 and run["failed"] == 0, (key, run)
        assert run["envoy_cpu_us_per_request"] > 0, (key, run)
        if not key.startswith("plain"):
            assert run["filter_requests"] > 0, (key, run)
    assert set(d["per_chunk_us"]) == {"plain", "wasm", "native"}
    assert "| wasm |" in r.stdout
    bad = subprocess.run([sys.executable, bench, "--chunks", "8,2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--chunks" in bad.stderr, bad.stderr


def test_stream_chunks_upstream_answers_a_request_without_a_count():
    """The bench's upstream answers a request whose x-chunks is missing or not a count with a
    400 that says why, on a connection that stays usable; a count in any case streams."""
    sys.path.insert(0, str(ROOT / "benches"))
    import stream_chunks
    port, ready = free_port(), threading.Event()
    threading.Thread(target=stream_chunks.serve, args=([port], 0.01, ready), daemon=True).start()
    assert ready.wait(10)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for header, status in ((b"", b"400"), (b"x-chunks: many\r\n", b"400"), (b"X-Chunks: 2\r\n", b"200")):
            sock.sendall(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n" + header + b"\r\n{}")
            answer = b""
            end = stream_chunks.END if status == b"200" else b"1000000\n"
            while not answer.endswith(end):
                got = sock.recv(65536)
                assert got, f"the upstream closed the connection after {answer!r}"
                answer += got
            assert answer.startswith(b"HTTP/1.1 " + status), answer


def test_the_prefix_hash_ring_is_the_same_every_run():
    """The prefix-hash baseline places workers on Envoy's ring by index, not by their
    (random) ports: the same header value reaches the same worker index in every run."""
    from harness import PREFIX_HASH_HEADER, Envoy, free_port, render_config
    from upstream import Worker

    def layout():
        workers = [Worker() for _ in range(4)]
        cfg, lp, ap = render_config(workers, free_port(), policy="ring_hash")
        envoy = Envoy(cfg, lp, ap, concurrency=1)
        try:
            for key in range(40):
                status, _, _ = envoy.request(headers={PREFIX_HASH_HEADER: f"{key:016x}"})
                assert status == 200
            return [next(i for i, w in enumerate(workers) if any(
                r.get(PREFIX_HASH_HEADER) == f"{key:016x}" for r in w.requests)) for key in range(40)]
        finally:
            envoy.stop()
            for w in workers:
                w.stop()

    first = layout()
    assert len(set(first)) > 1, "40 keys should spread over more than one worker"
    assert layout() == first


def run_peers(tmp_path, *args, per_group=4):
    """Two groups of `per_group` requests on two workers. Process CPU is charged in clock
    ticks, by sampling: a line must run long enough that its router is sure to be charged."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "benches" / "peers.py"), "--workloads", "shared_prefix_70", "--workers", "2",
         "--groups", "2", "--per-group", str(per_group), "--out", str(tmp_path), *args],
        capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    runs = {x["policy"]: x for x in out["runs"]}
    for x in runs.values():
        assert x["requests"] == 2 * per_group and x["failed"] == 0, x
        assert x["router_cpu_ms_per_request"] > 0 and x["router_peak_rss_mb"] > 0, x
    assert (tmp_path / "ttft-shared_prefix_70.svg").exists()
    return out, runs


def test_peers_run_against_the_same_fleet(tmp_path):
    """benches/peers.py: kvroute and NVIDIA Dynamo's KV router (installed into its own
    virtualenv under target/peers/) in front of one fleet. Dynamo decodes the engines'
    KV events with vLLM's wire format (its relay refuses anything else): it must have
    applied them, every one."""
    out, runs = run_peers(tmp_path, "--lines", "kvroute_w1,dynamo_kv", "--speedup", "8")
    assert set(runs) == {"kvroute_w1", "dynamo_kv"} and out["versions"]["dynamo"].startswith("ai-dynamo==1.6.1")
    assert runs["kvroute_w1"]["scored"] == 8
    events = runs["dynamo_kv"]["peer_events_stored"]
    assert events.get("ok", 0) > 0 and set(events) == {"ok"}, events
    # Each group's later requests can hit, on whichever engine Dynamo sent the first.
    assert runs["dynamo_kv"]["hit_rate"] > 0, runs["dynamo_kv"]
    # One line again, merged: its run replaced, the other line's kept as it was. Warmed up
    # first: the warm-up's requests are not the run's.
    again, merged = run_peers(tmp_path, "--lines", "kvroute_w1", "--speedup", "8", "--merge", "--warmup", "1")
    assert merged["kvroute_w1"]["scored"] == 8 and again["config"]["merged"][0]["warmup"] == 1
    assert [x["policy"] for x in again["runs"]] == ["kvroute_w1", "dynamo_kv"]
    assert merged["dynamo_kv"] == runs["dynamo_kv"] and again["config"]["merged"][0]["lines"] == "kvroute_w1"


def test_peers_reference_lines_take_kvroute_apart(tmp_path):
    """The reference lines: Envoy alone, kvroute without its filter or without its sync
    service, and kvroute as the native module, each metered for the processes it runs; a
    busy loop beside them."""
    lines = "envoy_round_robin,envoy_round_robin_stage,kvroute_sync_only,kvroute_filter_only,kvroute_w1_native"
    # Envoy alone is ~2 ms of CPU a request: 8 requests were once charged no tick at all.
    out, runs = run_peers(tmp_path, "--lines", lines, "--speedup", "8", "--background-cpu", "0.05", "--access-log",
                          per_group=16)
    assert out["config"]["background_cpu"] == 0.05 and set(runs) == set(lines.split(","))
    # Each Envoy line's access log: a line a request, its time to the engine within its time
    # to the response's first bytes.
    for line in lines.split(","):
        log = [json.loads(x) for x in (tmp_path / f"shared_prefix_70.{line}.access.jsonl").read_text().splitlines()]
        assert len(log) == runs[line]["requests"], (line, log[:2])
        assert all(0 < int(x["to_upstream_us"]) <= int(x["to_response_us"]) for x in log), (line, log[:2])
        # Through the stage, ext_proc's timing of its two calls, which fall within it.
        if line != "envoy_round_robin":
            assert all(0 < int(x["stage_headers_us"]) and 0 < int(x["stage_body_us"])
                       and int(x["stage_headers_us"]) + int(x["stage_body_us"]) <= int(x["to_upstream_us"])
                       for x in log), (line, log[:2])
        else:
            assert not any("stage_body_us" in x for x in log), log[:2]
    # benches/access_paths.py reads them: every request falls in some group of arrivals.
    paths = subprocess.run([sys.executable, str(ROOT / "benches" / "access_paths.py"), "--json",
                            str(tmp_path / "shared_prefix_70.envoy_round_robin_stage.access.jsonl")],
                           capture_output=True, text=True, check=True)
    [report] = json.loads(paths.stdout)
    assert report["requests"] == runs["envoy_round_robin_stage"]["requests"], report
    assert set(report["first"]) == {"to upstream", "body read", "stage headers", "stage body", "Envoy, rest"}, report
    # ... and the stage's own line for each group's first tokenization, which took no
    # longer than ext_proc's call around it.
    tokens, *_ = report["first in the stage"]["tokens"]
    in_stage, *_ = report["first in the stage"]["in the stage"]
    assert tokens > 0 and 0 < in_stage <= report["every"]["stage body"][2], report
    procs = {k: set(v["router_cpu_ms_per_request_by_process"]) for k, v in runs.items()}
    assert procs == {"envoy_round_robin": {"envoy"}, "envoy_round_robin_stage": {"envoy", "tokenizer"},
                     "kvroute_sync_only": {"envoy", "tokenizer", "sidecar"},
                     "kvroute_filter_only": {"envoy", "tokenizer"},
                     "kvroute_w1_native": {"envoy", "tokenizer", "sidecar"}}, procs
    # Without the sync service the filter has no worker table: it sees every request and
    # scores none (Envoy's fallback policy routes).
    assert runs["kvroute_filter_only"]["scored"] == 0
    # The native module scores every request it sees.
    assert runs["kvroute_w1_native"]["scored"] == runs["kvroute_w1_native"]["requests"] > 0
    # An unknown line still ends the run.
    r = subprocess.run([sys.executable, str(ROOT / "benches" / "peers.py"), "--lines", "kvroute_w1,nope",
                        "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown lines: nope" in r.stderr, r.stderr[-500:]


def test_peers_run_on_dynamos_mocker(tmp_path):
    """The second engine simulator: Dynamo's mocker, kvroute's sidecar subscribed to its
    vLLM-format events, and Dynamo deployed on the mockers as its users run it."""
    out, runs = run_peers(tmp_path, "--sim", "mocker", "--lines", "kvroute_w1,dynamo_kv", "--speedup", "1",
                          "--keep-samples")
    assert out["config"]["sim"] == "mocker" and set(runs) == {"kvroute_w1", "dynamo_kv"}
    # Every request scored by its blocks: the sidecar read the mocker's events.
    assert runs["kvroute_w1"]["scored"] == 8 and runs["kvroute_w1"]["hit_rate"] > 0, runs["kvroute_w1"]
    assert runs["dynamo_kv"]["peer_events_stored"].get("ok", 0) > 0, runs["dynamo_kv"]
    # The engines' own gauges and started-request counters, read while kvroute's line ran
    # (Dynamo's line reaches the mockers past their frontends): all eight requests counted.
    sampled = runs["kvroute_w1"]["engine_inflight"]
    assert sampled["load_started_s"] is not None and sampled["failed_reads"] == 0, sampled
    assert sum(sampled["samples"][-1][2]) >= 8, sampled["samples"][-3:]


def run_session_steps(*args, timeout=60):
    """benches/session_steps.py run on `args`, its output captured."""
    return subprocess.run([sys.executable, str(ROOT / "benches" / "session_steps.py"), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_session_steps_reads_the_committed_agentic_runs(tmp_path):
    """benches/session_steps.py on the samples docs/peers-mocker-agentic keeps: the per-step
    table and engine counts its README quotes (from the samples, or for a line whose samples
    name no engine from the engines' own gauges peers.py read), and a clear error for
    samples without their run's results.json entry."""
    runs = ROOT / "docs" / "peers-mocker-agentic"
    samples = sorted(str(p) for d in ("a", "b") for p in (runs / d).glob("samples/*.json"))
    r = run_session_steps(*samples, "--every-s", "20")
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in r.stdout.splitlines() if line.startswith("| ")}
    assert rows["kvroute_dbg"].startswith("| kvroute_dbg | 0.75, 67 | 0.85, 89 |") and rows["kvroute_dbg"].endswith("| 0.71 |")
    assert rows["vllm_router_cache_aware"].endswith("| 0.78 |")
    assert "t=   40 s    7   0   6   0   6   0   6   7" in r.stdout
    assert "counted a hit rate of 0.87, the engines found 0.71; 111 of 256" in r.stdout
    assert "dynamo_kv: the samples do not name engines" in r.stdout

    placement = sorted(str(p) for p in (runs / "placement").glob("samples/*.json"))
    r = run_session_steps(*placement, "--every-s", "10")
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in r.stdout.splitlines() if line.startswith("| ")}
    assert rows["vllm_router_cache_aware"].startswith("| vllm_router_cache_aware | 0.67, 59 | 0.89, 87 |")
    assert "vllm_router_cache_aware: requests in flight per engine, from the engines' gauges" in r.stdout
    assert "t=   30 s    4   4   4   4   4   4   4   4" in r.stdout
    assert "t=   10 s    0   0   0  12   0   0   0   0" in r.stdout  # kvroute's, from its debug header
    # Per step: the conversations that changed engine, and the router's count against the
    # engines' (the debug header's hits), as the README quotes them.
    per_step = {line.split(":")[0].strip(): line.split(":")[1].split()
                for line in r.stdout.splitlines() if "per step:" in line}
    assert per_step["conversations that changed engine, per step"] == "- 14 12 6 7 3 3 4".split()
    assert per_step["hit rate the router counted, per step"][5:] == ["0.89", "0.89", "0.87"]
    assert per_step["hit rate the engines found, per step"][5:] == ["0.76", "0.66", "0.72"]
    # Where the first steps went and what chose the moves, and the TTFT fit the README's
    # "What a weight learned from first tokens would set" quotes.
    assert "first steps per engine, most first: 17 8 7\n" in r.stdout
    assert "the moves by what chose the new engine: 33 cost, 13 memory limit, 3 wait limit" in r.stdout
    assert "1.49 uncached, 3.19 queued for prefill ahead, 0.048 in flight; R² 0.64" in r.stdout
    fleet = sorted(str(p) for p in (runs / "fit-fleet").glob("samples/*.json"))
    r = run_session_steps(*fleet)
    assert r.returncode == 0, r.stderr
    assert "3.13 uncached, 1.63 queued for prefill ahead, 0.036 in flight; R² 0.95" in r.stdout
    assert "3.26 uncached, 1.73 queued for prefill ahead, 0.114 in flight; R² 0.94" in r.stdout
    # One line from two runs: both reported, told apart by the run's folder.
    both = [*placement, str(runs / "a" / "samples" / "agentic_70.kvroute_dbg.json")]
    r = run_session_steps(*both)
    assert r.returncode == 0 and "| kvroute_dbg@a |" in r.stdout and "| kvroute_dbg |" in r.stdout, r.stdout

    stray = tmp_path / "samples" / "agentic_70.kvroute_dbg.json"
    stray.parent.mkdir()
    stray.write_text((runs / "a" / "samples" / "agentic_70.kvroute_dbg.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps({"runs": []}))
    bad = run_session_steps(str(stray))
    assert bad.returncode != 0 and "no run of agentic_70 kvroute_dbg" in bad.stderr


def test_session_steps_pools_engines_by_how_far_apart_their_conversations_run():
    """--stagger on every kvroute agentic run on the mocker that docs/peers-mocker-agentic
    keeps gives the table its README quotes ("Which four agents share an engine"); and the
    engines' started-request counters place vllm-router's conversations as quoted there."""
    runs = ROOT / "docs" / "peers-mocker-agentic"
    samples = sorted(str(p) for p in runs.glob("*/seed-*/samples/agentic_70.kvroute*.json") if "fleet" not in str(p))
    r = run_session_steps("--stagger", *samples, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "189 engines carrying 4 conversations each to their last steps, from 29 runs" in r.stdout
    assert "| 0–5 s apart (standard deviation) | 46 | 0.56 (0.49–0.66) |" in r.stdout
    assert "| ≥ 10 s apart (standard deviation) | 52 | 0.74 (0.55–0.92) |" in r.stdout
    assert "correlation of spread and hit rate: 0.71" in r.stdout
    counted = sorted(str(p) for p in (runs / "started-counters").glob("seed-1/samples/*.json"))
    r = run_session_steps(*counted)
    assert r.returncode == 0, r.stderr
    assert "started-request counters put 17 of 32 conversations on one engine throughout" in r.stdout


def test_started_counters_place_conversations_that_stay():
    """session_steps.conversations_placed on made-up counters: a conversation whose every step
    rose one engine's counter is placed there, whatever the load generator's lag; one that
    moved, or whose steps always started beside another's on a second engine, is not."""
    sys.path.insert(0, str(ROOT / "benches"))
    import session_steps
    engines = ["e0", "e1", "e2"]
    # a on e0; b on e1, then e2 (moved); c on e2 and d on e1, started in the same half second
    # at their first steps and apart at their second; f on e0 and g on e2, together each time.
    plan = {"a": [(1.2, 0), (5.2, 0)], "b": [(2.2, 1), (6.2, 2)], "c": [(3.2, 2), (7.2, 2)],
            "d": [(3.3, 1), (8.3, 1)], "f": [(4.2, 0), (9.2, 0)], "g": [(4.3, 2), (9.3, 2)]}
    lag = 1.4  # the load generator's clock starts this long after peers.py's mark
    started, rows = [0, 0, 0], []
    for i in range(30):
        t = 0.5 * i
        for sends in plan.values():
            for sent, e in sends:
                if t - 0.5 < 1.0 + lag + sent <= t:
                    started[e] += 1
        rows.append([t, [0, 0, 0], list(started)])
    xs = [{"key": k, "sent_s": sent} for k, sends in plan.items() for sent, _ in sends]
    placed = session_steps.conversations_placed(xs, {"engines": engines, "load_started_s": 1.0, "samples": rows})
    assert placed == {"a": "e0", "c": "e2", "d": "e1"}
    # Older runs kept the in-flight gauges only: nothing is placed.
    assert session_steps.conversations_placed(xs, {"engines": engines, "samples": [r[:2] for r in rows]}) == {}


def test_the_ttft_fit_recovers_known_coefficients():
    """session_steps.least_squares on exact data returns the coefficients that made it, and
    None where a term never varies (it cannot be told from the intercept)."""
    sys.path.insert(0, str(ROOT / "benches"))
    import session_steps
    rows = [[1.0, a, b, (a * b) % 7] for a in range(5) for b in range(4)]
    ys = [2 + 3 * a - 0.5 * b + 0.25 * c for _, a, b, c in rows]
    assert [round(c, 9) for c in session_steps.least_squares(rows, ys)] == [2, 3, -0.5, 0.25]
    assert session_steps.least_squares([[1.0, 1.0, a, 0.0] for a in range(5)], list(range(5))) is None
