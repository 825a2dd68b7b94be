"""The server process's malloc settings: glibc's heap on transparent huge pages (Linux).

Model weights (oneDNN's packed copies included) live in ordinary heap allocations, which glibc
backs with 4 KiB pages unless it is told otherwise before the process starts
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: madvise its mmap'd chunks for THP). Every decode step
streams all the weights, and on 2 MiB pages that pass costs far fewer TLB misses, so the matmuls
run faster (docs/design/cpu-performance.md). ``pagedserve serve`` therefore re-executes itself
once with the tunable added, unless ``PAGEDSERVE_HUGE_PAGE_MALLOC=0``, the C library is not glibc,
or THP is off (``never``).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "PAGEDSERVE_HUGE_PAGE_MALLOC"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages_enabled(mode_file: str = THP_MODE_FILE) -> bool:
    """True if THP is in ``always`` or ``madvise`` mode (the selected mode is the bracketed word)."""
    try:
        with open(mode_file, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return False
    return "[never]" not in text and "[" in text


def environ_with_huge_page_malloc(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, or None when the process already has (or must not get) it."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    if environ.get(OPT_OUT, "1") == "0":
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if any(item.startswith("glibc.malloc.hugetlb=") for item in current.split(":")):
        return None  # set already (by us after the re-exec, or by the user: theirs wins)
    if not transparent_huge_pages_enabled():
        return None
    updated = dict(environ)
    updated["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return updated


def reexec_with_huge_page_malloc(argv: list[str]) -> None:
    """Replace this process (same pid) with ``python -m pagedserve.cli *argv`` under the tunable; returns if not needed."""
    environ = environ_with_huge_page_malloc(os.environ)
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "pagedserve.cli", *argv], environ)
