"""Optional C++ kernels for CPUs, built on first use with torch.utils.cpp_extension (cached afterwards).

``load_cpu_kernels()`` returns the compiled module, or None when it cannot be built (no compiler,
no ninja): callers then fall back to the plain PyTorch reference path. The build uses
``-march=native``, so its cache entry is named after the CPU's feature flags: a cache shared with
an older CPU (a shared home, a container image) is never loaded there; and after the sources and
where they lie, so that two checkouts never rebuild (or load) each other's module (torch's build
directory records the source paths: a second checkout in the same directory rebuilds it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from types import ModuleType

logger = logging.getLogger(__name__)

STALE_LOCK_S = 600  # a build on 2 idle cores takes a few minutes at most
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")  # pagedserve/kernels/csrc
_SOURCE_NAMES = (
    "bindings.cpp",
    "paged_attention_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "fused_ops_cpu.cpp",
    "sampling_cpu.cpp",
    "linear_amx_cpu.cpp",
    "linear_avx512_bf16_cpu.cpp",
    "linear_quant_cpu.cpp",
)
_SOURCES = [os.path.join(_CSRC, name) for name in _SOURCE_NAMES]


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        name = f"pagedserve_cpu_kernels_{_cpu_fingerprint()}_{_sources_fingerprint()}"
        _remove_stale_build_lock(name)

        # NOTE: no -ffast-math: it links crtfastmath, which turns on flush-to-zero for the whole process
        flags = ["-O3", "-fopenmp", "-march=native"]
        module = load(
            name=name,
            sources=_SOURCES,
            extra_include_paths=[_CSRC],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference path"
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch reference attention", exc)
        return None
    return module


def _sources_fingerprint() -> str:
    """8 hex digits naming the kernel sources and their directory: two checkouts never share a build."""
    digest = hashlib.sha256(_CSRC.encode())
    for path in sorted(_SOURCES + [os.path.join(_CSRC, n) for n in os.listdir(_CSRC) if n.endswith(".h")]):
        with open(path, "rb") as source:
            digest.update(source.read())
    return digest.hexdigest()[:8]


def _cpu_fingerprint() -> str:
    """8 hex digits naming the CPU's instruction set (its /proc/cpuinfo flags, else the machine type)."""
    features = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    features += " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return hashlib.sha256(features.encode()).hexdigest()[:8]


def _remove_stale_build_lock(name: str) -> None:
    """A build killed half-way leaves its lock file behind, and every later build would wait on it forever."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(name, False), "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
    except (ImportError, OSError):
        pass
