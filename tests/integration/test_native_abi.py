"""The native module's FFI declarations (native/src/abi.rs) against the Envoy binary the
suite runs: every declared callback is exported by it, and the argument registers and
stack slots its machine code reads fit the declaration (native/check_abi.py). An Envoy
upgrade that changes a signature fails here, before a module built on it crashes."""
import platform
import subprocess
import sys

import pytest

from harness import ROOT

# The check reads x86-64 machine code (SysV argument registers).
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="check_abi.py reads x86-64 code")


def test_every_declared_callback_is_exported_with_the_declared_arguments():
    r = subprocess.run([sys.executable, str(ROOT / "native" / "check_abi.py"), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "callbacks declared" in r.stdout


def test_a_wrong_declaration_is_caught(tmp_path):
    abi = (ROOT / "native" / "src" / "abi.rs").read_text()
    # The logging callback's message argument, dropped: the binary reads one more register.
    broken = abi.replace("message: ModuleBuffer", "", 1)
    assert broken != abi
    path = tmp_path / "abi.rs"
    path.write_text(broken)
    r = subprocess.run([sys.executable, str(ROOT / "native" / "check_abi.py"), "--quiet", "--abi", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "BAD envoy_dynamic_module_callback_log" in r.stdout


def _hook_tables():
    sys.path.insert(0, str(ROOT / "native"))
    import check_abi
    return check_abi.parse_hook_tables((ROOT / "native" / "src" / "abi.rs").read_text())


def test_the_module_exports_every_hook_the_loader_requires_as_the_tables_declare_them():
    """The built libkvroute_native.so exports every hook of abi.rs's tables marked required
    (and all 17 bootstrap hooks, which the 1.40 loader resolves), nothing that is not a
    known hook, and each definition in native/src takes as many arguments as its row."""
    import re
    from harness import NATIVE
    tables = _hook_tables()
    abi = (ROOT / "native" / "src" / "abi.rs").read_text()
    required = {n for n in tables if n.startswith("envoy_dynamic_module_on_bootstrap_extension_")}
    required |= {"envoy_dynamic_module_on_" + m for m in re.findall(r"//! \| `(\w+)` \(required\)", abi)}
    assert len(required) == 17 + 21, sorted(required)
    out = subprocess.run(["nm", "-D", "--defined-only", str(NATIVE)], capture_output=True, text=True,
                         check=True).stdout
    exported = set(re.findall(r" T (envoy_dynamic_module_on_\w+)$", out, re.M))
    assert required <= exported, sorted(required - exported)
    assert exported <= set(tables), sorted(exported - set(tables))
    source = "".join(p.read_text() for p in sorted((ROOT / "native" / "src").glob("*.rs")))
    defined = {m.group(1): [p for p in m.group(2).replace("\n", " ").split(",") if p.strip()]
               for m in re.finditer(r'extern "C" fn (envoy_dynamic_module_on_\w+)\((.*?)\)', source, re.S)}
    assert set(defined) == exported
    for name, params in defined.items():
        assert len(params) == len(tables[name]), (name, params, tables[name])


def test_the_module_binds_every_envoy_symbol_at_load():
    """An Envoy that lacks a callback the module calls refuses the module at load, naming
    the symbol (BIND_NOW), instead of crashing on its first call; every callback it needs
    is one check_abi.py checked."""
    import re
    from harness import NATIVE
    dynamic = subprocess.run(["readelf", "-d", str(NATIVE)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"\(FLAGS\)\s+BIND_NOW", dynamic) or re.search(r"FLAGS_1.*\bNOW\b", dynamic), dynamic
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(NATIVE)], capture_output=True, text=True,
                               check=True).stdout
    needed = set(re.findall(r"(envoy_dynamic_module_callback_\w+)", undefined))
    declared = set(re.findall(r"pub fn (envoy_dynamic_module_callback_\w+)\(",
                              (ROOT / "native" / "src" / "abi.rs").read_text()))
    assert needed and needed <= declared, sorted(needed - declared)


def test_an_envoy_without_a_callback_refuses_the_module_at_load(tmp_path):
    """What an Envoy of another version that lacks a callback kvroute calls does with the
    module: refuses it at load, naming the symbol, with a rejected configuration (a clear
    error, not a crash on the first request). Simulated by renaming one of the module's
    undefined symbols in a copy of it (same length: the ELF stays valid)."""
    import json
    import yaml
    from harness import ENVOY_NATIVE_YAML, NATIVE, envoy_binary
    data = NATIVE.read_bytes()
    name = b"envoy_dynamic_module_callback_http_set_upstream_override_host"
    assert data.count(name + b"\0") >= 1  # .dynstr (and .strtab)
    broken = tmp_path / "libkvroute_native.so"
    broken.write_bytes(data.replace(name + b"\0", name[:-1] + b"X\0"))
    cfg = yaml.safe_load(ENVOY_NATIVE_YAML.read_text())
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(cfg).replace("target/release/libkvroute_native.so", str(broken)))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]  # an error exit, not a signal
    assert "undefined symbol: " + name[:-1].decode() + "X" in out, out[-3000:]
