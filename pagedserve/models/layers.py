"""Building blocks of decoder-only transformers: linear layers with fused-shard loading (and
optionally quantized weights), the token embedding, RMSNorm (with a fused residual add), rotary position embedding (default, linear and llama3 scaling) and
the SiLU-and-mul activation.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.quantization import GroupQuantized, QuantizedWeight
from pagedserve.models.tensor_parallel import TensorParallel

# Up to this many rows (tokens in a step) the AMX kernel beats oneDNN's packed matmul on the
# default model's shapes; from about 256 rows (prefill) oneDNN is as fast or faster
# (measurements in docs/design/cpu-performance.md).
AMX_LINEAR_MAX_ROWS = 192


class Linear(nn.Module):
    """``y = x @ W.T + b`` whose output rows may be several checkpoint tensors packed together.

    ``shard_sizes`` names the packed parts in order (``{"q": 576, "k": 192, "v": 192}``);
    ``weight_loader`` copies one checkpoint tensor into its rows. Parameters are created
    uninitialized (a checkpoint always overwrites them), unless ``weight`` shares an existing
    one (tied embeddings). ``quant`` (set by ``quantize_model``) replaces the weight by a
    quantized one; a GGUF loader hands its quantized shards to ``weight_loader`` as
    ``GroupQuantized`` and ``install_staged_quant`` joins them.

    Under tensor parallelism a layer holds one rank's slice and ``weight_loader`` cuts it from the
    whole checkpoint tensor: ``row_slices`` gives ``(start, size)`` of the output rows kept from each
    shard (key None for an unpacked weight; column-parallel layers), ``col_slice`` the input features
    kept (``RowParallelLinear``). ``in_features`` / ``out_features`` are the slice's sizes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shard_sizes: dict[str | int, int] | None = None,
        dtype: torch.dtype | None = None,
        weight: nn.Parameter | None = None,
        row_slices: dict[str | int | None, tuple[int, int]] | None = None,
        col_slice: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.row_slices = row_slices
        self.col_slice = col_slice
        self.in_features = in_features
        self.out_features = out_features
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        elif weight.shape != (out_features, in_features):
            raise ValueError(f"shared weight has shape {tuple(weight.shape)}, expected {(out_features, in_features)}")
        self.weight = weight
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        self.packed_weight: torch.Tensor | None = None  # a oneDNN-blocked copy of `weight`, see pack_weight()
        self.amx_weight: torch.Tensor | None = None  # [out/16, in/32, 16, 16, 2] AMX tile operands, see pack_weight()
        self.amx_kernels: ModuleType | None = None  # the C++ kernels whose linear_amx reads amx_weight
        # [out/16, in/2, 16, 2] pair-interleaved slices for AVX512-BF16 dot products (CPUs without AMX), see pack_weight()
        self.vnni_weight: torch.Tensor | None = None
        self.vnni_kernels: ModuleType | None = None  # the C++ kernels whose linear_avx512_bf16 reads vnni_weight
        self.quant: QuantizedWeight | None = None  # a quantized weight in place of `weight`
        self.staged_quant: dict[str | int | None, GroupQuantized] = {}  # quantized checkpoint shards, by shard id
        if shard_sizes is not None:
            if sum(shard_sizes.values()) != out_features:
                raise ValueError(f"shard sizes {shard_sizes} do not add up to {out_features}")
            offset = 0
            for shard_id, size in shard_sizes.items():
                self.shard_offsets[shard_id] = (offset, size)
                offset += size

    @property
    def is_packed(self) -> bool:
        """True once pack_weight() has given this layer a copy in a kernel's layout."""
        return self.packed_weight is not None or self.vnni_weight is not None or self.quant is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` with whichever copy of the weight the kernels use."""
        if self.quant is not None:
            return self.quant.matmul(x, bias)
        if self.vnni_weight is not None:
            return self.vnni_kernels.linear_avx512_bf16(x, self.vnni_weight, bias)
        if self.amx_weight is not None and x.dim() == 2 and x.size(0) <= AMX_LINEAR_MAX_ROWS:
            return self.amx_kernels.linear_amx(x, self.amx_weight, bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def pack_weight(
        self,
        batch_size_hint: int,
        release_original: bool,
        amx_kernels: ModuleType | None = None,
        vnni_kernels: ModuleType | None = None,
    ) -> None:
        """Reorder the weight once into a matmul kernel's layout (CPU, bf16 or float32), so that no matmul repacks it.

        By default the copy is oneDNN's blocked layout: ``F.linear`` on bf16 CPU tensors reorders
        the weight on every call; the packed copy gives bit-identical results without that cost.
        For float32 ``F.linear`` is MKL's matmul; oneDNN's on the packed copy agrees up to
        summation order. With ``amx_kernels`` (the C++ kernels, on a CPU with AMX) a second copy
        is laid out as AMX tile operands for steps of at most ``AMX_LINEAR_MAX_ROWS`` rows. With
        ``vnni_kernels`` (the C++ kernels built with AVX512-BF16, on a CPU without AMX) the only
        copy is in the layout of their AVX512-BF16 matmul, which is faster than oneDNN's at every
        row count measured (1-2,048). Both kernels sum in float32 and round once: equal to
        oneDNN's results up to the summation order, identical on most elements. Shapes a kernel
        cannot take (out_features not a multiple of 16, or in_features of 32 for AMX, of 2 for
        AVX512-BF16) stay on oneDNN. With ``release_original`` the plain weight's memory is given
        back (it must not be shared, e.g. with a tied embedding), after which this layer can no
        longer load weights.
        """
        weight = self.weight.detach()
        bf16_tiles = weight.dtype == torch.bfloat16 and self.out_features % 16 == 0
        if amx_kernels is not None and bf16_tiles and self.in_features % 32 == 0:
            self.amx_weight = amx_kernels.pack_linear_weight_amx(weight)
            self.amx_kernels = amx_kernels
        if vnni_kernels is not None and bf16_tiles and self.in_features % 2 == 0 and self.amx_weight is None:
            self.vnni_weight = vnni_kernels.pack_linear_weight_vnni(weight)
            self.vnni_kernels = vnni_kernels
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)
        if release_original:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor | GroupQuantized, shard_id: str | int | None = None
    ) -> None:
        """Copy ``loaded`` into ``param`` (this layer's weight or bias), or into one shard of it;
        a quantized weight (or shard) is kept aside for ``install_staged_quant``."""
        if self.is_packed:
            raise RuntimeError("weights cannot be loaded into a Linear after pack_weight()")
        loaded = self._local_slice(loaded, shard_id)
        if isinstance(loaded, GroupQuantized):
            expected = (
                self.shard_offsets[shard_id][1] if shard_id is not None else self.out_features,
                self.in_features,
            )
            if param is not self.weight or loaded.shape != expected:
                raise ValueError(f"shape mismatch: parameter {expected} vs quantized checkpoint {loaded.shape}")
            self.staged_quant[shard_id] = loaded
            return
        target = param.data
        if shard_id is not None:
            offset, size = self.shard_offsets[shard_id]
            target = target.narrow(0, offset, size)
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(target.shape)} vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    def _local_slice(
        self, loaded: torch.Tensor | GroupQuantized, shard_id: str | int | None
    ) -> torch.Tensor | GroupQuantized:
        """This rank's part of a whole checkpoint tensor (itself without tensor parallelism). A quantized
        weight whose input slice would cut its groups is dequantized first."""
        if self.row_slices is not None:
            loaded = loaded.narrow(0, *self.row_slices[shard_id])
        if self.col_slice is not None and len(loaded.shape) == 2:  # a weight; the bias keeps every output
            if isinstance(loaded, GroupQuantized):
                try:
                    return loaded.narrow(1, *self.col_slice)
                except ValueError:
                    loaded = loaded.dequantize(self.weight.dtype)
            loaded = loaded.narrow(1, *self.col_slice)
        return loaded

    def install_staged_quant(self) -> None:
        """Make the staged quantized shards this layer's weight (``quant``); a layer whose shards
        came only partly quantized gets the quantized ones dequantized into its plain weight."""
        if not self.staged_quant:
            return
        shard_ids = list(self.shard_offsets) if self.shard_offsets else [None]
        if all(shard_id in self.staged_quant for shard_id in shard_ids):
            joined = GroupQuantized.cat_rows([self.staged_quant[shard_id] for shard_id in shard_ids])
            self.quant = joined.to(self.weight.device)  # NOTE: the loader decodes on the CPU
        else:
            for shard_id, part in self.staged_quant.items():
                target = self.weight.data
                if shard_id is not None:
                    target = target.narrow(0, *self.shard_offsets[shard_id])
                target.copy_(part.dequantize(target.dtype))
        self.staged_quant = {}

    def extra_repr(self) -> str:
        packed = f", rows {self.row_slices}" if self.row_slices is not None else ""
        packed += f", inputs {self.col_slice}" if self.col_slice is not None else ""
        packed += ", packed" if self.packed_weight is not None else ""
        packed += ", amx" if self.amx_weight is not None else ""
        packed += ", avx512-bf16" if self.vnni_weight is not None else ""
        packed += f", quantized ({type(self.quant).__name__})" if self.quant is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{packed}"


class RowParallelLinear(Linear):
    """A Linear over one rank's slice of the input features (``col_slice``); the ranks' partial
    outputs are summed (all-reduce) and the bias is added once, after the sum.

    Attention's output projection and the MLP's down projection: their inputs are the rank's own
    heads and MLP features, so the only communication of a layer is this sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tensor_parallel: TensorParallel,
        col_slice: tuple[int, int],
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, col_slice=col_slice)
        self.tensor_parallel = tensor_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.matmul(x, None)  # [num_tokens, out_features]: this rank's share of the sum
        out = self.tensor_parallel.all_reduce_(partial)
        return out if self.bias is None else out.add_(self.bias)


class Embedding(nn.Module):
    """Token embedding table ``[vocab_size, hidden_size]``, created uninitialized; with ``quant``
    set, rows are dequantized from the quantized table as they are looked up."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype), requires_grad=False)
        self.quant: QuantizedWeight | None = None
        self.staged_quant: GroupQuantized | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.lookup(input_ids, self.dtype)
        return F.embedding(input_ids, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | GroupQuantized, shard_id: None = None) -> None:
        """Copy ``loaded`` into the table, or keep a quantized table for ``install_staged_quant``."""
        expected = (self.num_embeddings, self.embedding_dim)
        shape = loaded.shape if isinstance(loaded, GroupQuantized) else tuple(loaded.shape)
        if param is not self.weight or tuple(shape) != expected:
            raise ValueError(f"shape mismatch: embedding {expected} vs checkpoint {tuple(shape)}")
        if isinstance(loaded, GroupQuantized):
            self.staged_quant = loaded
        else:
            param.data.copy_(loaded)

    def install_staged_quant(self) -> None:
        if self.staged_quant is not None:
            self.quant, self.staged_quant = self.staged_quant.to(self.weight.device), None


class VocabParallelEmbedding(Embedding):
    """One rank's rows ``[vocab_start, vocab_start + num_embeddings)`` of the embedding table: ids
    outside them look up zeros, and the ranks' lookups are summed (all-reduce), so every rank ends
    with every token's row."""

    def __init__(
        self,
        vocab_slice: tuple[int, int],
        embedding_dim: int,
        tensor_parallel: TensorParallel,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(vocab_slice[1], embedding_dim, dtype=dtype)
        self.vocab_start = vocab_slice[0]
        self.tensor_parallel = tensor_parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, embedding_dim]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)  # [num_tokens]
        rows = super().forward(local.masked_fill(outside, 0))
        rows.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tensor_parallel.all_reduce_(rows)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | GroupQuantized, shard_id: None = None) -> None:
        super().weight_loader(param, loaded.narrow(0, self.vocab_start, self.num_embeddings))


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like Hugging Face's ``LlamaRMSNorm``.

    ``forward(x)`` returns the normed ``x``; ``forward(x, residual)`` first adds ``x`` into
    ``residual`` in place and returns ``(norm(residual), residual)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.fused_ops: ModuleType | None = None  # compiled bf16 ops (rms_norm), set by the runner

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.hidden_size,), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused_ops is not None:
            out = self.fused_ops.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual.add_(x)  # NOTE: in place, in the model dtype, as HF's `residual + hidden_states`
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for the fused ``[..., 2 * intermediate]`` gate/up projection output."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_ops: ModuleType | None = None  # compiled bf16 ops (silu_and_mul), set by the runner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is not None:
            return self.fused_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept, smooth in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` (float32, CPU) for a Hugging Face ``rope_scaling`` dict."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = "default"
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed ``[max_positions, head_dim]`` cos|sin cache.

    One instance serves all layers: ``forward(positions)`` looks cos/sin up once per model
    forward, and ``apply_rotary_emb`` rotates each layer's q/k with them.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)  # [head_dim // 2]
        positions = torch.arange(max_position_embeddings, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, head_dim]
        # NOTE: computed in float32 on the CPU (same values on every device), then cast once to the
        # model dtype, as HF casts cos/sin to the activation dtype before rotating.
        cos_sin_cache = cos_sin_cache.to(device=torch.get_default_device(), dtype=dtype or torch.float32)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, 1, head_dim // 2]`` for ``positions`` ``[num_tokens]``."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` (halves as pairs); returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
