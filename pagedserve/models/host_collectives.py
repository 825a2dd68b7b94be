"""Collectives between tensor-parallel ranks on one host, through shared memory.

A step of a split model sums partial outputs twice per layer; with gloo over loopback TCP each sum
costs about a millisecond on a small CPU host (measured in docs/tensor-parallelism.md), more than the
layer's own work. Here each rank copies its tensor into its slot of a shared buffer, publishes a
sequence number, waits (spinning briefly, then yielding the CPU) until every rank has published, and
reads the others' slots. Two buffers alternate, so a rank never overwrites a slot a slower rank is
still reading: to publish step ``s + 2`` in a buffer, every rank must have published ``s + 1``,
which each does only after reading step ``s``.

Every rank sums the slots in rank order, so all ranks hold bit-identical results. Tensors larger than
a slot, and every tensor on CUDA, go through ``torch.distributed`` (gloo / NCCL) instead.

Layout of the file (``/dev/shm``): ``world_size`` sequence numbers (int64, one 64-byte line each),
then two buffers of ``world_size`` slots of ``slot_bytes``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

LINE_BYTES = 64
DEFAULT_SLOT_BYTES = 16 << 20  # a [2048, 2048] float32 sum, or 64 rows of a 64k-token vocabulary slice
SPINS_BEFORE_YIELD = 2000  # busy polls (a few microseconds each) before the wait gives the CPU away
CHECK_EVERY_S = 0.1  # how often a long wait asks whether a peer is gone


def shm_file_bytes(world_size: int, slot_bytes: int) -> int:
    return world_size * LINE_BYTES + 2 * world_size * slot_bytes


def create_shm_file(path: str, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
    """Create the zeroed shared file the ranks map (the leader, before the workers start)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, shm_file_bytes(world_size, slot_bytes))
    finally:
        os.close(fd)


class PeerLost(RuntimeError):
    """A rank stopped taking part in the collectives (it died, or waited past the timeout)."""


class HostCollectives:
    """Sum and gather over the ranks of one host; see the module docstring."""

    def __init__(
        self,
        path: str,
        rank: int,
        world_size: int,
        *,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 300.0,
        peer_lost: Callable[[], str | None] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self._peer_lost = peer_lost  # a reason when a peer is known to be gone, else None
        size = shm_file_bytes(world_size, slot_bytes)
        self._buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)  # [size] bytes, mapped
        # each rank's published sequence number, one cache line apart
        self._sequences = self._buffer[: world_size * LINE_BYTES].numpy().view(np.int64)[:: LINE_BYTES // 8]
        self._data = self._buffer[world_size * LINE_BYTES :].view(2, world_size, slot_bytes)
        self._sequence = 0
        # (buffer, dtype, shape) -> every rank's slot viewed as that tensor: a step repeats a few shapes
        self._views: dict[tuple[int, torch.dtype, torch.Size], list[torch.Tensor]] = {}

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x`` and return every rank's tensor of the same shape (views into shared memory)."""
        self._sequence += 1
        sequence = self._sequence
        key = (sequence % 2, x.dtype, x.shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 64:  # shapes change with the batch; keep the recent ones
                self._views.clear()
            slots = self._data[sequence % 2]  # [world_size, slot_bytes]
            nbytes = x.numel() * x.element_size()
            views = self._views[key] = [slots[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.world_size)]
        views[self.rank].copy_(x)
        # NOTE: x86 keeps stores in order, so the data is visible before the number that announces it
        self._sequences[self.rank] = sequence
        self._wait_for(sequence)
        return views

    def _wait_for(self, sequence: int) -> None:
        sequences = self._sequences
        spins = 0
        deadline = next_check = 0.0
        while sequences.min() < sequence:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            now = time.monotonic()
            if not deadline:
                deadline, next_check = now + self.timeout_s, now + CHECK_EVERY_S
            elif now >= next_check:
                next_check = now + CHECK_EVERY_S
                reason = self._peer_lost() if self._peer_lost is not None else None
                if reason is not None:
                    raise PeerLost(reason)
                if now >= deadline:
                    raise PeerLost(f"a tensor-parallel rank did not reach a collective in {self.timeout_s:.0f} s")

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (rank order: identical on every rank); returns it."""
        if not self.fits(x):
            dist.all_reduce(x)
            return x
        parts = self._exchange(x.contiguous())
        torch.add(parts[0], parts[1], out=x)
        for part in parts[2:]:
            x.add_(part)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (the same shape on every rank), in rank order; read them before the next call."""
        return self._exchange(x.contiguous()) if self.fits(x) else dist_all_gather(x)


def dist_all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` through torch.distributed's process group, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


__all__ = ["HostCollectives", "PeerLost", "create_shm_file", "dist_all_gather"]
