"""The KV cache's size: configured bytes checked against the free memory, or a share of the memory less what
the engine holds and a reserve for activations, split between engines, capped by what is free."""

from __future__ import annotations

import pytest
import torch

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.engine.kv_cache_sizing import DeviceMemory, activation_reserve, device_memory, kv_cache_size
from pagedserve.host_resources import MemoryBudget

GIB = 1 << 30
CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def machine(total=16, available=12, held=1.0) -> DeviceMemory:
    return DeviceMemory(int(total * GIB), int(available * GIB), int(held * GIB), f"{total} GiB of RAM")


def test_the_default_share_less_what_is_held_and_the_reserve():
    size = kv_cache_size(CacheConfig(), CPU, machine(), reserve=GIB // 4)
    assert size.bytes == 8 * GIB - GIB - GIB // 4  # 0.5 of 16 GiB on a CPU
    assert size.reason.startswith("0.5 of 16 GiB of RAM, less 1.00 GiB held and 0.25 GiB for activations")
    gpu = kv_cache_size(CacheConfig(), CUDA, machine(available=16), reserve=0)
    assert gpu.bytes == int(0.9 * 16 * GIB) - GIB  # vLLM's 0.9 on accelerators


def test_a_configured_share_split_between_engines():
    size = kv_cache_size(CacheConfig(memory_utilization=0.75, memory_shared_by=3), CPU, machine(), reserve=0)
    assert size.bytes == 4 * GIB - GIB
    assert "0.75 of 16 GiB of RAM split between 3 engines" in size.reason


def test_capped_by_the_memory_still_free():
    size = kv_cache_size(CacheConfig(memory_utilization=0.9), CPU, machine(available=3), reserve=GIB // 2)
    assert size.bytes == 3 * GIB - GIB // 2
    assert size.reason.endswith("capped to the 3.00 GiB free")


def test_capped_to_what_the_running_sequences_can_hold():
    size = kv_cache_size(CacheConfig(), CPU, machine(), reserve=0, most_useful=2 * GIB)
    assert size.bytes == 2 * GIB and size.reason.endswith("capped to 2.00 GiB, all the running sequences can hold")
    assert kv_cache_size(CacheConfig(kv_cache_memory=3 * GIB), CPU, machine(), 0, most_useful=GIB).bytes == 3 * GIB


def test_nothing_left_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no memory left for the KV cache.*raise --memory-utilization \(now 0.1\)"):
        kv_cache_size(CacheConfig(memory_utilization=0.1), CPU, machine(held=2.0), reserve=0)


def test_configured_bytes_are_used_when_they_fit_and_refused_when_not():
    size = kv_cache_size(CacheConfig(kv_cache_memory=2 * GIB), CPU, machine(), reserve=GIB)
    assert size.bytes == 2 * GIB and size.reason == "--kv-cache-memory"
    with pytest.raises(ValueError, match=r"asks for 13.00 GiB, but only 12.00 GiB is free \(16 GiB of RAM\)"):
        kv_cache_size(CacheConfig(kv_cache_memory=13 * GIB), CPU, machine(), reserve=0)


def test_config_checks_the_share():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="memory_utilization"):
            CacheConfig(memory_utilization=bad)
    with pytest.raises(ValueError, match="memory_shared_by"):
        CacheConfig(memory_shared_by=0)


def test_the_activation_reserve_grows_with_the_budget_and_the_sampled_rows():
    small = activation_reserve(576, 1536, 49152, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16))
    big = activation_reserve(576, 1536, 49152, SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16))
    drafts = activation_reserve(576, 1536, 49152, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16), 5)
    assert 0 < small < big and small < drafts
    assert big - small == 1536 * 4 * (6 * 576 + 2 * 1536)  # per token of budget
    assert drafts - small == 16 * 4 * 4 * 3 * 49152  # four more logits rows per request


def test_the_host_memory_is_the_machines_or_its_cgroups():
    host = MemoryBudget(total=8 * GIB, available=5 * GIB, reason="cgroup memory limit 8.00 GiB")
    memory = device_memory(CPU, host)
    assert (memory.total, memory.available, memory.describe) == (8 * GIB, 5 * GIB, "cgroup memory limit 8.00 GiB")
    assert 0 < memory.held < memory.total  # this process's resident set
