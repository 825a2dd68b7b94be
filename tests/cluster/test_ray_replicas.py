"""Engine replicas on a real local Ray cluster (bound to 127.0.0.1), driven through AsyncLLM as the server
drives them: streams from two replicas, prefix affinity, an abort reaching the replica, a replica killed
mid-stream (the streams resume elsewhere, token-identical at temperature 0 in float32), loopback only."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal

import psutil
import pytest

from pagedserve.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig, ModelSpec, SchedulerConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.models.default_model import default_model_path
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import load_tokenizer

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

ENGINE = EngineConfig(
    model=ModelConfig(model=default_model_path(), dtype="float32"),
    cache=CacheConfig(kv_cache_memory=96 << 20),
    scheduler=SchedulerConfig(max_num_seqs=16),
)


class Cluster:
    """Two replicas of the default model behind the prefix-affinity router, and one event loop."""

    def __init__(self) -> None:
        from pagedserve.cluster.factory import RayEngineFactory

        self.loop = asyncio.new_event_loop()
        self.factory = RayEngineFactory(ClusterConfig(cpus_per_replica=1, request_router="prefix-affinity"))
        self.core = self.factory.create(ModelSpec("smol", ENGINE, replicas=2), at_startup=True)
        self.tokenizer = load_tokenizer(default_model_path())
        self.llm = AsyncLLM(self.core, self.tokenizer)
        self.run(self._start())
        self._ids = 0

    async def _start(self) -> None:
        await self.llm.warmup()
        await self.llm.start()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def request_id(self) -> str:
        self._ids += 1
        return f"req-{self._ids}"

    async def complete(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        [(tokens, reason)] = await self.complete_n(token_ids, max_tokens, 1)
        return tokens, reason

    async def complete_n(self, token_ids: list[int], max_tokens: int, n: int) -> list[tuple[list[int], str]]:
        tokens: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str] = [""] * n
        params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for output in self.llm.generate(token_ids, params, self.request_id()):
            for sample in output.outputs:
                tokens[sample.index].extend(sample.token_ids)
                if sample.finish_reason is not None:
                    reasons[sample.index] = sample.finish_reason.value
        return list(zip(tokens, reasons))

    async def until(self, condition, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.2)

    def close(self) -> None:
        self.run(self.llm.shutdown())
        self.factory.close()
        self.loop.close()


@pytest.fixture(scope="module")
def cluster():
    started = Cluster()
    yield started
    started.close()


async def gather(*coros):
    return await asyncio.gather(*coros)


def prompt(cluster: Cluster, text: str) -> list[int]:
    return cluster.tokenizer.encode(text)


def test_requests_stream_from_both_replicas(cluster: Cluster) -> None:
    ids = prompt(cluster, "List three colours:")
    before = dict(cluster.core.counters.requests)
    results = cluster.run(gather(*(cluster.complete(ids, 24) for _ in range(8))))
    assert all(reason == "length" and len(tokens) == 24 for tokens, reason in results)
    assert len({tuple(tokens) for tokens, _ in results}) == 1  # greedy: every replica answers alike
    routed = {replica: count - before.get(replica, 0) for replica, count in cluster.core.counters.requests.items()}
    assert sum(routed.values()) == 8
    assert len([count for count in routed.values() if count]) == 2, routed  # least-loaded spread them


def test_prefix_affinity_keeps_a_family_on_one_replica(cluster: Cluster) -> None:
    counters = cluster.core.counters
    queries, hits = counters.prefix_queries, counters.prefix_hits
    families = [
        prompt(cluster, f"Document {name}. " + " ".join(f"{name}-{i} is a fact about {name}." for i in range(60)))
        for name in ("alpha", "beta", "gamma")
    ]
    for round_ in range(3):
        for family in families:
            suffix = prompt(cluster, f" Question {round_}: what is {round_}?")
            cluster.run(cluster.complete(family + suffix, 4))
    assert counters.prefix_queries - queries == 6  # every request after its family's first
    assert counters.prefix_hits - hits == 6  # ... went where its prefix was
    assert sum(status.stats.prefix_cache_hits for status in cluster.core.replica_statuses()) > 0


def test_an_abandoned_stream_is_aborted_on_its_replica(cluster: Cluster) -> None:
    async def abandon() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        stream = cluster.llm.generate(prompt(cluster, "Count slowly:"), params, cluster.request_id())
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 1:
                break
        await stream.aclose()

        def replicas_idle() -> bool:
            statuses = cluster.core.replica_statuses()
            return bool(statuses) and all(s.stats.num_running + s.stats.num_waiting == 0 for s in statuses)

        await asyncio.sleep(1.5)  # past one status poll
        await cluster.until(replicas_idle)

    cluster.run(abandon())
    assert cluster.llm.num_unfinished_requests == 0


def test_ray_listens_on_loopback_only(cluster: Cluster) -> None:
    import ray

    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    assert {status.node for status in cluster.core.replica_statuses()} == {"127.0.0.1"}
    listening = set()
    for process in psutil.Process().children(recursive=True):
        try:
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening |= {(c.laddr.ip, process.name()) for c in connections if c.status == psutil.CONN_LISTEN}
    assert listening, "the Ray processes listen somewhere"
    assert all(ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback for ip, _ in listening), listening


def test_each_replica_engine_is_pinned_to_its_own_cores(cluster: Cluster) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores for two one-core replicas")
    masks = [frozenset(psutil.Process(status.pid).cpu_affinity()) for status in cluster.core.replica_statuses()]
    assert len(masks) == 2 and all(len(mask) == 1 for mask in masks)  # --cpus-per-replica 1
    assert masks[0] != masks[1]


def test_a_killed_replica_loses_no_stream(cluster: Cluster) -> None:
    ids = prompt(cluster, "Write a long story about a lighthouse keeper.")
    reference, _ = cluster.run(cluster.complete(ids, 160))
    counters = cluster.core.counters
    resumes, failed = counters.resumes, counters.failed

    async def kill_mid_stream() -> list:
        tasks = [asyncio.create_task(cluster.complete_n(ids, 160, n)) for n in (1, 1, 1, 1, 1, 2, 2)]

        def all_streaming() -> bool:
            statuses = cluster.core.replica_statuses()
            return sum(s.stats.num_running for s in statuses) >= 9  # every sample

        await asyncio.sleep(1.5)
        await cluster.until(all_streaming)
        victim = max(cluster.core.replica_statuses(), key=lambda status: status.stats.num_running)
        replica_actor = psutil.Process(victim.pid).parent()  # the engine core's parent: the replica actor
        os.kill(replica_actor.pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    results = [sample for samples in cluster.run(kill_mid_stream()) for sample in samples]
    assert [reason for _, reason in results] == ["length"] * 9
    assert all(tokens == reference for tokens, _ in results)  # n = 2 samples resumed one by one too
    assert counters.resumes - resumes >= 1
    assert counters.failed == failed
    cluster.run(cluster.until(lambda: len(cluster.core.replica_statuses()) == 2, timeout=120))  # Serve replaced it


def test_the_front_end_counts_a_prompt_as_queued_prefill_until_its_first_token(cluster: Cluster) -> None:
    ids = prompt(cluster, "Summarise the list. " + " ".join(f"Item {i} is a {i % 7}-sided shape." for i in range(70)))
    samples: list[dict[str, tuple[int, int]]] = []
    streaming: dict[str, tuple[int, int]] = {}

    async def watch() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        stream = cluster.llm.generate(ids, params, cluster.request_id())
        first = asyncio.ensure_future(anext(stream))
        while not first.done():
            samples.append(dict(cluster.core.replica_loads()))
            await asyncio.sleep(0.01)
        await first
        streaming.update(cluster.core.replica_loads())  # 15 tokens to go: still in flight, prompt computed
        async for _ in stream:
            pass

    cluster.run(watch())
    placed = [loads for loads in samples if any(count for count, _ in loads.values())]
    assert placed, "the request was never seen in flight"
    waiting = [(1, len(ids)) in loads.values() for loads in placed]
    assert any(waiting)  # placed, prompt not computed yet: one request and its whole prompt as prefill
    assert all(prefill in (0, len(ids)) for loads in placed for _, prefill in loads.values())
    assert (1, 0) in streaming.values()
    assert all(value == (0, 0) for value in cluster.core.replica_loads().values())  # done: no load left
