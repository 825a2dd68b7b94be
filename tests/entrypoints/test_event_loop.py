"""``--event-loop``: which loop the front end runs on (uvloop when installed, else asyncio's own).

Every other server test runs the defaults (uvloop and httptools here); ``tests/test_server_limits.py``
serves with ``--event-loop asyncio --http h11``, so both loops and both HTTP parsers serve real
requests in the suite (the head limit of the httptools one: ``tests/test_server_errors.py``).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from pagedserve.entrypoints.launcher import event_loop_factory


def test_asyncio_choice_means_asyncios_own_loop():
    assert event_loop_factory("asyncio") is None


def test_auto_and_uvloop_choose_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")
    for choice in ("auto", "uvloop"):
        factory = event_loop_factory(choice)
        assert factory is uvloop.new_event_loop
        loop = factory()
        try:
            assert isinstance(loop, uvloop.Loop)
            assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
        finally:
            loop.close()


def test_without_uvloop_auto_falls_back_and_uvloop_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert event_loop_factory("auto") is None
    with pytest.raises(ImportError):
        event_loop_factory("uvloop")
