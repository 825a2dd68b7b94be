"""How many bytes the paged KV cache gets, decided once when the engine starts (after its weights load).

``--kv-cache-memory`` given: that, refused with a clear error when the memory still free cannot hold it.
Otherwise, as vLLM sizes its cache from ``gpu_memory_utilization``: the engine may use a share of the
memory (``memory_utilization`` of the RAM or cgroup limit on CPUs, of the device's memory on
accelerators, split between the engines one server starts), and the KV cache gets that share less what
the engine already holds (weights, the interpreter) and a reserve for one step's activations, capped
by what is free now. The reason string says which of these decided, for the start-up banner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.host_resources import MemoryBudget, memory_budget, resident_bytes
from pagedserve.host_resources import format_gib as gib


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    bytes: int
    reason: str


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The memory an engine on one device works within (bytes)."""

    total: int  # what this engine's share is taken of: RAM / cgroup limit, or the device's memory
    available: int  # what can still be allocated now
    held: int  # what this engine process already holds there (RSS, or torch's reserved device memory)
    describe: str  # "23.5 GiB of RAM", "cgroup memory limit 4.0 GiB", "79.1 GiB of cuda:0"


def device_memory(device: torch.device, host: MemoryBudget | None = None) -> DeviceMemory:
    """The memory of ``device`` as this process sees it: CUDA's free / total and torch's reservation, else
    the host's RAM (cgroup-limited) and this process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total, free, torch.cuda.memory_reserved(device), f"{gib(total)} of {device}")
    host = host or memory_budget()
    return DeviceMemory(host.total, host.available, resident_bytes(), host.reason)


def activation_reserve(
    hidden_size: int, intermediate_size: int, vocab_size: int, scheduler: SchedulerConfig, rows_per_seq: int = 1
) -> int:
    """Bytes one step's activations may take at most, estimated in float32: the widest per-token tensors
    (hidden states, fused QKV, gate/up) for a full token budget, and the logits plus the sampler's
    float copies for every sampled row (``rows_per_seq`` per request: K + 1 when drafts are verified)."""
    per_token = 4 * (6 * hidden_size + 2 * intermediate_size)  # [tokens, 2*intermediate] + a few [tokens, hidden]
    sampled_rows = scheduler.max_num_seqs * rows_per_seq
    per_row = 4 * 3 * vocab_size  # logits, probabilities, a sorted copy: [rows, vocab] each
    return scheduler.max_num_batched_tokens * per_token + sampled_rows * per_row


def kv_cache_size(
    cache: CacheConfig, device: torch.device, memory: DeviceMemory, reserve: int, most_useful: int | None = None
) -> KVCacheSize:
    """The KV cache's bytes for ``cache`` on ``device`` (see the module docstring); ValueError when there is
    no room for the configured size, or none left at all. A size from the memory share is also capped to
    ``most_useful`` bytes (what the most sequences the scheduler runs at once can hold at full length)."""
    if cache.kv_cache_memory is not None:
        if cache.kv_cache_memory > memory.available:
            raise ValueError(
                f"--kv-cache-memory asks for {gib(cache.kv_cache_memory)}, but only {gib(memory.available)} is free "
                f"({memory.describe}): give it less, or free memory"
            )
        return KVCacheSize(cache.kv_cache_memory, "--kv-cache-memory")
    utilization = cache.resolved_memory_utilization(device.type)
    share = utilization * memory.total / cache.memory_shared_by
    wanted = int(share - memory.held - reserve)
    room = memory.available - reserve
    shared = f" split between {cache.memory_shared_by} engines" if cache.memory_shared_by > 1 else ""
    reason = (
        f"{utilization:g} of {memory.describe}{shared}, less {gib(memory.held)} held and {gib(reserve)} for activations"
    )
    if wanted > room:
        wanted, reason = room, f"{reason}; capped to the {gib(memory.available)} free"
    if most_useful is not None and wanted > most_useful:
        wanted, reason = most_useful, f"{reason}; capped to {gib(most_useful)}, all the running sequences can hold"
    if wanted <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {reason} leaves nothing; raise --memory-utilization (now "
            f"{utilization:g}) or give --kv-cache-memory"
        )
    return KVCacheSize(wanted, reason)
