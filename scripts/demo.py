#!/usr/bin/env python3
"""kvroute's local demo: a simulated vLLM fleet behind Envoy, KV-aware routing against
round robin, side by side, driven by plain OpenAI chat requests. Run through
./scripts/demo.sh (which builds and installs what this needs).

What runs (all on loopback, stopped at the end and on Ctrl-C):
  - N mock engines (kvroute-fleet worker): vLLM's API, tokenizing chats with Qwen3's
    tokenizer and chat template as vLLM does, a paged prefix cache small enough that a
    worker holds a few system prompts, vLLM-format KV events over ZMQ;
  - kvroute-sidecar subscribed to them;
  - kvroute-tokenizer, the tokenizer stage: Envoy hands it each request body and it
    answers with the prompt's token ids;
  - Envoy on :8000 with envoy/envoy.yaml (the stage, then the kvroute filter), then the
    same Envoy and bootstrap with round robin instead;
  - the load generator (kvroute-fleet load): a shared-prefix workload (SGLang's
    generated-shared-prefix shape) sent as chat completions (a system message and a user
    message, nothing else) through :8000, once per policy, with the engines' caches reset
    between.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import (FLEET, TOKENIZER_DIR, Envoy, Processes, Tokenizer, free_port, render_config,  # noqa: E402
                     reset_fleet, start_fleet, wait_synced)


def run_load(args, label, engines, out_dir):
    path = out_dir / f"{label}.json"
    cmd = [str(FLEET), "load", "--target", f"127.0.0.1:{args.port}", "--label", label,
           "--send", args.send, "--tokenizer", str(TOKENIZER_DIR),
           "--workload", "shared-prefix", "--groups", str(args.groups),
           "--prompts-per-group", str(args.prompts_per_group),
           "--system-prompt-len", str(args.system_prompt_len), "--question-len", "64",
           "--output-len", "16", "--rate", str(args.rate * args.speedup), "--seed", "7",
           "--json", str(path)]
    for e in engines:
        cmd += ["--engine", e.id]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--groups", type=int, default=12, help="distinct system prompts")
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=400, help="KV-cache blocks per worker (16 tokens each)")
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second, in model time")
    ap.add_argument("--speedup", type=float, default=4.0, help="run the fleet this much faster than real time")
    ap.add_argument("--overlap-weight", type=float, default=1.0,
                    help="the filter's overlap_weight (the specification's default, as envoy/envoy.yaml)")
    ap.add_argument("--send", choices=("chat", "text", "tokens"), default="chat",
                    help="how requests carry their prompt: chat messages, text, or token ids")
    ap.add_argument("--build", choices=("wasm", "native"), default="wasm",
                    help="kvroute's build: the wasm filter (envoy/envoy.yaml) or the native dynamic module "
                         "(envoy/envoy-native.yaml)")
    ap.add_argument("--port", type=int, default=8000,
                    help="Envoy's listener; 0: a free port, chosen with the demo's other ports so none "
                         "of them can take it first")
    ap.add_argument("--out", default=str(ROOT / "target" / "demo"))
    args = ap.parse_args()
    if args.port == 0:
        args.port = free_port()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    procs = Processes()
    try:
        print(f"starting {args.workers} mock engines ({args.blocks} KV blocks each, {args.speedup}x real time), "
              "the sidecar, the tokenizer stage and Envoy on :%d ..." % args.port, flush=True)
        engines, sidecar = start_fleet(procs, args.workers, args.blocks, args.speedup, tokenizer=TOKENIZER_DIR)
        # The engines' --max-model-len is what their KV cache holds; the stage is told the same.
        stage = procs.add(Tokenizer(models=[("mock-llm", TOKENIZER_DIR, [])], max_model_len=args.blocks * 16))

        results = {}
        for policy in ("kvroute", "round_robin"):
            reset_fleet(engines, sidecar)  # every policy starts cold
            filter_cfg = {"overlap_weight": args.overlap_weight, "block_size": 16}
            cfg, lp, ap_ = render_config(engines, sidecar.port, filter_cfg, listener_port=args.port, policy=policy,
                                         sync_config={"poll_timeout_ms": 5000, "stale_after_ms": 15000},
                                         tokenizer_port=stage.grpc_port, build=args.build)
            envoy = procs.add(Envoy(cfg, lp, ap_, concurrency=2))
            if policy == "kvroute":
                wait_synced(envoy, sidecar)
            what = "chat completions" if args.send == "chat" else f"completions ({args.send} prompts)"
            print(f"\n{policy}: {args.groups * args.prompts_per_group} {what}, {args.groups} shared "
                  f"system prompts of {args.system_prompt_len} tokens ...", flush=True)
            results[policy] = run_load(args, policy, engines, out_dir)
            if policy == "kvroute":
                # The specification's verification, through Envoy's port.
                busiest = max(engines, key=lambda e: sidecar.block_count(e.id))
                url = f"http://127.0.0.1:{args.port}/v1/admin/cache-view/{busiest.id}"
                with urllib.request.urlopen(url, timeout=5) as r:
                    view = r.read().decode()
            procs.stop(envoy)

        k, rr = results["kvroute"], results["round_robin"]
        rows = [
            ("prefix cache hit rate", f"{k['hit_rate']:.0%}", f"{rr['hit_rate']:.0%}"),
            ("TTFT p50 (ms, model time)", k["ttft_ms"]["p50"] * args.speedup, rr["ttft_ms"]["p50"] * args.speedup),
            ("TTFT p99 (ms, model time)", k["ttft_ms"]["p99"] * args.speedup, rr["ttft_ms"]["p99"] * args.speedup),
            ("end-to-end p50 (ms, model time)", k["e2e_ms"]["p50"] * args.speedup, rr["e2e_ms"]["p50"] * args.speedup),
            ("throughput (req/s, model time)", k["throughput_rps"] / args.speedup, rr["throughput_rps"] / args.speedup),
            ("failed requests", k["failed"], rr["failed"]),
        ]
        print(f"\n{'':34}{'kvroute':>12}{'round robin':>14}")
        for name, a, b in rows:
            fa = f"{a:.0f}" if isinstance(a, float) else str(a)
            fb = f"{b:.0f}" if isinstance(b, float) else str(b)
            print(f"{name:34}{fa:>12}{fb:>14}")
        sent = k["requests"] + rr["requests"]
        tokenized = int(stage.outcome("tokenized"))
        print(f"\nThe tokenizer stage tokenized {tokenized} of the {sent} requests "
              "(the engines computed the same token ids: see the hit rate).")
        if tokenized != sent:
            print(f"WARNING: {sent - tokenized} requests were not tokenized: see {stage.log_path}")
        if rr["ttft_ms"]["p50"] > 0 and k["ttft_ms"]["p50"] > 0:
            print(f"\nTTFT p50: kvroute is {rr['ttft_ms']['p50'] / k['ttft_ms']['p50']:.1f}x faster than round robin.")
        print(f"\n$ curl localhost:{args.port}/v1/admin/cache-view/{busiest.id}\n{view}")
        svg = out_dir / "ttft.svg"
        subprocess.run([str(FLEET), "plot", str(out_dir / "kvroute.json"), str(out_dir / "round_robin.json"),
                        "--out", str(svg), "--title", "Time to first token: kvroute vs round robin"], check=True)
        print(f"\nresults: {out_dir}/kvroute.json, {out_dir}/round_robin.json; TTFT CDF: {svg}")
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
