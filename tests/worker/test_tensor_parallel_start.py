"""Start-up of the tensor-parallel workers: a worker that dies after it announced it is joining, but
before it joined the process group, fails the engine's start at once with an error naming its rank,
instead of leaving rank 0 waiting for the process group's timeout."""

from __future__ import annotations

import os
import signal

import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.worker import tensor_parallel_executor
from pagedserve.worker.tensor_parallel_executor import TensorParallelError, TensorParallelExecutor
from pagedserve.worker.tensor_parallel_worker import WorkerJoining

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_a_worker_that_dies_before_joining_the_group_fails_the_start(monkeypatch):
    # longer than the test's timeout: a start that does not watch its workers waits this long (a C++ wait
    # that no timeout interrupts) and then fails with the store's own error, not this one
    monkeypatch.setattr(tensor_parallel_executor, "COLLECTIVE_TIMEOUT_S", 700.0)
    expect = TensorParallelExecutor._expect
    killed = []

    def expect_then_kill(self, worker, kind):
        message = expect(self, worker, kind)
        if kind is WorkerJoining:
            os.kill(worker.pid, signal.SIGKILL)
            killed.append(worker)
        return message

    monkeypatch.setattr(TensorParallelExecutor, "_expect", expect_then_kill)
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(kv_cache_memory=64 << 20),
        parallel=ParallelConfig(tensor_parallel_size=2),
        device="cpu",
    )
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        LLMEngine(config)
    assert len(killed) == 1 and killed[0].proc.poll() is not None
