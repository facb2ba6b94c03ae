#!/usr/bin/env python3
"""Routing quality: the same workloads through the same Envoy binary and the simulated
fleet, once per routing policy, side by side.

Policies:
  round_robin, least_request, random   Envoy's own load balancers (no kvroute filter)
  prefix_hash                          Envoy ring_hash on x-prefix-hash, a hash of the prompt's
                                       first --prefix-hash-blocks blocks (prefix affinity)
  kvroute_w0, kvroute_w1, kvroute_wT   kvroute (its defaults: potential load, outstanding
                                       prefill) at overlap_weight 0, 1 and --tuned-weight
  kvroute_w1_literal, kvroute_wT_literal
                                       the specification's formula read literally: active_blocks
                                       as they are, no prefill term (kvroute before both)
  kvroute_w1_nopredict                 kvroute at weight 1, predict-on-route off
  kvroute_w1_nolimit                   kvroute at weight 1 without the wait limit
  kvroute_w1_notie                     kvroute at weight 1 without the holder tie
  kvroute_w1_native                    kvroute at weight 1, the native build (the dynamic
                                       module) in place of the wasm filter: the same routing
  kvroute_w1_p<x>                      with --prefill-sweep: weight 1, prefill_load_weight x

Workloads (each run on a freshly reset fleet): shared prefix (uniform) at light, ~70% and
~100% of the fleet's prefill capacity; shared prefix with Zipf popularity, multi-turn chat,
an agentic loop (agents sharing a system prompt, each growing its own history), the
Mooncake trace and a burst workload at ~70%. "Capacity" is the fleet's rate of
uncached prefills for the workload's prompts (no cache at all): load levels are the same
offered load for every policy. One Zipf workload (zipf_busy) is loaded instead to ~70% of
what the fleet can serve at the oracle's hit rate: the load at which pinning a hot prefix
to one engine starts to cost.

Requests go the way real clients send them: the prompt's token ids in the body
(`"prompt": [ids]`: tokenizing text would only measure this machine's CPU), through the
tokenizer stage in front of every policy, which writes the token header kvroute reads.
`--via header` runs the path from before the stage instead: no stage, the load generator
writes the header itself (the two give the same routing: docs/benchmarks.md).

    ./scripts/fetch-tokenizer.sh
    cargo build --release -p kvroute-sidecar -p kvroute-fleet -p kvroute-tokenizer
    cargo build --target wasm32-unknown-unknown --release
    python3 benches/routing_quality.py [--quick] [--via stage|header] [--out docs/routing-quality]

Writes results.json (every run's summary), one TTFT-CDF SVG per workload, hit-rate-vs-load
SVG, and prints the tables as Markdown.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import (FLEET, TOKENIZER_DIR, Envoy, Processes, Tokenizer, free_port, render_config,  # noqa: E402
                     reset_fleet, start_fleet, wait_for, wait_synced)

TRACE = ROOT / "benches" / "data" / "mooncake" / "conversation_trace_2000.jsonl"
TRACE_SOURCE = ("the first 2000 requests of the Mooncake FAST'25 conversation trace: kvcache-ai/Mooncake, "
                "FAST25-release/traces/conversation_trace.jsonl")
# The mock engines' timing model (defaults, fleet/src/engine.rs): ms to start a prefill,
# ms per uncached token; ms per decode step, and the batch size at which that doubles.
PREFILL_OVERHEAD_MS, PREFILL_MS_PER_TOKEN = 30.0, 0.2
ITL_MS, ITL_KNEE = 12.0, 64.0


def prefill_capacity(workers, prompt_tokens):
    """Requests per second the fleet can prefill with nothing cached."""
    return workers * 1000.0 / (PREFILL_OVERHEAD_MS + PREFILL_MS_PER_TOKEN * prompt_tokens)


def cached_capacity(workers, uncached_tokens, output_tokens):
    """Requests per second the fleet can serve when only `uncached_tokens` of a prompt
    need computing. Engines pack every waiting prefill into one step, so under load the
    fixed costs (prefill overhead, the decode step's base) are shared by ever more
    requests; what is left per request is its uncached tokens and its share of the
    batch-size term of the decode steps it runs in (output_tokens - 1 of them)."""
    per_request_ms = (PREFILL_MS_PER_TOKEN * uncached_tokens
                      + ITL_MS * (output_tokens - 1) / ITL_KNEE)
    return workers * 1000.0 / per_request_ms


LITERAL = {"active_blocks": "in_flight", "prefill_load_weight": 0.0, "wait_slack_per_hit": None,
           "holder_tie_per_hit": None}


def policies(tuned, prefill_sweep=()):
    t = f"{tuned:g}"
    return [
        ("round_robin", "round_robin", None),
        ("least_request", "least_request", None),
        ("random", "random", None),
        ("prefix_hash", "ring_hash", None),
        ("kvroute_w0", "kvroute", {"overlap_weight": 0.0}),
        ("kvroute_w1", "kvroute", {"overlap_weight": 1.0}),
        (f"kvroute_w{t}", "kvroute", {"overlap_weight": tuned}),
        ("kvroute_w1_literal", "kvroute", {"overlap_weight": 1.0, **LITERAL}),
        (f"kvroute_w{t}_literal", "kvroute", {"overlap_weight": tuned, **LITERAL}),
        ("kvroute_w1_nopredict", "kvroute", {"overlap_weight": 1.0, "predict_on_route": False}),
        ("kvroute_w1_nolimit", "kvroute", {"overlap_weight": 1.0, "wait_slack_per_hit": None}),
        ("kvroute_w1_notie", "kvroute", {"overlap_weight": 1.0, "holder_tie_per_hit": None}),
        ("kvroute_w1_native", "kvroute", {"overlap_weight": 1.0}),
    ] + [(f"kvroute_w1_p{p:g}", "kvroute", {"overlap_weight": 1.0, "prefill_load_weight": p}) for p in prefill_sweep]


def named(items, wanted, what):
    """The items (tuples, name first) that a comma-separated `wanted` names, in their own
    order; all of them if `wanted` is empty. An unknown name ends the run."""
    if not wanted:
        return items
    wanted = wanted.split(",")
    unknown = set(wanted) - {i[0] for i in items}
    if unknown:
        sys.exit(f"unknown {what}: {', '.join(sorted(unknown))}")
    return [i for i in items if i[0] in wanted]


def workloads(args):
    """(name, load level, load-generator arguments, fleet settings). Rates are in model
    time here and multiplied by the fleet's speed-up below."""
    sp = ["--workload", "shared-prefix", "--groups", str(args.groups), "--prompts-per-group", str(args.per_group),
          "--system-prompt-len", "2048", "--question-len", "64", "--output-len", "16"]
    cap = prefill_capacity(args.workers, 2048 + 64)
    out = [(f"shared_prefix_{name}", level, sp + ["--rate", f"{cap * level:.3f}"], {})
           for name, level in (("light", 0.2), ("70", 0.7), ("100", 1.0))]
    # Zipf: enough requests (1600) that each group's one compulsory miss is under 1% of
    # them, so p99 measures routing, not the cold start.
    zipf_per_group = 100
    zipf = [x if x != str(args.per_group) else str(zipf_per_group) for x in sp]
    out.append(("zipf_70", 0.7, zipf + ["--zipf", "1.1", "--rate", f"{cap * 0.7:.3f}"], {}))
    # The same requests at 70% of what the fleet can serve when every prompt but each
    # group's first is cached (the oracle): 23x the rate, so the hottest group (~1/3 of
    # the requests) is more than one engine can serve even fully cached. The fleet runs
    # at a lower speed-up so this machine can drive the arrival rate (~570 requests/s:
    # kvroute's results match those at speed-up 1).
    busy_cap = cached_capacity(args.workers, 64 + 2048 / zipf_per_group, 16)
    out.append(("zipf_busy_70", 0.7, zipf + ["--zipf", "1.1", "--rate", f"{busy_cap * 0.7:.3f}"],
                {"speedup": min(args.speedup, 2.0)}))
    # Hot prefixes with real work behind them (RAG-like: 1024-token questions), popularity
    # steep enough (s = 1.5: the top group gets ~45%) that one worker cannot serve the
    # hottest group alone: what pinning a prefix to one worker costs.
    hot = [x if x != "64" else "1024" for x in sp]
    hot_cap = prefill_capacity(args.workers, 2048 + 1024)
    out.append(("zipf_hot_70", 0.7, hot + ["--zipf", "1.5", "--rate", f"{hot_cap * 0.7:.3f}"], {}))
    # Bursts: each group's prompts at once; bursts spaced to the same average load.
    out.append(("burst_70", 0.7, sp + ["--burst", "--rate", f"{cap * 0.7 / args.per_group:.3f}"], {}))
    # Chat: 4 turns; the prompt grows by ~80 tokens a turn from 1024.
    turns, first = 4, 1024
    chat_cap = prefill_capacity(args.workers, first + 1.5 * 80)
    out.append(("chat_70", 0.7, ["--workload", "chat", "--conversations", str(args.groups * 2), "--turns", str(turns),
                                 "--system-prompt-len", str(first), "--question-len", "64", "--output-len", "16",
                                 "--rate", f"{chat_cap * 0.7 / turns:.3f}"], {}))
    # An agentic loop: 32 agents at once share one 2048-token system prompt (instructions
    # and tools); each has a 256-token task, then 8 steps of a 32-token tool call and a
    # 256-token tool result appended. Each agent's history outgrows what its first worker
    # can keep beside the others', and every agent's first blocks are the same.
    steps, tool = 8, 256
    agent_cap = prefill_capacity(args.workers, 2048 + tool + (steps - 1) / 2 * (32 + tool))
    out.append(("agentic_70", 0.7, ["--workload", "agentic", "--conversations", str(args.groups * 2),
                                    "--turns", str(steps), "--system-prompt-len", "2048",
                                    "--question-len", str(tool), "--output-len", "32",
                                    "--rate", f"{agent_cap * 0.7 / steps:.3f}"], {}))
    out.append(("mooncake_70", 0.7, None, {"blocks": args.mooncake_blocks}))
    if args.quick:
        out = [w for w in out if w[0] in ("shared_prefix_70", "zipf_70")]
    out = named(out, args.workloads, "workloads")
    if any(w[0] == "mooncake_70" for w in out):
        trace = pathlib.Path(args.trace)
        if trace.exists():
            out = [(*w[:2], mooncake_args(args, trace), w[3]) if w[0] == "mooncake_70" else w for w in out]
        elif args.workloads:
            sys.exit(f"mooncake_70: no trace at {trace} (--trace; {TRACE_SOURCE})")
        else:
            print(f"mooncake_70 skipped: no trace at {trace} (--trace; {TRACE_SOURCE})", flush=True)
            out = [w for w in out if w[0] != "mooncake_70"]
    # A workload may ask for another cache size or speed-up; the rest get the defaults.
    fleets = [{"blocks": args.blocks, "speedup": args.speedup, **f} for *_, f in out]
    return [(name, level, wall_clock(a, f["speedup"]), f) for (name, level, a, _), f in zip(out, fleets)]


def mooncake_args(args, trace):
    """The first N requests of the Mooncake trace, lengths ÷ 8, time-scaled to ~70% of the
    fleet's capacity. Conversations come back minutes later, so this workload's engines get
    a realistic cache (8192 blocks, 128k tokens), or every policy would only see evictions."""
    n, ls = args.trace_requests, 8.0
    lines = [json.loads(x) for x in trace.read_text().splitlines()[:n]]
    mean_len = sum(x["input_length"] for x in lines) / len(lines) / ls
    span_s = (lines[-1]["timestamp"] - lines[0]["timestamp"]) / 1000.0
    ts = 0.7 * prefill_capacity(args.workers, mean_len) * span_s / len(lines)
    return ["--workload", "mooncake", "--trace", str(trace), "--requests", str(n),
            "--length-scale", f"{ls:g}", "--time-scale", f"{ts:.3f}", "--output-len", "32"]


def wall_clock(load_args, speedup):
    """The fleet runs `speedup` times faster than model time: so must arrivals."""
    a = list(load_args)
    for flag in ("--rate", "--time-scale"):
        if flag in a:
            i = a.index(flag) + 1
            a[i] = f"{float(a[i]) * speedup:.4f}"
    return a


def save_samples(out, wname, label, samples, speedup):
    """A run's TTFTs (model time) kept for the workload's CDF plot (plot_ttft)."""
    (out / f"{wname}.{label}.samples.json").write_text(json.dumps(
        {"label": label, "samples": [{"ok": s["ok"], "ttft_ms": s["ttft_ms"] * speedup} for s in samples]}))


def plot_ttft(out, wname, labels, title):
    """ttft-<workload>.svg: the TTFT CDFs of the runs of `labels` that saved samples; the
    sample files go (results.json keeps the summaries)."""
    files = [f for f in (out / f"{wname}.{label}.samples.json" for label in labels) if f.exists()]
    if files:
        subprocess.run([str(FLEET), "plot", *map(str, files), "--out", str(out / f"ttft-{wname}.svg"),
                        "--title", title], check=True)
    for f in files:
        f.unlink()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=512, help="KV blocks per worker (16 tokens each)")
    ap.add_argument("--speedup", type=float, default=5.0)
    ap.add_argument("--tuned-weight", type=float, default=4.0)
    ap.add_argument("--prefix-hash-blocks", type=int, default=8)
    ap.add_argument("--trace", default=str(TRACE), help="the Mooncake conversation trace (JSONL)")
    ap.add_argument("--trace-requests", type=int, default=2000)
    ap.add_argument("--mooncake-blocks", type=int, default=8192, help="KV blocks per worker for mooncake_70")
    ap.add_argument("--quick", action="store_true", help="two workloads only")
    ap.add_argument("--workloads", help="comma-separated workload names to run (results merge into results.json)")
    ap.add_argument("--policies", help="comma-separated policy labels to run (default: all)")
    ap.add_argument("--prefill-sweep", default="",
                    help="comma-separated prefill_load_weight values: adds kvroute_w1_p<x> policies")
    ap.add_argument("--via", choices=("stage", "header"), default="stage",
                    help="stage: token-id bodies through the tokenizer stage; header: the client writes the token header")
    ap.add_argument("--out", default=str(ROOT / "target" / "routing-quality"))
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    sweep = [float(x) for x in args.prefill_sweep.split(",") if x]
    chosen = named(policies(args.tuned_weight, sweep), args.policies, "policies")

    procs = Processes()
    t_start = time.time()
    results = []
    fleet = {"settings": None, "engines": [], "sidecar": None, "stage": None}
    try:
        port = free_port()
        for wname, level, wargs, settings in workloads(args):
            if fleet["settings"] != settings:
                # Another cache size or speed-up: a new fleet.
                for p in [fleet["sidecar"], *fleet["engines"]]:
                    if p is not None:
                        procs.stop(p)
                if fleet["stage"] is not None:
                    procs.stop(fleet["stage"])
                engines, sidecar = start_fleet(procs, args.workers, settings["blocks"], settings["speedup"])
                # The stage is told the engines' max_model_len (what their KV cache holds).
                stage = procs.add(Tokenizer(models=[("mock-llm", TOKENIZER_DIR, [])],
                                            max_model_len=settings["blocks"] * 16)) if args.via == "stage" else None
                fleet.update(settings=settings, engines=engines, sidecar=sidecar, stage=stage)
            engines, sidecar, stage = fleet["engines"], fleet["sidecar"], fleet["stage"]
            speedup = settings["speedup"]
            for label, policy, fcfg in chosen:
                reset_fleet(engines, sidecar)
                filter_cfg = {"block_size": 16}
                filter_cfg.update(fcfg or {})
                cfg, lp, adm = render_config(engines, sidecar.port, filter_cfg, listener_port=port, policy=policy,
                                             sync_config={"poll_timeout_ms": 5000, "stale_after_ms": 15000},
                                             tokenizer_port=stage.grpc_port if stage else None,
                                             build="native" if label.endswith("_native") else "wasm")
                envoy = procs.add(Envoy(cfg, lp, adm, concurrency=2))
                if policy == "kvroute":
                    wait_synced(envoy, sidecar)
                path = out / f"{wname}.{label}.json"
                cmd = [str(FLEET), "load", "--target", f"127.0.0.1:{port}", "--label", label, "--seed", "7",
                       "--json", str(path), "--quiet", "--prefix-hash-blocks", str(args.prefix_hash_blocks), *wargs]
                if args.via == "header":
                    cmd.append("--token-header")
                for e in engines:
                    cmd += ["--engine", e.id]
                tokenized = stage.outcome("tokenized") if stage else 0
                t0 = time.time()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                r = json.loads(path.read_text())
                samples = r.pop("samples")
                # How many requests kvroute scored by their blocks (0 for Envoy's policies),
                # and how many the stage tokenized: a run that silently routed by load shows.
                scored = 0
                if policy == "kvroute":
                    # The wasm filters' counters reach Envoy on their next tick.
                    wait_for(lambda: envoy.stat("kvroute.requests") >= r["requests"], what="the filters' counters")
                    scored = envoy.stat("kvroute.scored")
                procs.stop(envoy)
                r.update({"workload": wname, "load": level, "policy": label, "wall_s": round(time.time() - t0, 1),
                          "speedup": speedup, "blocks_per_worker": settings["blocks"], "via": args.via,
                          "scored": scored,
                          "tokenized": int(stage.outcome("tokenized") - tokenized) if stage else None})
                results.append(r)
                print(f"{wname:18} {label:26} hit {r['hit_rate']:.2f}/{r['oracle_hit_rate']:.2f} "
                      f"ttft p50 {r['ttft_ms']['p50'] * speedup:7.0f} p99 {r['ttft_ms']['p99'] * speedup:7.0f} ms "
                      f"failed {r['failed']}", flush=True)
                save_samples(out, wname, label, samples, speedup)
                path.unlink()
            plot_ttft(out, wname, [p[0] for p in chosen], f"TTFT, {wname} (model time)")
    finally:
        procs.stop_all()
    # Runs of other workloads from an earlier invocation are kept.
    previous = out / "results.json"
    if previous.exists() and args.workloads:
        ran = {r["workload"] for r in results}
        results = [r for r in json.loads(previous.read_text())["runs"] if r["workload"] not in ran] + results
    (out / "results.json").write_text(json.dumps({"config": vars(args), "wall_s": round(time.time() - t_start),
                                                  "runs": results}, indent=1))
    print(markdown(results))
    (out / "hit-rate-vs-load.svg").write_text(hit_rate_svg(results))
    print(f"\n{len(results)} runs in {time.time() - t_start:.0f} s; results in {out}")


def markdown(results):
    lines = []
    for w in dict.fromkeys(r["workload"] for r in results):
        rs = [r for r in results if r["workload"] == w]
        lines.append(f"\n**{w}** (oracle hit rate {rs[0]['oracle_hit_rate']:.2f})\n")
        lines.append("| policy | hit rate | ÷ oracle | TTFT p50 | p90 | p99 | e2e p50 | p99 | req/s | busy max/mean | failed |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rs:
            s = r["speedup"]
            orc = r["oracle_hit_rate"] or 1
            lines.append(f"| {r['policy']} | {r['hit_rate']:.2f} | {r['hit_rate'] / orc:.2f} | "
                         f"{r['ttft_ms']['p50'] * s:.0f} | {r['ttft_ms']['p90'] * s:.0f} | {r['ttft_ms']['p99'] * s:.0f} | "
                         f"{r['e2e_ms']['p50'] * s:.0f} | {r['e2e_ms']['p99'] * s:.0f} | "
                         f"{r['throughput_rps'] / s:.1f} | {r['busy_imbalance']:.2f} | {r['failed']} |")
    return "\n".join(lines)


def hit_rate_svg(results):
    """Hit rate against offered load, one line per policy (shared prefix, uniform)."""
    rs = [r for r in results if r["workload"].startswith("shared_prefix_")]
    pols = list(dict.fromkeys(r["policy"] for r in rs))
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
              "#17becf", "#000000", "#aec7e8"]
    w, h, l, b, t = 640, 380, 60, 50, 30
    x = lambda v: l + v / 1.0 * (w - l - 200)  # noqa: E731
    y = lambda v: h - b - v * (h - b - t)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">'
             '<rect width="100%" height="100%" fill="white"/>'
             f'<text x="{(w - 200) / 2}" y="18" text-anchor="middle" font-size="14">Prefix cache hit rate vs load (shared prefix)</text>']
    for v in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line x1="{l}" x2="{w - 200}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                     f'<text x="{l - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0%}</text>')
    for v in (0.2, 0.7, 1.0):
        parts.append(f'<text x="{x(v):.1f}" y="{h - b + 16}" text-anchor="middle">{v:.0%}</text>')
    parts.append(f'<text x="{(l + w - 200) / 2}" y="{h - 12}" text-anchor="middle">offered load (of uncached prefill capacity)</text>')
    for i, p in enumerate(pols):
        pts = sorted((r["load"], r["hit_rate"]) for r in rs if r["policy"] == p)
        c = colors[i % len(colors)]
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                     + " ".join(f"{x(a):.1f},{y(v):.1f}" for a, v in pts) + '"/>')
        parts.append(f'<rect x="{w - 190}" y="{t + i * 18}" width="14" height="4" fill="{c}"/>'
                     f'<text x="{w - 170}" y="{t + i * 18 + 6}">{p}</text>')
    parts.append("</svg>\n")
    return "".join(parts)


if __name__ == "__main__":
    main()
