"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) as one flat-batch model over a paged KV cache.

Differences between the members are config flags: ``attention_bias`` / Qwen2's q/k/v bias,
``mlp_bias``, ``tie_word_embeddings``, ``head_dim``, ``rope_theta`` and ``rope_scaling``.

Under tensor parallelism (``TensorParallel`` with more than one rank) each rank holds whole GQA
groups of attention heads (its slice of the fused QKV rows, of the O projection's inputs and of the
KV cache), a slice of the MLP's features (gate/up rows, down inputs) and a slice of the vocabulary
(embedding rows and lm_head rows); a layer's two row-parallel projections sum over the ranks, the
embedding sums its lookups, and the logits are gathered, so every rank sees every row of the logits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.attention import AttentionMetadata, paged_attention
from pagedserve.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    apply_rotary_emb,
)
from pagedserve.models.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config: PretrainedConfig) -> int:
    """The model's K/V heads (all ranks together)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention with one fused QKV projection; K/V go to (and are read from) the paged cache."""

    def __init__(
        self, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype, tensor_parallel: TensorParallel
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim = _head_dim(config)
        heads = tensor_parallel.head_slice(config.num_attention_heads, num_kv_heads(config))
        self.num_heads = heads.num_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        # NOTE: Qwen2 has q/k/v biases but no o_proj bias and no `attention_bias` flag.
        qkv_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        o_bias = bool(getattr(config, "attention_bias", False))
        q_rows = (heads.q_start * head_dim, self.q_size)
        kv_rows = (heads.kv_start * head_dim, self.kv_size)
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=qkv_bias,
            shard_sizes={"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            dtype=dtype,
            row_slices={"q": q_rows, "k": kv_rows, "v": kv_rows} if tensor_parallel.is_parallel else None,
        )
        if tensor_parallel.is_parallel:
            self.o_proj = RowParallelLinear(
                self.q_size, config.hidden_size, tensor_parallel, q_rows, bias=o_bias, dtype=dtype
            )
        else:
            self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias, dtype=dtype)
        self.fused_ops: ModuleType | None = None  # compiled bf16 ops (rotary_embedding_), set by the runner

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim // 2]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        # NOTE: q and k sit side by side in qkv and share cos/sin, so one rotation covers both.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.fused_ops is not None:
            self.fused_ops.rotary_embedding_(qk, *rotary)  # in place, inside qkv
        else:
            qk = apply_rotary_emb(qk, *rotary)  # [num_tokens, num_heads + num_kv_heads, head_dim]
        q = qk[:, : self.num_heads]  # [num_tokens, num_heads, head_dim]
        k = qk[:, self.num_heads :]  # [num_tokens, num_kv_heads, head_dim]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, attn_metadata, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, tensor_parallel: TensorParallel) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        features = tensor_parallel.slice(config.intermediate_size)  # (start, size): this rank's features
        size = features[1]
        self.gate_up_proj = Linear(
            config.hidden_size,
            2 * size,
            bias=bias,
            shard_sizes={0: size, 1: size},
            dtype=dtype,
            row_slices={0: features, 1: features} if tensor_parallel.is_parallel else None,
        )
        if tensor_parallel.is_parallel:
            self.down_proj = RowParallelLinear(size, config.hidden_size, tensor_parallel, features, bias, dtype)
        else:
            self.down_proj = Linear(size, config.hidden_size, bias=bias, dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the residual stream is carried separately and added in the norms."""

    def __init__(
        self, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype, tensor_parallel: TensorParallel
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype, tensor_parallel)
        self.mlp = LlamaMLP(config, dtype, tensor_parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]: the previous block's output
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]: the residual stream before it
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(rotary, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, tensor_parallel: TensorParallel) -> None:
        super().__init__()
        if tensor_parallel.is_parallel:
            vocab = tensor_parallel.slice(config.vocab_size)
            self.embed_tokens = VocabParallelEmbedding(vocab, config.hidden_size, tensor_parallel, dtype=dtype)
        else:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layer_idx, dtype, tensor_parallel)
            for layer_idx in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(
            _head_dim(config),
            config.max_position_embeddings,
            rope_theta=getattr(config, "rope_theta", 10000.0),
            rope_scaling=getattr(config, "rope_scaling", None),
            dtype=dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        rotary = self.rotary_emb(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(rotary, hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a flat token batch and per-layer paged KV caches.

    Parameters are created uninitialized in ``dtype`` on the current default device;
    ``load_weights`` fills them from Hugging Face-named tensors, packing q/k/v into
    ``qkv_proj`` and gate/up into ``gate_up_proj`` (each rank's slices of them under
    ``tensor_parallel``). ``num_layers``, ``num_kv_heads`` (this rank's) and ``head_dim`` give the
    KV cache shape each layer expects.
    """

    # HF name fragment -> (fused module name, shard id)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype = torch.float32,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tensor_parallel = tensor_parallel or TensorParallel.single()
        self.tensor_parallel = tensor_parallel
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.head_dim = _head_dim(config)
        self.num_kv_heads = tensor_parallel.head_slice(config.num_attention_heads, num_kv_heads(config)).num_kv_heads
        self.model = LlamaModel(config, dtype, tensor_parallel)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tied_weight = self.model.embed_tokens.weight if self.tie_word_embeddings else None
        vocab = tensor_parallel.slice(config.vocab_size)
        self.vocab_sizes = tensor_parallel.slice_sizes(config.vocab_size)  # each rank's lm_head rows
        self.lm_head = Linear(
            config.hidden_size,
            vocab[1],
            dtype=dtype,
            weight=tied_weight,
            row_slices={None: vocab} if tensor_parallel.is_parallel else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` logits in the model's dtype.

        Not widened to float32 here: greedy rows take the argmax of the bf16 logits as they are
        (widening is exact, so the order is the same), and the sampler widens only when it needs to.
        """
        return self.tensor_parallel.gather_columns(self.lm_head(hidden_states), self.vocab_sizes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters; returns the names loaded.

        Raises ``ValueError`` when a parameter (or one shard of a fused one) got no tensor.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            param_name, shard_id = name, None
            for fragment, (packed_name, packed_shard) in self.packed_modules_mapping.items():
                if f".{fragment}." in name:
                    param_name, shard_id = name.replace(fragment, packed_name), packed_shard
                    break
            param = params.get(param_name)
            if param is None:
                unexpected.append(name)
                continue
            module = self.get_submodule(param_name.rsplit(".", 1)[0])
            if isinstance(module, (Linear, Embedding)):
                module.weight_loader(param, tensor, shard_id)
            else:
                _copy_checked(param, tensor, name)
            loaded.add(param_name if shard_id is None else f"{param_name}#{shard_id}")
        if unexpected:
            logger.warning("ignored %d checkpoint tensors with no parameter: %s", len(unexpected), unexpected[:8])
        missing = [name for name in self._expected_loads() if name not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:8]}")
        return loaded

    def _expected_loads(self) -> list[str]:
        """Every parameter name (``name#shard`` for each shard of a fused one) a checkpoint must provide."""
        expected = []
        for name, _ in self.named_parameters():
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, Linear) and module.shard_offsets:
                expected.extend(f"{name}#{shard_id}" for shard_id in module.shard_offsets)
            else:
                expected.append(name)
        return expected


def _copy_checked(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: parameter shape {tuple(param.shape)} vs checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with GQA. Attention is always full: the loader caps ``max_model_len`` at
    ``sliding_window`` so that the window never matters."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases (selected by ``model_type == "qwen2"``)."""
