"""Benchmark output: the terminal tables, summary.json, per-request JSON and the Markdown report.

The report follows the usual serving-comparison layout: throughput per system and workload,
P50/P90/P99 latency, memory peak/average/efficiency and cost per 1k tokens, then side-by-side
ratios.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import sys
from collections.abc import Sequence
from typing import Any

from pagedserve.bench.metrics import PointMetrics
from pagedserve.bench.runner import PointRecord, PointResult

_VERSIONED = ("pagedserve", "torch", "transformers", "httpx", "numpy", "matplotlib")
_MIB = 1024.0 * 1024.0


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "logical_cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import psutil

        info["physical_cpus"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 1024**3, 1)
    except ImportError:
        pass
    return info


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in _VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def command_line(argv: Sequence[str] | None = None) -> str:
    import shlex

    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(("__main__.py", "/pagedserve")):
        argv[0] = "pagedserve" if argv[0].endswith("pagedserve") else "python -m pagedserve.bench"
    return " ".join(shlex.quote(arg) for arg in argv)


def comparisons(records: list[PointRecord]) -> list[dict[str, Any]]:
    """For every (workload, point): each later target's figures as ratios to the first target's."""
    by_key: dict[tuple[str, str], list[PointRecord]] = {}
    for record in records:
        by_key.setdefault((record.workload, record.point), []).append(record)
    rows = []
    for (workload, point), group in by_key.items():
        base = group[0]
        for other in group[1:]:
            b, o = base.metrics, other.metrics
            if not b.output_throughput or not o.output_throughput:
                continue  # one of them delivered nothing: no ratio means anything
            rows.append(
                {
                    "workload": workload,
                    "point": point,
                    "baseline": base.target,
                    "target": other.target,
                    "output_throughput_ratio": _ratio(o.output_throughput, b.output_throughput),
                    "request_throughput_ratio": _ratio(o.request_throughput, b.request_throughput),
                    "ttft_p50_ratio": _latency_ratio(o, b, "ttft", "p50"),
                    "ttft_p99_ratio": _latency_ratio(o, b, "ttft", "p99"),
                    "ttft_started_p99_ratio": _ratio(o.ttft_started_ms["p99"], b.ttft_started_ms["p99"])
                    if b.started and o.started
                    else None,
                    "tpot_p50_ratio": _latency_ratio(o, b, "tpot", "p50"),
                    "tpot_p99_ratio": _latency_ratio(o, b, "tpot", "p99"),
                    "e2el_p99_ratio": _latency_ratio(o, b, "e2el", "p99"),
                    "peak_rss_ratio": _ratio(other.memory.peak_rss_bytes, base.memory.peak_rss_bytes),
                }
            )
    return rows


def _latency_ratio(other: PointMetrics, base: PointMetrics, metric: str, stat: str) -> float | None:
    """A latency stat's ratio; None unless both completed requests (their zeros mean "no data")."""
    if not (base.completed and other.completed):
        return None
    return _ratio(_latency(other, metric)[stat], _latency(base, metric)[stat])


def _latency(metrics: PointMetrics, metric: str) -> dict[str, float]:
    """The ``stats_ms`` of ``ttft``, ``tpot``, ``itl`` or ``e2el``."""
    return getattr(metrics, f"{metric}_ms")


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def build_summary(
    results: list[PointResult], target_info: dict[str, Any], settings: dict[str, Any], command: str
) -> dict[str, Any]:
    """The run's summary; ``results`` holds the ``PointRecord``s (``summary_json`` makes it JSON)."""
    records = [r.record for r in results]
    return {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "machine": machine_info(),
        "versions": versions(),
        "settings": settings,
        "targets": target_info,
        "results": records,
        "comparisons": comparisons(records),
    }


def summary_json(summary: dict[str, Any]) -> dict[str, Any]:
    """What summary.json holds: the summary with each record as its flat JSON object."""
    return {**summary, "results": [record.to_json() for record in summary["results"]]}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")


def write_outputs(output_dir: str, summary: dict[str, Any], results: list[PointResult]) -> dict[str, str]:
    """Write summary.json, requests/*.json and report.md; returns their paths."""
    os.makedirs(os.path.join(output_dir, "requests"), exist_ok=True)
    paths = {"summary": os.path.join(output_dir, "summary.json")}
    with open(paths["summary"], "w", encoding="utf-8") as file:
        json.dump(summary_json(summary), file, indent=2, default=str)
    for result in results:
        name = _slug(f"{result.target.name}__{result.workload}__{result.point.label}") + ".json"
        with open(os.path.join(output_dir, "requests", name), "w", encoding="utf-8") as file:
            json.dump(
                {
                    "target": result.target.name,
                    "workload": result.workload,
                    "point": result.point.label,
                    "seed": result.seed,
                    "requests": [o.to_dict() for o in result.outputs],
                    "warmup_requests": [o.to_dict() for o in result.warmup_outputs],
                },
                file,
            )
    plots: list[tuple[str, str]] = []
    try:
        from pagedserve.bench.plots import write_plots

        plots = write_plots(output_dir, results)
    except ImportError as exc:
        print(f"plots skipped: {exc} (pip install 'pagedserve[bench]')", file=sys.stderr)
    paths["report"] = os.path.join(output_dir, "report.md")
    with open(paths["report"], "w", encoding="utf-8") as file:
        file.write(markdown_report(summary, plots))
    return paths


# ---- tables -------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _lat(record: PointRecord, metric: str, stat: str) -> str:
    """A latency cell; "-" when nothing completed (the zeros in summary.json mean "no data")."""
    if not record.metrics.completed:
        return "-"
    return _fmt(_latency(record.metrics, metric)[stat])


def _started_ttft(record: PointRecord) -> str:
    """TTFT P99 over every request that got its first token in the window, and how many did."""
    metrics = record.metrics
    if not metrics.started:
        return "-"
    return f"{_fmt(metrics.ttft_started_ms['p99'])} ({metrics.started})"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / _MIB:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.0f}%"


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


_RESULT_HEADERS = [
    "target",
    "workload",
    "load",
    "ok",
    "fail",
    "cut",
    "req/s",
    "out tok/s",
    "tot tok/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "ITL p99",
    "E2E p50",
    "E2E p99",
    "peak RSS MiB",
    "mem eff",
    "KV eff",
    "need eff",
    "prefix hit",
    "goodput",
    "$/1k tok",
]


def result_rows(records: list[PointRecord]) -> list[list[str]]:
    rows = []
    for r in records:
        m = r.metrics
        rows.append(
            [
                r.target,
                r.workload,
                r.point,
                str(m.completed),
                str(m.failed),
                str(m.incomplete),
                _fmt(m.request_throughput, 2),
                _fmt(m.output_throughput),
                _fmt(m.total_token_throughput),
                _lat(r, "ttft", "p50"),
                _lat(r, "ttft", "p99"),
                _lat(r, "tpot", "p50"),
                _lat(r, "tpot", "p99"),
                _lat(r, "itl", "p99"),
                _lat(r, "e2el", "p50"),
                _lat(r, "e2el", "p99"),
                _mib(r.memory.peak_rss_bytes),
                _pct(r.memory.memory_efficiency),
                _pct(r.memory.kv_efficiency),
                _pct(r.kv_demand.kv_demand_efficiency),
                _pct(r.memory.prefix_cache_hit_rate),
                _fmt(m.goodput, 2),
                _fmt(r.cost_per_1k_output_tokens, 5),
            ]
        )
    return rows


_COMPARISON_HEADERS = [
    "workload",
    "load",
    "target / baseline",
    "out tok/s",
    "TTFT p50",
    "TTFT p99",
    "TTFT p99 started",
    "TPOT p50",
    "TPOT p99",
    "E2E p99",
    "peak RSS",
]


def comparison_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    return [
        [
            c["workload"],
            c["point"],
            f"{c['target']} / {c['baseline']}",
            x(c["output_throughput_ratio"]),
            x(c["ttft_p50_ratio"]),
            x(c["ttft_p99_ratio"]),
            x(c["ttft_started_p99_ratio"]),
            x(c["tpot_p50_ratio"]),
            x(c["tpot_p99_ratio"]),
            x(c["e2el_p99_ratio"]),
            x(c["peak_rss_ratio"]),
        ]
        for c in rows
    ]


def terminal_report(summary: dict[str, Any]) -> str:
    parts = [
        "Latencies in ms; efficiency = average / peak over the measured phase; cut = still running at the "
        "end of a --duration window (not in the figures).",
        format_table(_RESULT_HEADERS, result_rows(summary["results"])),
    ]
    if summary["comparisons"]:
        parts += [
            "",
            "Ratios to the first target (throughput: higher is better; latency and memory: lower is better)",
            format_table(_COMPARISON_HEADERS, comparison_rows(summary["comparisons"])),
        ]
    failures = _failure_lines(summary["results"])
    if failures:
        parts += ["", "Failures:", *failures]
    return "\n".join(parts)


def _failure_lines(records: list[PointRecord]) -> list[str]:
    lines = []
    for r in records:
        for reason, count in r.metrics.failures.items():
            example = r.metrics.failure_examples.get(reason, "")
            lines.append(f"  {r.target} {r.workload} {r.point}: {count} x {reason}: {example[:160]}")
    return lines


def markdown_report(summary: dict[str, Any], plots: list[tuple[str, str]]) -> str:
    records: list[PointRecord] = summary["results"]
    targets = list(dict.fromkeys(r.target for r in records))
    workloads = list(dict.fromkeys(r.workload for r in records))
    points = list(dict.fromkeys(r.point for r in records))
    index = {(r.target, r.workload, r.point): r for r in records}
    out = ["# pagedserve bench report", ""]
    out += _header_lines(summary)
    out += ["## Throughput (output tokens/s)", ""]
    if len(targets) > 1:
        out += [f"In brackets: the ratio to {targets[0]}.", ""]
    for point in points:
        rows = [[t] + [_throughput_cell(index, targets[0], t, w, point) for w in workloads] for t in targets]
        out += [f"Load: {point}", "", markdown_table(["System", *workloads], rows), ""]
    out += [
        "## Latency (ms)",
        "",
        "End-to-end latency (E2E) P50/P90/P99, time to first token (TTFT) and time per output token (TPOT) of "
        "the completed requests; TTFT P99 started: of every request that got its first token in the window, "
        "those cut off at its end too.",
        "",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                r.target,
                r.workload,
                r.point,
                _lat(r, "e2el", "p50"),
                _lat(r, "e2el", "p90"),
                _lat(r, "e2el", "p99"),
                _lat(r, "ttft", "p50"),
                _lat(r, "ttft", "p99"),
                _started_ttft(r),
                _lat(r, "tpot", "p50"),
                _lat(r, "tpot", "p99"),
                _lat(r, "itl", "p99"),
            ]
        )
    out += [
        markdown_table(
            [
                "System",
                "Workload",
                "Load",
                "E2E P50",
                "E2E P90",
                "E2E P99",
                "TTFT P50",
                "TTFT P99",
                "TTFT P99 started (n)",
                "TPOT P50",
                "TPOT P99",
                "ITL P99",
            ],
            rows,
        ),
        "",
    ]
    out += [
        "## Memory",
        "",
        "Server resident memory and KV-cache usage; efficiency = average / peak. KV needed: the context "
        "(prompt + tokens streamed so far) of the requests in flight at the same instants, from the client's "
        "records; its efficiency is what an allocator that wastes nothing would show under this load. "
        "Allocated / needed: the server's KV usage in tokens (from its block size and count) over that need. "
        "Reservation: what reserving prompt + max_tokens per request over the same lives (no paging) would "
        "hold at the same instants; a higher efficiency there, bought with reserved / needed times the memory, "
        "is what average / peak rewards.",
        "",
    ]
    rows = [
        [
            r.target,
            r.workload,
            r.point,
            _mib(r.memory.peak_rss_bytes),
            _mib(r.memory.avg_rss_bytes),
            _pct(r.memory.memory_efficiency),
            _pct(r.memory.peak_kv_usage),
            _pct(r.memory.avg_kv_usage),
            _pct(r.memory.kv_efficiency),
            _fmt(r.kv_demand.peak_kv_demand_tokens, 0),
            _pct(r.kv_demand.kv_demand_efficiency),
            _fmt(r.kv_demand.kv_allocated_per_needed, 2),
            _pct(r.kv_demand.kv_reservation_efficiency),
            _fmt(r.kv_demand.kv_reserved_per_needed, 2),
        ]
        for r in records
    ]
    out += [
        markdown_table(
            [
                "System",
                "Workload",
                "Load",
                "Peak RSS (MiB)",
                "Avg RSS (MiB)",
                "Memory efficiency",
                "Peak KV",
                "Avg KV",
                "KV efficiency",
                "Peak KV needed (tokens)",
                "KV needed efficiency",
                "Allocated / needed",
                "Reservation efficiency",
                "Reserved / needed",
            ],
            rows,
        ),
        "",
    ]
    if any(r.cost_per_1k_output_tokens is not None for r in records):
        out += [f"## Cost per 1k output tokens (at ${summary['settings'].get('price_per_hour')}/hour)", ""]
        rows = [
            [t]
            + [
                _fmt(index[(t, w, p)].cost_per_1k_output_tokens, 5) if (t, w, p) in index else "-"
                for w in workloads
                for p in points
            ]
            for t in targets
        ]
        out += [markdown_table(["System", *[f"{w} {p}" for w in workloads for p in points]], rows), ""]
    if summary["comparisons"]:
        out += [
            "## Side by side",
            "",
            "Ratios to the first target (throughput: higher is better; latency, memory: lower is better).",
            "",
        ]
        out += [markdown_table(_COMPARISON_HEADERS, comparison_rows(summary["comparisons"])), ""]
    failures = _failure_lines(records)
    out += ["## Failures", ""] + ([f"- {line.strip()}" for line in failures] or ["None."]) + [""]
    if plots:
        out += ["## Plots", ""] + [f"![{title}]({path})\n" for title, path in plots]
    out += ["## All results", "", markdown_table(_RESULT_HEADERS, result_rows(records)), ""]
    return "\n".join(out)


def _throughput_cell(
    index: dict[tuple[str, str, str], PointRecord], base: str, target: str, workload: str, point: str
) -> str:
    record = index.get((target, workload, point))
    if record is None:
        return "-"
    text = _fmt(record.metrics.output_throughput)
    base_record = index.get((base, workload, point))
    if target != base and base_record is not None:
        ratio = _ratio(record.metrics.output_throughput, base_record.metrics.output_throughput)
        if ratio is not None:
            text += f" ({ratio:.2f}x)"
    return text


def _header_lines(summary: dict[str, Any]) -> list[str]:
    machine = summary["machine"]
    settings = summary["settings"]
    lines = [
        f"- Date: {summary['created']}",
        f"- Command: `{summary['command']}`",
        f"- Machine: {machine.get('cpu')}, {machine.get('logical_cpus')} logical CPUs, "
        f"{machine.get('memory_gib', '?')} GiB RAM, {machine.get('platform')}, Python {machine.get('python')}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items() if v),
        "- Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items() if v not in (None, {}, [])),
        "",
        markdown_table(
            ["Target", "URL", "Model", "Server version"],
            [
                [name, t["url"], t["model"] or "-", t.get("server_version") or "-"]
                for name, t in summary["targets"].items()
            ],
        ),
        "",
    ]
    return lines
