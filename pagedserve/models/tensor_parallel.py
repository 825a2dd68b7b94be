"""Tensor parallelism inside the model: which slice of each weight this rank holds, and the two
collectives the sharded layers need (a sum over ranks, a gather of vocabulary slices).

``TensorParallel(rank, world_size, collectives)`` is built once per process and passed to the model's
constructor; with ``world_size`` 1 (``TensorParallel.single()``) every slice is the whole tensor
and no collective runs. The process group (gloo on CPUs, NCCL on CUDA) and the shared-memory
collectives (``host_collectives.py``, used on CPUs) are set up by the executor
(``pagedserve.worker.tensor_parallel_executor``) before the model is built.

Slices are as even as possible (the first ``total % world_size`` ranks get one more), so a model
whose sizes do not divide by the rank count still splits: attention is split by groups of K/V
heads (each rank holds whole GQA groups: its K/V heads and the query heads that read them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pagedserve.models.host_collectives import HostCollectives, dist_all_gather


def even_slice(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, size)`` of ``rank``'s part when ``total`` items are split as evenly as possible."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """One rank's attention heads: K/V heads ``[kv_start, kv_start + num_kv_heads)`` and the query
    heads of their groups ``[q_start, q_start + num_heads)``."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place among ``world_size`` ranks that each hold a slice of every large weight."""

    rank: int = 0
    world_size: int = 1
    # sums and gathers through shared memory (CPUs); None: torch.distributed's process group for all
    collectives: HostCollectives | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of {self.world_size}")

    @classmethod
    def single(cls) -> TensorParallel:
        return cls(0, 1)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def slice(self, total: int) -> tuple[int, int]:
        """``(start, size)`` of this rank's part of ``total`` rows (MLP features, vocabulary)."""
        return even_slice(total, self.world_size, self.rank)

    def slice_sizes(self, total: int) -> list[int]:
        """Every rank's part of ``total``, in rank order."""
        return [even_slice(total, self.world_size, rank)[1] for rank in range(self.world_size)]

    def head_slice(self, num_heads: int, num_kv_heads: int) -> HeadSlice:
        """This rank's whole GQA groups. Raises ValueError when there are fewer K/V heads than ranks."""
        if num_kv_heads < self.world_size:
            raise ValueError(
                f"tensor_parallel_size {self.world_size} is larger than the model's {num_kv_heads} K/V heads: "
                "each rank needs at least one"
            )
        group = num_heads // num_kv_heads
        kv_start, kv_heads = self.slice(num_kv_heads)
        return HeadSlice(kv_start * group, kv_heads * group, kv_start, kv_heads)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            if self.collectives is not None:
                return self.collectives.all_reduce_(x)
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``[n, sizes[rank]]`` on each rank -> ``[n, sum(sizes)]`` on every rank, in rank order."""
        if self.world_size == 1:
            return x
        width = max(sizes)
        if x.shape[1] < width:  # NOTE: a gather moves equal shapes; a short slice travels padded
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = self.collectives.all_gather(x) if self.collectives is not None else dist_all_gather(x)
        return torch.cat([part[:, :size] for part, size in zip(parts, sizes, strict=True)], dim=1)


__all__ = ["HeadSlice", "TensorParallel", "even_slice"]
