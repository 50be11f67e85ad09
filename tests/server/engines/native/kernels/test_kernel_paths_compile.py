"""Each instruction-set path of the weight kernels compiles, on any x86 host with g++: the paths this
CPU does not run are built for a CPU that has them (-march=...) and their object code is checked for
the instructions that path exists for. The kernels' own tests run only the paths of the host's CPU
(an AMX path is never run on a CPU without AMX), so without this a broken path would go unseen until
a host of its kind ran it."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from server.engines.native.kernels import cpp_kernel

NATIVE = Path(cpp_kernel.__file__).parent
# (source, target flags, an instruction the path's object code must hold, one it must not)
PATHS = [
    ("quant_linear_bf16.cpp", ["-march=sapphirerapids"], "tdpbf16ps", "vdpbf16ps"),
    ("quant_linear_bf16.cpp", ["-march=sapphirerapids", "-mno-amx-tile"], "vdpbf16ps", "tdpbf16ps"),
    ("quant_linear.cpp", ["-march=skylake-avx512"], "zmm", None),
    ("quant_linear.cpp", ["-march=haswell"], "vfmadd", "zmm"),
]

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or cpp_kernel._compiler() is None or shutil.which("objdump") is None,
    reason="needs an x86 host with a C++ compiler and objdump")


@pytest.mark.parametrize("source, target, has, lacks", PATHS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_each_path_compiles_into_its_instructions(tmp_path, source, target, has, lacks):
    cxx = cpp_kernel._compiler()
    flags = [f for f in cpp_kernel.FLAGS if f not in ("-march=native", "-shared")]
    probe = subprocess.run([cxx, *target, "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True,
                           text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"{cxx} does not know {' '.join(target)}: {probe.stderr.strip()[-200:]}")
    obj = tmp_path / "kernel.o"
    built = subprocess.run([cxx, *flags, *target, "-c", "-o", str(obj), str(NATIVE / source)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-2000:]
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                          check=True).stdout
    assert has in code
    if lacks is not None:
        assert lacks not in code
