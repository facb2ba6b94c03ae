#!/usr/bin/env python3
"""Where a burst's requests spent their time before the engine, from the access logs
`peers.py --access-log` writes (one JSON line a request, harness ACCESS_LOG_TIMES and,
through the stage, ACCESS_LOG_STAGE_TIMES).

    python3 benches/peers.py --seed 1 --workloads burst_70 --warmup 2 --access-log --out DIR \\
        --lines kvroute_w1,envoy_round_robin_stage,envoy_round_robin
    python3 benches/access_paths.py DIR/burst_70.*.access.jsonl --skip 2
    python3 benches/access_paths.py DIR/burst_70.*.access.jsonl --per-burst 4   # after a start

Requests are grouped into bursts by their arrival: a gap of more than `--gap-s` starts a
new one. For each log, over the bursts after the first `--skip` (the warm-up's), the
first request of each burst to reach its upstream (the one whose engine step the burst
waits for) and every request: the median and range of each time, in ms. With the stage,
"stage headers" and "stage body" are ext_proc's own timing of its two calls (a message
sent to its answer read), and "Envoy, rest" is what is left of the time to the upstream:
Envoy and the filters between those calls.

Beside a log, peers.py keeps the stage's (`<workload>.<line>.stage.log`), with a line a
request at debug level: its tokens and its time in the stage, waiting for a permit (one
of `max_concurrency`), for a thread of the blocking pool, and tokenizing. The first such
line of each burst (the first tokenization it finished) is reported beside the first
request.
"""
import argparse
import datetime
import json
import pathlib
import re
import statistics

# The stage's debug line for a tokenized request (tokenizer/src/extproc/handler.rs), after
# env_logger's "[<RFC 3339 time, µs> DEBUG <module>] ".
STAGE_LINE = re.compile(r"^\[(\S+Z) DEBUG \S+\] tokenized (\d+) tokens: (\d+) µs for a permit, (\d+) µs for a "
                        r"thread, (\d+) µs tokenizing, (\d+) µs in all$")
STAGE_FIELDS = ["tokens", "permit", "thread", "tokenizing", "in the stage"]

FIELDS = [("to upstream", "to_upstream_us"), ("body read", "request_rx_us"),
          ("stage headers", "stage_headers_us"), ("stage body", "stage_body_us")]


def number(v):
    """An access-log value: µs as a number, or None (Envoy writes "-" or null for a time it
    has not got, e.g. no stage)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def bursts(entries, gap_s):
    """`entries` split where arrivals are more than `gap_s` apart, in arrival order."""
    out = []
    for e in sorted(entries, key=lambda e: float(e["start_s"])):
        if out and float(e["start_s"]) - float(out[-1][-1]["start_s"]) <= gap_s:
            out[-1].append(e)
        else:
            out.append([e])
    return out


def times(entry):
    t = {name: number(entry.get(key)) for name, key in FIELDS}
    stage = [t["stage headers"], t["stage body"]]
    if t["to upstream"] is not None and None not in stage:
        t["Envoy, rest"] = t["to upstream"] - sum(stage)
    return t


def summary(rows):
    """name -> (median, min, max) in ms over the rows that have it."""
    out = {}
    for name in [n for n, _ in FIELDS] + ["Envoy, rest"]:
        vals = [r[name] / 1000 for r in rows if r.get(name) is not None]
        if vals:
            out[name] = (statistics.median(vals), min(vals), max(vals))
    return out


def stage_lines(path):
    """The stage's per-request lines: [(finished at, s since the epoch; {field: value})]."""
    out = []
    for line in pathlib.Path(path).read_text(errors="replace").splitlines():
        m = STAGE_LINE.match(line)
        if m:
            at = datetime.datetime.fromisoformat(m[1].replace("Z", "+00:00")).timestamp()
            out.append((at, dict(zip(STAGE_FIELDS, map(int, m.groups()[1:])))))
    return sorted(out, key=lambda x: x[0])


def first_in_stage(groups, lines):
    """Per burst, the stage's first finished tokenization from its first arrival on (to
    the next burst's): {field: value} (times in ms), or None."""
    starts = [float(g[0]["start_s"]) for g in groups] + [float("inf")]
    out = []
    for start, end in zip(starts, starts[1:]):
        hit = next((f for at, f in lines if start <= at < end), None)
        out.append(hit and {k: v if k == "tokens" else v / 1000 for k, v in hit.items()})
    return out


def read_bursts(path, gap_s):
    """An access log's requests, grouped into bursts; and its stage's lines ([] if the
    stage's log is not beside it)."""
    entries = [json.loads(x) for x in pathlib.Path(path).read_text().splitlines() if x.strip()]
    stage_log = pathlib.Path(str(path).removesuffix(".access.jsonl") + ".stage.log")
    return bursts(entries, gap_s), stage_lines(stage_log) if stage_log.exists() else []


def first_to_upstream(group):
    """The times of the request of `group` that reached its upstream first."""
    return times(min(group, key=lambda e: number(e["to_upstream_us"]) or 1 << 62))


def per_burst(path, count, gap_s):
    """The first `count` bursts one by one: each one's first request's times, and the
    stage's first finished tokenization in it (ms)."""
    groups, lines = read_bursts(path, gap_s)
    groups = groups[:count]
    out = []
    for g, st in zip(groups, first_in_stage(groups, lines)):
        row = {k: v / 1000 for k, v in first_to_upstream(g).items() if v is not None}
        row["last to upstream"] = max(number(e["to_upstream_us"]) or 0 for e in g) / 1000
        row.update({f"stage {k}": v for k, v in (st or {}).items() if k != "tokens"})
        out.append(row)
    return out


def report(path, skip, gap_s):
    groups, lines = read_bursts(path, gap_s)
    groups = groups[skip:]
    if not groups:
        return {"log": str(path), "bursts": 0}
    every = [times(e) for g in groups for e in g]
    r = {"log": str(path), "bursts": len(groups), "requests": len(every),
         "first": summary([first_to_upstream(g) for g in groups]), "every": summary(every)}
    if lines:
        found = [f for f in first_in_stage(groups, lines) if f]
        r["first in the stage"] = {k: (statistics.median(f[k] for f in found), min(f[k] for f in found),
                                       max(f[k] for f in found)) for k in STAGE_FIELDS} if found else {}
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--skip", type=int, default=0, help="bursts to leave out at the start (the warm-up's)")
    ap.add_argument("--gap-s", type=float, default=0.05, help="a gap between arrivals that starts a new burst")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--per-burst", type=int, metavar="N",
                    help="instead: the first N bursts one by one (what a router pays after its start)")
    args = ap.parse_args()
    if args.per_burst:
        for path in args.logs:
            print(f"\n{path}:")
            for i, row in enumerate(per_burst(path, args.per_burst, args.gap_s)):
                print(f"  burst {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        return
    reports = [report(p, args.skip, args.gap_s) for p in args.logs]
    if args.json:
        print(json.dumps(reports, indent=1))
        return
    for r in reports:
        print(f"\n{r['log']}: {r['bursts']} bursts, {r.get('requests', 0)} requests")
        for which in ("first", "every", "first in the stage"):
            for name, (med, lo, hi) in r.get(which, {}).items():
                unit = "" if name == "tokens" else " ms"
                print(f"  {which:18} {name:14} {med:8.2f}{unit}  ({lo:.2f}–{hi:.2f})")


if __name__ == "__main__":
    main()
