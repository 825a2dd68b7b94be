"""ModelRegistry and leases without a model: resolution (default, aliases, 404), the atomic switch of a
swap, removal, and a retired serving shut down only once its leases and requests are gone."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pagedserve.entrypoints.model_registry import ModelRegistry
from pagedserve.entrypoints.model_serving import DRAINING, ModelServing
from pagedserve.entrypoints.serving.errors import APIError
from pagedserve.entrypoints.serving.routing import respond_leased
from pagedserve.entrypoints.serving.sse import SSEResponse


class FakeEngine:
    def __init__(self) -> None:
        self.num_unfinished_requests = 0
        self.shut_down = False

    async def shutdown(self) -> None:
        self.shut_down = True


def serving(*names: str, path: str = "/m") -> ModelServing:
    fields = {name: None for name, f in ModelServing.__dataclass_fields__.items() if f.default is dataclasses.MISSING}
    fields.update(spec=None, names=names, engine=FakeEngine(), model_path=path, created=0)
    return ModelServing(**fields)


def test_resolve_default_aliases_and_unknown():
    registry = ModelRegistry()
    first, second = serving("a", "alias"), serving("b")
    registry.add(first)
    registry.add(second)
    assert registry.resolve(None) is first and registry.resolve("") is first
    assert registry.resolve("alias") is first and registry.resolve("b") is second
    assert registry.served_names() == ["a", "alias", "b"]
    with pytest.raises(APIError) as excinfo:
        registry.acquire("nope")
    assert excinfo.value.status == 404 and excinfo.value.code == "model_not_found"
    with pytest.raises(ValueError):
        registry.add(serving("alias"))


def test_acquire_takes_a_lease_and_replace_switches_every_name():
    registry = ModelRegistry()
    old = serving("a", "alias")
    registry.add(old)
    leased = registry.acquire("alias")
    assert leased is old and old.leases == 1
    new = serving("a", "alias", path="/new")
    assert registry.replace(new) is old
    assert registry.resolve("a") is new and registry.resolve("alias") is new and registry.default is new
    assert registry.is_current(new) and not registry.is_current(old)
    assert old.leases == 1  # the request resolved before the switch keeps its serving
    old.release()
    assert old.idle
    with pytest.raises(ValueError):
        registry.replace(serving("a"))  # a replacement keeps the names


def test_remove_moves_the_default():
    registry = ModelRegistry()
    first, second = serving("a", "alias"), serving("b")
    registry.add(first)
    registry.add(second)
    assert registry.remove("alias") is first
    assert registry.default is second and "a" not in registry and "alias" not in registry and len(registry) == 1


def test_retire_waits_for_leases_and_requests():
    async def scenario() -> None:
        registry = ModelRegistry()
        old = serving("a")
        registry.add(old)
        registry.acquire("a")
        old.engine.num_unfinished_requests = 1
        registry.replace(serving("a"))
        task = asyncio.create_task(registry.retire(old, timeout=None))
        await asyncio.sleep(0.15)
        assert old.state == DRAINING and registry.retiring() == [old] and not old.engine.shut_down
        old.release()
        await asyncio.sleep(0.15)
        assert not old.engine.shut_down  # a request still runs
        old.engine.num_unfinished_requests = 0
        await asyncio.wait_for(task, 2)
        assert old.engine.shut_down and registry.retiring() == []

    asyncio.run(scenario())


def test_retire_times_out():
    async def scenario() -> None:
        registry = ModelRegistry()
        old = serving("a")
        registry.add(old)
        registry.acquire("a")
        await asyncio.wait_for(registry.retire(old, timeout=0.1), 2)
        assert old.engine.shut_down

    asyncio.run(scenario())


def test_respond_leased_releases_when_the_response_ends():
    async def scenario() -> None:
        released: list[str] = []

        async def body():
            return "not a stream"

        await respond_leased(lambda: released.append("plain"), body())
        assert released == ["plain"]

        async def failing():
            raise APIError("bad", 400)

        with pytest.raises(APIError):
            await respond_leased(lambda: released.append("error"), failing())
        assert released == ["plain", "error"]

        async def events():
            yield "data: x\n\n"

        async def stream():
            return SSEResponse(events(), on_close=lambda: released.append("admission"))

        response = await respond_leased(lambda: released.append("lease"), stream())
        assert released == ["plain", "error"]  # held while the stream is open
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert released == ["plain", "error", "admission", "lease"]

    asyncio.run(scenario())
