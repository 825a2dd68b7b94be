"""A short soak (the 30-minute one is `make soak`): 45 s at concurrency 32 with disconnects and bad
requests mixed in; afterwards memory has not grown past the warm-up, no fd or thread was left behind,
no KV block is held, and every valid request completed."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.bench.soak import Soak, verdict
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow


def test_short_soak_leaks_nothing():
    with RemoteServer(["--log-stats-interval", "0", "--disable-access-log"]) as server:
        result = asyncio.run(Soak(server.url, server.pid, concurrency=32, duration_s=45, model=None).run())
    summary = result["summary"]
    assert summary["valid_requests"] >= 30 and summary["disconnects"] >= 3 and summary["bad_refused"] >= 3
    assert verdict(summary, max_tpot_drift=None) == [], summary
