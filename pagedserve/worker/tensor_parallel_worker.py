"""A tensor-parallel worker process (ranks 1 .. N-1): loads its slice of the model, builds a
ModelRunner over its slice of the KV cache, then runs every ForwardPlan the leader sends.

Started by ``TensorParallelExecutor`` as a fresh interpreter running ``main(FD)`` (imported, so
that the messages' classes pickle under this module's name), where FD is its end of a socket pair
to the leader. The exchange over it: the leader sends a
``WorkerSetup``; the worker maps the shared-memory collectives' file, answers ``WorkerJoining``, joins the process group, loads its slice and
answers ``WorkerLoaded``; the leader sends a ``RunnerSetup`` (the KV cache's size, decided from the
whole model) and the worker answers ``WorkerReady``. From then on each message is a ForwardPlan, or
None to stop. Any failure is sent as ``WorkerFailed`` and the worker exits with 1;
the leader's end closing (the engine gone) ends it quietly.
"""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

from pagedserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    config: EngineConfig
    rank: int
    world_size: int
    store_port: int  # the leader's TCPStore on 127.0.0.1, where the process group meets
    device: str  # e.g. "cpu" or "cuda:1"
    num_threads: int  # torch intra-op threads
    cpus: tuple[int, ...]  # CPUs to pin the process to; empty: not pinned
    timeout_s: float  # the process group's timeout for one collective
    log_level: int
    shm_path: str | None  # the shared-memory collectives' file (CPUs); None: the process group only


@dataclass(frozen=True, slots=True)
class RunnerSetup:
    num_blocks: int
    block_size: int
    batch_size_hint: int


@dataclass(frozen=True, slots=True)
class WorkerJoining:
    pid: int


@dataclass(frozen=True, slots=True)
class WorkerLoaded:
    """The worker's slice of the model is loaded."""


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """The worker's runner is built (it logs its resident weight bytes itself)."""


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    error: str
    details: str


def init_process_group(device: str, store_port: int, rank: int, world_size: int, timeout_s: float, is_leader: bool):
    """Join the ranks' process group (gloo on CPUs, NCCL on CUDA), which meets at a TCPStore on
    127.0.0.1 that the leader serves; returns the store (the leader must keep it alive)."""
    import torch.distributed as dist

    # NOTE: gloo otherwise binds to the address the host name resolves to, which may be external
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=is_leader, timeout=timeout)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return store


def _serve(conn: Connection, setup: WorkerSetup) -> None:
    import torch

    from pagedserve.models.host_collectives import HostCollectives
    from pagedserve.models.loader import load_model
    from pagedserve.models.tensor_parallel import TensorParallel
    from pagedserve.worker.model_runner import ModelRunner

    if setup.cpus:
        os.sched_setaffinity(0, setup.cpus)
    torch.set_num_threads(setup.num_threads)
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    collectives = None
    if setup.shm_path is not None:  # mapped before the leader hears from us: it then removes the file
        leader = os.getppid()
        collectives = HostCollectives(
            setup.shm_path,
            setup.rank,
            setup.world_size,
            timeout_s=setup.timeout_s,
            peer_lost=lambda: "the leader exited" if os.getppid() != leader else None,
        )
    conn.send(WorkerJoining(os.getpid()))
    init_process_group(setup.device, setup.store_port, setup.rank, setup.world_size, setup.timeout_s, False)
    config = setup.config
    loaded = load_model(config.model, device, TensorParallel(setup.rank, setup.world_size, collectives))
    conn.send(WorkerLoaded())
    runner_setup: RunnerSetup | None = conn.recv()
    if runner_setup is None:  # the leader failed to start and stops us
        return
    runner = ModelRunner(
        loaded.model,
        num_layers=loaded.num_layers,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        vocab_size=loaded.vocab_size,
        num_blocks=runner_setup.num_blocks,
        block_size=runner_setup.block_size,
        dtype=loaded.dtype,
        device=device,
        seed=config.model.seed,
        batch_size_hint=runner_setup.batch_size_hint,
    )
    conn.send(WorkerReady())
    while True:
        plan = conn.recv()
        if plan is None:
            return
        runner.run_plan(plan)


def main(fd: int) -> int:
    # Ctrl-C and a SIGTERM to the server's process group are the server's to handle (it drains, then stops
    # the engine, which stops us); the leader's end closing or the leader exiting ends a worker too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        setup: WorkerSetup | None = conn.recv()
    except (EOFError, OSError):
        return 0
    if setup is None:
        return 0
    logging.basicConfig(
        level=setup.log_level, format=f"%(asctime)s %(levelname)s [tp rank {setup.rank}] %(name)s: %(message)s"
    )
    try:
        _serve(conn, setup)
    except (EOFError, ConnectionResetError, BrokenPipeError):
        return 0  # the leader is gone: nothing left to serve
    except BaseException as exc:  # noqa: BLE001 - any failure is reported to the leader, then the worker exits
        details = traceback.format_exc()
        logging.getLogger(__name__).error("tensor-parallel rank %d failed\n%s", setup.rank, details)
        try:
            conn.send(WorkerFailed(f"{type(exc).__name__}: {exc}", details))
        except OSError:
            pass
        return 1
    finally:
        _leave_process_group()
    return 0


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the peers may be gone already
            pass
