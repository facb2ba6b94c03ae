"""Where the built binaries and the shipped configuration are."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
WASM = ROOT / "target" / "wasm32-unknown-unknown" / "release" / "kvroute.wasm"
NATIVE = ROOT / "target" / "release" / "libkvroute_native.so"  # the dynamic module
SIDECAR = ROOT / "target" / "release" / "kvroute-sidecar"
FLEET = ROOT / "target" / "release" / "kvroute-fleet"
TOKENIZER = ROOT / "target" / "release" / "kvroute-tokenizer"
ENVOY_YAML = ROOT / "envoy" / "envoy.yaml"
ENVOY_NATIVE_YAML = ROOT / "envoy" / "envoy-native.yaml"
WORKERS_EDS_YAML = ROOT / "envoy" / "workers-eds.yaml"  # the `workers` cluster from the sidecar (EDS)
TOKENIZER_DIR = ROOT / "target" / "tokenizers" / "qwen3"  # scripts/fetch-tokenizer.sh
