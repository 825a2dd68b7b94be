"""Shared-memory collectives of tensor-parallel ranks: two real processes sum and gather many times in a
row (alternating buffers, no stale reads), tensors larger than a slot go through gloo, and a rank left
waiting for a peer that is gone raises instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pagedserve.models.host_collectives import HostCollectives, PeerLost, create_shm_file
from pagedserve.models.tensor_parallel import TensorParallel

SLOT_BYTES = 4096  # small, so that a [40, 40] float32 tensor does not fit and takes the gloo path
ROUNDS = 200


def _script(collectives: HostCollectives, rank: int) -> list[torch.Tensor]:
    """What each rank runs; returns what it saw (the same list on both ranks when all is right)."""
    seen = []
    for step in range(ROUNDS):
        x = torch.full((3, 5), float(rank + 1) * (step + 1))
        seen.append(collectives.all_reduce_(x).clone())  # 3 * (step + 1) everywhere
    big = torch.arange(1600, dtype=torch.float32).view(40, 40) * (rank + 1)
    seen.append(collectives.all_reduce_(big).clone())  # through gloo: 3 * arange
    half = torch.full((4, 2), 0.5, dtype=torch.bfloat16) * (rank + 1)
    seen.append(collectives.all_reduce_(half).float())
    columns = torch.full((2, 3 if rank == 0 else 2), float(rank))  # uneven slices: 3 + 2 columns
    seen.append(TensorParallel(rank, 2, collectives).gather_columns(columns, [3, 2]))
    return seen


def _init(rank: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))


def _rank_one(path: str, port: int, queue) -> None:
    _init(1, port)
    try:
        seen = _script(HostCollectives(path, 1, 2, slot_bytes=SLOT_BYTES, timeout_s=60), 1)
        queue.put([t.tolist() for t in seen])
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_and_gather(tmp_path):
    from tests.utils import free_port

    path = str(tmp_path / "collectives")
    create_shm_file(path, 2, SLOT_BYTES)
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    other = ctx.Process(target=_rank_one, args=(path, port, queue))
    other.start()
    try:
        _init(0, port)
        seen = _script(HostCollectives(path, 0, 2, slot_bytes=SLOT_BYTES, timeout_s=60), 0)
        theirs = queue.get(timeout=120)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        other.join(60)
    assert other.exitcode == 0
    for step in range(ROUNDS):
        assert torch.equal(seen[step], torch.full((3, 5), 3.0 * (step + 1)))
    assert torch.equal(seen[ROUNDS], torch.arange(1600, dtype=torch.float32).view(40, 40) * 3)
    assert torch.equal(seen[ROUNDS + 1], torch.full((4, 2), 1.5))
    assert seen[ROUNDS + 2].tolist() == [[0.0, 0.0, 0.0, 1.0, 1.0]] * 2
    assert [t.tolist() for t in seen] == theirs  # bit-identical on both ranks


def test_a_gone_peer_raises_instead_of_hanging(tmp_path):
    path = str(tmp_path / "collectives")
    create_shm_file(path, 2, SLOT_BYTES)
    lonely = HostCollectives(path, 0, 2, slot_bytes=SLOT_BYTES, peer_lost=lambda: "rank 1 exited")
    with pytest.raises(PeerLost, match="rank 1 exited"):
        lonely.all_reduce_(torch.ones(2, 2))
    waiting = HostCollectives(path, 0, 2, slot_bytes=SLOT_BYTES, timeout_s=0.3)
    with pytest.raises(PeerLost, match="did not reach a collective"):
        waiting.all_reduce_(torch.ones(2, 2))
