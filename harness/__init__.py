"""The processes kvroute's integration tests, its demo (scripts/demo.py) and its benchmarks
(benches/) run: Envoy with the built filter, the sidecar, the tokenizer stage and the
simulated fleet's mock engines, started on loopback ports and always stopped again.

  - paths:    the built binaries and the shipped configuration
  - procs:    starting, waiting for and stopping processes (Service: a process's directory,
              log and stop; Processes stops all on Ctrl-C), prometheus() for /metrics
  - envoy:    envoy/envoy.yaml (or envoy-native.yaml: BUILDS) rendered for a run, and Envoy
  - services: Sidecar, Tokenizer (the stage), MockEngine; start_fleet, reset_fleet
  - kvfeed:   the feed protocol from its document alone, and a feed server
  - kvevents: KV-event publishers as each vLLM and SGLang release runs them

Scripts put the repository root on sys.path and `from harness import ...`.
"""
from .envoy import (BUILDS, ENVOY_POLICIES, PREFIX_HASH_HEADER, Envoy, envoy_binary, render_config, wait_at_version,
                    wait_synced)
from .paths import ENVOY_NATIVE_YAML, ENVOY_YAML, FLEET, NATIVE, ROOT, SIDECAR, TOKENIZER, TOKENIZER_DIR, WASM
from .procs import Processes, end_children, free_port, ready_or_stop, stop_process, wait_for, wait_http_ok
from .services import MockEngine, Sidecar, Tokenizer, reset_fleet, start_fleet

__all__ = [
    "BUILDS", "ENVOY_POLICIES", "PREFIX_HASH_HEADER", "Envoy", "envoy_binary", "render_config",
    "wait_at_version", "wait_synced",
    "ENVOY_NATIVE_YAML", "ENVOY_YAML", "FLEET", "NATIVE", "ROOT", "SIDECAR", "TOKENIZER", "TOKENIZER_DIR", "WASM",
    "Processes", "end_children", "free_port", "ready_or_stop", "stop_process", "wait_for", "wait_http_ok",
    "MockEngine", "Sidecar", "Tokenizer", "reset_fleet", "start_fleet",
]
