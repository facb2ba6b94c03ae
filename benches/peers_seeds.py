#!/usr/bin/env python3
"""The head to head (benches/peers.py) at several workload seeds, and which line has the
best TTFT p99 at each.

A p99 over one run's 192–256 requests is its second or third slowest request: one run
moves it by ±5%, as much as the margins between the best routers. Each seed draws other
requests and arrival times, so the count of seeds a line wins, and its median p99 over
them, tell a margin from noise. Every seed is its own `peers.py` run (its own processes,
fresh fleets), into <out>/seed-<n>/; the summary goes to <out>/seeds.md. The i-th seed runs
the lines rotated by i (peers.py --rotate), so no line is always the first.

    python3 benches/peers_seeds.py --seeds 1,2,3,4,5 --out docs/peers-seeds \\
        --workloads shared_prefix_70,shared_prefix_100,chat_70 \\
        --lines kvroute_w1,smg_cache_aware,sglang_router_cache_aware
    python3 benches/peers_seeds.py --out docs/peers-seeds --summary-only

Arguments after the ones below go to peers.py unchanged (--workloads, --lines, --sim, ...).
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(out):
    """{seed: results.json} of every seed run under `out`."""
    runs = {}
    for d in sorted(out.glob("seed-*")):
        f = d / "results.json"
        if f.exists():
            runs[int(d.name.split("-", 1)[1])] = json.loads(f.read_text())
    return runs


def summary(runs):
    """Markdown: per workload, each line's TTFT p99 (model ms) at every seed, its median,
    its hit rates, and the number of seeds at which it has the best p99 of the lines run."""
    # (workload, line) -> {seed: run}
    table = {}
    for seed, res in runs.items():
        for r in res["runs"]:
            table.setdefault((r["workload"], r["policy"]), {})[seed] = r
    out = []
    for w in dict.fromkeys(w for w, _ in table):
        lines = [line for ww, line in table if ww == w]
        # Only the seeds every line ran: a win counts against the same rivals.
        seeds = sorted(set.intersection(*(set(table[(w, line)]) for line in lines)))
        if not seeds:
            continue

        def p99(line, s):
            r = table[(w, line)][s]
            return r["ttft_ms"]["p99"] * r["speedup"]
        best = {s: min(lines, key=lambda line: p99(line, s)) for s in seeds}
        out.append(f"\n**{w}** (seeds {', '.join(map(str, seeds))}; TTFT p99 in model ms)\n")
        out.append("| line | " + " | ".join(f"seed {s}" for s in seeds) + " | median | best at | hit rates |")
        out.append("|---|" + "---:|" * len(seeds) + "---:|---:|---|")
        for line in sorted(lines, key=lambda line: statistics.median(p99(line, s) for s in seeds)):
            vals = [p99(line, s) for s in seeds]
            hits = " ".join(f"{table[(w, line)][s]['hit_rate']:.2f}" for s in seeds)
            wins = sum(1 for s in seeds if best[s] == line)
            out.append(f"| {line} | " + " | ".join(f"{v:.0f}" for v in vals)
                       + f" | {statistics.median(vals):.0f} | {wins} of {len(seeds)} | {hits} |")
    return "\n".join(out).lstrip("\n") + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated workload seeds")
    ap.add_argument("--out", required=True, help="results folder: <out>/seed-<n>/ and <out>/seeds.md")
    ap.add_argument("--summary-only", action="store_true", help="only rewrite seeds.md from the runs there")
    args, rest = ap.parse_known_args()
    out = pathlib.Path(args.out)
    if not args.summary_only:
        for i, s in enumerate(int(x) for x in args.seeds.split(",")):
            # Each seed starts with another line: the first line of a run is a little
            # slower than the same line later in it (docs/benchmarks.md).
            cmd = [sys.executable, str(ROOT / "benches" / "peers.py"), "--seed", str(s), "--rotate", str(i),
                   "--out", str(out / f"seed-{s}"), *rest]
            print(f"== seed {s}: {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                sys.exit(f"peers.py failed at seed {s}")
    runs = load(out)
    if not runs:
        sys.exit(f"no seed runs under {out}")
    text = summary(runs)
    (out / "seeds.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
