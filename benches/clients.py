#!/usr/bin/env python3
"""Real load clients for the head-to-head benchmark: the shared-prefix workload of
benches/peers.py sent by the benchmark tools users run, instead of `kvroute-fleet load`.

Clients (each in its own virtualenv under target/peers/, installed on first use):
  bench_serving   SGLang 0.4.6.post5's `python -m sglang.bench_serving --backend vllm
                  --dataset-name generated-shared-prefix`, installed without its
                  dependencies (they pull torch) plus the few its benchmark path imports
  aiperf          NVIDIA aiperf 0.13.0's `aiperf profile --endpoint-type completions
                  --num-prefix-prompts ...`

Both send streaming OpenAI completions with text prompts to `target`, tokenize with the
engines' tokenizer folder, and run offline (HF_HUB_OFFLINE=1). `run()` returns the keys of
the load generator's JSON that apply (requests, failed, duration_s, throughput_rps,
ttft_ms and e2e_ms as {p50, p90, p99, mean}, in wall-clock ms) plus output_tokens_per_s,
read from the client's own result file. Neither sees which engine served a request, so
the hit rate comes from the engines' own counters: engine_counters() before and after a
run, engine_delta() of the two.

How each client's workload differs from the load generator's (SharedPrefix.from_load_args
takes the generator's arguments, so the same plan drives all three):
  bench_serving   prompts are random vocabulary ids decoded to text, which re-encode ~5%
                  longer, so it is asked for lengths ÷ 1.05 (the mean prompt it sent is in
                  prompt_tokens_mean); every group has exactly per_group prompts, shuffled,
                  Poisson arrivals seeded by --seed. Before the run it sends one warm-up
                  request (the first prompt; 0.4.6.post5 ignores --warmup-requests), which
                  the engines count (engine_requests = requests + 1) and which warms one
                  group on one engine. It reports no p90: ttft p90 is taken from its
                  per-request TTFTs (numpy's linear method, as its own p99), e2e p90 is None.
  aiperf          each prompt draws its prefix from the pool at random, so groups hold
                  per_group prompts on average, not exactly; lengths are exact (prefix and
                  question are joined as tokens); the text is Shakespeare; Poisson arrivals.
                  It also reports a hit rate of its own (client_hit_rate: cached ÷ prompt
                  tokens from the engines' usage), which matches the engines' counters.

    python3 benches/clients.py --smoke    # 4 engines, Envoy round robin, all three clients
"""
import argparse
import dataclasses
import json
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benches"))
from harness import (FLEET, TOKENIZER_DIR, Envoy, Processes, free_port, render_config,  # noqa: E402
                     reset_fleet, start_fleet)
import routing_quality as rq  # noqa: E402

PEERS = ROOT / "target" / "peers"
MODEL = "mock-llm"
VENVS = {"bench_serving": "sglang-bench", "aiperf": "aiperf"}
# pip install steps per client: the versions measured. sglang's own dependencies include
# torch; bench_serving's path imports only aiohttp, numpy, requests, tqdm and transformers,
# and `import sglang` adds IPython and pydantic (checked by running it in this venv).
PACKAGES = {
    "bench_serving": [["--no-deps", "sglang==0.4.6.post5"],
                      ["aiohttp", "numpy", "requests", "tqdm", "transformers<5", "IPython", "pydantic"]],
    "aiperf": [["aiperf==0.13.0"]],
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}
# bench_serving's generated-shared-prefix prompts are random vocabulary ids decoded to
# text; Qwen3's tokenizer reads that text back ~5% longer (2048 → 2153, 64 → 67, three
# seeds), so lengths are asked for ÷ this to send the workload's token counts.
GSP_RETOKENIZED = 1.05


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """SGLang's generated shared prefix: `groups` system prompts of `system_tokens`, each
    followed by `per_group` different questions of `question_tokens`; `output_tokens`
    generated per request, Poisson arrivals at `rate` requests per second (wall clock)."""
    groups: int
    per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    rate: float

    @property
    def requests(self):
        return self.groups * self.per_group

    @classmethod
    def from_load_args(cls, args):
        """The workload a `kvroute-fleet load` argument list describes (routing_quality's
        plans: rates already in wall-clock time). Only uniform shared prefixes arriving one
        by one: neither client has Zipf popularity or bursts."""
        flags = dict(zip(args[::2], args[1::2])) if "--burst" not in args else {}
        if flags.get("--workload") != "shared-prefix" or float(flags.get("--zipf", 0)) > 0:
            raise ValueError(f"not a uniform shared-prefix workload: {' '.join(args)}")
        return cls(groups=int(flags["--groups"]), per_group=int(flags["--prompts-per-group"]),
                   system_tokens=int(flags["--system-prompt-len"]), question_tokens=int(flags["--question-len"]),
                   output_tokens=int(flags["--output-len"]), rate=float(flags["--rate"]))

    def load_args(self):
        """The same workload as `kvroute-fleet load` arguments."""
        return ["--workload", "shared-prefix", "--groups", str(self.groups), "--prompts-per-group", str(self.per_group),
                "--system-prompt-len", str(self.system_tokens), "--question-len", str(self.question_tokens),
                "--output-len", str(self.output_tokens), "--rate", f"{self.rate:.4f}"]


def shared_prefix_70(workers, speedup, groups=16, per_group=12, blocks=512):
    """peers.py's shared_prefix_70, as routing_quality plans it for this fleet."""
    plan_args = argparse.Namespace(workers=workers, groups=groups, per_group=per_group, blocks=blocks,
                                   speedup=speedup, quick=False, workloads="shared_prefix_70",
                                   trace=str(rq.TRACE), trace_requests=0, mooncake_blocks=0)
    [(_, _, load_args, _)] = rq.workloads(plan_args)
    return SharedPrefix.from_load_args(load_args)


def install(name):
    """The client's virtualenv, created and its pinned packages installed on first use
    (again if the pins changed)."""
    if name not in PACKAGES:
        raise ValueError(f"unknown client {name!r}: one of {', '.join(PACKAGES)}")
    venv = PEERS / VENVS[name]
    marker = venv / ".installed"
    wanted = "\n".join(" ".join(step) for step in PACKAGES[name]) + "\n"
    if not marker.exists() or marker.read_text() != wanted:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        for step in PACKAGES[name]:
            subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", *step],
                           check=True)
        marker.write_text(wanted)
    return venv


def run(name, target, model, tokenizer_dir, workload, seed, out_dir):
    """One run of client `name` against target ("host:port"); its result file and log stay
    in out_dir. Returns the parsed metrics, plus the client's whole wall time (startup
    included) and CPU time."""
    venv = install(name)
    out = pathlib.Path(out_dir).resolve()  # the client runs in it
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = pathlib.Path(tokenizer_dir).resolve()
    command = _bench_serving if name == "bench_serving" else _aiperf
    cmd, env, result = command(venv, target, model, tokenizer_dir, workload, seed, out)
    log = out / f"{name}.log"
    cpu0 = _children_cpu()
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out, env={**os.environ, **OFFLINE, **env},
                              timeout=600 + 4 * workload.requests / workload.rate)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{name} exited {proc.returncode} (log: {log}):\n{tail}")
    r = _parse_bench_serving(result) if name == "bench_serving" else _parse_aiperf(result)
    r.update({"client": name, "version": PACKAGES[name][0][-1], "wall_s": round(wall, 1),
              "client_cpu_s": round(_children_cpu() - cpu0, 1)})
    return r


def _children_cpu():
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def _bench_serving(venv, target, model, tokenizer_dir, w, seed, out):
    result = out / "bench_serving.jsonl"
    result.unlink(missing_ok=True)  # it appends a line per run
    # It caches its generated prompts under ~/.cache/sglang/benchmark keyed by the
    # lengths but not the seed, and regenerating gives other prompts even with the same
    # seed (it samples from tokenizer.get_vocab(), whose order changes per process). A
    # home per tokenizer and seed: every run with that seed sends the same prompts.
    home = venv / "datasets" / f"{tokenizer_dir.name}-seed{seed}"
    home.mkdir(parents=True, exist_ok=True)
    cmd = [str(venv / "bin" / "python"), "-m", "sglang.bench_serving", "--backend", "vllm",
           "--base-url", f"http://{target}", "--model", model, "--tokenizer", str(tokenizer_dir),
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(w.groups),
           "--gsp-prompts-per-group", str(w.per_group),
           "--gsp-system-prompt-len", str(round(w.system_tokens / GSP_RETOKENIZED)),
           "--gsp-question-len", str(round(w.question_tokens / GSP_RETOKENIZED)),
           "--gsp-output-len", str(w.output_tokens), "--request-rate", f"{w.rate:.4f}", "--seed", str(seed),
           "--output-file", str(result), "--output-details", "--disable-tqdm",
           # Its vllm backend sends best_of: 1, which smg refuses with streaming (400);
           # null is vLLM's own default, which every router and engine here takes.
           "--extra-request-body", json.dumps({"best_of": None})]
    return cmd, {"HOME": str(home)}, result


def _aiperf(venv, target, model, tokenizer_dir, w, seed, out):
    artifacts = out / "aiperf"
    shutil.rmtree(artifacts, ignore_errors=True)
    hub_cache = out / "hf-cache"
    repo = _as_cached_repo(tokenizer_dir, hub_cache)
    cmd = [str(venv / "bin" / "aiperf"), "profile", "--model", model, "--url", f"http://{target}",
           "--endpoint-type", "completions", "--streaming", "--tokenizer", repo,
           "--num-prefix-prompts", str(w.groups), "--prefix-prompt-length", str(w.system_tokens),
           "--isl", str(w.question_tokens), "--osl", str(w.output_tokens),
           # What aiperf itself advises for a fixed output length on vLLM.
           "--extra-inputs", "ignore_eos:true",
           "--request-rate", f"{w.rate:.4f}", "--arrival-pattern", "poisson",
           # One dataset entry per request: with fewer (100 by default) entries repeat,
           # and a repeated prompt is a whole-prompt cache hit no other client sends.
           "--request-count", str(w.requests), "--num-dataset-entries", str(w.requests),
           "--random-seed", str(seed), "--artifact-dir", str(artifacts), "--export-level", "summary",
           # No UI, and no scraping of /metrics or GPU exporters while it runs.
           "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry"]
    return cmd, {"HF_HUB_CACHE": str(hub_cache)}, artifacts / "profile_export_aiperf.json"


def _as_cached_repo(tokenizer_dir, hub_cache):
    """The tokenizer folder laid out as a Hugging Face hub cache entry, local/<name> at
    revision main. aiperf 0.13.0 in offline mode loads tokenizers only through
    snapshot_download(local_files_only=True), which refuses a folder path
    ("HFValidationError: Repo id must be in the form 'repo_name' or
    'namespace/repo_name'"); without offline mode it would load the folder."""
    entry = hub_cache / f"models--local--{tokenizer_dir.name}"
    shutil.rmtree(entry, ignore_errors=True)
    snapshot = entry / "snapshots" / "local"
    snapshot.mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("local")
    for f in tokenizer_dir.iterdir():
        (snapshot / f.name).symlink_to(f)
    return f"local/{tokenizer_dir.name}"


def _round2(x):
    return None if x is None else round(x, 2)


def _p90(values):
    """numpy.percentile(values, 90), its default linear method."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=10, method="inclusive")[8]


def _parse_bench_serving(path):
    r = json.loads(path.read_text().splitlines()[-1])
    sent = len(r["input_lens"])
    ok_ttfts = [t * 1000 for t, error in zip(r["ttfts"], r["errors"]) if not error]
    return {
        "requests": sent, "failed": sent - r["completed"], "duration_s": _round2(r["duration"]),
        "throughput_rps": _round2(r["request_throughput"]), "output_tokens_per_s": _round2(r["output_throughput"]),
        "ttft_ms": {"p50": _round2(r["median_ttft_ms"]), "p90": _round2(_p90(ok_ttfts)),
                    "p99": _round2(r["p99_ttft_ms"]), "mean": _round2(r["mean_ttft_ms"])},
        "e2e_ms": {"p50": _round2(r["median_e2e_latency_ms"]), "p90": None,
                   "p99": _round2(r["p99_e2e_latency_ms"]), "mean": _round2(r["mean_e2e_latency_ms"])},
        "prompt_tokens_mean": _round2(r["total_input_tokens"] / max(r["completed"], 1)),
    }


def _parse_aiperf(path):
    r = json.loads(path.read_text())

    def value(tag):
        # A counter aiperf had nothing for (error_request_count with no errors) is absent.
        return (r.get(tag) or {}).get("avg", 0)

    def spread(tag):
        return {"p50": _round2(r[tag]["p50"]), "p90": _round2(r[tag]["p90"]), "p99": _round2(r[tag]["p99"]),
                "mean": _round2(r[tag]["avg"])}

    ok, failed = value("request_count"), value("error_request_count")
    return {
        "requests": int(ok + failed), "failed": int(failed), "duration_s": _round2(value("benchmark_duration")),
        "throughput_rps": _round2(value("request_throughput")),
        "output_tokens_per_s": _round2(value("output_token_throughput")),
        "ttft_ms": spread("time_to_first_token"), "e2e_ms": spread("request_latency"),
        "prompt_tokens_mean": _round2(value("input_sequence_length")),
        "client_hit_rate": _round2(value("overall_usage_prompt_cache_read_pct") / 100),
    }


def engine_counters(engines):
    """Every engine's /metrics now (harness.MockEngine.metrics): one before a run and one
    after, for engine_delta()."""
    return [e.metrics() for e in engines]


def engine_delta(before, after):
    """What the engines counted between two engine_counters(): the prefix-cache hit rate
    (cached ÷ prompt tokens, the load generator's hit_rate, but over every request the
    engines served: a client's warm-up too), requests finished, and each engine's modelled
    busy time and their imbalance (max ÷ mean), as the load generator reports them."""
    def delta(name):
        return [a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after)]
    prompt, cached = sum(delta("vllm:prefix_cache_queries_total")), sum(delta("vllm:prefix_cache_hits_total"))
    busy = delta("kvroute_mock_busy_seconds_total")
    mean_busy = sum(busy) / max(len(busy), 1)
    return {"hit_rate": round(cached / prompt, 2) if prompt else 0.0, "engine_prompt_tokens": int(prompt),
            "engine_cached_tokens": int(cached), "engine_requests": int(sum(delta("vllm:request_success_total"))),
            "engine_busy_s": [round(b, 2) for b in busy],
            "busy_imbalance": round(max(busy) / mean_busy, 2) if mean_busy > 0 else 0.0}


def _fleet_load(target, model, tokenizer_dir, workload, seed, out_dir, engines):
    """The load generator with the same workload, as peers.py runs it (text prompts)."""
    path = pathlib.Path(out_dir) / "fleet_load.json"
    cmd = [str(FLEET), "load", "--target", target, "--label", "fleet_load", "--seed", str(seed), "--json", str(path),
           "--quiet", "--send", "text", "--tokenizer", str(tokenizer_dir), "--model", model, *workload.load_args()]
    for e in engines:
        cmd += ["--engine", e.id]
    cpu0 = _children_cpu()
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(path.read_text())
    r.pop("samples")
    ok = r["requests"] - r["failed"]
    r.update({"client": "fleet_load", "wall_s": round(time.time() - t0, 1),
              "client_cpu_s": round(_children_cpu() - cpu0, 1), "client_hit_rate": r["hit_rate"],
              "prompt_tokens_mean": round(r["prompt_tokens"] / max(ok, 1), 2),
              # Its JSON has no output rate; the engines generate exactly output_tokens.
              "output_tokens_per_s": round(workload.output_tokens * ok / r["duration_s"], 2)})
    return r


def smoke(args):
    procs = Processes()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        engines, sidecar = start_fleet(procs, args.engines, args.blocks, args.speedup, tokenizer=TOKENIZER_DIR)
        port = free_port()
        cfg, lp, adm = render_config(engines, sidecar.port, listener_port=port, policy="round_robin")
        procs.add(Envoy(cfg, lp, adm, concurrency=2))
        target = f"127.0.0.1:{port}"
        workload = shared_prefix_70(args.engines, args.speedup, args.groups, args.per_group, args.blocks)
        print(f"{args.engines} engines (speed-up {args.speedup:g}) behind Envoy round robin at {target}; {workload}",
              flush=True)
        for name in args.clients.split(","):
            reset_fleet(engines, sidecar)
            before = engine_counters(engines)
            if name == "fleet_load":
                r = _fleet_load(target, MODEL, TOKENIZER_DIR, workload, args.seed, out, engines)
            else:
                r = run(name, target, MODEL, TOKENIZER_DIR, workload, args.seed, out)
            r.update(engine_delta(before, engine_counters(engines)))
            rows.append(r)
            print(json.dumps({k: r.get(k) for k in SUMMARY}), flush=True)
    finally:
        procs.stop_all()
    (out / "results.json").write_text(json.dumps({"workload": dataclasses.asdict(workload), "runs": rows}, indent=1))
    print(table(rows))
    print(f"\nresults in {out}")


SUMMARY = ("client", "requests", "failed", "ttft_ms", "e2e_ms", "throughput_rps", "output_tokens_per_s",
           "duration_s", "prompt_tokens_mean", "hit_rate", "client_hit_rate", "engine_requests", "busy_imbalance",
           "wall_s", "client_cpu_s")


def table(rows):
    def ms(v):
        return "–" if v is None else f"{v:.0f}"
    lines = ["| client | requests | failed | TTFT p50 | p90 | p99 | e2e p50 | p90 | p99 | req/s | out tok/s | "
             "prompt tok | hit (engines) | hit (client) | engine reqs | wall s | CPU s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t, e = r["ttft_ms"], r["e2e_ms"]
        client_hit = "–" if r.get("client_hit_rate") is None else f"{r['client_hit_rate']:.2f}"
        lines.append(f"| {r['client']} | {r['requests']} | {r['failed']} | {ms(t['p50'])} | {ms(t['p90'])} | "
                     f"{ms(t['p99'])} | {ms(e['p50'])} | {ms(e['p90'])} | {ms(e['p99'])} | {r['throughput_rps']:.1f} | "
                     f"{r['output_tokens_per_s']:.0f} | {r['prompt_tokens_mean']:.0f} | {r['hit_rate']:.2f} | "
                     f"{client_hit} | {r['engine_requests']} | {r['wall_s']:.0f} | {r['client_cpu_s']:.1f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", required=True,
                    help="start a fleet and a round-robin front and run the clients on shared_prefix_70")
    ap.add_argument("--clients", default="fleet_load,bench_serving,aiperf",
                    help="comma-separated: fleet_load (kvroute-fleet load, for comparison), bench_serving, aiperf")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--speedup", type=float, default=2.0, help="peers.py's")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "target" / "clients-smoke"))
    smoke(ap.parse_args())


if __name__ == "__main__":
    main()
