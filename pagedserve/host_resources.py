"""What this process may use of the machine: CPUs and memory, as its cgroups (and affinity mask) allow.

CPUs: the CPUs of its affinity mask (``taskset``, ``docker --cpuset-cpus``), capped by the CPU quota of
its cgroup and of every cgroup above it (``docker --cpus``, Kubernetes CPU limits; cgroup v2 ``cpu.max``
or v1 ``cpu.cfs_quota_us``). The engine sizes torch's intra-op threads from this when ``--num-threads``
is not given: a process limited to 2 CPUs of a 64-core host that ran 64 threads would spend its quota on
contention.

Memory: the machine's RAM (``/proc/meminfo``) or the smallest memory limit of its cgroups (``docker
--memory``, Kubernetes memory limits; v2 ``memory.max``, v1 ``memory.limit_in_bytes``), and what is still
free under each. The engine sizes its KV cache from this when ``--kv-cache-memory`` is not given.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
PROC_MEMINFO = "/proc/meminfo"
UNLIMITED_BYTES = 1 << 60  # v1 reports "no limit" as a number near 2**63


@dataclass(frozen=True, slots=True)
class CpuBudget:
    count: int  # CPUs' worth of threads to run, at least 1
    reason: str  # where the count comes from, for the start-up banner


def thread_budget(configured: int | None) -> CpuBudget:
    """Threads for torch's intra-op pool: ``configured`` (``--num-threads``, or a replica's whole CPUs)
    when given, else the CPUs this process may use."""
    if configured:
        return CpuBudget(configured, "configured")
    return usable_cpus()


def usable_cpus(cgroup_root: str = CGROUP_ROOT, proc_self_cgroup: str = PROC_SELF_CGROUP) -> CpuBudget:
    """CPUs in the affinity mask, lowered to the cgroup CPU quota (rounded up) where one is set."""
    if hasattr(os, "sched_getaffinity"):
        affinity = len(os.sched_getaffinity(0))
        reason = f"{affinity} CPUs in the affinity mask"
    else:
        affinity = os.cpu_count() or 1
        reason = f"{affinity} CPUs"
    quota = cgroup_cpu_quota(cgroup_root, proc_self_cgroup)
    if quota is not None and math.ceil(quota) < affinity:
        return CpuBudget(max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g}, {reason}")
    return CpuBudget(max(1, affinity), reason)


def cgroup_cpu_quota(cgroup_root: str = CGROUP_ROOT, proc_self_cgroup: str = PROC_SELF_CGROUP) -> float | None:
    """The smallest CPU quota (in CPUs) of this process's cgroup and its ancestors, or None when none is set
    or no cgroup file can be read."""
    quotas = [q for q in (_quota_at(d) for d in _cgroup_dirs(cgroup_root, proc_self_cgroup, "cpu")) if q is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(cgroup_root: str, proc_self_cgroup: str, controller: str) -> list[str]:
    """This process's cgroup directories (v2 unified, v1 ``controller``) and each of their ancestors up to
    the mount point; inside a container whose /proc/self/cgroup names a path its mount does not show,
    the mount point alone."""
    try:
        with open(proc_self_cgroup, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    found: list[str] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            mounts = [cgroup_root]  # v2 unified hierarchy
        elif controller in controllers.split(","):
            mounts = [os.path.join(cgroup_root, controllers), os.path.join(cgroup_root, controller)]
        else:
            continue
        for mount in mounts:
            if not os.path.isdir(mount):
                continue
            relative = path.strip("/")
            while True:
                directory = os.path.join(mount, relative) if relative else mount
                if os.path.isdir(directory) and directory not in found:
                    found.append(directory)
                if not relative:
                    break
                relative = os.path.dirname(relative)
            break
    if not found and os.path.isdir(cgroup_root):
        found.append(cgroup_root)
    return found


def _quota_at(directory: str) -> float | None:
    """``directory``'s CPU quota in CPUs: v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"), else v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none)."""
    try:
        with open(os.path.join(directory, "cpu.max"), encoding="ascii") as f:
            fields = f.read().split()
        if len(fields) == 2 and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return None
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us"), encoding="ascii") as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us"), encoding="ascii") as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    total: int  # bytes this process may hold at most: the RAM, or the smallest cgroup limit above it
    available: int  # bytes it can still take now: MemAvailable, lowered to what each limiting cgroup has left
    reason: str  # where ``total`` comes from, for the start-up banner


def memory_budget(
    cgroup_root: str = CGROUP_ROOT, proc_self_cgroup: str = PROC_SELF_CGROUP, proc_meminfo: str = PROC_MEMINFO
) -> MemoryBudget:
    """The machine's memory, lowered to the tightest memory limit of this process's cgroups.

    A cgroup's free room is its limit less its usage, where the usage's reclaimable page cache
    (``inactive_file``) counts as free, as ``docker stats`` and the kernel's own reclaim see it.
    """
    meminfo = _read_meminfo(proc_meminfo)
    total = meminfo.get("MemTotal", 0)
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    reason = f"{format_gib(total)} of RAM"
    for directory in _cgroup_dirs(cgroup_root, proc_self_cgroup, "memory"):
        limit, usage = _memory_limit_at(directory)
        if limit is None:
            continue
        if limit < total:
            total, reason = limit, f"cgroup memory limit {format_gib(limit)}"
        if usage is not None:
            available = min(available, max(0, limit - usage))
    return MemoryBudget(total, min(available, total), reason)


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``; 0 where there is none to read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def format_gib(size: float) -> str:
    return f"{size / (1 << 30):.2f} GiB"


def _read_meminfo(path: str) -> dict[str, int]:
    """``/proc/meminfo`` in bytes (its values are kB)."""
    values: dict[str, int] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    values[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return values


def _memory_limit_at(directory: str) -> tuple[int | None, int | None]:
    """``directory``'s memory limit and usage less its inactive page cache, in bytes: v2 ``memory.max``
    ("max": none) and ``memory.current``, else v1 ``memory.limit_in_bytes`` (near 2**63: none) and
    ``memory.usage_in_bytes``. (None, None) when no limit is set or none can be read."""
    for limit_file, usage_file, inactive_key in (
        ("memory.max", "memory.current", "inactive_file"),
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            with open(os.path.join(directory, limit_file), encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= UNLIMITED_BYTES:
            return None, None
        limit = int(text)
        try:
            with open(os.path.join(directory, usage_file), encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            return limit, None
        return limit, max(0, usage - _stat_value(os.path.join(directory, "memory.stat"), inactive_key))
    return None, None


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
