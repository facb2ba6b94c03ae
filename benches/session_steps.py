#!/usr/bin/env python3
"""Per step of a multi-turn workload (chat, agentic), each line's hit rate and TTFT, from
the per-request samples `peers.py --keep-samples` kept; for a line whose samples name the
engine (the fleet's engines, or kvroute's `route` when its line sets `debug_header`), how
many conversations each engine carried over time (on the mocker, for any router: from the
engines' own in-flight gauges, which peers.py reads every half second with --keep-samples,
and which conversations shared an engine, from their started-request counters), how many
conversations changed engine at each step, and how often the router's own count of a
request's cache hits exceeded what the engine found, per step and in all (the
blocks were evicted between the decision and the prefill, or the router's view was
stale), where each conversation's first step went and what chose each move, and a fit of
the TTFTs to the terms the cost prices (what a block of each costs a first token).

    python3 benches/peers.py --sim mocker --workloads agentic_70 --keep-samples --out DIR \\
        --lines kvroute_dbg,vllm_router_cache_aware \\
        --kvroute 'kvroute_dbg={"overlap_weight":1,"debug_header":"x-kvroute-debug"}'
    python3 benches/session_steps.py DIR/samples/agentic_70.*.json
    python3 benches/session_steps.py --stagger DIR*/samples/agentic_70.kvroute*.json

--stagger pools the engines of every run given: how far apart the conversations sharing an
engine reached their late steps, against the hit rate of those steps.

A step is a request's turn within its conversation (the samples' `key`), in sending order.
"""
import argparse
import bisect
import collections
import json
import pathlib
import statistics

# kvroute's and the simulators' block size in the head-to-head (peers.py).
BLOCK_TOKENS = 16


def route_fields(sample):
    """The `x-kvroute-debug` fields (worker=..;hits=..;...) of a sample, or {}."""
    return dict(kv.split("=", 1) for kv in (sample.get("route") or "").split(";") if "=" in kv)


def engine_of(sample):
    return sample.get("worker") or route_fields(sample).get("worker") or ""


def found_tokens(sample):
    """The prompt tokens the engine found cached, as it reported them."""
    return sample["cached_tokens"]


def counted_tokens(sample):
    """The prompt tokens the router counted as cached (kvroute's debug header), at most the
    prompt."""
    return min(int(route_fields(sample)["hits"]) * BLOCK_TOKENS, sample["prompt_tokens"])


def hit_rate(samples, cached=found_tokens):
    """Cached ÷ prompt tokens over `samples`."""
    return sum(map(cached, samples)) / max(1, sum(x["prompt_tokens"] for x in samples))


def by_step(samples):
    """{step: [sample]} with steps counted from 1 per conversation, in sending order."""
    seen, steps = collections.Counter(), collections.defaultdict(list)
    for s in sorted(samples, key=lambda s: s["sent_s"]):
        seen[s["key"]] += 1
        steps[seen[s["key"]]].append(s)
    return steps


def step_table(runs):
    """Markdown: per line, each step's cached ÷ prompt tokens and median TTFT (model ms)."""
    n = max(len(by_step(r["samples"])) for r in runs.values())
    head = "| line | " + " | ".join(f"step {i}" for i in range(1, n + 1)) + " | all |"
    rows = [head, "|---|" + "---:|" * (n + 1)]
    for label, r in runs.items():
        cells = []
        for i, xs in sorted(by_step(r["samples"]).items()):
            cells.append(f"{hit_rate(xs):.2f}, {statistics.median(x['ttft_ms'] for x in xs) * r['speedup']:.0f}")
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {hit_rate(r['samples']):.2f} |")
    return "\n".join(rows)


def conversations_placed(xs, inflight):
    """{conversation key: engine} for the conversations the engines' started-request counters
    (peers.py reads them every half second with --keep-samples on the mocker) put on one
    engine throughout, for a line whose samples do not name engines.

    A request's candidates are the engines whose counters rose in the reading interval it
    was sent in or the next; a conversation's engine is the one engine every step of it had
    as a candidate (a router that moved it, or two engines started together each time, leave
    it out). The samples' clock starts when the load generator has read its tokenizer, some
    tenths of a second after peers.py marked its start: the lag (searched over 0–2 s) at
    which the most requests find a rise in their window is taken, and among those the one
    that places the most conversations."""
    rows = [row for row in inflight.get("samples", []) if len(row) == 3 and None not in row[2]]
    if inflight.get("load_started_s") is None or len(rows) < 2:
        return {}
    engines = inflight["engines"]
    starts = [row[0] for row in rows[1:]]
    rises = [{engines[i] for i, (u, v) in enumerate(zip(a[2], b[2])) if v > u} for a, b in zip(rows, rows[1:])]
    by_key = collections.defaultdict(list)
    for x in xs:
        by_key[x["key"]].append(x["sent_s"])

    def placed(lag):
        """(requests some engine started in their window, {key: engine}) at this lag."""
        out, found = {}, 0
        for key, sent in by_key.items():
            common = set(engines)
            for t in sent:
                i = bisect.bisect_left(starts, inflight["load_started_s"] + lag + t)
                candidates = set().union(*rises[i:i + 2])
                found += bool(candidates)
                common &= candidates
            if len(common) == 1:
                out[key] = common.pop()
        return found, out

    # At the right lag every request finds a rise in its window; a wrong one can still
    # place a few by coincidence.
    return max((placed(lag / 20) for lag in range(41)), key=lambda p: (p[0], len(p[1])))[1]


def stagger_rows(xs):
    """[(spread, hit, conversations)] per engine that carried several conversations to their
    second-to-last step: how far apart (the standard deviation of their send times, wall s)
    they reached it, the hit rate of their last two steps, and how many they were.
    Conversations whose memory peaks coincide on one engine outgrow it together, and evict
    each other's histories."""
    steps = collections.defaultdict(list)
    for x in sorted(xs, key=lambda x: x["sent_s"]):
        steps[x["key"]].append(x)
    if not steps:
        return []
    n = max(map(len, steps.values()))
    groups = collections.defaultdict(list)
    for st in steps.values():
        if len(st) == n and engine_of(st[n - 2]):
            groups[engine_of(st[n - 2])].append(st[n - 2:])
    return [(statistics.pstdev(last[0]["sent_s"] for last in g), hit_rate([x for last in g for x in last]), len(g))
            for g in groups.values() if len(g) > 1]


def stagger_table(runs):
    """Every engine of every run that carried the most common number of conversations
    pooled, by how far apart its conversations reached their second-to-last step: the hit
    rate of their last two steps."""
    rows = [row for r in runs.values() for row in stagger_rows(r["samples"])]
    if not rows:
        return "no engine carried several conversations to their last steps"
    most = collections.Counter(n for *_, n in rows).most_common(1)[0][0]
    rows = sorted((spread, hit) for spread, hit, n in rows if n == most)
    out = [f"{len(rows)} engines carrying {most} conversations each to their last steps, from {len(runs)} runs", "",
           "| the conversations reach their second-to-last step | engines | hit rate of the last two steps, mean (range) |",
           "|---|---:|---|"]
    for lo, hi in ((0, 5), (5, 7.5), (7.5, 10), (10, float("inf"))):
        hits = [h for spread, h in rows if lo <= spread < hi]
        if hits:
            span = f"{lo}–{hi} s apart" if hi != float("inf") else f"≥ {lo} s apart"
            out.append(f"| {span} (standard deviation) | {len(hits)} | {statistics.fmean(hits):.2f} ({min(hits):.2f}–{max(hits):.2f}) |")
    if len(rows) > 2:
        out.append(f"\ncorrelation of spread and hit rate: {statistics.correlation(*zip(*rows)):.2f}")
    return "\n".join(out)


def engine_report(label, r, every_s):
    """Requests in flight per engine every `every_s` seconds (wall), and the router's
    counted hits against the engine's, for a line whose samples name engines."""
    xs = r["samples"]
    if not all(engine_of(x) for x in xs):
        if r.get("engine_inflight"):
            return sampled_report(label, r["engine_inflight"], every_s, xs)
        return f"{label}: the samples do not name engines"
    end = max(x["sent_s"] + x["e2e_ms"] / 1000 for x in xs)
    engines = sorted({engine_of(x) for x in xs})
    out = [f"{label}: requests in flight per engine ({', '.join(e.rsplit(':', 1)[-1] for e in engines)})"]
    t = every_s
    while t < end:
        live = collections.Counter(engine_of(x) for x in xs if x["sent_s"] <= t < x["sent_s"] + x["e2e_ms"] / 1000)
        out.append(f"  t={t:5.0f} s  " + " ".join(f"{live[e]:3d}" for e in engines))
        t += every_s
    out.extend(step_moves(xs))
    out.append(ttft_terms(xs, r["speedup"]))
    counted = [(int(route_fields(x)["hits"]) * BLOCK_TOKENS, x) for x in xs if "hits" in route_fields(x)]
    if counted:
        short = [(c - x["cached_tokens"], x) for c, x in counted if c - x["cached_tokens"] >= BLOCK_TOKENS]
        believed, found = (hit_rate([x for _, x in counted], cached) for cached in (counted_tokens, found_tokens))
        out.append(f"  the router counted a hit rate of {believed:.2f}, the engines found {found:.2f}; "
                   f"{len(short)} of {len(counted)} requests found at least a block less than counted")
    return "\n".join(out)


# kvroute's debug-header flags of a decision that passed the cheapest worker over.
MOVE_REASONS = {"spilled": "wait limit", "memory": "memory limit", "holder": "holder tie"}


def step_moves(xs):
    """Per step: how many conversations went to another engine than their previous step's,
    how many first steps each engine took, and, where the samples carry kvroute's debug
    header, what chose each move (the cost, or a limit or tie passing the cheapest over)
    and the hit rate the router counted against what the engines found (a gap: blocks
    evicted between the decision and the prefill)."""
    steps = by_step(xs)
    last, moved, why = {}, collections.Counter(), collections.Counter()
    for i, group in sorted(steps.items()):
        for x in group:
            e = engine_of(x)
            if x["key"] in last and last[x["key"]] != e:
                moved[i] += 1
                # What kvroute's debug header says passed the cheaper worker over, if anything.
                why[next((MOVE_REASONS[k] for k in MOVE_REASONS if k in route_fields(x)), "cost")] += 1
            last[x["key"]] = e
    first = collections.Counter(engine_of(x) for x in steps[1])
    out = ["  conversations that changed engine, per step:".ljust(50) + " ".join(
        "   -" if i == 1 else f"{moved[i]:4d}" for i in sorted(steps)),
           f"  first steps per engine, most first: {' '.join(map(str, sorted(first.values(), reverse=True)))}"]
    if all("hits" in route_fields(x) for x in xs):
        if why:
            out.append("  the moves by what chose the new engine: " +
                       ", ".join(f"{n} {k}" for k, n in why.most_common()))
        for name, cached in (("the router counted", counted_tokens), ("the engines found", found_tokens)):
            rates = (hit_rate(g, cached) for _, g in sorted(steps.items()))
            out.append(f"  hit rate {name}, per step:".ljust(50) + " ".join(f"{r:4.2f}" for r in rates))
    return out


def ttft_terms(xs, speedup):
    """A least-squares fit of each request's TTFT (model ms) to the three quantities the
    cost prices, on the engine that served it: its own uncached blocks (as the engine found
    them), the uncached blocks of requests sent there before it whose first token had not
    come (prefill queued ahead), and the prompt blocks of requests in flight there (load).
    Its coefficients are what a block of each costs a request's first token; their ratio is
    what a weight learned from TTFTs would set."""
    by_engine = collections.defaultdict(list)
    for x in xs:
        by_engine[engine_of(x)].append(x)

    def miss(x):
        return (x["prompt_tokens"] - x["cached_tokens"]) / BLOCK_TOKENS

    rows, ys = [], []
    for x in xs:
        t = x["sent_s"]
        before = [o for o in by_engine[engine_of(x)] if o is not x and o["sent_s"] <= t]
        queued = sum(miss(o) for o in before if o["sent_s"] + o["ttft_ms"] / 1000 > t)
        load = sum(o["prompt_tokens"] / BLOCK_TOKENS for o in before if o["sent_s"] + o["e2e_ms"] / 1000 > t)
        rows.append([1.0, miss(x), queued, load])
        ys.append(x["ttft_ms"] * speedup)
    coef = least_squares(rows, ys)
    if coef is None:
        return "  TTFT fit: the terms do not vary enough to fit"
    mean = statistics.fmean(ys)
    residual = sum((y - sum(c * v for c, v in zip(coef, row))) ** 2 for row, y in zip(rows, ys))
    r2 = 1 - residual / max(1e-9, sum((y - mean) ** 2 for y in ys))
    _, per_miss, per_queued, per_load = coef
    line = (f"  TTFT fit (model ms a block): {per_miss:.2f} uncached, {per_queued:.2f} queued for prefill "
            f"ahead, {per_load:.3f} in flight; R² {r2:.2f}")
    return line + (f"; an uncached block costs {per_miss / per_load:.0f}× a block in flight" if per_load > 0 else "")


def least_squares(rows, ys):
    """The coefficients minimising the squared error of rows · c against ys (the normal
    equations, solved by Gaussian elimination), or None when they are singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-9:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [v - f * w for v, w in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def sampled_report(label, inflight, every_s, xs):
    """Requests in flight per engine every `every_s` seconds as peers.py read them from the
    mocker engines' own gauges (the reading nearest each time; t from the line's start,
    ~1 s before the load generator's first request)."""
    engines, rows = inflight["engines"], inflight["samples"]
    out = [f"{label}: requests in flight per engine, from the engines' gauges "
           f"({', '.join(e.rsplit(':', 1)[-1] for e in engines)})"]
    t = every_s
    while rows and t < rows[-1][0]:
        counts = min(rows, key=lambda row: abs(row[0] - t))[1]
        out.append(f"  t={t:5.0f} s  " + " ".join("  ?" if c is None else f"{c:3d}" for c in counts))
        t += every_s
    placed = conversations_placed(xs, inflight)
    if placed:
        engines = collections.Counter(placed.values())
        out.append(f"  the engines' started-request counters put {len(placed)} of {len({x['key'] for x in xs})} "
                   f"conversations on one engine throughout; per engine: "
                   f"{' '.join(str(engines[e]) for e in inflight['engines'])}")
        ys = [{**x, "worker": placed[x["key"]]} for x in xs if x["key"] in placed]
        for spread, hit, n in sorted(stagger_rows(ys)):
            out.append(f"    {n} conversations whose second-to-last steps came {spread:4.1f} s apart (standard "
                       f"deviation): their last two steps' hit rate {hit:.2f}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples", nargs="+", help="<workload>.<line>.json files from peers.py --keep-samples")
    ap.add_argument("--every-s", type=float, default=10.0, help="wall seconds between in-flight counts")
    ap.add_argument("--stagger", action="store_true",
                    help="only the engines of every run pooled: their conversations' late-step hit rate by how far "
                         "apart they reached their late steps")
    args = ap.parse_args()
    runs = {}
    for f in args.samples:
        path = pathlib.Path(f)
        r = json.loads(path.read_text())
        # The samples' times are wall clock; the run's results.json (beside samples/) has
        # the speed-up that turns them into model time.
        workload = path.name.split(".", 1)[0]
        results = json.loads((path.parent.parent / "results.json").read_text())
        run = [x for x in results["runs"] if (x["workload"], x["label"]) == (workload, r["label"])]
        if not run:
            raise SystemExit(f"{path}: no run of {workload} {r['label']} in {path.parent.parent / 'results.json'}")
        r["speedup"] = run[0]["speedup"]
        r["engine_inflight"] = run[0].get("engine_inflight")
        # A failed request has no TTFT or cache count: the report reads the answered ones.
        failed = sum(not x.get("ok", True) for x in r["samples"])
        if failed:
            print(f"{r['label']}: {failed} failed requests left out")
        r["samples"] = [x for x in r["samples"] if x.get("ok", True)]
        # The same line from two runs: told apart by the run's folder (and its parent's, for
        # peers_seeds.py's seed-N folders).
        label = r["label"]
        if label in runs:
            label = f"{r['label']}@{path.parent.parent.name}"
        if label in runs:
            label = f"{r['label']}@{path.parent.parent.parent.name}/{path.parent.parent.name}"
        runs[label] = r
    if args.stagger:
        print(stagger_table(runs))
        return
    print(step_table(runs))
    for label, r in runs.items():
        print()
        print(engine_report(label, r, args.every_s))


if __name__ == "__main__":
    main()
