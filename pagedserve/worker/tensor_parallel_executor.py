"""TensorParallelExecutor: the leader's (rank 0's) side of tensor parallelism. It starts the
worker processes (ranks 1 .. N-1), forms the process group with them, hands each step's ForwardPlan
to them, watches that they stay alive, and stops them.

The leader is the engine core itself: it schedules, runs rank 0's slice of the forward and samples;
the workers only run their slices (``tensor_parallel_worker.py``). On x86 CPUs the ranks sum and
gather through shared memory (``models/host_collectives.py``, a file in /dev/shm that is unlinked as
soon as every rank has mapped it); gloo (NCCL on CUDA) carries the rest. Each rank gets an equal share of
the CPUs the engine may use, pinned where the affinity mask has enough of them (on CUDA, one GPU
per rank). A worker that dies or fails takes the engine down: the next collective fails, or the idle
engine's health check finds it, and the error names the rank, its pid and its exit code.
"""

from __future__ import annotations

import logging
import os
import platform
import queue
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection

import torch

from pagedserve.config import EngineConfig
from pagedserve.models.host_collectives import HostCollectives, create_shm_file
from pagedserve.models.tensor_parallel import TensorParallel
from pagedserve.worker.forward_plan import ForwardPlan
from pagedserve.worker.tensor_parallel_worker import (
    RunnerSetup,
    WorkerFailed,
    WorkerJoining,
    WorkerLoaded,
    WorkerReady,
    WorkerSetup,
    init_process_group,
)

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # a rank that hangs (not dies) inside a collective fails the step after this
START_TIMEOUT_S = 600.0  # a worker's start, model load and runner build together
EXIT_WAIT_S = 5.0  # how long the workers may take to stop before they are killed
FAILURE_WAIT_S = 2.0  # after a failed step: how long a worker whose death caused it may take to be reaped
WORKER_ENTRY = "import sys; from pagedserve.worker.tensor_parallel_worker import main; sys.exit(main(int(sys.argv[1])))"


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed or died; the engine cannot go on."""


def rank_cpus(num_ranks: int, threads_per_rank: int) -> list[tuple[int, ...]]:
    """Each rank's CPUs: consecutive ``threads_per_rank`` of the affinity mask, or none (not pinned) when
    the mask has fewer than ``num_ranks * threads_per_rank``."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) < num_ranks * threads_per_rank:
        return [() for _ in range(num_ranks)]
    return [tuple(allowed[r * threads_per_rank : (r + 1) * threads_per_rank]) for r in range(num_ranks)]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU for every rank, or its own GPU (``cuda:rank``)."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection) -> None:
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.pid = proc.pid


class TensorParallelExecutor:
    """Starts ``world_size - 1`` workers and joins the process group as rank 0 (``start``); then
    ``build_runners`` and ``send_plan`` per step; ``check_health`` between steps; ``close`` at the end."""

    def __init__(self, config: EngineConfig, device: torch.device, threads_per_rank: int) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        self.device = device
        self.threads_per_rank = threads_per_rank
        self.cpus = rank_cpus(self.world_size, threads_per_rank)
        self._workers: list[_Worker] = []
        self._closed = False
        self._store = None
        self._shm_path: str | None = None
        self._own_affinity: set[int] | None = None  # this thread's CPUs before rank 0 was pinned
        self.tensor_parallel = TensorParallel(0, self.world_size)  # rank 0's, with its collectives once started
        self._start(config)

    # ----------------------------------------------------------------- start-up
    def _start(self, config: EngineConfig) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise TensorParallelError(
                "this process already belongs to a process group (another tensor-parallel engine)"
            )
        port = _free_port()
        collectives = None
        # NOTE: the shared-memory collectives rely on x86's in-order stores; other CPUs use gloo alone
        if self.device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64"):
            shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self._shm_path = os.path.join(shm_dir, f"pagedserve-tp-{os.getpid()}-{secrets.token_hex(4)}")
            create_shm_file(self._shm_path, self.world_size)
            collectives = HostCollectives(
                self._shm_path, 0, self.world_size, timeout_s=COLLECTIVE_TIMEOUT_S, peer_lost=self._lost_worker
            )
        try:
            for rank in range(1, self.world_size):
                self._workers.append(self._spawn(rank))
            for worker in self._workers:
                worker.conn.send(
                    WorkerSetup(
                        config=config,
                        rank=worker.rank,
                        world_size=self.world_size,
                        store_port=port,
                        device=str(rank_device(self.device, worker.rank)),
                        num_threads=self.threads_per_rank,
                        cpus=self.cpus[worker.rank],
                        timeout_s=COLLECTIVE_TIMEOUT_S,
                        log_level=logging.getLogger("pagedserve").getEffectiveLevel(),
                        shm_path=self._shm_path,
                    )
                )
            for worker in self._workers:
                self._expect(worker, WorkerJoining)
            self._remove_shm_file()  # every rank has it mapped: nothing is left behind, whatever happens next
            if self.cpus[0]:
                self._own_affinity = os.sched_getaffinity(0)  # given back at close (an offline LLM's process)
                os.sched_setaffinity(0, self.cpus[0])
            self._store = self._join_process_group(port)
            self.tensor_parallel = TensorParallel(0, self.world_size, collectives)
        except BaseException:
            self.close()
            raise
        logger.info(
            "tensor parallelism: %d ranks (workers %s), %d threads each%s",
            self.world_size,
            ", ".join(f"rank {w.rank} pid {w.pid}" for w in self._workers),
            self.threads_per_rank,
            f", pinned to CPUs {list(self.cpus)}" if self.cpus[0] else "",
        )

    def _join_process_group(self, port: int):
        """Join as rank 0 (the store's host) while watching the workers: a worker that dies before it
        joins fails the start at once instead of after the store's timeout. The join runs on a thread;
        after such a failure that thread stays blocked until the timeout, holding nothing of ours."""
        joined: queue.Queue = queue.Queue(maxsize=1)

        def join() -> None:
            try:
                joined.put(init_process_group(str(self.device), port, 0, self.world_size, COLLECTIVE_TIMEOUT_S, True))
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                joined.put(exc)

        threading.Thread(target=join, name="tp-join", daemon=True).start()
        while True:
            try:
                result = joined.get(timeout=0.2)
            except queue.Empty:  # still joining
                self.check_health()
                continue
            if isinstance(result, BaseException):
                raise TensorParallelError(f"the tensor-parallel ranks could not form a process group: {result}")
            return result

    def _spawn(self, rank: int) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        child_fd = child_sock.fileno()
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads_per_rank))
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_ENTRY, str(child_fd)], pass_fds=(child_fd,), env=env, close_fds=True
        )
        child_sock.close()
        if self.cpus[rank]:
            try:
                os.sched_setaffinity(proc.pid, self.cpus[rank])  # before it starts its threads; it sets it again
            except OSError:
                pass
        return _Worker(rank, proc, Connection(parent_sock.detach()))

    def wait_loaded(self) -> None:
        """Wait for every worker to have loaded its slice of the model."""
        for worker in self._workers:
            self._expect(worker, WorkerLoaded)

    def build_runners(self, num_blocks: int, block_size: int, batch_size_hint: int) -> None:
        """Give the workers the KV cache's size and wait until each has built its runner."""
        for worker in self._workers:
            worker.conn.send(RunnerSetup(num_blocks, block_size, batch_size_hint))
        for worker in self._workers:
            self._expect(worker, WorkerReady)

    def _expect(self, worker: _Worker, kind: type):
        """The worker's next message, which must be ``kind``; raises TensorParallelError if it failed,
        died or took longer than START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not worker.conn.poll(0.2):
            if worker.proc.poll() is not None:
                raise self._dead_error(worker)
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank {worker.rank} (pid {worker.pid}) did not start in time"
                )
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            raise self._dead_error(worker) from None
        if isinstance(message, WorkerFailed):
            raise TensorParallelError(f"tensor-parallel rank {worker.rank} failed to start: {message.error}")
        if not isinstance(message, kind):
            raise TensorParallelError(f"tensor-parallel rank {worker.rank} sent {message!r}, expected {kind.__name__}")
        return message

    # ----------------------------------------------------------------- steps
    def send_plan(self, plan: ForwardPlan) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(plan)
            except OSError:
                raise self._dead_error(worker) from None

    def _lost_worker(self) -> str | None:
        """Why a worker is gone (it exited), or None while all run."""
        for worker in self._workers:
            if worker.proc.poll() is not None:
                return f"tensor-parallel worker rank {worker.rank} (pid {worker.pid}) exited"
        return None

    def check_health(self) -> None:
        """Raise TensorParallelError if a worker has exited."""
        for worker in self._workers:
            if worker.proc.poll() is not None:
                raise self._dead_error(worker)

    def explain_failure(self, exc: BaseException) -> TensorParallelError | None:
        """After a step failed with ``exc``: the worker failure behind it, if a worker failed or died (a
        peer's death reaches the others as a failed collective, maybe a moment before it is reaped)."""
        deadline = time.monotonic() + FAILURE_WAIT_S
        while True:
            for worker in self._workers:
                if worker.proc.poll() is not None:
                    return self._dead_error(worker)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _dead_error(self, worker: _Worker) -> TensorParallelError:
        try:
            worker.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        reason = ""
        try:
            while worker.conn.poll(0):
                message = worker.conn.recv()
                if isinstance(message, WorkerFailed):
                    reason = f": {message.error}"
        except (EOFError, OSError):
            pass
        code = worker.proc.returncode
        how = "is not responding" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by signal {-code}"
        return TensorParallelError(f"tensor-parallel worker rank {worker.rank} (pid {worker.pid}) {how}{reason}")

    # ----------------------------------------------------------------- shut-down
    def close(self) -> None:
        """Stop the workers (killed if they do not stop in EXIT_WAIT_S) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + EXIT_WAIT_S  # one wait for all of them
        for worker in self._workers:
            try:
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
            worker.conn.close()
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the workers are gone already
                pass
        self._store = None
        self._remove_shm_file()
        if self._own_affinity is not None:
            try:
                os.sched_setaffinity(0, self._own_affinity)
            except OSError:
                pass
            self._own_affinity = None

    def _remove_shm_file(self) -> None:
        if self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            self._shm_path = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


__all__ = ["TensorParallelError", "TensorParallelExecutor", "rank_cpus", "rank_device"]
