"""Served names derived from model paths (no torch: the command line names its models before loading)."""

from __future__ import annotations

import os
import re

_GGUF_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|b?f(?:16|32))$", re.IGNORECASE)


def derive_model_name(path: str) -> str:
    """Served name from a path: ``.../SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``,
    ``.../models--org--name/snapshots/<rev>`` -> ``org/name``, else the directory name."""
    normalized = os.path.normpath(os.path.abspath(path))
    match = re.search(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots", normalized)
    if match:
        return f"{match.group(1)}/{match.group(2)}"
    base = os.path.basename(normalized)
    if base.endswith(".gguf"):
        base = _GGUF_QUANT_SUFFIX.sub("", base[: -len(".gguf")])
    return base
