"""Shared fixtures: the default model's tokenizer, and one real `pagedserve serve` per test session."""

from __future__ import annotations

import pytest

from tests.utils import RemoteServer

API_KEY = "sk-pagedserve-test"
MAX_REQUEST_BYTES = 1 << 20


@pytest.fixture(scope="session")
def tokenizer():
    from pagedserve.models.default_model import default_model_path
    from pagedserve.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def server():
    """The default model behind an API key; shared by every test_server_* module that needs no special flags."""
    # NOTE: float32 because a bf16 prefix-cache hit can change greedy output, and these tests compare
    # the text of repeated temperature-0 requests.
    args = ["--api-key", API_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES), "--log-stats-interval", "5",
            "--dtype", "float32"]
    with RemoteServer(args, api_key=API_KEY) as remote:
        yield remote


@pytest.fixture(scope="session")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="session")
def async_client(server):
    return server.async_openai_client()
