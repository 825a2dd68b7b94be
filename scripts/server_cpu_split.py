"""Where a running server's CPU time goes under load: the front-end process against its children.

Starts a `pagedserve bench` run against the server and reports the CPU seconds (user + system)
each process of the server used during it, and per output token. For pagedserve the parent process
is the front end (HTTP, validation, detokenization, SSE) and the child is the engine core
(scheduler and model). From pagedserve's `/metrics` it reads the CPU seconds the engine core's
process used while the model forward pass and logits ran (`model_forward_cpu_seconds`, all its
threads) and prints the share of all the server's CPU spent outside the forward:
(all processes' CPU - forward CPU) / all processes' CPU. The wall-time estimate of earlier
versions (front end + engine core x (1 - forward / busy wall time)) is printed beside it.

    python scripts/server_cpu_split.py --pid $(pgrep -f "pagedserve serve" | head -1) \
        --url http://127.0.0.1:8000 --workload short --concurrency 64 --duration 20

``--warmup-duration S`` runs the load S seconds before the measurement starts (the steady state of
long and mixed loads, where every sequence carries hundreds of tokens of context).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil

from pagedserve.bench.monitor import parse_prometheus

ENGINE_METRICS = (
    "pagedserve:engine_busy_seconds_total",
    "pagedserve:model_forward_seconds_total",
    "pagedserve:model_forward_cpu_seconds_total",
)


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def snapshot(root: psutil.Process) -> dict[int, tuple[str, float]]:
    procs = [root, *root.children(recursive=True)]
    return {p.pid: (" ".join(p.cmdline()[:3])[:60], cpu_seconds(p)) for p in procs if p.is_running()}


def metrics_text(url: str) -> str | None:
    """The server's /metrics page, or None when it cannot be read."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as response:
            return response.read().decode()
    except OSError:
        return None


def requests_running(url: str) -> bool:
    """Whether the server reports requests in flight (pagedserve's or vLLM's running-requests gauge)."""
    names = ("pagedserve:num_requests_running", "vllm:num_requests_running")
    return any(value > 0 for value in parse_prometheus(metrics_text(url) or "", names).values())


def engine_seconds(url: str) -> tuple[float, ...] | None:
    """(engine busy wall s, forward wall s, forward CPU s) from pagedserve's /metrics, or None elsewhere."""
    text = metrics_text(url)
    if text is None:
        return None
    values = parse_prometheus(text, ENGINE_METRICS)
    if len(values) != len(ENGINE_METRICS):
        return None
    return tuple(values[name] for name in ENGINE_METRICS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pid", type=int, required=True, help="the server's main process")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--workload", default="short")
    parser.add_argument("--concurrency", default="64")
    parser.add_argument("--duration", default="20")
    parser.add_argument(
        "--warmup-duration",
        type=float,
        default=0.0,
        help="seconds of load before the measurement starts (a steady-state window)",
    )
    args = parser.parse_args()

    root = psutil.Process(args.pid)
    with tempfile.TemporaryDirectory() as output_dir:
        bench = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedserve.bench",
                "--target",
                args.url,
                "--workload",
                args.workload,
                "--concurrency",
                args.concurrency,
                "--duration",
                args.duration,
                "--drain-timeout",
                "0",
                "--warmup-duration",
                str(args.warmup_duration),
                "--num-warmups",
                "0",
                "--ignore-eos",
                "--no-progress",
                "--output-dir",
                output_dir,
            ],
            stdout=subprocess.DEVNULL,
        )
        if args.warmup_duration > 0:
            while bench.poll() is None and not requests_running(args.url):  # the client loads its tokenizer first
                time.sleep(0.2)
            time.sleep(args.warmup_duration)
        before = snapshot(root)
        engine_before = engine_seconds(args.url)
        if bench.wait() != 0:
            raise SystemExit(f"pagedserve bench failed (exit {bench.returncode})")
        after = snapshot(root)
        with open(os.path.join(output_dir, "summary.json")) as f:
            records = json.load(f)["results"]
    tokens = sum(
        r["total_output_tokens"] + r.get("incomplete_output_tokens", 0) + r.get("warmup_carried_output_tokens", 0)
        for r in records
    )  # the last: streamed in the window by requests sent during the warm-up
    engine_after = engine_seconds(args.url)
    for _ in range(60):  # the cut-off requests are aborted; once idle, the core sends exact totals
        time.sleep(0.5)
        latest = engine_seconds(args.url)
        if latest == engine_after:
            break
        engine_after = latest
    duration = sum(r["duration_s"] for r in records) or 1.0
    print(f"{tokens} output tokens in {duration:.1f} s ({tokens / duration:.0f} tok/s)")
    used = {pid: after[pid][1] - before.get(pid, ("", 0.0))[1] for pid in after}
    total = sum(used.values()) or 1.0
    for pid, seconds in sorted(used.items(), key=lambda item: -item[1]):
        role = "front end" if pid == args.pid else "child"
        per_token = f"{1e6 * seconds / tokens:7.0f} us/token" if tokens else ""
        print(f"{pid:>8} {role:<10} {seconds:8.1f} s CPU  {100 * seconds / total:5.1f} %  {per_token}  {after[pid][0]}")
    if engine_before is None or engine_after is None:
        return
    busy, forward, forward_cpu = (b - a for a, b in zip(engine_before, engine_after))
    if busy <= 0:
        return
    front = used.get(args.pid, 0.0) / total
    outside = 1 - forward / busy
    print(
        f"engine core: {busy:.1f} s busy, {forward:.1f} s in the model forward and logits "
        f"({100 * outside:.1f} % outside); {forward_cpu:.1f} s CPU in them"
    )
    print(
        f"outside the forward, measured: {total - forward_cpu:.1f} of {total:.1f} s CPU = "
        f"{100 * (total - forward_cpu) / total:.1f} % of the server's CPU"
    )
    print(
        f"outside the forward, wall-time estimate: front end {100 * front:.1f} % + engine core "
        f"{100 * (1 - front):.1f} % x {100 * outside:.1f} % = {100 * (front + (1 - front) * outside):.1f} %"
    )


if __name__ == "__main__":
    main()
