"""API fuzzing: schemathesis drives a real server from its own /openapi.json, with the API key and
without, through every route; no 5xx, no hang, every answer as the schema declares it (status, content
type, headers, body, errors in OpenAI's or TGI's shape), schema-violating requests refused; afterwards
nothing runs, waits or holds KV blocks, and a fixed greedy request is answered as before."""

from __future__ import annotations

import pytest

from tests.reliability.fuzzing import API_KEY, SERVER_ARGS, engine_state, reference_answer, run_schemathesis
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow


def test_fuzz_every_route_with_and_without_the_key():
    with RemoteServer(SERVER_ARGS, api_key=API_KEY) as server:
        before = reference_answer(server)
        # the coverage phase (thousands of boundary cases, minutes) runs in `make fuzz`
        keyed = run_schemathesis(
            server, api_key=API_KEY, max_examples=10, max_time=None, seed=7, phases="fuzzing,stateful"
        )
        assert keyed.returncode == 0, keyed.output[-8000:]
        anonymous = run_schemathesis(server, api_key=None, max_examples=5, max_time=None, seed=7, phases="fuzzing")
        assert anonymous.returncode == 0, anonymous.output[-8000:]
        assert anonymous.cases >= 50, anonymous.summary
        assert keyed.cases >= 150, keyed.summary
        assert engine_state(server) == {"running": 0, "waiting": 0, "kv_usage": 0.0}
        assert reference_answer(server) == before
        assert server.get("/health").status_code == 200
