"""A small C++ kernel of the native engine (lora_rows.cpp, decode_attention.cpp), compiled once
per machine with the system C++ compiler (g++ -O3 -march=native -fopenmp) into
$POLYSERVE_HOME/kernels/, keyed by the source, the flags, the compiler and the CPU, and loaded
with ctypes. Where no compiler works, `load()` gives None and `error()` says why: the caller
runs torch ops instead (auto) or fails (on).

-fopenmp: the library's libgomp.so.1 is torch's, already loaded, so a kernel's parallel region
runs on the calling thread's own OpenMP team (server/infra/openmp.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from adapters_store.backbone.home import polyserve_home

log = logging.getLogger("polyserve.engine")

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(cxx: str, source: Path, target: Path, extra: tuple[str, ...] = ()) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cxx, *FLAGS, *extra, "-o", str(out), str(source)]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-800:]}")
        os.replace(out, target)  # atomic: another process never loads a half-written library


class CppKernel:
    """One exported function of one source file, built and loaded on first use."""

    def __init__(self, source: Path, symbol: str, argtypes: list[Any], restype: Any, what: str,
                 headers: tuple[Path, ...] = (), flags: tuple[str, ...] = ()) -> None:
        """headers: the files next to the source that it includes (part of the build's key); flags:
        compiler flags after FLAGS (e.g. -mno-avx512f: the build a CPU without AVX-512 gets)."""
        self.source, self.symbol, self.what, self.headers, self.flags = source, symbol, what, headers, flags
        self._argtypes, self._restype = argtypes, restype
        self._lock = threading.Lock()
        self._fn: Any = None
        self._error: str | None = None
        self._companions: dict[str, CppKernel] = {}

    def load(self) -> Any:
        """The ctypes function, built on first use; None (and the reason in `error()`) where it
        cannot be built or loaded."""
        fn = self._fn  # once loaded, no lock: kernels are called several times a layer
        if fn is not None:
            return fn
        with self._lock:
            if self._fn is not None or self._error is not None:
                return self._fn
            try:
                cxx = _compiler()
                if cxx is None:
                    raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
                version = subprocess.run([cxx, "--version"], check=False, capture_output=True, text=True,
                                         timeout=30).stdout
                text = self.source.read_bytes() + b"".join(h.read_bytes() for h in self.headers)
                key = hashlib.sha256(text + " ".join([*FLAGS, *self.flags]).encode() + version.encode()
                                     + _cpu_key().encode()).hexdigest()[:16]
                target = polyserve_home() / "kernels" / f"{self.source.stem}-{key}.so"
                if not target.exists():
                    log.info("building the native %s kernel: %s", self.what, target)
                    _build(cxx, self.source, target, self.flags)
                fn = getattr(ctypes.CDLL(str(target)), self.symbol)
                fn.argtypes, fn.restype = self._argtypes, self._restype
                self._fn = fn
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
                self._error = str(exc)
                log.warning("native %s kernel unavailable, torch ops instead: %s", self.what, exc)
            return self._fn

    def error(self) -> str | None:
        return self._error

    def companion(self, symbol: str, argtypes: tuple[Any, ...] = (), restype: Any = ctypes.c_int) -> CppKernel:
        """Another exported function of the same library (one per symbol, kept)."""
        with self._lock:
            if symbol not in self._companions:
                self._companions[symbol] = CppKernel(self.source, symbol, list(argtypes), restype,
                                                     f"{self.what} ({symbol})", self.headers, self.flags)
            return self._companions[symbol]

    def with_flags(self, flags: tuple[str, ...]) -> CppKernel:
        """The same kernel built with these extra flags (a library of its own)."""
        return CppKernel(self.source, self.symbol, self._argtypes, self._restype, self.what, self.headers,
                         self.flags + flags)
