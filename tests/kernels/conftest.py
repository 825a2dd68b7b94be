"""The ``kernels`` fixture: the compiled C++ kernels, or a skip where this machine lacks what a module needs."""

from __future__ import annotations

import pytest

from tests.utils import cpu_kernels_or_skip


@pytest.fixture(scope="module")
def kernels(request):
    """The kernel module with the capability the test module names in ``REQUIRED_KERNEL = (method, skip reason)``."""
    capability, reason = getattr(request.module, "REQUIRED_KERNEL", (None, "the C++ kernels could not be built here"))
    return cpu_kernels_or_skip(capability, reason)
