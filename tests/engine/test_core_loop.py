"""The engine-core loop (engine/core_loop.py) with a fake engine, through the thread and the process client:
inputs applied in order, steps while busy, an idle wait that does not spin, stats snapshots, a failing
step failing every waiter, start-up failures and shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core_client import EngineDeadError
from pagedserve.engine.core_loop import STATS_INTERVAL_S
from pagedserve.engine.mp_client import MPEngineCoreClient
from pagedserve.engine.threaded_client import ThreadedEngineCoreClient
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest, ModelInfo, SchedulerStats
from pagedserve.outputs import FinishReason
from pagedserve.sampling_params import SamplingParams


class FakeEngine:
    """LLMEngine's synchronous surface: each live request gets one token per step until max_tokens.

    A request's last output carries the engine's input log in ``stop_reason``; stats report the step
    count (``num_steps``) and how often the loop asked for work (``prefix_cache_queries``).
    """

    def __init__(self, *, step_delay: float = 0.0, fail_at_step: int | None = None, fail_warmup: bool = False):
        self.model_info = ModelInfo("fake", 64, 100, (), "float32")
        self.step_delay = step_delay
        self.fail_at_step = fail_at_step
        self.fail_warmup = fail_warmup
        self.requests: dict[str, list[int]] = {}  # id -> [tokens made, max_tokens]
        self.log: list[str] = []
        self.steps = 0
        self.polls = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        assert request.request_id not in self.requests
        self.log.append(f"add {request.request_id}")
        self.eos_token_ids = request.eos_token_ids
        self.requests[request.request_id] = [0, request.sampling_params.max_tokens]

    def abort_requests(self, request_ids) -> None:
        self.log.append("abort " + ",".join(request_ids))
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def stop_samples(self, samples) -> None:
        self.log.append("stop " + ",".join(f"{rid}:{i}" for rid, i in samples))
        for request_id, _ in samples:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        self.polls += 1
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("boom in step")
        outputs = []
        for request_id, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    0,
                    [state[0]],
                    finish_reason=FinishReason.LENGTH if done else None,
                    stop_reason="|".join(self.log) if done else None,
                )
            )
            if done:
                del self.requests[request_id]
        return outputs

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.requests), num_steps=self.steps, prefix_cache_queries=self.polls)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def warmup(self) -> None:
        if self.fail_warmup:
            raise RuntimeError("boom in warmup")
        self.log.append("warmup")


def make_client(kind: str, **engine_kwargs):
    """Built outside the event loop: the process client forks before any thread starts."""
    if kind == "thread":
        return ThreadedEngineCoreClient(FakeEngine(**engine_kwargs))
    return MPEngineCoreClient(EngineConfig(), engine=lambda config: FakeEngine(**engine_kwargs))


def run(client, scenario):
    async def main():
        try:
            return await asyncio.wait_for(scenario(client), timeout=60)
        finally:
            await client.shutdown()

    return asyncio.run(main())


def request(request_id: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), time.monotonic())


async def collect(client, until: set[str]) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    while until:
        for output in await client.get_outputs():
            outputs.append(output)
            if output.finish_reason is not None:
                until.discard(output.request_id)
    return outputs


async def wait_for_stats(client, predicate, timeout: float = 5.0) -> SchedulerStats:
    deadline = time.monotonic() + timeout
    while not predicate(stats := client.get_stats()):
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.01)
    return stats


KINDS = ["thread", "process"]


@pytest.mark.parametrize("kind", KINDS)
def test_inputs_applied_in_order_and_steps_while_busy(kind):
    async def scenario(client):
        await client.warmup()
        await client.start()
        # no awaiting in between: the abort must be applied after the add it follows
        await client.add_request(request("long", 10_000))
        await client.abort_requests(["long"])
        await client.add_request(request("a", 5))
        await client.add_request(request("b", 3))
        outputs = await collect(client, {"a", "b"})
        return outputs, await wait_for_stats(client, lambda s: s.num_running == 0 and s.num_steps >= 5)

    outputs, stats = run(make_client(kind), scenario)
    tokens = {rid: [t for o in outputs if o.request_id == rid for t in o.new_token_ids] for rid in ("a", "b")}
    assert tokens == {"a": [1, 2, 3, 4, 5], "b": [1, 2, 3]}
    assert len([o for o in outputs if o.request_id == "long"]) < 10_000
    log = next(o.stop_reason for o in outputs if o.request_id == "a" and o.finish_reason).split("|")
    assert log[:5] == ["warmup", "add long", "abort long", "add a", "add b"]
    assert stats.num_running == 0 and stats.num_steps >= 5


@pytest.mark.parametrize("kind", KINDS)
def test_idle_wait_does_not_spin_and_stats_snapshots(kind):
    async def scenario(client):
        await client.start()
        await client.add_request(request("r", 12))
        seen_busy = []
        outputs: list[EngineCoreOutput] = []
        while not outputs or outputs[-1].finish_reason is None:
            outputs += await client.get_outputs()
            seen_busy.append(client.get_stats())
        idle = await wait_for_stats(client, lambda s: s.num_running == 0 and s.num_steps == 12)
        await asyncio.sleep(0.5)  # idle: the loop must sleep, not poll the engine
        await client.abort_requests(["unknown"])  # wakes the loop: a fresh idle snapshot
        later = await wait_for_stats(client, lambda s: s.prefix_cache_queries != idle.prefix_cache_queries)
        return seen_busy, idle, later

    # 12 steps of 50 ms: several STATS_INTERVAL_S periods while busy
    seen_busy, idle, later = run(make_client(kind, step_delay=0.05), scenario)
    assert 12 * 0.05 > 2 * STATS_INTERVAL_S
    assert any(s.num_running == 1 and 0 < s.num_steps < 12 for s in seen_busy)  # snapshots while busy
    assert idle.num_running == 0 and later.num_steps == 12  # and one on going idle
    assert later.prefix_cache_queries - idle.prefix_cache_queries <= 4  # no spinning over 0.5 s


@pytest.mark.parametrize("kind", KINDS)
def test_failing_step_fails_every_waiter(kind):
    async def scenario(client):
        await client.start()
        await client.add_request(request("r", 100))
        first = await client.get_outputs()  # step 1 works, step 2 raises
        with pytest.raises(EngineDeadError, match="boom in step"):
            while True:
                await client.get_outputs()
        assert client.is_dead
        with pytest.raises(EngineDeadError):
            await client.add_request(request("late", 1))
        with pytest.raises(EngineDeadError):
            await client.warmup()
        await client.abort_requests(["r"])  # harmless once dead
        return first

    first = run(make_client(kind, fail_at_step=2), scenario)
    assert [o.new_token_ids for o in first] == [[1]]


@pytest.mark.parametrize("kind", KINDS)
def test_waiter_pending_when_the_core_dies(kind):
    async def scenario(client):
        await client.start()
        waiter = asyncio.create_task(client.get_outputs())
        await asyncio.sleep(0.05)
        await client.add_request(request("r", 100))
        assert [o.new_token_ids for o in await waiter] == [[1]]
        waiter = asyncio.create_task(client.get_outputs())  # waiting when step 2 raises
        with pytest.raises(EngineDeadError):
            await waiter

    run(make_client(kind, fail_at_step=2, step_delay=0.05), scenario)


@pytest.mark.parametrize("kind", KINDS)
def test_failing_warmup_fails_its_waiter(kind):
    async def scenario(client):
        with pytest.raises(EngineDeadError, match="boom in warmup"):
            await client.warmup()
        assert client.is_dead

    run(make_client(kind, fail_warmup=True), scenario)


def test_process_start_up_failure_is_readable():
    def broken(config):
        raise ValueError("no such model: nowhere.gguf")

    with pytest.raises(RuntimeError, match="the engine core failed to start") as info:
        MPEngineCoreClient(EngineConfig(), engine=broken)
    assert "no such model: nowhere.gguf" in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_shutdown_while_busy(kind):
    client = make_client(kind, step_delay=0.01)

    async def scenario(client):
        await client.start()
        await client.add_request(request("r", 100_000))
        await client.get_outputs()
        start = time.monotonic()
        await client.shutdown()
        return time.monotonic() - start

    elapsed = run(client, scenario)
    assert elapsed < 5
    if kind == "thread":
        assert not client._thread.is_alive()
    else:
        assert not client._proc.is_alive() and client._proc.exitcode == 0
    assert not client.is_dead  # a shutdown is not a death


def test_async_llm_refuses_a_request_id_in_flight_and_sends_the_tokenizer_eos(tokenizer):
    engine = FakeEngine(step_delay=0.01)  # its model declares no EOS ids

    async def scenario(client):
        llm = AsyncLLM(client, tokenizer)
        await llm.warmup()
        await llm.start()
        try:
            first = llm.generate([1, 2, 3], SamplingParams(max_tokens=20), "same")
            await first.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                await llm.generate([1, 2, 3], SamplingParams(max_tokens=2), "same").__anext__()
            outputs = [output async for output in first]  # the first request is undisturbed
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) >= 1
            again = [output async for output in llm.generate([4], SamplingParams(max_tokens=2), "same")]
            assert again[-1].finished  # the id is free once its request finished
        finally:
            await llm.shutdown()

    run(ThreadedEngineCoreClient(engine), scenario)
    assert engine.eos_token_ids == (tokenizer.eos_token_id,)


def test_request_eos_token_ids_keep_the_loaders_rule():
    from pagedserve.tokenizer import request_eos_token_ids

    class Tokenizer:
        eos_token_id = 2

    assert request_eos_token_ids((2,), Tokenizer()) == ()  # the model's own list already has it
    assert request_eos_token_ids((), Tokenizer()) == (2,)
    assert request_eos_token_ids((0, 5), Tokenizer()) == (0, 5, 2)  # as the loader appended it
    assert request_eos_token_ids((1,), object()) == ()
