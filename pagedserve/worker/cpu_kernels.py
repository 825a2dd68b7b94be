"""Optional C++ kernels for CPUs, built on first use with torch.utils.cpp_extension (cached afterwards).

``load_cpu_kernels()`` returns the compiled module, or None when it cannot be built (no compiler,
no ninja): callers then fall back to the plain PyTorch reference path.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc", "paged_attention_cpu.cpp")


@functools.cache
def load_cpu_kernels() -> ModuleType | None:
    if os.environ.get("PAGEDSERVE_DISABLE_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # NOTE: no -ffast-math: it links crtfastmath, which turns on flush-to-zero for the whole process
        flags = ["-O3", "-fopenmp", "-march=native"]
        module = load(name="pagedserve_cpu_kernels", sources=[_SOURCE], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference path"
        logger.warning("C++ CPU kernels unavailable (%s); using the PyTorch reference attention", exc)
        return None
    return module
