"""Tokenizer loading: a ``PreTrainedTokenizerFast`` from a Hugging Face directory or built from GGUF metadata.

For GGUF files the vocabulary is converted with transformers' GGUF converter; special tokens,
BOS/EOS insertion and the chat template are then set from the file's own ``tokenizer.*`` keys.
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedserve.config import ModelConfig
from pagedserve.models.registry import ModelLoadError

# GGUF tokenizer key (without the "tokenizer." prefix) -> transformers' converter argument
_GGUF_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def tokenizer_path(model_config: ModelConfig) -> str:
    """Where the served model's tokenizer is: ``--tokenizer``, else the model (a HF directory or a
    ``.gguf`` file), else the default model's GGUF. Front ends: ``load_tokenizer(tokenizer_path(config.model))``."""
    if model_config.tokenizer:
        return model_config.tokenizer
    if model_config.model:
        return model_config.model
    from pagedserve.models.default_model import default_model_path

    return default_model_path()


def eos_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS id(s) (none when it has no EOS token)."""
    value = getattr(tokenizer, "eos_token_id", None)
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def request_eos_token_ids(model_eos_token_ids: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """What a front end puts in ``EngineCoreRequest.eos_token_ids`` (computed once per model): empty (the
    engine then uses the model's own, ``ModelInfo.eos_token_ids``) unless the tokenizer's EOS is not among
    them; then the model's followed by the tokenizer's, as the loader used to collect them."""
    extra = tuple(t for t in eos_token_ids(tokenizer) if t not in model_eos_token_ids)
    return tuple(model_eos_token_ids) + extra if extra else ()


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """The tokenizer of a Hugging Face model directory or of a ``.gguf`` file (never downloads)."""
    if path.endswith(".gguf") and os.path.isfile(path):
        from pagedserve.models.gguf_loader import open_gguf

        return tokenizer_from_gguf_metadata(open_gguf(path).metadata)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path!r} ({exc}); the directory needs tokenizer.json / "
            "tokenizer_config.json, or pass --tokenizer PATH"
        ) from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"{path!r} has no fast (tokenizers-backed) tokenizer; only fast tokenizers are supported")
    return tokenizer


def tokenizer_from_gguf_metadata(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    """Build the tokenizer stored in a GGUF file's metadata (``open_gguf(path).metadata``)."""
    from transformers.integrations.ggml import convert_gguf_tokenizer

    architecture = metadata.get("general.architecture", "llama")
    tokenizer_dict = {
        name: metadata[f"tokenizer.{key}"]
        for key, name in _GGUF_TOKENIZER_KEYS.items()
        if f"tokenizer.{key}" in metadata
    }
    if "tokens" not in tokenizer_dict:
        raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.tokens is missing); pass --tokenizer PATH")
    try:
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as exc:  # NOTE: the tokenizers library raises bare Exceptions for bad vocabularies
        raise ModelLoadError(f"cannot convert the GGUF tokenizer of a {architecture!r} model: {exc}") from exc
    vocab_size = len(metadata["tokenizer.ggml.tokens"])
    special_tokens = {
        attr: metadata["tokenizer.ggml.tokens"][metadata[key]]
        for attr, key in _SPECIAL_TOKEN_KEYS.items()
        if key in metadata and 0 <= metadata[key] < vocab_size
    }
    # NOTE: built as a plain PreTrainedTokenizerFast so that BOS/EOS insertion is decided by the
    # backend post-processor alone, and decode does not "clean up" spaces the model produced.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **special_tokens)
    # llama.cpp's defaults when the flags are absent: SentencePiece vocabularies add BOS.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", metadata.get("tokenizer.ggml.model") == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _set_special_token_insertion(tokenizer, add_bos, add_eos)
    if "tokenizer.chat_template" in metadata:
        tokenizer.chat_template = metadata["tokenizer.chat_template"]
    return tokenizer


def _set_special_token_insertion(tokenizer: PreTrainedTokenizerFast, add_bos: bool, add_eos: bool) -> None:
    """Make ``encode(add_special_tokens=True)`` add exactly BOS and/or EOS as the flags say."""
    if add_bos and tokenizer.bos_token is None:
        raise ModelLoadError("the GGUF tokenizer says add_bos_token but has no bos_token_id")
    if add_eos and tokenizer.eos_token is None:
        raise ModelLoadError("the GGUF tokenizer says add_eos_token but has no eos_token_id")
    bos = [f"{tokenizer.bos_token}:0"] if add_bos else []
    eos = [f"{tokenizer.eos_token}:0"] if add_eos else []
    bos_b = [f"{tokenizer.bos_token}:1"] if add_bos else []
    eos_b = [f"{tokenizer.eos_token}:1"] if add_eos else []
    special = []
    if add_bos:
        special.append((tokenizer.bos_token, tokenizer.bos_token_id))
    if add_eos and tokenizer.eos_token != tokenizer.bos_token:
        special.append((tokenizer.eos_token, tokenizer.eos_token_id))
    backend = tokenizer.backend_tokenizer
    template = processors.TemplateProcessing(
        single=" ".join(bos + ["$A:0"] + eos),
        pair=" ".join(bos + ["$A:0"] + eos + bos_b + ["$B:1"] + eos_b),
        special_tokens=special,
    )
    current = backend.post_processor
    # NOTE: a byte-level post-processor only trims offsets; keep it alongside the template.
    if isinstance(current, processors.ByteLevel):
        backend.post_processor = processors.Sequence([current, template])
    else:
        backend.post_processor = template
