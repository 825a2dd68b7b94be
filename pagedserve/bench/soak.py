"""The soak test: a server held at saturation for a long time (``python -m pagedserve.bench.soak``).

Concurrent clients stream a mixed workload; a share of them disconnects mid-stream and a share sends
bad requests. Every few seconds the server's processes are sampled (resident memory of each, open file
descriptors, threads); each minute gets its latency percentiles. At the end the load stops and the KV
blocks still held are read once the server is idle. The verdict checks the goals docs/reliability.md
states: memory growth from minute 5 to the end, no fd or thread growth, nothing held when idle, no
error on a valid request, and the late P99 TPOT against the early one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from pagedserve.bench.monitor import parse_prometheus

WORDS = "river valley stone light garden winter market silver engine forest music harbor paper cloud".split()
SAMPLE_EVERY_S = 5.0


@dataclass
class Minute:
    """What finished within one minute of the run."""

    valid: int = 0
    errors: int = 0  # valid requests that did not complete (an error status, an error event, a cut stream)
    disconnects: int = 0
    bad_refused: int = 0  # bad requests answered 4xx, as they should be
    bad_unexpected: int = 0  # bad requests answered anything else
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)


@dataclass
class Sample:
    t: float
    rss_mb: dict[str, float]  # per process (pid: MB)
    fds: int
    threads: int
    kv_usage: float


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


class Soak:
    def __init__(self, url: str, pid: int, concurrency: int, duration_s: float, model: str | None) -> None:
        self.url = url.rstrip("/")
        self.server = psutil.Process(pid)
        self.concurrency = concurrency
        self.duration_s = duration_s
        self.model = model
        self.minutes: list[Minute] = []
        self.samples: list[Sample] = []
        self.start = 0.0

    def minute(self) -> Minute:
        index = int((time.monotonic() - self.start) // 60)
        while len(self.minutes) <= index:
            self.minutes.append(Minute())
        return self.minutes[index]

    # ----------------------------------------------------------------- the clients
    def _body(self, rng: random.Random) -> tuple[str, dict]:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.choice([8, 32, 128, 320])))
        max_tokens = rng.choice([16, 32, 64, 128])
        if rng.random() < 0.5:
            body = {"messages": [{"role": "user", "content": f"Write about: {words}"}], "max_tokens": max_tokens}
            path = "/v1/chat/completions"
        else:
            body, path = {"prompt": words, "max_tokens": max_tokens}, "/v1/completions"
        body |= {"stream": True, "temperature": rng.choice([0.0, 0.7]), "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        return path, body

    async def _valid(self, client: httpx.AsyncClient, rng: random.Random, disconnect_after: int | None) -> None:
        path, body = self._body(rng)
        sent = time.perf_counter()
        first = last = None
        tokens = 0
        done = usage = False
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    self.minute().errors += 1
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        break
                    if chunk.get("usage"):
                        usage = True
                    choices = chunk.get("choices") or [{}]
                    if choices[0].get("text") or (choices[0].get("delta") or {}).get("content"):
                        now = time.perf_counter()  # a token's text (not the chat role chunk, sent first)
                        first = first or now
                        last = now
                        tokens += 1
                    if disconnect_after is not None and tokens >= disconnect_after:
                        self.minute().disconnects += 1
                        return  # leaving the block closes the connection mid-stream
        except httpx.HTTPError:
            pass
        minute = self.minute()
        if not (done and usage):
            minute.errors += 1
            return
        minute.valid += 1
        if first is not None:
            minute.ttft_ms.append((first - sent) * 1000)
            if tokens > 1 and last is not None:
                minute.tpot_ms.append((last - first) * 1000 / (tokens - 1))

    async def _bad(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        body = rng.choice(
            [
                {"prompt": "x", "max_tokens": -1},
                {"prompt": "x", "temperature": "hot"},
                {"messages": []},
                {"prompt": [10**9]},
                {"prompt": "x", "n": 10_000},
            ]
        )
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        try:
            response = await client.post(path, json=body)
            good = 400 <= response.status_code < 500
        except httpx.HTTPError:
            good = False
        if good:
            self.minute().bad_refused += 1
        else:
            self.minute().bad_unexpected += 1

    async def _client(self, client: httpx.AsyncClient, seed: int, end: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            roll = rng.random()
            if roll < 0.10:
                await self._bad(client, rng)
            elif roll < 0.25:
                await self._valid(client, rng, disconnect_after=rng.choice([1, 3, 8]))
            else:
                await self._valid(client, rng, disconnect_after=None)

    # ----------------------------------------------------------------- the server's side
    def _processes(self) -> list[psutil.Process]:
        return [self.server, *self.server.children(recursive=True)]

    async def _kv_usage(self, client: httpx.AsyncClient) -> float:
        text = (await client.get("/metrics")).text
        return parse_prometheus(text, ("pagedserve:kv_cache_usage_perc",)).get("pagedserve:kv_cache_usage_perc", -1.0)

    async def _sample(self, client: httpx.AsyncClient) -> Sample:
        rss: dict[str, float] = {}
        fds = threads = 0
        for process in self._processes():
            try:
                rss[str(process.pid)] = process.memory_info().rss / 2**20
                fds += process.num_fds()
                threads += process.num_threads()
            except psutil.NoSuchProcess:
                continue
        return Sample(time.monotonic() - self.start, rss, fds, threads, await self._kv_usage(client))

    async def _sampler(self, client: httpx.AsyncClient, end: float) -> None:
        while time.monotonic() < end:
            self.samples.append(await self._sample(client))
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def run(self) -> dict:
        self.start = time.monotonic()
        end = self.start + self.duration_s
        limits = httpx.Limits(max_connections=self.concurrency + 8, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:
            sampler = asyncio.create_task(self._sampler(client, end))
            await asyncio.gather(*(self._client(client, seed, end) for seed in range(self.concurrency)))
            await sampler
            idle = await self._wait_idle(client)
        return self.report(idle)

    async def _wait_idle(self, client: httpx.AsyncClient, deadline_s: float = 120.0) -> Sample:
        names = ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting")
        limit = time.monotonic() + deadline_s
        while time.monotonic() < limit:
            values = parse_prometheus((await client.get("/metrics")).text, names)
            if not any(values.get(name, 0.0) for name in names):
                break
            await asyncio.sleep(0.5)
        return await self._sample(client)

    # ----------------------------------------------------------------- the verdict
    def report(self, idle: Sample) -> dict:
        per_minute = [
            {
                "minute": i + 1,
                "valid": m.valid,
                "errors": m.errors,
                "disconnects": m.disconnects,
                "bad_refused": m.bad_refused,
                "bad_unexpected": m.bad_unexpected,
                "ttft_p50_ms": _percentile(m.ttft_ms, 50),
                "ttft_p99_ms": _percentile(m.ttft_ms, 99),
                "tpot_p50_ms": _percentile(m.tpot_ms, 50),
                "tpot_p99_ms": _percentile(m.tpot_ms, 99),
            }
            for i, m in enumerate(self.minutes)
        ]
        total_rss = [(s.t, sum(s.rss_mb.values())) for s in self.samples]
        warm = self.duration_s / 6  # "minute 5 of 30": the growth is measured after the warm-up
        after_warmup = [rss for t, rss in total_rss if t >= warm] or [rss for _, rss in total_rss]
        window = max(1, len(after_warmup) // 10)
        rss_start = statistics.median(after_warmup[:window])
        rss_end = statistics.median(after_warmup[-window:])
        late = [s for s in self.samples if s.t >= warm] or self.samples
        full = self.minutes[: max(1, int(self.duration_s // 60))]  # not the drain after the end
        fifth = max(1, len(full) // 6)
        early_tpot = [v for m in full[:fifth] for v in m.tpot_ms]
        late_tpot = [v for m in full[-fifth:] for v in m.tpot_ms]
        summary = {
            "duration_s": self.duration_s,
            "concurrency": self.concurrency,
            "valid_requests": sum(m.valid for m in self.minutes),
            "valid_errors": sum(m.errors for m in self.minutes),
            "disconnects": sum(m.disconnects for m in self.minutes),
            "bad_refused": sum(m.bad_refused for m in self.minutes),
            "bad_unexpected": sum(m.bad_unexpected for m in self.minutes),
            "rss_growth_pct": (rss_end - rss_start) / rss_start * 100,
            "rss_mb_after_warmup": rss_start,
            "rss_mb_at_end": rss_end,
            "fds": [min(s.fds for s in late), max(s.fds for s in late)],
            "threads": [min(s.threads for s in late), max(s.threads for s in late)],
            "kv_usage_when_idle": idle.kv_usage,
            "fds_when_idle": idle.fds,
            "threads_when_idle": idle.threads,
            "tpot_p99_early_ms": _percentile(early_tpot, 99),
            "tpot_p99_late_ms": _percentile(late_tpot, 99),
        }
        early, late_p99 = summary["tpot_p99_early_ms"], summary["tpot_p99_late_ms"]
        summary["tpot_p99_late_vs_early"] = late_p99 / early if early and late_p99 else None
        return {"summary": summary, "per_minute": per_minute, "samples": [asdict(s) for s in self.samples]}


def verdict(summary: dict, *, max_rss_growth_pct: float = 3.0, max_tpot_drift: float | None = 1.10) -> list[str]:
    """The goals a run missed (empty: all met); ``max_tpot_drift`` None leaves latency out (the test suite
    checks resources and errors only: speed belongs to measured runs)."""
    missed = []
    if summary["rss_growth_pct"] >= max_rss_growth_pct:
        missed.append(f"RSS grew {summary['rss_growth_pct']:.2f} % after the warm-up")
    if summary["fds_when_idle"] > summary["fds"][0]:
        missed.append(f"open fds when idle {summary['fds_when_idle']} > {summary['fds'][0]} under load")
    if summary["threads_when_idle"] > summary["threads"][0]:
        missed.append(f"threads when idle {summary['threads_when_idle']} > {summary['threads'][0]} under load")
    if summary["kv_usage_when_idle"] != 0.0:
        missed.append(f"KV usage when idle {summary['kv_usage_when_idle']}")
    if summary["valid_errors"] or summary["bad_unexpected"]:
        missed.append(f"{summary['valid_errors']} valid requests failed, {summary['bad_unexpected']} bad ones not 4xx")
    drift = summary["tpot_p99_late_vs_early"]
    if max_tpot_drift is not None and (drift is None or drift > max_tpot_drift):
        missed.append(f"P99 TPOT late / early = {drift}")
    return missed


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["t"] / 60 for s in samples]
    pids = sorted({pid for s in samples for pid in s["rss_mb"]})
    figure, (memory, latency) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for pid in pids:
        memory.plot(minutes, [s["rss_mb"].get(pid) for s in samples], label=f"pid {pid}")
    memory.plot(minutes, [sum(s["rss_mb"].values()) for s in samples], label="all", linewidth=2)
    memory.set_ylabel("RSS (MiB)")
    memory.legend(loc="lower right", fontsize=7)
    rows = result["per_minute"]
    latency.plot([r["minute"] - 0.5 for r in rows], [r["tpot_p99_ms"] for r in rows], marker="o", label="P99 TPOT")
    latency.plot([r["minute"] - 0.5 for r in rows], [r["tpot_p50_ms"] for r in rows], marker=".", label="P50 TPOT")
    latency.set_ylabel("ms per token")
    latency.set_xlabel("minute")
    latency.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Hold a pagedserve server at saturation and watch its resources")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, required=True, help="the server's pid (its children are sampled)")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", type=Path, default=Path("soak-out"))
    args = parser.parse_args(argv)
    soak = Soak(args.url, args.server_pid, args.concurrency, args.duration, args.model)
    result = asyncio.run(soak.run())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    print(json.dumps(result["summary"], indent=1))
    for row in result["per_minute"]:
        print(row)
    missed = verdict(result["summary"])
    print("all goals met" if not missed else "missed: " + "; ".join(missed))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
