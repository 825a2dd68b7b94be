"""`pagedserve serve --replicas` on a real local Ray cluster, through real clients: two models (one with
two replicas), the OpenAI and TGI clients streaming and not, per-replica metrics, a disconnect aborting
on its replica, a replica killed under load (no stream lost or changed), and a blue/green swap of the
engine behind a served name under load (no request failed or cut short)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import psutil
import pytest

from pagedserve.models.default_model import default_model_path
from tests.utils import RemoteServer

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

ADMIN_KEY = "admin-test-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = default_model_path()
    args = [
        *("--model", f"smol={model}", "--model", f"tiny={model}"),
        *("--replicas", "smol=2", "--replicas", "tiny=1", "--cpus-per-replica", "0.5"),
        *("--dtype", "float32", "--kv-cache-memory", "96MiB", "--max-num-seqs", "16"),
        *("--admin-key", ADMIN_KEY, "--log-stats-interval", "0"),
    ]
    with RemoteServer(args, start_timeout=600) as started:
        yield started


def admin_models(server) -> dict:
    response = httpx.get(server.url + "/admin/models", headers=ADMIN, timeout=30)
    assert response.status_code == 200, response.text
    return {entry["name"]: entry for entry in response.json()["models"]}


def metric_values(server, name: str) -> dict[str, float]:
    """``labels -> value`` of one metric family's samples."""
    values = {}
    for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)", line)
        if match:
            values[match.group(1) or ""] = float(match.group(2))
    return values


def test_models_and_replicas_are_listed(server) -> None:
    names = {card.id for card in server.openai_client().models.list().data}
    assert names == {"smol", "tiny"}
    models = admin_models(server)
    assert len(models["smol"]["replicas"]) == 2 and len(models["tiny"]["replicas"]) == 1
    for replica in models["smol"]["replicas"]:
        assert replica["node"] == "127.0.0.1" and replica["pid"] > 0 and replica["id"]


def test_openai_client_streaming_and_not(server) -> None:
    client = server.openai_client()
    whole = client.completions.create(model="smol", prompt="The sky is", max_tokens=12, temperature=0)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model="smol", prompt="The sky is", max_tokens=12, temperature=0, stream=True
        )
        if chunk.choices
    )
    assert whole.choices[0].text == streamed and whole.model == "smol"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
    )
    assert chat.model == "tiny" and chat.choices[0].finish_reason in ("stop", "length")


def test_tgi_client_streaming_and_not(server) -> None:
    from text_generation import Client

    client = Client(server.url, timeout=120)
    whole = client.generate("The sky is", max_new_tokens=10, decoder_input_details=False)
    streamed = "".join(
        response.token.text
        for response in client.generate_stream("The sky is", max_new_tokens=10)
        if not response.token.special
    )
    assert whole.generated_text == streamed and whole.details.generated_tokens == 10


def test_each_model_answers_its_own_requests(server) -> None:
    before = metric_values(server, "pagedserve:router_requests_total")
    client = server.openai_client()
    for model in ("smol", "smol", "tiny"):
        client.completions.create(model=model, prompt="Count: 1, 2,", max_tokens=3, temperature=0)
    after = metric_values(server, "pagedserve:router_requests_total")

    def routed(model: str) -> float:
        return sum(v - before.get(k, 0) for k, v in after.items() if f'model_name="{model}"' in k)

    assert (routed("smol"), routed("tiny")) == (2, 1)
    replicas = metric_values(server, "pagedserve:num_requests_running")
    assert len([labels for labels in replicas if 'model_name="smol"' in labels and "replica=" in labels]) == 2


def test_disconnect_aborts_on_the_replica(server) -> None:
    async def abandon() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "smol", "prompt": "Count slowly:", "max_tokens": 1500, "stream": True, **LONG}
            async with client.stream("POST", server.base_url + "/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # one token arrived: hang up

    asyncio.run(abandon())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(1.5)  # the replicas' statuses refresh once a second
        running = sum(r["running"] + r["waiting"] for r in admin_models(server)["smol"]["replicas"])
        if running == 0:
            break
    assert running == 0


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple[str, str]:
    body = {"model": model, "prompt": "Tell a story about a lighthouse.", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, **LONG}  # fmt: skip
    text, reason = "", None
    async with client.stream("POST", url + "/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason


def test_a_killed_replica_loses_no_stream(server) -> None:
    async def run() -> tuple[str, list]:
        async with httpx.AsyncClient(timeout=300) as client:
            reference, _ = await stream_completion(client, server.base_url, "smol", 120)
            tasks = [asyncio.create_task(stream_completion(client, server.base_url, "smol", 120)) for _ in range(8)]
            await asyncio.sleep(3.0)
            victim = max(admin_models(server)["smol"]["replicas"], key=lambda replica: replica["running"])
            os.kill(psutil.Process(victim["pid"]).parent().pid, signal.SIGKILL)  # the replica actor
            return reference, await asyncio.gather(*tasks)

    reference, results = asyncio.run(run())
    assert [reason for _, reason in results] == ["length"] * 8
    assert all(text == reference for text, _ in results)  # float32, temperature 0: resumed token-identically
    assert sum(metric_values(server, "pagedserve:router_resumes_total").values()) >= 1


def test_swap_under_load_fails_nothing(server, tmp_path) -> None:
    new_path = tmp_path / "swapped.gguf"
    new_path.symlink_to(default_model_path())

    async def run() -> tuple[list, httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            tasks = [asyncio.create_task(stream_completion(client, server.base_url, "tiny", 48)) for _ in range(16)]
            await asyncio.sleep(1.0)
            swap = client.post(
                server.url + "/admin/models",
                json={"name": "tiny", "model": str(new_path), "dtype": "bfloat16"},
                headers=ADMIN,
            )
            more = []
            swap_task = asyncio.create_task(swap)
            while not swap_task.done():  # keep the load up for the whole swap
                more.append(asyncio.create_task(stream_completion(client, server.base_url, "tiny", 48)))
                await asyncio.sleep(0.5)
            return await asyncio.gather(*tasks, *more), swap_task.result()

    results, swap = asyncio.run(run())
    assert swap.status_code == 200, swap.text
    assert all(reason == "length" for _, reason in results), results
    cards = {card.id: card for card in server.openai_client().models.list().data}
    assert cards["tiny"].root == str(new_path)
    tiny = admin_models(server)["tiny"]
    assert tiny["state"] == "ready" and tiny["model"] == str(new_path) and len(tiny["replicas"]) == 1


def test_a_load_the_cluster_has_no_room_for_is_refused(server) -> None:
    before = admin_models(server)
    response = httpx.post(
        server.url + "/admin/models",
        json={"name": "big", "model": str(default_model_path()), "replicas": 4},  # 2 CPUs at 0.5 each
        headers=ADMIN,
        timeout=120,
    )
    assert response.status_code == 409, response.text
    assert "no room for 4 replica(s)" in response.json()["error"]["message"]
    after = admin_models(server)
    assert "big" not in after or after["big"]["state"] == "failed"
    assert {name: len(entry["replicas"]) for name, entry in after.items() if name != "big"} == {
        name: len(entry["replicas"]) for name, entry in before.items()
    }
    reply = server.openai_client().completions.create(model="smol", prompt="Hi", max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
