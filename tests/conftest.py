"""Shared fixtures: the default model's tokenizer, and one real `pagedserve serve` per test session;
the ``model`` / ``kernels`` markers, set from what each test uses (``make test-fast`` leaves them out);
and the C++ kernels built once before a session that starts servers or uses them, so that no server's
start-up waits on (or races) that build."""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest

from tests.utils import RemoteServer

API_KEY = "sk-pagedserve-test"
MAX_REQUEST_BYTES = 1 << 20

TESTS_DIR = Path(__file__).resolve().parent
# A test gets the marker when its function, one of its fixtures, or a function of tests/ that they
# call names one of these (so nobody has to remember to mark a test that loads them).
HEAVY_NAMES = {
    "kernels": {"load_cpu_kernels", "cpu_kernels_or_skip"},  # the C++ build (slow unless cached)
    "model": {"default_model_path", "RemoteServer"},  # the default model's files: its tokenizer, a server
}


def _in_tests(func: object) -> bool:
    code = getattr(func, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS_DIR)


def _names_used(func: types.FunctionType, seen: set[types.CodeType]) -> set[str]:
    """The global and attribute names ``func`` uses, with its nested functions' and those of the
    functions of tests/ it calls (recursively)."""
    names: set[str] = set()
    codes = [func.__code__]
    while codes:
        code = codes.pop()
        if code in seen:
            continue
        seen.add(code)
        names.update(code.co_names)
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    for name in list(names):
        called = func.__globals__.get(name)
        if inspect.isfunction(called) and _in_tests(called) and called.__code__ not in seen:
            names |= _names_used(called, seen)
    return names


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    cache: dict[types.CodeType, set[str]] = {}

    def names_of(func: object) -> set[str]:
        func = inspect.unwrap(func)  # type: ignore[arg-type]
        func = getattr(func, "__func__", func)  # a method's function
        if not inspect.isfunction(func) or not _in_tests(func):
            return set()
        if func.__code__ not in cache:
            cache[func.__code__] = _names_used(func, set())
        return cache[func.__code__]

    for item in items:
        funcs = [getattr(item, "obj", None)]
        fixture_info = getattr(item, "_fixtureinfo", None)  # the fixtures it uses, with theirs (pytest-private)
        if fixture_info is not None:
            funcs += [fixture_def.func for defs in fixture_info.name2fixturedefs.values() for fixture_def in defs]
        used = set().union(*(names_of(func) for func in funcs if func is not None))
        for marker, names in HEAVY_NAMES.items():
            if used & names:
                item.add_marker(marker)


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.get_closest_marker(name) for item in session.items for name in ("kernels", "model", "slow")):
        from pagedserve.kernels import load_cpu_kernels

        load_cpu_kernels()  # cached per CPU and sources: later loads (in servers, engine cores) only import it


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
    args = [
        "--api-key",
        API_KEY,
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--log-stats-interval",
        "5",
        "--dtype",
        "float32",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    with RemoteServer(args, api_key=API_KEY) as remote:
        yield remote


@pytest.fixture(scope="session")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="session")
def async_client(server):
    return server.async_openai_client()
