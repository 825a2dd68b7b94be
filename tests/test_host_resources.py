"""What a process may use of the machine. CPUs: the affinity mask capped by the CPU quota of its cgroup and
every cgroup above it (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``). Memory: the RAM or the tightest cgroup
limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) and what is free under it. On fake cgroup trees;
in real cgroups where this machine lets the test make them (a server sizing its KV cache from a memory
limit); and the served engine's banner naming its threads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pagedserve.host_resources import cgroup_cpu_quota, memory_budget, thread_budget, usable_cpus
from tests.utils import RemoteServer, free_port

AFFINITY = len(os.sched_getaffinity(0))


def tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_v2_quota_rounds_up_and_the_smallest_ancestor_wins(tmp_path):
    root = tree(
        tmp_path / "cg",
        {
            "cpu.max": "max 100000\n",
            "kubepods/cpu.max": "150000 100000\n",  # 1.5 CPUs
            "kubepods/pod/cpu.max": "max 100000\n",  # no limit of its own: the parent's applies
        },
    )
    proc = tree(tmp_path, {"self_cgroup": "0::/kubepods/pod\n"}) / "self_cgroup"
    assert cgroup_cpu_quota(str(root), str(proc)) == 1.5
    budget = usable_cpus(str(root), str(proc))
    assert budget.count == min(AFFINITY, 2)
    if AFFINITY > 2:
        assert budget.reason.startswith("cgroup CPU quota 1.5")


def test_v1_quota_and_no_quota(tmp_path):
    root = tree(
        tmp_path / "cg",
        {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"},
    )
    proc = tree(tmp_path, {"v1": "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n"}) / "v1"
    assert cgroup_cpu_quota(str(root), str(proc)) == 0.5
    assert usable_cpus(str(root), str(proc)).count == 1
    assert "cgroup CPU quota 0.5" in usable_cpus(str(root), str(proc)).reason
    unlimited = tree(tmp_path / "free", {"cpu.max": "max 100000\n"})
    none = tree(tmp_path, {"v2": "0::/\n"}) / "v2"
    assert cgroup_cpu_quota(str(unlimited), str(none)) is None
    assert usable_cpus(str(unlimited), str(none)) == usable_cpus(str(tmp_path / "missing"), str(tmp_path / "nope"))
    assert usable_cpus(str(unlimited), str(none)).count == AFFINITY


GIB = 1 << 30
MEMINFO = f"MemTotal:       {16 * GIB // 1024} kB\nMemFree:  {GIB // 1024} kB\nMemAvailable:   {10 * GIB // 1024} kB\n"


def test_memory_is_the_ram_or_the_tightest_cgroup_limit_v2(tmp_path):
    root = tree(
        tmp_path / "cg",
        {
            "memory.max": "max\n",
            "kubepods/memory.max": f"{8 * GIB}\n",
            "kubepods/memory.current": f"{2 * GIB}\n",
            "kubepods/pod/memory.max": f"{4 * GIB}\n",  # the tightest limit
            "kubepods/pod/memory.current": f"{3 * GIB}\n",
            "kubepods/pod/memory.stat": f"anon 1\ninactive_file {GIB}\nactive_file 5\n",  # reclaimable
        },
    )
    files = tree(tmp_path, {"self_cgroup": "0::/kubepods/pod\n", "meminfo": MEMINFO})
    budget = memory_budget(str(root), str(files / "self_cgroup"), str(files / "meminfo"))
    assert (budget.total, budget.available) == (4 * GIB, 2 * GIB)  # 4 - (3 - 1) free in the pod
    assert budget.reason == "cgroup memory limit 4.00 GiB"


def test_memory_v1_limit_and_no_limit(tmp_path):
    root = tree(
        tmp_path / "cg",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{12 * GIB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{5 * GIB}\n",
            "memory/docker/abc/memory.stat": f"cache 7\ntotal_inactive_file {GIB}\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        },
    )
    files = tree(tmp_path, {"v1": "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n", "meminfo": MEMINFO})
    budget = memory_budget(str(root), str(files / "v1"), str(files / "meminfo"))
    assert (budget.total, budget.available, budget.reason) == (12 * GIB, 8 * GIB, "cgroup memory limit 12.00 GiB")
    free = tree(tmp_path / "free", {"memory.max": "max\n"})
    files = tree(tmp_path, {"v2": "0::/\n"})
    budget = memory_budget(str(free), str(files / "v2"), str(files / "meminfo"))
    assert (budget.total, budget.available, budget.reason) == (16 * GIB, 10 * GIB, "16.00 GiB of RAM")


def test_a_configured_count_wins():
    assert thread_budget(3).count == 3 and thread_budget(3).reason == "configured"
    assert thread_budget(None) == usable_cpus()


def make_cpu_cgroup(quota_us: int, period_us: int = 100_000) -> Path | None:
    """A real cgroup with a CPU quota (v1 cpu controller, or a v2 child of the root), or None where this
    process may not make one (not root, read-only cgroupfs, no cpu controller)."""
    name = f"pagedserve-test-{uuid.uuid4().hex[:8]}"
    for parent, write in (
        (Path("/sys/fs/cgroup/cpu"), {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}),
        (Path("/sys/fs/cgroup"), {"cpu.max": f"{quota_us} {period_us}"}),
    ):
        if not parent.is_dir() or (parent == Path("/sys/fs/cgroup") and not (parent / "cgroup.controllers").exists()):
            continue
        path = parent / name
        try:
            path.mkdir()
            for file, value in write.items():
                (path / file).write_text(value)
            return path
        except OSError:
            if path.exists():
                path.rmdir()
    return None


def make_memory_cgroup(limit: int) -> Path | None:
    """A real cgroup with a memory limit (v1 memory controller, or a v2 child of the root), or None where this
    process may not make one."""
    name = f"pagedserve-test-{uuid.uuid4().hex[:8]}"
    for parent, file in (
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),
    ):
        if not parent.is_dir() or (parent == Path("/sys/fs/cgroup") and not (parent / "cgroup.controllers").exists()):
            continue
        path = parent / name
        try:
            path.mkdir()
            (path / file).write_text(str(limit))
            return path
        except OSError:
            if path.exists():
                path.rmdir()
    return None


def remove_cgroup(path: Path) -> None:
    """rmdir once the cgroup's processes are gone (their exit is reaped asynchronously)."""
    for _ in range(100):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


@pytest.mark.slow
def test_a_server_in_a_memory_limited_cgroup_sizes_its_kv_cache_from_the_limit():
    limit = 4 * GIB
    cgroup = make_memory_cgroup(limit)
    if cgroup is None:
        pytest.skip("cannot make a cgroup with a memory limit here (needs root and a writable memory controller)")
    join = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -m pagedserve.cli "$@"', sys.executable]
    try:
        with RemoteServer(["--max-model-len", "2048"], launcher=join, size_kv_cache=False) as server:
            banner = re.search(
                r"KV cache: (\d+) blocks x (\d+) tokens = \d+ tokens, ([\d.]+) GiB \((.*)\)$",
                server.log_text(),
                re.MULTILINE,
            )
            assert banner, server.log_text()[-3000:]
            assert banner.group(4).startswith("0.5 of cgroup memory limit 4.00 GiB, less "), banner.group(0)
            assert 0.1 < float(banner.group(3)) < 2.0  # half the limit, less the weights and the interpreter
            answer = httpx.post(server.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        # a configured size the cgroup cannot hold is refused at start-up, before anything is allocated
        done = subprocess.run(
            [*join, "serve", "--kv-cache-memory", "6GiB", "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode != 0
        assert re.search(
            r"--kv-cache-memory asks for 6.00 GiB, but only [\d.]+ GiB is free \(cgroup memory limit",
            done.stdout + done.stderr,
        ), (done.stdout + done.stderr)[-3000:]
    finally:
        remove_cgroup(cgroup)


def test_inside_a_real_cgroup_with_half_a_cpu():
    cgroup = make_cpu_cgroup(50_000)
    if cgroup is None:
        pytest.skip("cannot make a cgroup with a CPU quota here (needs root and a writable cpu controller)")
    try:
        code = "from pagedserve.host_resources import usable_cpus; b = usable_cpus(); print(b.count, '|', b.reason)"
        script = f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -c "$1"'
        out = subprocess.run(
            ["sh", "-c", script, sys.executable, code], capture_output=True, text=True, timeout=120, check=True
        )
        count, reason = out.stdout.strip().split(" | ")
        assert int(count) == 1 and reason.startswith("cgroup CPU quota 0.5"), out.stdout
    finally:
        cgroup.rmdir()


@pytest.mark.slow
def test_the_banner_names_the_engine_threads(server):
    match = re.search(r"threads: (\d+) \((.*)\)$", server.log_text(), re.MULTILINE)
    assert match, server.log_text()[-3000:]
    assert int(match.group(1)) == usable_cpus().count and match.group(2) == usable_cpus().reason
