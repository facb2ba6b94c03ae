#!/usr/bin/env bash
# Runs the libFuzzer targets (fuzz/fuzz_targets/) for a chosen time each, one after the other.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET…]     default: 60 s, every target
#   JOBS=2 scripts/fuzz.sh 600                          two fuzzing processes per target
#
# cargo-fuzz needs nightly flags (-Zsanitizer); the pinned stable compiler takes them with
# RUSTC_BOOTSTRAP=1, so no second toolchain is installed. Builds with AddressSanitizer and
# debug assertions (overflow checks on). Each target's working corpus starts from the
# checked-in seeds (fuzz/corpus/<target>) in target/fuzz-corpus/<target> and grows there;
# the checked-in corpus stays small. A crash leaves its input in fuzz/artifacts/<target>/:
# fix the bug, then copy the input into fuzz/regressions/<target>/, where the ordinary test
# run (invariants/tests/corpus.rs) replays it from then on.
# Each target's last status line (executions, coverage, corpus) goes to
# target/fuzz-logs/<target>.log; docs/reliability.md records the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz@0.13.2
./scripts/fetch-tokenizer.sh  # stage_request runs on the real Qwen3 tokenizer
export RUSTC_BOOTSTRAP=1
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cd fuzz && cargo fuzz list)
fi
mkdir -p target/fuzz-logs
(cd fuzz && cargo fuzz build --debug-assertions)
for t in "${targets[@]}"; do
  corpus=target/fuzz-corpus/$t
  mkdir -p "$corpus" "fuzz/artifacts/$t"
  cp -n fuzz/corpus/"$t"/* "$corpus"/ 2>/dev/null || true
  echo "==> $t for ${seconds}s"
  # libFuzzer's -jobs runs fuzzers in child processes that log to fuzz-N.log instead.
  parallel=()
  if [ "${JOBS:-1}" -gt 1 ]; then parallel=(-jobs="$JOBS" -workers="$JOBS"); fi
  (cd fuzz && cargo fuzz run --debug-assertions "$t" "../$corpus" -- \
     -max_total_time="$seconds" "${parallel[@]}" -print_final_stats=1 \
     -timeout=10 -rss_limit_mb=2048 -max_len=65536) >"target/fuzz-logs/$t.log" 2>&1 || echo "$t: CRASH (see target/fuzz-logs/$t.log)"
  # (A target that failed to build matches nothing: the run goes on to the next.)
  grep -E "^#[0-9]+ +DONE|stat::number_of_executed_units|stat::peak_rss|ERROR|panicked|^error" \
    "target/fuzz-logs/$t.log" | tail -4 || true
done
# The figures docs/reliability.md records, one row per target run above.
python3 - "${targets[@]}" <<'PY'
import re, sys
print("| target | executions | exec/s | coverage (edges) | features | corpus | peak RSS MB |")
print("|---|---:|---:|---:|---:|---:|---:|")
for t in sys.argv[1:]:
    log = open(f"target/fuzz-logs/{t}.log", errors="replace").read()
    stat = dict(re.findall(r"stat::(\w+):\s+(\d+)", log))
    last = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", log)
    cov, ft, corp = last[-1] if last else ("?", "?", "?")
    crashed = " (CRASH)" if re.search(r"panicked|ERROR: (AddressSanitizer|libFuzzer)", log) else ""
    print(f"| `{t}`{crashed} | {stat.get('number_of_executed_units', '?')} | {stat.get('average_exec_per_sec', '?')} "
          f"| {cov} | {ft} | {corp} | {stat.get('peak_rss_mb', '?')} |")
PY
