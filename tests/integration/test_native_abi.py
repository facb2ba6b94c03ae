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
