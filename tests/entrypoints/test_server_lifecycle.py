"""Engine death: a fault injected into the real engine's step() -> in-flight requests fail with 500,
/health answers 503, and the process exits non-zero on its own."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.utils import RemoteServer

pytestmark = pytest.mark.slow

# Runs the real CLI with LLMEngine.step wrapped to fail once a request asks for max_tokens=777.
FAULTY_LAUNCHER = r"""
import sys
from pagedserve.engine.llm_engine import LLMEngine

armed = {"on": False}
original_add, original_step = LLMEngine.add_request, LLMEngine.step

def add_request(self, request):
    if request.sampling_params.max_tokens == 777:
        armed["on"] = True
    return original_add(self, request)

def step(self):
    if armed["on"]:
        raise RuntimeError("injected fault")
    return original_step(self)

LLMEngine.add_request, LLMEngine.step = add_request, step
from pagedserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_engine_death_fails_requests_and_exits_nonzero():
    with RemoteServer(["--log-stats-interval", "0"], launcher=[sys.executable, "-c", FAULTY_LAUNCHER]) as server:
        ok = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
        assert ok.status_code == 200
        response = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 777})
        assert response.status_code == 500
        assert "engine" in response.json()["error"]["message"].lower()
        try:
            health = httpx.get(server.url + "/health", timeout=10)
            assert health.status_code == 503
        except httpx.HTTPError:
            pass  # already gone
        code = server.proc.wait(60)
        assert code != 0
        assert "injected fault" in server.log_text()
