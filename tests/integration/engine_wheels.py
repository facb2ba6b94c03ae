"""The engines' own KV-event code, loaded from their PyPI wheels without their heavy
dependencies: vLLM 0.33.0's `vllm/distributed/kv_events.py` and SGLang 0.5.23's
`sglang/srt/disaggregation/kv_events.py`, the files that define what goes on the wire.

`scripts/test.sh` downloads the two wheels (`pip download --no-deps`) into
`target/wheels/`; Python imports straight from them (a wheel is a zip). Their top-level
packages import torch, so each parent package is registered bare (a namespace with the
wheel's path and no `__init__`), and only pure-Python modules load. For vLLM, two imports
of `kv_events.py` reach modules that need torch, and they are replaced here by what
`kv_events.py` takes from them:
  - `vllm.config.utils.config` (used by `vllm/config/kv_events.py`, loaded for real): the
    decorator that turns a config class into a pydantic dataclass; here a stdlib
    dataclass (the publisher only records its configuration).
  - `vllm.v1.core.kv_cache_utils.ExternalBlockHash`: `bytes | int`, as on line 57 of that
    file in 0.33.0.
Everything else (`vllm.envs`, `vllm.logger`, `vllm.utils.network_utils`) is vLLM's own.
"""
import dataclasses
import importlib
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "target" / "wheels"
VLLM = "vllm-0.33.0"
SGLANG = "sglang-0.5.23"


def _wheel(dist):
    name, version = dist.split("-")
    found = sorted(WHEELS.glob(f"{name}-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"{dist} wheel not in {WHEELS}: run `python3 -m pip download --no-deps "
                           f"-d {WHEELS} {name}=={version}` (scripts/test.sh does)")
    return str(found[0])


def _bare(name, wheel):
    if name not in sys.modules:
        m = types.ModuleType(name)
        m.__path__ = [wheel + "/" + name.replace(".", "/")]
        sys.modules[name] = m


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m


def vllm_kv_events():
    """vLLM 0.33.0's `vllm.distributed.kv_events` module."""
    if "vllm.distributed.kv_events" in sys.modules:
        return sys.modules["vllm.distributed.kv_events"]
    wheel = _wheel(VLLM)
    sys.path.insert(0, wheel)
    for p in ("vllm", "vllm.distributed", "vllm.v1", "vllm.v1.core", "vllm.config", "vllm.utils"):
        _bare(p, wheel)

    def config(cls=None, **_):
        return dataclasses.dataclass(cls) if cls is not None else dataclasses.dataclass

    _module("vllm.config.utils", config=config)
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return importlib.import_module("vllm.distributed.kv_events")


def sglang_kv_events():
    """SGLang 0.5.23's `sglang.srt.disaggregation.kv_events` module (loads as it is)."""
    if "sglang.srt.disaggregation.kv_events" in sys.modules:
        return sys.modules["sglang.srt.disaggregation.kv_events"]
    wheel = _wheel(SGLANG)
    sys.path.insert(0, wheel)
    for p in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation", "sglang.srt.arg_groups"):
        _bare(p, wheel)
    return importlib.import_module("sglang.srt.disaggregation.kv_events")
