"""The CPUs a process may use: the affinity mask capped by the CPU quota of its cgroup and every cgroup
above it (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), on fake cgroup trees; once in a real cgroup with a
quota where this machine lets the test make one; and the served engine's banner naming its threads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pagedserve.host_resources import cgroup_cpu_quota, thread_budget, usable_cpus

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
