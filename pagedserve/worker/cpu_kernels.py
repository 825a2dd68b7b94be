"""Optional C++ kernels for CPUs, built on first use with torch.utils.cpp_extension (cached afterwards).

``load_cpu_kernels()`` returns the compiled module, or None when it cannot be built (no compiler,
no ninja): callers then fall back to the plain PyTorch reference path.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from types import ModuleType

logger = logging.getLogger(__name__)

STALE_LOCK_S = 600  # a build takes well under a minute
_CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
_SOURCES = [os.path.join(_CSRC, name) for name in ("bindings.cpp", "paged_attention_cpu.cpp", "fused_ops_cpu.cpp")]


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        _remove_stale_build_lock("pagedserve_cpu_kernels")

        # NOTE: no -ffast-math: it links crtfastmath, which turns on flush-to-zero for the whole process
        flags = ["-O3", "-fopenmp", "-march=native"]
        module = load(name="pagedserve_cpu_kernels", sources=_SOURCES, extra_include_paths=[_CSRC], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference path"
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch reference attention", exc)
        return None
    return module


def _remove_stale_build_lock(name: str) -> None:
    """A build killed half-way leaves its lock file behind, and every later build would wait on it forever."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(name, False), "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
    except (ImportError, OSError):
        pass
