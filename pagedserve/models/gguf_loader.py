"""Reads llama.cpp GGUF files: metadata -> a transformers config, and tensors under Hugging Face names
(dequantized, or kept in their block format as ``GroupQuantized`` where ``gguf_quants`` reads it).

llama.cpp permutes the rows of ``attn_q``/``attn_k`` (rotary pairs interleaved) for the llama
architecture; ``iter_gguf_weights`` undoes that, matching transformers' own GGUF loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from pagedserve.models.gguf_file import GGUFFile, read_gguf_file
from pagedserve.models.gguf_quants import GGUF_KEPT_TYPES, decode_gguf_tensor
from pagedserve.models.layers import compute_inv_freq
from pagedserve.models.quantization import GroupQuantized
from pagedserve.models.registry import ModelLoadError

# general.architecture -> (HF architecture name, config class, q/k rows permuted by llama.cpp)
_GGUF_ARCHITECTURES: dict[str, tuple[str, type[PretrainedConfig], bool]] = {
    "llama": ("LlamaForCausalLM", LlamaConfig, True),
    "qwen2": ("Qwen2ForCausalLM", Qwen2Config, False),
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ rope (stored by llama.cpp only as the `rope_freqs` tensor): the parameters Meta uses
_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def open_gguf(path: str) -> GGUFFile:
    """A GGUF file's metadata and tensor directory (tensor data is memory-mapped, read when used)."""
    try:
        return read_gguf_file(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {exc}") from exc


def gguf_to_hf_config(gguf_file: GGUFFile) -> PretrainedConfig:
    """A transformers config equivalent to the GGUF metadata (and tensor list, for tying and rope)."""
    metadata = gguf_file.metadata
    arch = metadata.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        supported = ", ".join(_GGUF_ARCHITECTURES)
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    architecture, config_class, _ = _GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
        return value

    hidden_size = get("embedding_length")
    num_heads = get("attention.head_count")
    tensor_names = {tensor.name for tensor in gguf_file.tensors}
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    config = config_class(
        architectures=[architecture],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=get("attention.head_count_kv", num_heads),
        head_dim=get("attention.key_length", hidden_size // num_heads),
        max_position_embeddings=get("context_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(gguf_file, arch, tensor_names),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )
    if arch == "qwen2":
        config.use_sliding_window = False
    return config


def _rope_scaling(gguf_file: GGUFFile, arch: str, tensor_names: set[str]) -> dict[str, Any] | None:
    metadata = gguf_file.metadata
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if scaling_type == "yarn":
        return {
            "rope_type": "yarn",
            "factor": float(metadata[f"{arch}.rope.scaling.factor"]),
            "original_max_position_embeddings": int(metadata[f"{arch}.rope.scaling.original_context_length"]),
        }
    if scaling_type != "none":
        raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        return _llama3_scaling_from_rope_freqs(gguf_file, arch)
    return None


def _llama3_scaling_from_rope_freqs(gguf_file: GGUFFile, arch: str) -> dict[str, Any]:
    """Recover Llama 3.1's ``rope_scaling`` from llama.cpp's per-frequency divisors (``rope_freqs``)."""
    from gguf.quants import dequantize

    tensor = next(t for t in gguf_file.tensors if t.name == "rope_freqs.weight")
    divisors = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)).flatten()
    head_dim = 2 * divisors.numel()
    theta = float(gguf_file.metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), **_LLAMA3_ROPE_DEFAULTS}
    expected = compute_inv_freq(head_dim, theta, None) / divisors
    if not torch.allclose(compute_inv_freq(head_dim, theta, scaling), expected, rtol=1e-3):
        raise ModelLoadError("the GGUF rope_freqs tensor does not match Llama 3 rope scaling; not supported")
    return scaling


def gguf_eos_token_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """End-of-generation token ids: EOS plus end-of-turn / end-of-message when the file names them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(int(metadata[key]) for key in keys if key in metadata))


def _hf_tensor_name(gguf_name: str) -> str | None:
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match:
        layer, part, suffix = match.groups()
        module = _BLOCK_TENSORS.get(part)
        return f"model.layers.{layer}.{module}.{suffix}" if module else None
    base, _, suffix = gguf_name.rpartition(".")
    module = _GLOBAL_TENSORS.get(base)
    return f"{module}.{suffix}" if module else None


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of q/k (``[heads * head_dim, ...]``)."""
    shape = weight.shape
    return weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def iter_gguf_weights(
    gguf_file: GGUFFile, config: PretrainedConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
    """Tensors with Hugging Face names: float32, or with ``keep_quantized`` the 2-D tensors of the
    block types ``gguf_quants`` reads as ``GroupQuantized`` (the others dequantized); tensors we have
    no use for are skipped."""
    from gguf.quants import dequantize

    permuted = _GGUF_ARCHITECTURES[gguf_file.metadata["general.architecture"]][2]
    for tensor in tqdm(gguf_file.tensors, desc="Loading GGUF tensors", unit="tensor"):
        name = _hf_tensor_name(tensor.name)
        if name is None:
            continue
        type_name = tensor.tensor_type.name
        weight: torch.Tensor | GroupQuantized
        if keep_quantized and type_name in GGUF_KEPT_TYPES and len(tensor.shape) == 2:
            cols, rows = (int(n) for n in tensor.shape)  # NOTE: GGUF lists dimensions innermost first
            weight = decode_gguf_tensor(tensor.data, type_name, (rows, cols))
        else:
            try:
                array = dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] in HF order, float32
            except NotImplementedError as exc:
                raise ModelLoadError(f"cannot dequantize {tensor.name} ({type_name}): {exc}") from exc
            if not array.flags.writeable or not array.flags.c_contiguous or array.dtype != np.float32:
                array = np.array(array, dtype=np.float32)  # NOTE: unquantized tensors come back as read-only mmap views
            weight = torch.from_numpy(array)
        if permuted and ".self_attn.q_proj." in name:
            weight = _unpermute(weight, config.num_attention_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weight = _unpermute(weight, config.num_key_value_heads)
        yield name, weight


def _unpermute(weight: torch.Tensor | GroupQuantized, num_heads: int) -> torch.Tensor | GroupQuantized:
    if isinstance(weight, GroupQuantized):
        return weight.map_rows(lambda rows: _unpermute_rows(rows, num_heads).contiguous())
    return _unpermute_rows(weight, num_heads)
