"""The C++ CPU kernels (``csrc/``) and their build: ``load_cpu_kernels()`` compiles them on first use
(``cpu_build.py``) and returns the extension module, or None where they cannot be built.

Layer 1 of the package: above the leaf modules only. The models and the worker hand the module
around; nothing here imports them.
"""

from pagedserve.kernels.cpu_build import load_cpu_kernels

__all__ = ["load_cpu_kernels"]
