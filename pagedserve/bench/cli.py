"""``pagedserve bench``: load-test one or more OpenAI-compatible servers side by side.

Example::

    pagedserve bench --target paged=http://127.0.0.1:8000 --target hf=http://127.0.0.1:8001 \\
        --workload short,mixed --concurrency 1,16 --num-prompts 32 --ignore-eos --output-dir out/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from typing import Any

from pagedserve.bench.datasets import WORKLOAD_NAMES, PromptFactory, load_tokenizer
from pagedserve.bench.metrics import parse_slo
from pagedserve.bench.report import build_summary, command_line, terminal_report, write_outputs
from pagedserve.bench.runner import BenchOptions, LoadPoint, PointResult, Target, run_sweep
from pagedserve.gc_heap import freeze_heap

DEFAULT_TARGET = "http://127.0.0.1:8000"
DEFAULT_NUM_PROMPTS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to ``parser`` (used by ``pagedserve bench`` and ``python -m pagedserve.bench``)."""
    target = parser.add_argument_group("targets")
    target.add_argument(
        "--target",
        action="append",
        metavar="[NAME=]URL[,api_key=K][,model=M][,pid=P]",
        help=f"server to load; repeat for a side-by-side run (default {DEFAULT_TARGET})",
    )
    target.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="stream from /v1/completions or /v1/chat/completions",
    )
    target.add_argument("--model", help="model name to send (default: the first one the server lists)")
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default $OPENAI_API_KEY)"
    )
    target.add_argument(
        "--tokenizer", help="HF directory or .gguf file for prompt lengths (default: the default model's)"
    )

    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload",
        default="short",
        help=f"comma-separated, from {', '.join(WORKLOAD_NAMES)}; short=50/100, medium=200/500, "
        "long=500/1000 input/output tokens, mixed=20/50/30%% of them; grounded: copy / correct / quote a "
        "passage of --input-len tokens (output: the passage's length + 16)",
    )
    work.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="random: prompt tokens; shared-prefix: unique suffix tokens; grounded: passage tokens",
    )
    work.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens (random and shared-prefix default 128; overrides the others when given)",
    )
    work.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1 +- ratio)")
    work.add_argument("--dataset-path", help="ShareGPT-format JSON file for --workload sharegpt")
    work.add_argument(
        "--shared-prefix-len", type=int, default=512, help="shared-prefix: tokens of the common system prompt"
    )
    work.add_argument("--num-prefix-groups", type=int, default=1, help="shared-prefix: number of distinct prefixes")
    work.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly the output length")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")
    work.add_argument(
        "--no-usage",
        action="store_true",
        help="do not send stream_options.include_usage (count output tokens with the tokenizer)",
    )
    work.add_argument(
        "--seed", type=int, default=None, help="prompt seed (default: fresh each run, so runs share no prompts)"
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        nargs="+",
        default=None,
        help="closed loop: clients in flight, a sweep as 1,4,16,64 (default 1 unless --request-rate)",
    )
    load.add_argument(
        "--request-rate",
        nargs="+",
        default=None,
        help="open loop: arrivals per second (a sweep as 1,2,4; inf sends all at once)",
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="open loop: gamma shape; 1 is Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    load.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"measured requests per point (default {DEFAULT_NUM_PROMPTS}, or unlimited with --duration)",
    )
    load.add_argument("--duration", type=float, default=None, help="measure for this many seconds per point")
    load.add_argument(
        "--drain-timeout",
        type=float,
        default=math.inf,
        help="with --duration: seconds in-flight requests may still finish after the window; the rest "
        "are cut off and reported as incomplete (default: wait for all)",
    )
    load.add_argument("--num-warmups", type=int, default=1, help="uncounted requests per point before measuring")
    load.add_argument("--warmup-output-len", type=int, default=16, help="cap on warm-up output tokens (0: no cap)")
    load.add_argument(
        "--warmup-duration",
        type=float,
        default=0.0,
        help="with --duration: run the load this many seconds before the measured window opens (a "
        "steady-state window, e.g. 120 s before 480 s); requests sent meanwhile are not measured, "
        "the tokens they stream inside the window count in the throughput, memory/KV sampling "
        "starts with it",
    )
    load.add_argument(
        "--ramp-up",
        type=float,
        default=0.0,
        help="closed loop: start the clients one by one, evenly over this many seconds (at most "
        "--warmup-duration), so the window sees requests at every stage as in a long-running "
        "service rather than waves that start together",
    )
    load.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")

    measure = parser.add_argument_group("measurement and output")
    measure.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft:500ms,tpot:50ms,e2el:10s")
    measure.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="sample this process and its children's RSS (else /metrics process_resident_memory_bytes)",
    )
    measure.add_argument("--memory-interval", type=float, default=1.0, help="seconds between memory samples")
    measure.add_argument(
        "--price-per-hour", type=float, default=None, help="machine price for cost per 1k output tokens"
    )
    measure.add_argument("--output-dir", default=None, help="write summary.json, requests/, report.md and plots/ here")
    measure.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _split(values: list[str] | None) -> list[str]:
    return [item for value in values or () for item in value.split(",") if item.strip()]


def build_points(args: argparse.Namespace) -> list[LoadPoint]:
    points = [LoadPoint(concurrency=int(c)) for c in _split(args.concurrency)]
    for rate in _split(args.request_rate):
        value = math.inf if rate.strip().lower() == "inf" else float(rate)
        if value <= 0:
            raise ValueError("--request-rate must be positive")
        points.append(LoadPoint(concurrency=args.max_concurrency, request_rate=value, burstiness=args.burstiness))
    if not points:
        points.append(LoadPoint(concurrency=1))
    if any(p.concurrency is not None and p.concurrency <= 0 for p in points):
        raise ValueError("--concurrency must be positive")
    return points


def build_targets(specs: list[str] | None) -> list[Target]:
    targets = [Target.parse(spec) for spec in specs or [DEFAULT_TARGET]]
    seen: dict[str, int] = {}
    for target in targets:
        count = seen.get(target.name, 0)
        seen[target.name] = count + 1
        if count:
            target.name = f"{target.name}#{count + 1}"
    return targets


def _settings(args: argparse.Namespace, workloads: list[str], points: list[LoadPoint], seed: int) -> dict[str, Any]:
    return {
        "endpoint": args.endpoint,
        "workloads": workloads,
        "input_len": args.input_len if {"random", "shared-prefix", "grounded"} & set(workloads) else None,
        "output_len": args.output_len,
        "shared_prefix_len": args.shared_prefix_len if "shared-prefix" in workloads else None,
        "dataset_path": args.dataset_path,
        "loads": [p.label for p in points],
        "num_prompts": args.num_prompts,
        "duration": args.duration,
        "drain_timeout": None if math.isinf(args.drain_timeout) else args.drain_timeout,
        "warmup_duration": args.warmup_duration or None,
        "ramp_up": args.ramp_up or None,
        "num_warmups": args.num_warmups,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": seed,
        "tokenizer": args.tokenizer or "default model",
        "slo": args.slo,
        "price_per_hour": args.price_per_hour,
    }


def _on_point_done(result: PointResult) -> None:
    """Print the point's line; then freeze the records kept so far, so that the collector's full
    passes during the next point (each stalls every stream's timestamps) stay short (``gc_heap``)."""
    _print_point(result)
    freeze_heap("bench client")


def _print_point(result: PointResult) -> None:
    r, m = result.record, result.record.metrics
    cut = f" incomplete={m.incomplete}" if m.incomplete else ""
    latency = (
        f"TTFT p50 {m.ttft_ms['p50']:.0f} ms, TPOT p50 {m.tpot_ms['p50']:.1f} ms"
        if m.completed
        else "no request completed"
    )
    print(
        f"[{r.target} {r.workload} {r.point}] ok={m.completed} failed={m.failed}{cut} "
        f"{m.output_throughput:.1f} out tok/s, {latency}, {m.duration_s:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; 1 if every request failed, 2 on bad arguments, else 0."""
    logging.basicConfig(level=logging.WARNING)
    try:
        workloads = _split([args.workload])
        for workload in workloads:
            if workload not in WORKLOAD_NAMES:
                raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOAD_NAMES)}")
        points = build_points(args)
        if args.warmup_duration < 0 or (args.warmup_duration and not args.duration):
            raise ValueError("--warmup-duration needs --duration and must not be negative")
        if args.ramp_up < 0 or (args.duration and args.ramp_up > args.warmup_duration):
            raise ValueError("--ramp-up must not be negative, nor longer than --warmup-duration with --duration")
        targets = build_targets(args.target)
        slos = parse_slo(args.slo)
    except ValueError as exc:
        print(f"pagedserve bench: error: {exc}", file=sys.stderr)
        return 2
    num_prompts = args.num_prompts if args.num_prompts is not None else (None if args.duration else DEFAULT_NUM_PROMPTS)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    options = BenchOptions(
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        num_prompts=num_prompts,
        duration=args.duration,
        num_warmups=args.num_warmups,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        include_usage=not args.no_usage,
        extra_body=args.extra_body,
        slos=slos,
        price_per_hour=args.price_per_hour,
        memory_interval=args.memory_interval,
        server_pid=args.server_pid,
        request_timeout=args.request_timeout,
        drain_timeout=args.drain_timeout,
        warmup_output_len=args.warmup_output_len or None,
        progress=not args.no_progress and sys.stderr.isatty(),
        warmup_duration=args.warmup_duration,
        ramp_up=args.ramp_up,
    )
    print("loading tokenizer ...", file=sys.stderr, flush=True)
    factory = PromptFactory(load_tokenizer(args.tokenizer), args.endpoint)
    source_kwargs = {
        "input_len": args.input_len,
        "output_len": args.output_len or 128,
        "range_ratio": args.range_ratio,
        "dataset_path": args.dataset_path,
        "shared_prefix_len": args.shared_prefix_len,
        "num_prefix_groups": args.num_prefix_groups,
        "output_len_override": args.output_len,
    }
    freeze_heap("bench client")  # the tokenizer and the libraries: ~300k objects a full pass would walk
    try:
        results, info = asyncio.run(
            run_sweep(targets, workloads, points, options, factory, seed, source_kwargs, on_result=_on_point_done)
        )
    except ValueError as exc:
        print(f"pagedserve bench: error: {exc}", file=sys.stderr)
        return 2
    summary = build_summary(results, info, _settings(args, workloads, points, seed), command_line())
    print(terminal_report(summary))
    if args.output_dir:
        paths = write_outputs(args.output_dir, summary, results)
        print(f"\nwrote {paths['summary']} and {paths['report']}", file=sys.stderr)
    return 0 if any(r.record.metrics.completed for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve bench",
        description="Load-test OpenAI-compatible servers: throughput, latency percentiles, memory, cost.",
    )
    add_arguments(parser)
    return parser
