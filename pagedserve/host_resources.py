"""What this process may use of the machine's CPUs: the CPUs of its affinity mask (``taskset``,
``docker --cpuset-cpus``), capped by the CPU quota of its cgroup and of every cgroup above it
(``docker --cpus``, Kubernetes CPU limits; cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``).

The engine sizes torch's intra-op threads from this when ``--num-threads`` is not given: a process
limited to 2 CPUs of a 64-core host that ran 64 threads would spend its quota on contention.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


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
    quotas = [q for q in (_quota_at(d) for d in _cgroup_dirs(cgroup_root, proc_self_cgroup)) if q is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(cgroup_root: str, proc_self_cgroup: str) -> list[str]:
    """This process's cgroup directories (v2 unified, v1 cpu controller) and each of their ancestors up to
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
        elif "cpu" in controllers.split(","):
            mounts = [os.path.join(cgroup_root, controllers), os.path.join(cgroup_root, "cpu")]
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
