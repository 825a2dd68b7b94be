"""Builds a ready-to-run model from a ``ModelConfig``: resolves the path and dtype, reads config,
weights (Hugging Face safetensors or GGUF), EOS ids and generation defaults into a ``LoadedModel``.

No tokenizer: engines work in token ids; front ends load theirs with ``pagedserve.tokenizer``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, PretrainedConfig

from pagedserve.config import ModelConfig
from pagedserve.models import gguf_loader
from pagedserve.models.default_model import default_model_path
from pagedserve.models.llama import num_kv_heads
from pagedserve.models.names import derive_model_name
from pagedserve.models.quantization import QuantizationConfig
from pagedserve.models.quantize_model import quantize_model
from pagedserve.models.registry import ModelLoadError, get_model_class
from pagedserve.models.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """A model in eval mode on its device, with everything the engine needs to serve it (token ids only)."""

    model: nn.Module
    hf_config: PretrainedConfig
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]  # the model's own (config / generation config / GGUF); may be empty
    max_model_len: int
    model_name: str
    num_layers: int
    num_kv_heads: int  # this rank's (all of them without tensor parallelism)
    head_dim: int
    vocab_size: int
    generation_config: dict[str, Any]
    quantization: str = "none"  # how the weights are stored: none | int8 | int4 | gguf
    total_num_kv_heads: int = 0  # all ranks' K/V heads (KV cache sizing); 0: num_kv_heads

    @property
    def kv_heads_all_ranks(self) -> int:
        return self.total_num_kv_heads or self.num_kv_heads


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype for ``float32``/``bfloat16``/``float16``; ``auto`` is bfloat16 where the
    hardware computes it natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), else float32."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
        return _DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and _cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _cpu_has_native_bf16() -> bool:
    get_capability = getattr(torch._C._cpu, "_get_cpu_capability", None)
    if get_capability is not None:
        capability = get_capability()
        if capability.get("avx512_bf16") or capability.get("amx_bf16"):
            return True
    if platform.machine().lower() in ("aarch64", "arm64"):
        try:  # NOTE: on Arm oneDNN reports bf16 only when the cores have the BF16 extension
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def load_model(
    model_config: ModelConfig, device: torch.device | str, tensor_parallel: TensorParallel | None = None
) -> LoadedModel:
    """Load the model ``model_config`` names (the default GGUF model when None) onto ``device``; under
    ``tensor_parallel`` only this rank's slices of the weights are kept.

    Cheap checks (path, config, context length) run before the weights are read.
    Raises ``ModelLoadError`` with a message meant for the user.
    """
    device = torch.device(device)
    path = model_config.model or default_model_path()
    is_gguf = _check_model_path(path)
    dtype = resolve_dtype(model_config.dtype, device)
    if is_gguf:
        gguf_file = gguf_loader.open_gguf(path)
        hf_config = gguf_loader.gguf_to_hf_config(gguf_file)
        generation_config: dict[str, Any] = {}
    else:
        hf_config = _read_hf_config(path)
        generation_config = _read_generation_config(path)
    model_class = get_model_class(getattr(hf_config, "architectures", None))
    max_model_len = _resolve_max_model_len(model_config.max_model_len, hf_config)
    quantization = resolve_quantization(model_config, is_gguf)
    if is_gguf:
        eos_token_ids = gguf_loader.gguf_eos_token_ids(gguf_file.metadata)
        weights = gguf_loader.iter_gguf_weights(gguf_file, hf_config, keep_quantized=quantization.method == "gguf")
    else:
        eos_token_ids = _collect_eos_token_ids(hf_config, generation_config)
        weights = iter_safetensors_weights(path)

    tensor_parallel = tensor_parallel or TensorParallel.single()
    logger.info("loading %s from %s as %s on %s", model_class.__name__, path, dtype, device)
    try:
        with torch.device(device):
            model = model_class(hf_config, dtype=dtype, tensor_parallel=tensor_parallel)
        model.load_weights(weights)
        quantize_model(model, quantization)
    except ValueError as exc:
        raise ModelLoadError(f"cannot build the model from {path!r}: {exc}") from exc
    model.eval()
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        dtype=dtype,
        eos_token_ids=eos_token_ids,
        max_model_len=max_model_len,
        model_name=model_config.served_model_name or derive_model_name(path),
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        vocab_size=hf_config.vocab_size,
        generation_config=generation_config,
        quantization=quantization.method,
        total_num_kv_heads=num_kv_heads(hf_config),
    )


def resolve_quantization(model_config: ModelConfig, is_gguf: bool) -> QuantizationConfig:
    """The weight storage to use: ``model_config.quantization``, or by default the GGUF file's own
    format for a .gguf model and the model dtype otherwise."""
    method = model_config.quantization or "none"
    if method == "gguf" and not is_gguf:
        raise ModelLoadError("quantization 'gguf' needs a .gguf model file; use int8 or int4 for other models")
    return QuantizationConfig(method, model_config.quantization_group_size, model_config.quantization_symmetric)


def _check_model_path(path: str) -> bool:
    """Whether ``path`` is a GGUF file; raises ``ModelLoadError`` when it is neither that nor an HF directory."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"model file {path!r} is not a .gguf file; pass a .gguf file or an HF model directory")
        return True
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"model directory {path!r} has no config.json; it must be a Hugging Face model dir")
        return False
    raise ModelLoadError(
        f"model path {path!r} does not exist; pass a local Hugging Face model directory or a .gguf file "
        "(models are never downloaded)"
    )


def _read_hf_config(path: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read the model config in {path!r}: {exc}") from exc


def _read_generation_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    return {key: value for key, value in config.items() if key not in ("transformers_version", "_from_model_config")}


def _weight_files(path: str) -> list[str]:
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    names = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if len(names) > 1:  # NOTE: Mistral repos also ship consolidated.safetensors with non-HF names
        names = [name for name in names if not name.startswith("consolidated")]
    if not names:
        raise ModelLoadError(f"no *.safetensors weights in {path!r} (only safetensors checkpoints are supported)")
    return [os.path.join(path, name) for name in names]


def iter_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of an HF directory's safetensors files, read one at a time on the CPU."""
    from safetensors import safe_open

    files = _weight_files(path)
    num_tensors = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            num_tensors += len(f.keys())
    with tqdm(total=num_tensors, desc="Loading safetensors", unit="tensor") as progress:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    progress.update(1)


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _collect_eos_token_ids(hf_config: PretrainedConfig, generation_config: dict[str, Any]) -> tuple[int, ...]:
    """The model's EOS ids from config.json and generation_config.json; the front end adds its tokenizer's
    (``pagedserve.tokenizer.eos_token_ids``) to requests when these are empty."""
    ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    ids += _as_id_list(generation_config.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _sliding_window(hf_config: PretrainedConfig) -> int | None:
    """The attention window the model was trained with, when its attention uses one."""
    window = getattr(hf_config, "sliding_window", None)
    if hf_config.model_type == "mistral" or getattr(hf_config, "use_sliding_window", False):
        return window
    return None


def _resolve_max_model_len(requested: int | None, hf_config: PretrainedConfig) -> int:
    model_len = getattr(hf_config, "max_position_embeddings", None)
    window = _sliding_window(hf_config)
    if window is not None and (model_len is None or window < model_len):
        # NOTE: our attention has no sliding window; within one window full attention is exact.
        logger.info("sliding_window=%d: limiting max_model_len to it", window)
        model_len = window
    if requested is None:
        if model_len is None:
            raise ModelLoadError("the model config has no max_position_embeddings; set max_model_len")
        return int(model_len)
    if model_len is not None and requested > model_len:
        raise ModelLoadError(f"max_model_len={requested} exceeds the model's context length ({model_len})")
    return requested
