"""The server re-executes itself once with glibc's heap on transparent huge pages, keeps its pid,
respects a user's own setting and the opt-out, and never re-executes a program that calls main()."""

from __future__ import annotations

import os
import platform
import sys

import pytest

from pagedserve.entrypoints import malloc_env
from pagedserve.entrypoints.malloc_env import (
    OPT_OUT,
    TUNABLE,
    environ_with_huge_page_malloc,
    transparent_huge_pages_enabled,
)
from tests.utils import RemoteServer

linux_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def test_thp_mode_file_parsing(tmp_path):
    mode = tmp_path / "enabled"
    for text, expected in (
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
        ("", False),
    ):
        mode.write_text(text)
        assert transparent_huge_pages_enabled(str(mode)) is expected, text
    assert transparent_huge_pages_enabled(str(tmp_path / "missing")) is False


@pytest.mark.skipif(not linux_glibc, reason="glibc tunables exist on Linux with glibc only")
def test_environment_gets_the_tunable_once(monkeypatch):
    monkeypatch.setattr(malloc_env, "transparent_huge_pages_enabled", lambda: True)
    env = environ_with_huge_page_malloc({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE}
    assert environ_with_huge_page_malloc(env) is None  # after the re-exec: nothing more to do
    other = environ_with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
    assert environ_with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's choice
    assert environ_with_huge_page_malloc({OPT_OUT: "0"}) is None
    monkeypatch.setattr(malloc_env, "transparent_huge_pages_enabled", lambda: False)
    assert environ_with_huge_page_malloc({}) is None


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [item.decode(errors="replace") for item in f.read().split(b"\0") if item]
    return dict(item.split("=", 1) for item in items if "=" in item)


@pytest.mark.slow
@pytest.mark.skipif(not linux_glibc or not transparent_huge_pages_enabled(), reason="needs Linux, glibc and THP")
@pytest.mark.skipif("glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""), reason="the tunable is set outside")
@pytest.mark.skipif(os.environ.get(OPT_OUT) == "0", reason="opted out outside")
def test_served_process_runs_with_the_tunable_under_the_same_pid():
    with RemoteServer(["--kv-cache-memory", "256MiB"]) as server:
        assert TUNABLE in _environ_of(server.pid)["GLIBC_TUNABLES"].split(":")
        assert server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    launcher = [sys.executable, "-c", "import sys; from pagedserve.cli import main; sys.exit(main(sys.argv[1:]))"]
    with RemoteServer(["--kv-cache-memory", "256MiB"], launcher=launcher) as server:  # main(argv): no re-exec
        assert _environ_of(server.pid).get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES")
