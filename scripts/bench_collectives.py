"""Latency of one all-reduce between two tensor-parallel ranks on this host: gloo over loopback TCP
against the shared-memory collectives (pagedserve.models.host_collectives), for the shapes a decode
step of the default model sums (rows x 576 float32), each rank pinned to its own CPU where there are two.

    .venv/bin/python scripts/bench_collectives.py [--rounds 500]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.models.host_collectives import HostCollectives, create_shm_file

SHAPES = [(1, 576), (16, 576), (256, 576)]


def run_rank(rank: int, port: int, path: str, rounds: int, results) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[rank]})
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    shm = HostCollectives(path, rank, 2)
    for shape in SHAPES:
        x = torch.randn(shape)
        for name, reduce in (("gloo", dist.all_reduce), ("shared memory", shm.all_reduce_)):
            for _ in range(20):
                reduce(x)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(rounds):
                reduce(x)
            elapsed = time.perf_counter() - start
            if rank == 0:
                results.put((name, shape, elapsed / rounds * 1e6))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "collectives")
        create_shm_file(path, 2)
        port = free_port()
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=run_rank, args=(r, port, path, args.rounds, results)) for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        rows = [results.get() for _ in range(2 * len(SHAPES))]
    print("| shape | gloo (us) | shared memory (us) |")
    print("|---|---|---|")
    for shape in SHAPES:
        by_name = {name: us for name, s, us in rows if s == shape}
        print(f"| {shape[0]} x {shape[1]} | {by_name['gloo']:.0f} | {by_name['shared memory']:.0f} |")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
