"""Throughput and errors over time while the engine behind a served name is swapped and a replica is
killed: a closed loop of streaming completions against a running pagedserve, ``POST /admin/models`` at
``--swap-at`` seconds and SIGKILL of one replica's actor process at ``--kill-at`` (a server started with
``--replicas`` on this machine). Writes timeline.json and timeline.png to ``--out``; prints the totals.

  python scripts/scale_out_timeline.py --url http://127.0.0.1:8000 --admin-key K \\
      --swap-body '{"name": "smol", "model": "/path/model.gguf", "dtype": "float32"}' --swap-at 15 --kill-at 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil

from pagedserve.bench.request_funcs import RequestFuncInput, RequestFuncOutput, async_request_openai

PROMPT = "Write a short story about a robot who learns to paint. Use vivid detail."


async def admin(client: httpx.AsyncClient, url: str, key: str, method: str, body: dict | None = None) -> dict:
    response = await client.request(
        method, f"{url}/admin/models", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=900
    )
    response.raise_for_status()
    return response.json()


def kill_one_replica(models: dict, name: str | None) -> int:
    """SIGKILL the Ray actor of the busiest replica (the parent of its engine core process)."""
    entries = [m for m in models["models"] if name is None or m["name"] == name]
    replicas = [replica for entry in entries for replica in entry["replicas"]]
    victim = max(replicas, key=lambda replica: replica["running"])
    actor = psutil.Process(victim["pid"]).parent()
    os.kill(actor.pid, signal.SIGKILL)
    return actor.pid


async def run(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    records: list[RequestFuncOutput] = []
    events: list[tuple[float, str]] = []
    start = time.perf_counter()
    deadline = start + args.duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        inp = RequestFuncInput(
            prompt=PROMPT,
            prompt_len=0,
            output_len=args.max_tokens,
            model=args.model,
            api_url=f"{args.url}/v1/completions",
            ignore_eos=True,
        )

        async def worker() -> None:
            while time.perf_counter() < deadline:
                records.append(await async_request_openai(client, inp))

        async def faults() -> None:
            if args.swap_at is not None and args.swap_body:
                await asyncio.sleep(max(0.0, start + args.swap_at - time.perf_counter()))
                events.append((time.perf_counter() - start, "swap requested"))
                await admin(client, args.url, args.admin_key, "POST", json.loads(args.swap_body))
                events.append((time.perf_counter() - start, "swap done"))
            if args.kill_at is not None:
                await asyncio.sleep(max(0.0, start + args.kill_at - time.perf_counter()))
                models = await admin(client, args.url, args.admin_key, "GET")
                pid = kill_one_replica(models, args.kill_model)
                events.append((time.perf_counter() - start, f"replica killed (pid {pid})"))

        await asyncio.gather(faults(), *(worker() for _ in range(args.concurrency)))
    return timeline(records, events, start, args)


def timeline(records: list[RequestFuncOutput], events: list[tuple[float, str]], start: float, args) -> dict:
    seconds = int(max((r.start_time + r.latency - start for r in records), default=0)) + 1
    tokens = [0] * seconds
    completed = [0] * seconds
    errors = [0] * seconds
    failures = []
    for record in records:
        second = min(seconds - 1, int(record.start_time + record.latency - start))
        ok = record.success and record.finish_reason is not None and record.output_tokens == args.max_tokens
        if ok:
            completed[second] += 1
            tokens[second] += record.output_tokens
        else:
            errors[second] += 1
            failures.append({"at_s": round(record.start_time - start, 2), "error": record.error or record.error_reason})
    return {
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "requests": len(records),
        "failed_or_truncated": sum(errors),
        "failures": failures[:20],
        "events": [{"at_s": round(at, 2), "event": text} for at, text in events],
        "per_second": {"output_tokens": tokens, "completed": completed, "errors": errors},
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_second = result["per_second"]
    xs = list(range(len(per_second["output_tokens"])))
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(xs, per_second["output_tokens"], label="output tok/s (completed requests)")
    ax.bar(
        xs,
        [e * max(per_second["output_tokens"] or [1]) / 10 for e in per_second["errors"]],
        color="red",
        label="errors",
    )
    for event in result["events"]:
        ax.axvline(event["at_s"], color="grey", linestyle="--")
        ax.annotate(event["event"], (event["at_s"], ax.get_ylim()[1] * 0.9), rotation=90, fontsize=8, ha="right")
    ax.set_xlabel("seconds")
    ax.set_title(f"{result['requests']} requests, {result['failed_or_truncated']} failed or truncated")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None)
    parser.add_argument("--admin-key", default=os.environ.get("PAGEDSERVE_ADMIN_KEY", ""))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--swap-at", type=float, default=None)
    parser.add_argument("--swap-body", default=None, help="the JSON body of POST /admin/models")
    parser.add_argument("--kill-at", type=float, default=None)
    parser.add_argument("--kill-model", default=None, help="the served name whose replica is killed")
    parser.add_argument("--out", type=Path, default=Path("timeline-out"))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "timeline.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "timeline.png")
    print(json.dumps({k: result[k] for k in ("requests", "failed_or_truncated", "events", "failures")}, indent=1))


if __name__ == "__main__":
    main()
